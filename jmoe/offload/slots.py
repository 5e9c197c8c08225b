"""In-program expert slots: admit missed experts from pinned host memory, then run the MoE FFN.

One MoE layer owns a device buffer of `S + M` expert slots: `S` cache slots that persist across steps
and `M` scratch slots that hold experts used once. Its tables (int32, -1 = empty):
`slot_of_expert[E]` and `expert_in_slot[S]`. The manager hands every step a `victim_order[S]`: the
cache slots it may overwrite, first choice first (-1 = stop). Everything here runs inside the jitted
step with static shapes; the only data read from host memory are slices of the pinned-host expert
arrays, each copied once into the slot it will be computed from.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jmoe.kernels import moe_ffn


class LayerSlots(NamedTuple):
    w_gate_up: jax.Array  # [S + M, d, 2f] on the device
    w_down: jax.Array  # [S + M, f, d]
    slot_of_expert: jax.Array  # int32 [E]: cache slot holding the expert, -1 = not cached
    expert_in_slot: jax.Array  # int32 [S]: expert held by each cache slot, -1 = empty


def device_copy(host: jax.Array, expert) -> jax.Array:
    """One expert's weights from pinned host memory into device memory: slice, then device_put."""
    piece = jax.lax.dynamic_slice_in_dim(host, expert, 1, axis=0)
    return jax.device_put(piece, jax.memory.Space.Device)


def _copy_experts(slots: LayerSlots, host_gate_up, host_down, experts, destinations, count):
    """Copy experts[j] into buffer slot destinations[j] for j < count (a dynamic trip count)."""

    def body(j, buffers):
        gate_up, down = buffers
        gate_up = jax.lax.dynamic_update_slice_in_dim(gate_up, device_copy(host_gate_up, experts[j]),
                                                      destinations[j], axis=0)
        down = jax.lax.dynamic_update_slice_in_dim(down, device_copy(host_down, experts[j]), destinations[j], axis=0)
        return gate_up, down

    return jax.lax.fori_loop(0, count, body, (slots.w_gate_up, slots.w_down))


def needed_experts(ids: jax.Array, num_experts: int) -> jax.Array:
    """bool [E]: experts some token routes to (ids -1 ignored)."""
    return jnp.zeros((num_experts + 1,), bool).at[jnp.where(ids >= 0, ids, num_experts)].set(True)[:num_experts]


def admit_and_compute(slots: LayerSlots, victim_order, host_gate_up, host_down, x, ids, weights, *,
                      backend: str) -> tuple[jax.Array, LayerSlots]:
    """Decode path: every missed expert goes into a victim cache slot or, when none is left, a scratch slot.

    Needs M >= the number of distinct experts one step can miss (the caller checks it statically).
    A victim slot is never one whose expert this step needs, so no expert is ever computed with
    another expert's weights.
    """
    num_experts = slots.slot_of_expert.shape[0]
    num_cache = slots.expert_in_slot.shape[0]
    num_scratch = slots.w_gate_up.shape[0] - num_cache
    needed = needed_experts(ids, num_experts)
    missing = needed & (slots.slot_of_expert < 0)
    n_miss = jnp.sum(missing, dtype=jnp.int32)
    miss_ids = jnp.nonzero(missing, size=num_scratch, fill_value=0)[0].astype(jnp.int32)

    # Victims: the manager's order, minus slots whose expert this step needs, compacted to the front.
    held = jnp.where(victim_order >= 0, slots.expert_in_slot[jnp.maximum(victim_order, 0)], -1)
    usable = (victim_order >= 0) & ~((held >= 0) & needed[jnp.maximum(held, 0)])
    victims = victim_order[jnp.argsort(~usable, stable=True)]
    n_victims = jnp.sum(usable, dtype=jnp.int32)

    j = jnp.arange(num_scratch, dtype=jnp.int32)
    cached = j < jnp.minimum(n_miss, n_victims)  # miss j lands in cache slot victims[j]
    victims = jnp.pad(victims, (0, max(0, num_scratch - num_cache)), constant_values=-1)[:num_scratch]
    destinations = jnp.where(cached, victims, num_cache + j - jnp.minimum(n_victims, n_miss))
    gate_up, down = _copy_experts(slots, host_gate_up, host_down, miss_ids, destinations, n_miss)

    # Tables: evicted experts leave, admitted experts enter (scatters to index E / S are dropped).
    if num_cache:
        evicted = jnp.where(cached, slots.expert_in_slot[jnp.where(cached, destinations, 0)], -1)
    else:  # no cache slots: nothing is ever evicted
        evicted = jnp.full((num_scratch,), -1, jnp.int32)
    slot_of_expert = slots.slot_of_expert.at[jnp.where(evicted >= 0, evicted, num_experts)].set(-1, mode="drop")
    slot_of_expert = slot_of_expert.at[jnp.where(cached, miss_ids, num_experts)].set(destinations, mode="drop")
    expert_in_slot = slots.expert_in_slot.at[jnp.where(cached, destinations, num_cache)].set(miss_ids, mode="drop")

    # Compute map: cached experts by their cache slot, the rest of this step's misses by scratch slot.
    in_scratch = (j < n_miss) & ~cached
    compute_slot = slot_of_expert.at[jnp.where(in_scratch, miss_ids, num_experts)].set(destinations, mode="drop")
    slot_ids = jnp.where(ids >= 0, compute_slot[jnp.maximum(ids, 0)], -1)
    y = moe_ffn(x, slot_ids, weights, gate_up, down, backend=backend)
    return y, LayerSlots(gate_up, down, slot_of_expert, expert_in_slot)


def stream_and_compute(slots: LayerSlots, host_gate_up, host_down, x, ids, weights, *,
                       backend: str) -> tuple[jax.Array, LayerSlots]:
    """Prefill path: cached experts from their slots, every other needed expert streamed through the
    M scratch slots in chunks. Exact for any number of distinct experts; the cache is left unchanged."""
    num_experts = slots.slot_of_expert.shape[0]
    num_cache = slots.expert_in_slot.shape[0]
    num_scratch = slots.w_gate_up.shape[0] - num_cache
    cached_slot = jnp.where(ids >= 0, slots.slot_of_expert[jnp.maximum(ids, 0)], -1)
    y = moe_ffn(x, cached_slot, weights, slots.w_gate_up, slots.w_down, backend=backend).astype(jnp.float32)

    missing = needed_experts(ids, num_experts) & (slots.slot_of_expert < 0)
    n_miss = jnp.sum(missing, dtype=jnp.int32)
    miss_ids = jnp.nonzero(missing, size=num_experts, fill_value=0)[0].astype(jnp.int32)
    # Rank of each expert among the missing ones: chunk c holds ranks [c*M, (c+1)*M).
    rank = jnp.where(missing, jnp.cumsum(missing) - 1, -1)
    token_rank = jnp.where(ids >= 0, rank[jnp.maximum(ids, 0)], -1)
    scratch = num_cache + jnp.arange(num_scratch, dtype=jnp.int32)

    def chunk(c, carry):
        acc, gate_up, down = carry
        first = c * num_scratch
        count = jnp.minimum(num_scratch, n_miss - first)
        experts = jax.lax.dynamic_slice_in_dim(jnp.pad(miss_ids, (0, num_scratch)), first, num_scratch)
        gate_up, down = _copy_experts(slots._replace(w_gate_up=gate_up, w_down=down), host_gate_up, host_down,
                                      experts, scratch, count)
        local = token_rank - first
        slot_ids = jnp.where((token_rank >= 0) & (local >= 0) & (local < num_scratch), num_cache + local, -1)
        acc = acc + moe_ffn(x, slot_ids, weights, gate_up, down, backend=backend).astype(jnp.float32)
        return acc, gate_up, down

    num_chunks = (n_miss + num_scratch - 1) // num_scratch
    y, gate_up, down = jax.lax.fori_loop(0, num_chunks, chunk, (y, slots.w_gate_up, slots.w_down))
    return y.astype(x.dtype), slots._replace(w_gate_up=gate_up, w_down=down)
