"""Python's cyclic garbage collector, set for a process that has loaded what it works with and goes on to trace,
compile and run JAX programs: jmoe's commands, the plan's compile worker, the benchmarks' smoke runs, the tests.

Tracing allocates millions of short-lived containers, so with Python's defaults the collector runs thousands of
times while a model's programs compile, and every full collection walks every object alive: all of JAX and jmoe,
and in a test or a benchmark PyTorch and transformers too. That was 5% of `tests/test_offload.py`'s time, 11% of
`python -m bench.decode --smoke`'s and 20% of a process that compiles beside a loaded transformers model (2-core
Zen 3, 2026-11-29). Freezing what is loaded takes those objects out of every later collection (they live as long
as the process anyway; freed by reference counting as before, they are only never walked for cycles), and a larger
first generation runs the collector about a tenth as often. Cycles made after the freeze are still collected.
"""

from __future__ import annotations

import gc

FIRST_GENERATION_THRESHOLD = 50_000  # allocations between young collections; Python's default is 700


def freeze_loaded() -> None:
    """Collect once, move every object alive into the collector's permanent generation, and collect young objects
    less often. For a process's own entry point, once what it loads is loaded; never for a library's caller."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(FIRST_GENERATION_THRESHOLD, *gc.get_threshold()[1:])
