"""The expert readers' buffer pool: a block comes back only when no array made from it is left, and is reused."""

import gc
import os

import numpy as np
import pytest

from jmoe.checkpoint import read_buffers
from jmoe.checkpoint.read_buffers import BufferPool, piece_threads, read_into


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


def test_a_read_in_pieces_fills_the_buffer_with_the_files_bytes_and_an_early_end_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(read_buffers, "READ_PIECE_BYTES", 1000)  # 10 pieces and a short last one
    data = np.random.default_rng(0).integers(0, 256, 9_517, np.uint8)
    path = tmp_path / "file"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    pieces = piece_threads(3)
    try:
        into = BufferPool(keep=1).lease(data.size - 17)
        read_into(fd, 17, into, pieces, lambda offset: AssertionError(offset))
        np.testing.assert_array_equal(into, data[17:])
        with pytest.raises(EOFError, match="^9517$"):  # the file ends inside the last piece asked for
            read_into(fd, 0, np.empty(12_000, np.uint8), pieces, lambda offset: EOFError(offset))
    finally:
        pieces.shutdown()
        os.close(fd)
