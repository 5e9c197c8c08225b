"""Linux's limit on a process's memory mappings (vm.max_map_count), which compiled XLA:CPU programs use up.

XLA:CPU loads each kernel of a compiled program into pages of its own (code, constants, data: about three
mappings a kernel), and they stay mapped while the program lives: the default model's serving programs hold
240-390 mappings each, a 16-layer model's about 430 (Zen 4, jax 0.10). Past the limit (65,530 unless raised) LLVM
fails to load the next program ("Cannot allocate memory") and the process crashes. The serving engine compiles
all of its programs up front, so it can count before each one and refuse, with what to change, instead.
"""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path

from jmoe.errors import InsufficientMemoryError

LIMIT_FILE = Path("/proc/sys/vm/max_map_count")
MAPS_FILE = Path("/proc/self/maps")
# Of the limit, left for what the process maps besides programs (allocations, threads, files, later compiles).
HEADROOM = 0.05


def held_and_limit() -> tuple[int, int] | None:
    """(mappings this process holds, the most it may hold), or None where /proc does not say (not Linux)."""
    try:
        limit = int(LIMIT_FILE.read_text())
        with MAPS_FILE.open("rb") as maps:
            return sum(1 for _ in maps), limit
    except (OSError, ValueError):
        return None


class MappingBudget:
    """Counts the mappings each compiled program adds, by kind of program (prefill, decode, token choice: their
    sizes differ several-fold); `compiling` refuses a compile when the programs still to come, each at the most a
    program of its kind has taken so far (a kind not seen yet: the most any has), would pass the limit."""

    def __init__(self, what: str):
        self.what = what  # how the programs' number is changed, for the error
        self.per_kind: dict[str, int] = {}

    def needed(self, remaining: dict[str, int]) -> int:
        """The mappings that `remaining` programs of each kind would take, at the estimate above."""
        largest = max(self.per_kind.values(), default=0)
        return sum(count * self.per_kind.get(kind, largest) for kind, count in remaining.items())

    @contextlib.contextmanager
    def compiling(self, kind: str, remaining: dict[str, int]):
        """Around the compile of a program of `kind`, one of the programs of each kind still to compile (this one
        included)."""
        before = held_and_limit()
        if before is not None and self.per_kind and self._over(*before, remaining):
            gc.collect()  # programs no longer referenced give their mappings back once collected
            before = held_and_limit() or before
            if self._over(*before, remaining):
                held, limit = before
                needed = self.needed(remaining)
                measured = ", ".join(f"{name} {count:,}" for name, count in sorted(self.per_kind.items()))
                raise InsufficientMemoryError(
                    f"compiling {sum(remaining.values())} more programs needs about {needed:,} memory mappings (a "
                    f"program of each kind on this backend: {measured}), but this process holds {held:,} of the "
                    f"{limit:,} the kernel allows (vm.max_map_count) and would crash past it: {self.what}, or "
                    f"raise the limit (sysctl -w vm.max_map_count={_suggested_limit(held + needed)})")
        yield
        after = held_and_limit()
        if before is not None and after is not None:
            self.per_kind[kind] = max(self.per_kind.get(kind, 0), after[0] - before[0])

    def _over(self, held: int, limit: int, remaining: dict[str, int]) -> bool:
        return held + self.needed(remaining) > limit * (1 - HEADROOM)


def _suggested_limit(needed: int) -> int:
    """A round limit with room to spare: `needed` plus the headroom, doubled, in whole 65,536s."""
    return -(-int(2 * needed / (1 - HEADROOM)) // 65536) * 65536
