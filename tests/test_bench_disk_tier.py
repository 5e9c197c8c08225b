"""bench.disk_tier's memory-mapped baseline on jmoe's Orbax format reads the bytes the Orbax expert reader reads."""

import os

import numpy as np
import pytest

from bench.disk_reads import convert_once, write_checkpoint
from bench.disk_tier import SMOKE_CONFIG, memmap_orbax_reader_class
from jmoe.checkpoint.expert_reader_orbax import OrbaxExpertReader
from jmoe.config import load_config
from jmoe.errors import CheckpointError


@pytest.fixture(scope="module")
def orbax_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("disk_tier")
    return convert_once(write_checkpoint(root / "hf", SMOKE_CONFIG), root / "orbax")


@pytest.mark.quick
def test_memmap_orbax_reader_matches_the_orbax_reader(orbax_dir):
    cfg = load_config(orbax_dir)
    with OrbaxExpertReader(orbax_dir, cfg) as reader, memmap_orbax_reader_class()(orbax_dir, cfg) as mapped:
        for layer in reader.layers:
            for expert in (0, cfg.num_experts - 1):
                want, got = reader.read(layer, expert), mapped.read(layer, expert)
                assert want.keys() == got.keys()
                for name in want:
                    assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
                    np.testing.assert_array_equal(got[name].view(np.uint16), want[name].view(np.uint16))


def test_memmap_orbax_reader_checks_the_bytes_it_maps(orbax_dir):
    cfg = load_config(orbax_dir)
    with memmap_orbax_reader_class()(orbax_dir, cfg) as mapped:
        layer = mapped.layers[0]
        chunk = mapped._chunks[layer, 1, "w_down"]
        with open(chunk.value.file, "r+b") as f:  # flip one byte of the expert's values, size and mtime kept
            f.seek(chunk.value.offset)
            byte = f.read(1)
            f.seek(chunk.value.offset)
            f.write(bytes([byte[0] ^ 0xFF]))
        try:
            st = os.stat(chunk.value.file)
            os.utime(chunk.value.file, ns=(st.st_atime_ns, mapped._identity[chunk.value.file][1]))
            with pytest.raises(CheckpointError, match="CRC-32"):
                mapped.read(layer, 1)
        finally:
            with open(chunk.value.file, "r+b") as f:
                f.seek(chunk.value.offset)
                f.write(byte)
