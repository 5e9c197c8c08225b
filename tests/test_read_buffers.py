"""The expert readers' buffer pool: a block comes back only when no array made from it is left, and is reused."""

import errno
import gc
import os
import re

import numpy as np
import pytest

from jmoe.checkpoint import read_buffers
from jmoe.checkpoint.read_buffers import DIRECT_ALIGNMENT, BufferPool, open_for_reads, piece_threads, read_range
from jmoe.errors import CheckpointError

pytestmark = pytest.mark.quick  # the quick tier: all of this module


def address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def test_a_block_comes_back_only_when_its_last_view_is_gone_and_is_then_reused():
    pool = BufferPool(keep=2)
    block = pool.lease(4096)
    first = address(block)
    weights = block[:2048].view(np.float32).reshape(16, 32)  # what a reader hands out: a view of a view
    weights[:] = 7.0
    del block
    gc.collect()
    assert pool.free_blocks() == 0  # `weights` still uses the block
    other = pool.lease(4096)
    assert address(other) != first  # so a new lease never gets it
    other[:] = 0
    assert np.all(weights == 7.0)
    del weights
    gc.collect()
    assert pool.free_blocks() == 1
    again = pool.lease(4096)
    assert address(again) == first and pool.free_blocks() == 0  # the block, reused


def test_the_pool_keeps_at_most_keep_free_blocks_of_a_size():
    pool = BufferPool(keep=2)
    leases = [pool.lease(1 << 20) for _ in range(5)] + [pool.lease(512)]
    del leases
    gc.collect()
    assert pool.free_blocks() == 3  # two of the five large ones (the rest let go), and the small one


def test_retain_sets_how_many_free_blocks_are_kept():
    pool = BufferPool(keep=1)
    pool.retain(3)  # a user holding more reads alive at once (the disk tier's staged reads)
    leases = [pool.lease(256) for _ in range(5)]
    del leases
    gc.collect()
    assert pool.free_blocks() == 3


def test_a_cleared_pool_keeps_no_blocks():
    pool = BufferPool(keep=2)
    alive = pool.lease(512)
    pool.lease(512)  # let go at once: kept
    assert pool.free_blocks() == 1
    pool.clear()
    del alive
    gc.collect()
    assert pool.free_blocks() == 0


@pytest.mark.parametrize("direct, piece", [(False, 1000), (True, 2 * DIRECT_ALIGNMENT)], ids=["buffered", "direct"])
def test_a_read_in_pieces_gives_the_files_bytes_and_an_early_end_is_an_error(tmp_path, monkeypatch, direct, piece):
    monkeypatch.setattr(read_buffers, "READ_PIECE_BYTES", piece)  # 9 pieces and a short last one
    data = np.random.default_rng(0).integers(0, 256, 9 * piece + 517, np.uint8)
    path = tmp_path / "file"
    path.write_bytes(data.tobytes())
    fd = open_for_reads(path, direct)
    pieces, buffers = piece_threads(3), BufferPool(keep=1)
    try:
        for start, end in [(17, data.size), (17, data.size - 5), (piece, 3 * piece), (0, 1)]:
            got = read_range(fd, start, end - start, buffers, pieces, AssertionError, direct)
            np.testing.assert_array_equal(got, data[start:end])
        with pytest.raises(EOFError, match=f"^{data.size}$"):  # the file ends inside the last piece asked for
            read_range(fd, 3, data.size + 3000, buffers, pieces, EOFError, direct)
    finally:
        pieces.shutdown()
        os.close(fd)


def test_a_file_system_that_refuses_direct_reads_is_a_checkpoint_error_naming_the_file(tmp_path, monkeypatch):
    path = tmp_path / "file"
    path.write_bytes(b"x")

    def refuse(name, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(name, flags, *args)

    real_open = os.open
    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))}: cannot open the checkpoint file for direct "
                                              r"reads \(O_DIRECT\) \(\[Errno 22\] Invalid argument\)"
                                              r".*read it buffered"):
        open_for_reads(path, direct=True)
    os.close(open_for_reads(path, direct=False))


def test_reads_go_direct_when_the_page_cache_has_room_for_under_a_quarter_of_the_experts_on_disk():
    direct, why = read_buffers.direct_reads_pay(10 * 10**9, 2 * 10**9, "a test's limit")
    assert (direct, why) == (True, "the page cache has room for 2.0 GB (a test's limit) of the 10.0 GB of experts "
                                   "on disk only")
    assert read_buffers.direct_reads_pay(8 * 10**9, 2 * 10**9, "")[0] is False  # room for a quarter: buffered
