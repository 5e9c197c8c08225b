"""The serving engine's compiled programs: each compiled once, one compile at a time, with progress.

A server answers as soon as the programs small requests need exist (`ServingEngine.warm_up(first_only=True)`) and
compiles the rest on a thread behind them (`compile_behind`). A step that needs a program nobody has compiled yet
compiles it itself; one being compiled behind is waited for; no program is ever compiled twice (one lock: on two
cores a second compile beside the first gains nothing, tracing holds the GIL). Every compile is counted against
the memory-mapping budget (jmoe.serve.mappings) and logged with how many are left and about how long
(`compiled 12 of 84 programs, about 40 s left`), which `status()` reports for the server's /ready.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, NamedTuple

import jax

from jmoe.serve.mappings import MappingBudget

logger = logging.getLogger("jmoe.serve")


class ProgramSpec(NamedTuple):
    """One program the engine may run: its key, the jitted function, and its arguments (padding entries) made when
    asked, from the engine's live arrays or (`abstract`) from their shapes alone."""

    key: tuple
    fn: Callable
    args: Callable[[bool], tuple]


class ProgramCache:
    """Compiled programs by key, whose first item names its kind ("prefill", "decode", ...); `totals` is how many of
    each kind the engine may need (for the progress and the mapping budget)."""

    def __init__(self, totals: dict[str, int], budget: MappingBudget):
        self.totals = totals
        self.total = sum(totals.values())
        self.budget = budget
        self._programs: dict[tuple, Callable] = {}  # jax.stages.Compiled, or jmoe.decode.chain.ChainedCompiled
        self._lock = threading.Lock()
        self._seconds = 0.0  # spent compiling, for the estimate of what is left

    def __len__(self) -> int:
        return len(self._programs)

    def get(self, key: tuple, fn: Callable, args: tuple) -> jax.stages.Compiled:
        """The program for `key`, compiled from `fn` at `args` (arrays or shape structs) if nobody has yet."""
        program = self._programs.get(key)
        if program is not None:
            return program
        with self._lock:
            program = self._programs.get(key)
            if program is None:
                began = time.perf_counter()
                # Compiled XLA:CPU programs hold hundreds of memory mappings each (jmoe.serve.mappings).
                with self.budget.compiling(key[0], self._remaining(key[0])):
                    program = fn.lower(*args).compile()
                self._programs[key] = program
                self._seconds += time.perf_counter() - began
                logger.info("compiled %s", self.describe(key))
        return program

    def _remaining(self, kind: str) -> dict[str, int]:
        """Programs of each kind not compiled yet, at least the one of `kind` about to be."""
        compiled = collections.Counter(key[0] for key in self._programs)
        remaining = {name: max(0, total - compiled[name]) for name, total in self.totals.items()}
        return {**remaining, kind: max(1, remaining.get(kind, 0))}

    def seconds_left(self) -> float | None:
        """The programs not compiled yet at the mean time of those compiled (None before the first)."""
        if not self._programs:
            return None
        return max(0, self.total - len(self._programs)) * self._seconds / len(self._programs)

    def describe(self, key: tuple) -> str:
        left = self.seconds_left()
        return (f"{len(self._programs)} of {self.total} programs ({' '.join(map(str, key))})"
                + ("" if left is None or len(self._programs) >= self.total else f", about {left:.0f} s left"))

    def status(self) -> dict:
        """For /ready: programs compiled, of how many, and the estimate of the seconds the rest take."""
        left = self.seconds_left()
        return {"compiled_programs": len(self._programs), "programs": self.total,
                "compile_seconds_left": None if left is None else round(left, 1)}

    def compile_behind(self, specs: list[ProgramSpec], stopping: threading.Event) -> threading.Thread:
        """Compile every program of `specs` not compiled yet, in their order, on a thread of its own (its arguments
        made from shapes: the engine's arrays are donated step by step meanwhile); stops early once `stopping` is
        set. A failed compile is logged and leaves that program to the step that first needs it."""

        def run():
            for spec in specs:
                if stopping.is_set():
                    return
                if spec.key in self._programs:
                    continue
                try:
                    self.get(spec.key, spec.fn, spec.args(True))
                except Exception:  # the step that needs it compiles it and reports the error to its requests
                    logger.exception("compiling %s behind the first requests failed", spec.key)

        thread = threading.Thread(target=run, name="jmoe-compile", daemon=True)
        thread.start()
        return thread


def shapes_of(tree):
    """Shape structs (with shardings, so memory kinds too) of a pytree of arrays: what lowering needs of them."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                        if isinstance(a, jax.Array) else a, tree)
