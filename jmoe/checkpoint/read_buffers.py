"""Reusable host buffers for the expert readers (issue #31): a read fills a leased block of bytes, and the block
comes back to the pool when the last array made from it is collected, so a decode that reads thousands of 40 MB
experts touches fresh pages only when more reads are alive at once than before.

Why: a fresh buffer costs a page fault and a zeroing for every 4 KiB page before the read can fill it, and jmoe
serves every allocation of 1 MiB or more from fresh pages (jmoe.offload.host_tier.release_large_buffers_at_free).
On the 30 GB bench checkpoint (bench.disk_tier) TensorStore's two fresh buffers per read made 11 million page
faults in 8 tokens; the kernel's page zeroing alone took a fifth of the decode's CPU time.

How a block comes back: the pool hands out an ndarray subclass over the block whose own base is the block (not an
ndarray), so every numpy view made from it keeps it as its base, and a weakref finalizer on it returns the block
once nothing refers to any of them (never while XLA, a host row's write or a test still holds one).
"""

from __future__ import annotations

import mmap
import threading
import weakref

import numpy as np


class _Lease(np.ndarray):
    """An array over a pooled block (a subclass so that numpy stops collapsing view chains at it)."""


class BufferPool:
    """Blocks of bytes for reads; `keep`: the free blocks of one size kept for reuse (more are let go, so the pool
    holds at most what that many reads in flight need beyond the reads still alive)."""

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
            block = mmap.mmap(-1, nbytes)  # its own pages, unmapped when let go (never left in a malloc arena)
        lease = np.ndarray.__new__(_Lease, (nbytes,), np.uint8, buffer=block)
        weakref.finalize(lease, self._give_back, block)
        return np.asarray(lease)  # a plain ndarray whose base is the lease

    def _give_back(self, block: mmap.mmap) -> None:
        with self._lock:
            free = self._free.setdefault(len(block), [])
            if len(free) < self._keep:
                free.append(block)

    def clear(self) -> None:
        """Let go of the free blocks (a closed reader holds none); leases still alive come back and are let go."""
        with self._lock:
            self._free.clear()
            self._keep = 0

    def free_blocks(self) -> int:
        """Blocks held for reuse now."""
        with self._lock:
            return sum(len(blocks) for blocks in self._free.values())
