"""The serving engine's decode steps (`DecodeSteps`, which jmoe.serve.engine.ServingEngine inherits): the generating
rows' inputs, the step's dispatch and its read back, and running ahead: while no row's next token needs the host
(a grammar's mask, a bias that depends on its tokens) and no request waits for a row, the next decode step is
dispatched on this one's tokens, still on the device, before this one is read back, so the host's work between steps
(the read back, the expert manager, detokenising and streaming) overlaps the device's next step (issue #54 item 3).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import jax
import numpy as np

from jmoe.api import check_finite_layers
from jmoe.serve.choice import chosen_without_the_host
from jmoe.serve.requests import Request


class DecodeStep(NamedTuple):
    """A decode step dispatched and not yet read back: the requests of its entries (None: padding), their columns, and
    its outputs on the device."""

    rows: list
    positions: np.ndarray
    choice: tuple  # (tokens, their log-probabilities, top ids, top log-probabilities); None where not asked
    finite: jax.Array
    routing: jax.Array
    readback: tuple
    began: float


class DecodeSteps:
    """ServingEngine's decode steps; the engine holds the rows, programs, caches and locks they use."""

    def _decode_step(self) -> DecodeStep:
        """The decode step of the rows generating now, dispatched."""
        # The first R rows (an entry bucket) hold every generating request: rows are filled lowest first.
        generating = [i for i, r in enumerate(self._rows) if r is not None and r.prefilled == len(r.prompt)]
        entries = next(b for b in self.entry_buckets if b > generating[-1])
        rows = [self._rows[i] if i in generating else None for i in range(entries)]
        tokens = np.array([r.tokens[-1] if r else 0 for r in rows], np.int32)
        # A row's next write goes to its column; inactive rows write where their next real write will land, or past
        # the prefix a free row holds.
        positions = np.array([(len(r.prompt) + len(r.tokens) - 1) if r else self._spare_column(i)
                              for i, r in enumerate(rows)], np.int32)
        return self._dispatch_decode(rows, tokens, positions)

    def _dispatch_decode(self, rows: list[Request | None], tokens, positions, ahead: int = 0) -> DecodeStep:
        """`ahead`: 1 when the last step's tokens are not read back yet (their count goes into the sampling keys)."""
        active = np.array([r is not None for r in rows])
        furthest = int(positions[active].max()) + 1
        visible = next(v for v in self.visible_buckets if v >= furthest)
        began = time.perf_counter()
        args = self.decode_args(tokens, positions, active)
        (logits, argmax, finite), routing, self.kv_cache, self.model.engine.state, readback = self._program(
            ("decode", visible, len(rows)), self.decode_programs[visible], args)(*args)
        if all(r is None or (r.params.plain_greedy and not r.matcher) for r in rows):
            # Every token is its row's argmax: no choice program (0.2-0.5 ms a step, a tenth of it). The rows' penalty
            # counts are left behind, which only a request with penalties reads, and it resets them when it starts.
            choice = (argmax, None, None, None)
        else:
            choice = self._choose_tokens(logits, rows, reset=False, ahead=ahead)
        return DecodeStep(rows, positions, choice, finite, routing, readback, began)

    def _decode_ahead(self, step: DecodeStep) -> DecodeStep | None:
        """The next decode step, dispatched on `step`'s tokens while they are still on the device, when it needs nothing
        from the host: every row still generating and its next token chosen without the host (no grammar, no bias
        that depends on its tokens: choice.chosen_without_the_host), no request waiting for a row or cancelled, and
        room in the context. A row that ends with `step` computes one token more, dropped (its cache column gets
        that token's keys and values, past what the row's prefix holds)."""
        rows = step.rows
        if not self.run_ahead or any(r is not None and (r.done or not chosen_without_the_host(r)) for r in rows):
            return None  # a row that has ended needs the next round to take it out
        with self._lock:
            if self._waiting or any(r is not None and r.cancelled for r in rows):
                return None
        if all(r is None or len(r.tokens) + 1 >= r.params.max_tokens for r in rows):
            return None  # every row ends with `step`'s token
        active = np.array([r is not None for r in rows])
        positions = np.where(active, step.positions + 1, step.positions).astype(np.int32)
        if positions[active].max() >= self.context:
            return None
        return self._dispatch_decode(rows, step.choice[0], positions, ahead=1)

    def _finish_decode(self, step: DecodeStep) -> None:
        chosen, finite, routing = self.model.finish_step(step.readback, step.routing,
                                                         (step.choice, step.finite, step.routing))
        check_finite_layers(finite, "decode step")
        self._observe("decode", step.began, sum(r is not None for r in step.rows), routing)
        for i, request in enumerate(step.rows):
            if request is not None and not request.done:  # one that ended with the step before drops this token
                self._accept(request, chosen, i)

    def _spare_column(self, row: int) -> int:
        """The column a decode step may write in `row`, which generates nothing in it."""
        occupant = self._rows[row]
        if occupant is not None:
            return occupant.prefilled
        return 0 if self.prefixes is None else self.prefixes.spare_column(row)
