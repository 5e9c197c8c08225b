"""Belady's offline optimum for a demand expert cache, as a ``CachePolicy`` the replay can run.

It needs the whole future of the trace, so it exists for replays only, never in the engine.
"""

from __future__ import annotations

import numpy as np

from jmoe.offload.policies import CachePolicy


class BeladyOracle(CachePolicy):
    """Evict the expert whose next use is farthest in the future.

    Priority = minus the step of the expert's next use; never used again = -inf, so it goes
    first (ties among those: lower id first, by the shared rule ``choose_victims``). Optimal
    among caches that admit every miss; ``expert_ids`` [T, L, k] is the trace it will replay.
    """

    name = "belady"

    def __init__(self, expert_ids: np.ndarray, num_experts: int):
        expert_ids = np.asarray(expert_ids, dtype=np.int64)
        num_tokens, num_layers, top_k = expert_ids.shape
        super().__init__(num_layers, num_experts)
        self._ids = expert_ids
        self._layer_index = np.arange(num_layers)[:, None]
        # For every access (t, l, r): the step of the next use of the same (l, expert) after t.
        group = self._layer_index[None] * num_experts + expert_ids  # [T, L, k]
        times = np.broadcast_to(np.arange(num_tokens)[:, None, None], expert_ids.shape)
        key = group.ravel() * num_tokens + times.ravel()
        order = np.argsort(key, kind="stable")
        sorted_group = group.ravel()[order]
        sorted_time = times.ravel()[order].astype(np.float64)
        next_time = np.full(sorted_time.shape, np.inf)
        same = sorted_group[1:] == sorted_group[:-1]
        next_time[:-1][same] = sorted_time[1:][same]
        self._next_occurrence = np.empty(key.shape)
        self._next_occurrence[order] = next_time
        self._next_occurrence = self._next_occurrence.reshape(expert_ids.shape)
        # Next use of every expert as seen before step 0 (= its first use).
        self._next_use = np.full(self.shape, np.inf)
        first = np.r_[True, ~same]
        self._next_use.ravel()[sorted_group[first]] = sorted_time[first]
        self._priority = np.empty(self.shape)

    def update(self, counts: np.ndarray) -> None:
        # The routing of the step being observed comes from the trace; counts are redundant.
        step = self.step
        self._next_use[self._layer_index, self._ids[step]] = self._next_occurrence[step]

    def priority(self) -> np.ndarray:
        np.negative(self._next_use, out=self._priority)
        return self._priority
