"""Reads for the expert readers (issue #31): into reusable host buffers, in pieces in flight at once.

A read fills a leased block of bytes, and the block comes back to the pool when the last array made from it is
collected, so a decode that reads thousands of 40 MB experts touches fresh pages only when more reads are alive at
once than before.

Why: a fresh buffer costs a page fault and a zeroing for every 4 KiB page before the read can fill it, and jmoe
serves every allocation of 1 MiB or more from fresh pages (jmoe.offload.host_tier.release_large_buffers_at_free).
On the 30 GB bench checkpoint (bench.disk_tier) TensorStore's two fresh buffers per read made 11 million page
faults in 8 tokens; the kernel's page zeroing alone took a fifth of the decode's CPU time.

How a block comes back: the pool hands out an ndarray subclass over the block whose own base is the block (not an
ndarray), so every numpy view made from it keeps it as its base, and a weakref finalizer on it returns the block
once nothing refers to any of them (never while XLA, a host row's write or a test still holds one).

Why pieces (`read_range`): a layer needs a few experts at once, and one long pread keeps one request at the disk.
This guest's disk gave 0.56-0.75 GB/s for one 39 MB pread at a time and 1.1-1.4 GB/s for the same expert as 4 MiB
preads with 8 in flight (page cache dropped).

Why direct reads (`open_for_reads(path, direct=True)`, O_DIRECT): a buffered read that reaches storage costs the
kernel a copy out of the page cache and, where memory is short, the reclaim of the pages it filled. On the bench's
2-core Zen 3 guest in a 6 GB memory group that was 0.74-0.80 s of CPU per GB read, against 0.15-0.17 s/GB read direct
(bench/results/disk_tier_orbax.md). A direct read skips the page cache, so it loses the page cache's hits: worth it
only where the page cache cannot hold a useful share of the experts read (`direct_reads_pay`).
"""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import threading
import weakref

import numpy as np

from jmoe.checkpoint.read_order import PriorityPool
from jmoe.errors import CheckpointError

READ_PIECE_BYTES = 4 << 20
# A direct read's file offset, length and buffer address are whole blocks of this: 4 KiB covers the logical block
# of every common drive (512 B or 4 KiB), and pooled blocks are page aligned.
DIRECT_ALIGNMENT = 4096
PIECE_THREAD_PREFIX = "jmoe-read-piece"


def open_for_reads(path, direct: bool = False) -> int:
    """A descriptor for byte-range reads of checkpoint file `path` (`direct`: O_DIRECT, past the page cache), the
    kernel's readahead off: every read asks for exactly the range it needs, in pieces in flight at once, and
    readahead past a range's end (up to `read_ahead_kb`, 8 MiB on the bench's disk) read 15% more than asked from
    storage in a 6 GB cgroup, bytes the small page cache dropped before any use (bench/results/disk_tier_orbax.md).
    A file that cannot be opened (or whose file system refuses direct reads) is a CheckpointError."""
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open the checkpoint file{' for direct reads (O_DIRECT)' * direct} "
                              f"({e}); make it readable{', or read it buffered (direct_reads=False)' * direct}") from e
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    except OSError:  # a hint: a file system that refuses it reads the same bytes, with readahead
        pass
    return fd


def direct_reads_pay(disk_bytes: int, room: int, bound: str) -> tuple[bool, str]:
    """(whether to read `disk_bytes` of experts kept on disk only past the page cache, why), where the page cache has
    `room` bytes (jmoe.plan.resources.page_cache_room; `bound`: what bounds it). Direct when it has room for under a
    quarter of them: then most reads reach storage anyway, and a buffered read's copy and reclaim cost 5x the CPU of
    a direct one (above). With more room, buffered: routing is skewed, so the page cache's share of the reads
    outgrows its share of the bytes, and each hit saves a read from storage (without a memory limit on the bench's 30 GB
    checkpoint, three quarters of the reads were hits: direct reads lost on a Zen 4 guest, 0.319 tokens/s against
    0.392, and tied on a Zen 3 one, 0.224 against 0.223)."""
    direct = room < disk_bytes / 4
    return direct, (f"the page cache has room for {room / 1e9:.1f} GB ({bound}) of the {disk_bytes / 1e9:.1f} GB of "
                    f"experts on disk only")


def piece_threads(threads: int) -> PriorityPool:
    """The threads that read a reader's pieces (`threads` preads in flight at most), a demand read's first."""
    return PriorityPool(threads, PIECE_THREAD_PREFIX)


def read_range(fd: int, start: int, length: int, buffers: BufferPool, pieces: PriorityPool, end_error,
               direct: bool) -> np.ndarray:
    """uint8 [length]: the file's bytes from `start`, in a block leased from `buffers`, read as `_read_into` reads.
    `direct`: `fd` was opened with O_DIRECT, so the read covers the whole aligned blocks around the range and the
    result is a view into them."""
    if not direct:
        into = buffers.lease(length)
        _read_into(fd, start, into, length, pieces, end_error, direct)
        return into
    first = start - start % DIRECT_ALIGNMENT
    end = -(-(start + length) // DIRECT_ALIGNMENT) * DIRECT_ALIGNMENT
    block = buffers.lease(end - first)
    # The file may end inside the last block: only the range's bytes must exist.
    _read_into(fd, first, block, start + length - first, pieces, end_error, direct)
    return block[start - first:start - first + length]


def _read_into(fd: int, start: int, into: np.ndarray, need: int, pieces: PriorityPool, end_error,
               direct: bool) -> None:
    """Fill `into` (uint8) with the file's bytes from `start`, of which the first `need` must exist: pieces of
    READ_PIECE_BYTES read on `pieces`, all submitted at once (ranked as the calling read). Where the file ends
    first, raises end_error(offset); every piece has stopped when this returns or raises (a retry never races a
    piece of the failed attempt)."""
    view = memoryview(into)
    futures = [pieces.submit(_read_piece, fd, start + at, view[at:at + READ_PIECE_BYTES],
                             min(READ_PIECE_BYTES, need - at), end_error, direct)
               for at in range(0, need, READ_PIECE_BYTES)]
    concurrent.futures.wait(futures)
    for future in futures:
        future.result()


def _read_piece(fd: int, offset: int, view: memoryview, need: int, end_error, direct: bool) -> None:
    done = 0
    while done < need:  # a buffered read may return fewer bytes than asked; a direct one only at the file's end
        count = os.preadv(fd, [view[done:]], offset + done)
        done += count
        if not count or (direct and done < need):
            raise end_error(offset + done)


class _Lease(np.ndarray):
    """An array over a pooled block (a subclass so that numpy stops collapsing view chains at it)."""


class BufferPool:
    """Blocks of bytes for reads; `keep`: the free blocks of one size kept for reuse (more are let go), at most the
    reads alive at once that the pool's user plans for (`retain`)."""

    def __init__(self, keep: int):
        self._keep = keep
        self._free: dict[int, list[mmap.mmap]] = {}
        self._lock = threading.Lock()

    def lease(self, nbytes: int) -> np.ndarray:
        """uint8 [nbytes], contents undefined, the block returned when it and every view of it are gone."""
        with self._lock:
            free = self._free.get(nbytes)
            block = free.pop() if free else None
        if block is None:
            # Its own private pages, unmapped when let go (never left in a malloc arena).
            block = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        lease = np.ndarray.__new__(_Lease, (nbytes,), np.uint8, buffer=block)
        weakref.finalize(lease, self._give_back, block)
        return np.asarray(lease)  # a plain ndarray whose base is the lease

    def _give_back(self, block: mmap.mmap) -> None:
        with self._lock:
            free = self._free.setdefault(len(block), [])
            if len(free) < self._keep:
                free.append(block)

    def retain(self, keep: int) -> None:
        """Keep up to `keep` free blocks of a size from now on."""
        with self._lock:
            self._keep = keep

    def clear(self) -> None:
        """Let go of the free blocks (a closed reader holds none); leases still alive come back and are let go."""
        with self._lock:
            self._free.clear()
            self._keep = 0

    def free_blocks(self) -> int:
        """Blocks held for reuse now."""
        with self._lock:
            return sum(len(blocks) for blocks in self._free.values())
