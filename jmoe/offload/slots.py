"""In-program expert slots: admit missed experts from pinned host memory, then run the MoE FFN.

One MoE layer owns a device buffer of `S + M` expert slots (an ExpertWeights whose every leaf has the
slot axis first): `S` cache slots that persist across steps and `M` scratch slots that hold experts used
once. Its tables (int32, -1 = empty):
`slot_of_expert[E]` and `expert_in_slot[S]`. The manager hands every step a `victim_order[S]`: the
cache slots it may overwrite, first choice first (-1 = stop). Everything here runs inside the jitted
step with static shapes; the only data read from host memory are slices of the pinned-host expert
arrays, each copied once into the slot it will be computed from.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jmoe.kernels import ExpertKernel, ExpertWeights
from jmoe.memory import to_device
from jmoe.offload.host_compute import experts_on_host


class LayerSlots(NamedTuple):
    buffers: ExpertWeights  # [S + M, ...] per leaf, on the device
    slot_of_expert: jax.Array  # int32 [E]: cache slot holding the expert, -1 = not cached
    expert_in_slot: jax.Array  # int32 [S]: expert held by each cache slot, -1 = empty


def empty_slots(like: ExpertWeights, count: int) -> ExpertWeights:
    """Zeroed device buffers of `count` slots shaped like the experts in `like` (abstract or real arrays)."""
    return jax.tree.map(lambda a: jnp.zeros((count, *a.shape[1:]), a.dtype), like)


def device_copy(host: ExpertWeights, expert) -> ExpertWeights:
    """One expert's weights from pinned host memory into device memory: slice, then device_put, per leaf."""
    return jax.tree.map(lambda a: to_device(jax.lax.dynamic_slice_in_dim(a, expert, 1, axis=0)), host)


def put_slot(buffers: ExpertWeights, expert_weights: ExpertWeights, slot) -> ExpertWeights:
    """`buffers` with slot `slot` replaced by the single expert in `expert_weights`."""
    return jax.tree.map(lambda b, e: jax.lax.dynamic_update_slice_in_dim(b, e, slot, axis=0), buffers,
                        expert_weights)


def _copy_experts(buffers: ExpertWeights, host: ExpertWeights, experts, destinations, count) -> ExpertWeights:
    """Copy experts[j] into slot destinations[j] of `buffers` for j < count (a dynamic trip count)."""

    def body(j, buffers):
        return put_slot(buffers, device_copy(host, experts[j]), destinations[j])

    return jax.lax.fori_loop(0, count, body, buffers)


def needed_experts(ids: jax.Array, num_experts: int) -> jax.Array:
    """bool [E]: experts some token routes to (ids -1 ignored)."""
    return jnp.zeros((num_experts + 1,), bool).at[jnp.where(ids >= 0, ids, num_experts)].set(True)[:num_experts]


class Admission(NamedTuple):
    slots: LayerSlots  # with the admitted experts copied in and the tables updated
    victim_order: jax.Array  # int32 [S]: the victims not used, in order, padded with -1
    compute_slot: jax.Array  # int32 [E]: the buffer slot to compute each expert from (-1 = nowhere)
    copied: jax.Array  # int32: experts copied from host memory
    evicted: jax.Array  # int32: cached experts overwritten


def admit(slots: LayerSlots, victim_order, host: ExpertWeights, wanted, protected, *, limit: int,
          use_scratch: bool) -> Admission:
    """Copy the wanted experts that are not cached (at most `limit`, lowest ids first) into victim cache
    slots, and, if `use_scratch`, the rest into scratch slots.

    A victim slot is never one holding a `protected` expert: a step protects the experts it needs, so
    no expert is ever computed with another expert's weights.
    """
    num_experts = slots.slot_of_expert.shape[0]
    num_cache = slots.expert_in_slot.shape[0]
    missing = wanted & (slots.slot_of_expert < 0)
    n_miss = jnp.minimum(jnp.sum(missing, dtype=jnp.int32), limit)
    miss_ids = jnp.nonzero(missing, size=limit, fill_value=0)[0].astype(jnp.int32)

    # Victims: the manager's order minus slots holding protected experts, compacted to the front.
    held = jnp.where(victim_order >= 0, slots.expert_in_slot[jnp.maximum(victim_order, 0)], -1)
    usable = (victim_order >= 0) & ~((held >= 0) & protected[jnp.maximum(held, 0)])
    usable_order = jnp.argsort(~usable, stable=True)
    victims = victim_order[usable_order]
    n_cached = jnp.minimum(n_miss, jnp.sum(usable, dtype=jnp.int32))
    n_copy = n_miss if use_scratch else n_cached

    j = jnp.arange(limit, dtype=jnp.int32)
    cached = j < n_cached  # miss j lands in cache slot victims[j]
    victims = jnp.pad(victims, (0, max(0, limit - num_cache)), constant_values=-1)[:limit]
    destinations = jnp.where(cached, victims, num_cache + j - n_cached)
    buffers = _copy_experts(slots.buffers, host, miss_ids, destinations, n_copy)

    # Tables: evicted experts leave, admitted experts enter (scatters to index E / S are dropped).
    if num_cache:
        evicted = jnp.where(cached, slots.expert_in_slot[jnp.where(cached, destinations, 0)], -1)
    else:  # no cache slots: nothing is ever evicted
        evicted = jnp.full((limit,), -1, jnp.int32)
    slot_of_expert = slots.slot_of_expert.at[jnp.where(evicted >= 0, evicted, num_experts)].set(-1, mode="drop")
    slot_of_expert = slot_of_expert.at[jnp.where(cached, miss_ids, num_experts)].set(destinations, mode="drop")
    expert_in_slot = slots.expert_in_slot.at[jnp.where(cached, destinations, num_cache)].set(miss_ids, mode="drop")
    in_scratch = (j < n_copy) & ~cached
    compute_slot = slot_of_expert.at[jnp.where(in_scratch, miss_ids, num_experts)].set(destinations, mode="drop")

    # The victims used are gone from the order; the rest keep their order for a later admission.
    used = jnp.zeros(victim_order.shape, bool).at[usable_order].set(jnp.arange(num_cache) < n_cached)
    remaining = jnp.where(used, -1, victim_order)
    remaining = remaining[jnp.argsort(remaining < 0, stable=True)]
    return Admission(LayerSlots(buffers, slot_of_expert, expert_in_slot), remaining, compute_slot,
                     n_copy, jnp.sum(evicted >= 0, dtype=jnp.int32))


def count_hits(slot_of_expert, ids) -> jax.Array:
    """(token, choice) pairs whose expert sits in a cache slot."""
    return jnp.sum((ids >= 0) & (slot_of_expert[jnp.maximum(ids, 0)] >= 0), dtype=jnp.int32)


class StepCounts(NamedTuple):
    hits: jax.Array  # int32: (token, choice) pairs served from a cache slot filled before the layer started
    misses: jax.Array  # int32: the other pairs (stalls)
    copied: jax.Array  # int32: experts copied from host memory (demand and prefetch)
    evicted: jax.Array  # int32: cached experts overwritten


def admit_and_compute(slots: LayerSlots, victim_order, host: ExpertWeights, x, ids, weights, *,
                      kernel: ExpertKernel) -> tuple[jax.Array, Admission, StepCounts]:
    """Decode path: every missed expert goes into a victim cache slot or, when none is left, a scratch slot.

    Needs M >= the number of distinct experts one step can miss (the caller checks it statically).
    """
    num_experts = slots.slot_of_expert.shape[0]
    num_scratch = slots.buffers.num_experts - slots.expert_in_slot.shape[0]
    needed = needed_experts(ids, num_experts)
    hits = count_hits(slots.slot_of_expert, ids)
    adm = admit(slots, victim_order, host, needed, needed, limit=num_scratch, use_scratch=True)
    slot_ids = jnp.where(ids >= 0, adm.compute_slot[jnp.maximum(ids, 0)], -1)
    y = kernel(x, slot_ids, weights, adm.slots.buffers)
    counts = StepCounts(hits, jnp.sum(ids >= 0, dtype=jnp.int32) - hits, adm.copied, adm.evicted)
    return y, adm, counts


def prefetch(slots: LayerSlots, victim_order, host: ExpertWeights, scores, *, limit: int) -> Admission:
    """Copy up to `limit` of the highest-scoring experts (scores [E]) that are not cached into victim
    cache slots, ahead of the layer that will use them; never into scratch."""
    top = jax.lax.top_k(scores, limit)[1]
    wanted = jnp.zeros(scores.shape, bool).at[top].set(True)
    return admit(slots, victim_order, host, wanted, wanted, limit=limit, use_scratch=False)


def stream_and_compute(slots: LayerSlots, host: ExpertWeights, x, ids, weights, *,
                       kernel: ExpertKernel) -> tuple[jax.Array, StepCounts]:
    """Prefill path: cached experts from their slots, every other needed expert streamed from host memory in
    chunks of M (the scratch slot count), each copied into a step-local buffer of its own and then computed.
    The chunks are unrolled (at most E / M of them), so chunk c + 1's copy does not depend on chunk c's
    compute and XLA can overlap them, with two chunk buffers alive at once (double buffering). Chunks of
    M / 2 would halve that memory but double the kernel calls over all T tokens: 1.5x slower prefill on
    CPU. Exact for any number of distinct experts; the cache is left unchanged."""
    num_experts = slots.slot_of_expert.shape[0]
    num_cache = slots.expert_in_slot.shape[0]
    chunk_size = slots.buffers.num_experts - num_cache
    num_chunks = -(-num_experts // chunk_size)
    cached_slot = jnp.where(ids >= 0, slots.slot_of_expert[jnp.maximum(ids, 0)], -1)
    y = kernel(x, cached_slot, weights, slots.buffers).astype(jnp.float32)

    missing = needed_experts(ids, num_experts) & (slots.slot_of_expert < 0)
    n_miss = jnp.sum(missing, dtype=jnp.int32)
    miss_ids = jnp.nonzero(missing, size=num_chunks * chunk_size, fill_value=0)[0].astype(jnp.int32)
    # Rank of each expert among the missing ones: chunk c holds ranks [c*chunk_size, (c+1)*chunk_size).
    rank = jnp.where(missing, jnp.cumsum(missing) - 1, -1)
    token_rank = jnp.where(ids >= 0, rank[jnp.maximum(ids, 0)], -1)

    def compute(buffer, first):
        local = token_rank - first
        slot_ids = jnp.where((token_rank >= 0) & (local >= 0) & (local < chunk_size), local, -1)
        return kernel(x, slot_ids, weights, buffer).astype(jnp.float32)

    for c in range(num_chunks):
        first = c * chunk_size
        count = jnp.clip(n_miss - first, 0, chunk_size)
        buffer = _copy_experts(empty_slots(host, chunk_size), host, miss_ids[first:first + chunk_size],
                               jnp.arange(chunk_size), count)
        # Chunks past the last missing expert copy nothing and skip their compute.
        y = y + jax.lax.cond(count > 0, compute, lambda *_: jnp.zeros_like(y), buffer, first)
    hits = count_hits(slots.slot_of_expert, ids)
    counts = StepCounts(hits, jnp.sum(ids >= 0, dtype=jnp.int32) - hits, n_miss, jnp.int32(0))
    return y.astype(x.dtype), counts


def host_compute_misses(slots: LayerSlots, victim_order, host: ExpertWeights, x, ids, weights, *,
                        kernel: ExpertKernel, admit_limit: int) -> tuple[jax.Array, LayerSlots, StepCounts]:
    """Miss mode "host", decode path: cached experts run on the device from their slots; every other needed
    expert runs on the host, where its weights live, so only activations cross the link.

    Up to `admit_limit` missed experts are also copied into victim cache slots for later steps (never
    scratch, never a slot this step reads). The host compute does not wait for those copies; the device
    part reads the slots after them, because reading first made XLA copy the whole slot buffers to keep
    the version read (72 MB per layer and step on the GPT-OSS-shaped model).
    """
    num_experts = slots.slot_of_expert.shape[0]
    hits = count_hits(slots.slot_of_expert, ids)
    cached_slot = jnp.where(ids >= 0, slots.slot_of_expert[jnp.maximum(ids, 0)], -1)
    needed = needed_experts(ids, num_experts)
    missing = needed & (slots.slot_of_expert < 0)
    miss_ids = jnp.nonzero(missing, size=min(num_experts, ids.size), fill_value=0)[0].astype(jnp.int32)
    y_host = experts_on_host(x, ids, weights, miss_ids, jnp.sum(missing, dtype=jnp.int32), host,
                             activation=kernel.activation)
    copied = evicted = jnp.int32(0)
    if admit_limit:
        adm = admit(slots, victim_order, host, missing, needed, limit=admit_limit, use_scratch=False)
        slots, copied, evicted = adm.slots, adm.copied, adm.evicted
    y = kernel(x, cached_slot, weights, slots.buffers).astype(jnp.float32)
    y = y + y_host
    counts = StepCounts(hits, jnp.sum(ids >= 0, dtype=jnp.int32) - hits, copied, evicted)
    return y.astype(x.dtype), slots, counts
