"""jmoe.checkpoint.checksum: zlib's CRC-32, from zlib-ng where it is installed (the suite's environment has it)."""

import zlib

import numpy as np
import pytest
from zlib_ng import zlib_ng

from jmoe.checkpoint.checksum import crc32

pytestmark = pytest.mark.quick  # the quick tier: all of this module


def test_the_checksum_is_zlibs_crc32_computed_by_zlib_ng():
    data = np.random.default_rng(0).integers(0, 256, 3_000_001, dtype=np.uint8)
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data[1001:], crc32(data[:1001])) == zlib.crc32(data)  # chained over pieces, as the readers do
    assert crc32(b"") == 0
    assert crc32 is zlib_ng.crc32  # the fast one is in use, not the fallback
