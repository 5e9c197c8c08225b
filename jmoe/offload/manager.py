"""The cache manager: between steps, turn the step's routing into policy state, statistics, the next
step's victim order and its planned copies. Pure NumPy, vectorised over layers (it runs once per decode
step)."""

from __future__ import annotations

import numpy as np

from jmoe.offload.policies import (CachePolicy, StaticPolicy, eviction_ranking, expert_counts, initial_residents,
                                   make_policy)


def experts_in_slots(slot_of_expert: np.ndarray, num_slots: int) -> np.ndarray:
    """slot_of_expert int [L, E] -> expert_in_slot int [L, S] (-1 = empty)."""
    layers, num_experts = slot_of_expert.shape
    expert_in_slot = np.full((layers, num_slots + 1), -1, np.int32)
    rows, experts = np.nonzero(slot_of_expert >= 0)
    expert_in_slot[rows, slot_of_expert[rows, experts]] = experts
    return expert_in_slot[:, :num_slots]


class SlotManager:
    """Policy state, per-layer statistics, and the victim order handed to the next step."""

    def __init__(self, policy: str | CachePolicy, num_experts: int, caches: tuple[int, ...], expert_bytes: int,
                 plan_width: int = 0):
        """caches: the cache slots of each managed layer (they may differ); plan_width: copies planned per
        layer and step (the engine's miss mode "host" admits the last step's misses this way)."""
        num_layers = len(caches)
        self.num_layers, self.num_experts, self.caches = num_layers, num_experts, tuple(caches)
        self.expert_bytes = expert_bytes
        # A static policy named without a frequency table pins the experts the first step uses most.
        self.policy = None if policy == "static" else make_policy(policy, num_layers, num_experts)
        self.hits = np.zeros(num_layers, np.int64)
        self.misses = np.zeros(num_layers, np.int64)
        self.evictions = np.zeros(num_layers, np.int64)
        self.copies = np.zeros(num_layers, np.int64)
        self.slot_of_expert = np.full((num_layers, num_experts), -1, np.int32)
        self.plan_width = plan_width
        self.missed = np.zeros((num_layers, num_experts), bool)  # used by the last step, not cached after it
        # The last plan handed out: (experts, slots, the expert each slot held then) [L, W] each.
        self.last_plan = tuple(np.full((num_layers, plan_width), -1, np.int32) for _ in range(3))

    @property
    def admits_misses(self) -> bool:
        return self.policy is not None and self.policy.admits_misses

    def pinned_experts(self) -> list[np.ndarray] | None:
        """For a static policy: per layer, int [S_l] experts to install in its slots (None otherwise)."""
        if not isinstance(self.policy, StaticPolicy):
            return None
        keep = initial_residents(self.policy.priority(), np.array(self.caches))
        return [np.flatnonzero(row).astype(np.int32) for row in keep]

    def record(self, routing: np.ndarray, slot_of_expert_after: np.ndarray, step_counts: np.ndarray) -> None:
        """Statistics and policy update for one finished step.

        routing int [L, ...]: the experts chosen; step_counts int [L, 4]: hits, misses, experts copied and
        evictions the step counted itself (a hit is an access whose expert was cached when its layer
        started, prefetched or not).
        """
        counts = expert_counts(routing, self.num_experts)
        hits, misses, copies, evictions = step_counts.T
        self.hits += hits
        self.misses += misses
        self.copies += copies
        self.evictions += evictions
        self.slot_of_expert = self.with_plan_in_flight(slot_of_expert_after)
        self.missed = (counts > 0) & (self.slot_of_expert < 0)
        if self.policy is None:
            self.policy = StaticPolicy(self.num_layers, self.num_experts, frequency=counts)
        self.policy.observe(counts)

    def with_plan_in_flight(self, slot_of_expert: np.ndarray) -> np.ndarray:
        """The tables a step read back, plus the last plan's copies where that step had not made them yet: its slot
        still holds what the plan saw there and its expert sits nowhere. The step after it, dispatched before this
        read (Model.dispatch_step), makes them; planned again, they would be skipped as cached, admitting nothing.
        With every step read back before the next is dispatched the plan's copies are already in the tables."""
        experts, slots, seen = self.last_plan
        self.last_plan = tuple(np.full_like(a, -1) for a in self.last_plan)  # in flight for one step at most
        held = np.take_along_axis(experts_in_slots(slot_of_expert, max(self.caches, default=0) + 1),
                                  np.maximum(slots, 0), axis=1)
        pending = ((slots >= 0) & (held == seen)
                   & (np.take_along_axis(slot_of_expert, np.maximum(experts, 0), axis=1) < 0))
        if not pending.any():
            return slot_of_expert
        view = slot_of_expert.copy()
        for layer, w in zip(*np.nonzero(pending)):
            if seen[layer, w] >= 0:
                view[layer, seen[layer, w]] = -1
            view[layer, experts[layer, w]] = slots[layer, w]
        return view

    def expert_in_slot(self) -> np.ndarray:
        """int32 [L, max S_l]: the expert in each slot as the manager sees it (-1 = empty)."""
        return experts_in_slots(self.slot_of_expert, max(self.caches, default=0))

    def victim_order(self) -> np.ndarray:
        """int [L, max S_l]: per layer, the cache slots the next step may overwrite, first choice first,
        padded with -1 (= stop) after its S_l slots; int [L, 0] under a policy that admits no miss (a step's
        program sees from the shape that its misses go to scratch: jmoe.offload.slots.fetch_and_compute).

        Empty slots come first (lowest slot first), then occupied slots in the eviction rule's order of
        their experts (jmoe.offload.policies.eviction_ranking).
        """
        most = max(self.caches, default=0)
        has_slot = np.arange(most) < np.array(self.caches)[:, None]  # [L, most]: the slots each layer has
        if not self.admits_misses or most == 0:
            return np.full((self.num_layers, 0), -1, np.int32)
        resident = self.slot_of_expert >= 0
        ranking = eviction_ranking(self.policy.priority(), resident)  # [L, E], resident experts first
        rank_of_expert = np.argsort(ranking, axis=-1)
        expert_in_slot = experts_in_slots(self.slot_of_expert, most)
        rows = np.arange(self.num_layers)[:, None]
        empty_key = np.arange(most) - most  # negative: before every expert's rank
        key = np.where(expert_in_slot >= 0, rank_of_expert[rows, np.maximum(expert_in_slot, 0)], empty_key)
        key = np.where(has_slot, key, self.num_experts)  # slots a layer does not have sort last ...
        order = np.argsort(key, axis=-1, kind="stable").astype(np.int32)
        return np.where(has_slot, order, -1)  # ... and become padding

    def next_step(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(victim order int [L, max S_l], planned experts int [L, W], their slots int [L, W]) for the next
        step. The plan admits the last step's missed experts the policy values most (ties: lower id), up
        to W per layer, into the first victims; entries with slot -1 are not copied (the step copies only
        the planned admissions). The victim order the step gets has the planned slots taken out."""
        order = self.victim_order()
        width = self.plan_width
        plan_experts = np.zeros((self.num_layers, width), np.int32)
        plan_slots = np.full((self.num_layers, width), -1, np.int32)
        if not width or not self.admits_misses or order.shape[1] == 0:
            return order, plan_experts, plan_slots
        by_value = eviction_ranking(-self.policy.priority(), self.missed)  # missed experts, most valued first
        victims = np.pad(order, ((0, 0), (0, max(0, width - order.shape[1]))), constant_values=-1)[:, :width]
        admitted = np.take_along_axis(self.missed, by_value[:, :width], axis=1) & (victims >= 0)
        plan_experts[:] = by_value[:, :width]
        plan_slots[:] = np.where(admitted, victims, -1)
        seen = np.take_along_axis(self.expert_in_slot(), np.maximum(plan_slots, 0), axis=1)
        self.last_plan = (plan_experts.copy(), plan_slots.copy(), np.where(admitted, seen, -1).astype(np.int32))
        # Admitted entries are a prefix of each row, so they used the first victims of the order.
        used = admitted.sum(axis=1, keepdims=True)
        shifted = np.arange(order.shape[1]) + used
        remaining = np.take_along_axis(np.pad(order, ((0, 0), (0, width)), constant_values=-1), shifted, axis=1)
        return remaining.astype(np.int32), plan_experts, plan_slots

    def stats(self, layer_ids: tuple[int, ...]) -> list[dict]:
        out = []
        for i, layer in enumerate(layer_ids):
            accesses = int(self.hits[i] + self.misses[i])
            out.append({"layer": layer, "cache_slots": self.caches[i], "hits": int(self.hits[i]),
                        "misses": int(self.misses[i]),
                        "hit_rate": float(self.hits[i] / accesses) if accesses else None,
                        "evictions": int(self.evictions[i]),
                        "bytes_moved": int(self.copies[i]) * self.expert_bytes})
        return out
