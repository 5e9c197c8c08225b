"""Miss mode "fetch"'s bookkeeping for one offloaded layer of a decode step as one Pallas kernel (Triton on a GPU):
which missed experts are copied into which cache slots and which into scratch, the tables after the admissions, and
the slot each (token, choice) then reads.

Why a kernel: XLA:GPU made this integer work on a few dozen elements eight kernels a layer (the needed experts, the
victims the step may use, compacted by a sort, the misses listed by a scatter, the tables' updates, the slot ids), each
a launch as long as a small kernel's work; the layer's copies and expert kernels wait for all of them. One program
does it all here, with every gather and compaction written as comparisons of small vectors. `jmoe.offload.slots.
fetch_plan_in_xla` is the same computation in XLA, what every other platform runs, and tests/test_bookkeeping_kernels.py
holds the kernel (interpreted) to it."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# Elements of the largest comparison the kernel makes ((token, choice) pairs x experts, each padded to a power of
# two): one program holds it in registers, so larger steps (batches of many pairs) keep XLA's kernels.
MOST_COMPARED = 8192
TRITON_PARAMS = pltriton.CompilerParams(num_warps=4, num_stages=1)


class FetchPlan(NamedTuple):
    misses: jax.Array  # int32 [R]: the missed experts, lowest id first (0 past the last): what the cache copies read
    into_cache: jax.Array  # int32 [R]: the cache slot admitting misses[j], -1 = none
    slot_of_expert: jax.Array  # int32 [E]: the tables after the admissions
    expert_in_slot: jax.Array  # int32 [S]
    cache_slot_ids: jax.Array  # int32 [T, k]: the cache slot each (token, choice) reads then, -1 = none
    scratch_misses: jax.Array  # int32 [R]: the misses past the admitted ones, scratch slot j's
    into_scratch: jax.Array  # int32 [R]: j for the scratch slots filled, -1 after
    scratch_slot_ids: jax.Array  # int32 [T, k]: the scratch slot each (token, choice) reads, -1 = none
    past_scratch: jax.Array  # bool [E]: misses ranked past the scratch slots (computed on the host)
    routed: jax.Array  # int32: (token, choice) pairs that route to an expert
    hits: jax.Array  # int32: of them, those whose expert was cached before the step
    copied: jax.Array  # int32: misses copied to the device (at most R)
    evicted: jax.Array  # int32: cached experts overwritten


def fetch_plan_fits(num_experts: int, num_cache: int, num_victims: int, num_pairs: int) -> bool:
    """Whether the kernel serves a layer of these sizes: cache slots and a victim order to admit into, and
    comparisons small enough for one program."""
    # Every comparison is of one vector of pairs or misses (at most as many as the pairs) with another.
    widest = pl.next_power_of_2(max(num_experts, num_cache, num_victims)) * pl.next_power_of_2(num_pairs)
    return num_cache > 0 and num_victims > 0 and widest <= MOST_COMPARED


def fetch_plan_by_kernel(slots, victim_order, ids, *, most_missed: int, num_scratch: int, on_gpu: bool) -> FetchPlan:
    """`jmoe.offload.slots.plan_fetch` as one kernel (`slots`: a LayerSlots, whose tables it reads)."""
    num_experts, num_cache = slots.slot_of_expert.shape[0], slots.expert_in_slot.shape[0]
    sizes = dict(experts=num_experts, cache=num_cache, victims=victim_order.shape[0], pairs=ids.size,
                 most_missed=most_missed)
    vector = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    outputs = pl.pallas_call(
        functools.partial(_plan_kernel, num_scratch=num_scratch, on_gpu=on_gpu, **sizes),
        out_shape=[vector((most_missed,)), vector((most_missed,)), vector((num_experts,)), vector((num_cache,)),
                   vector((ids.size,)), vector((most_missed,)), vector((most_missed,)), vector((ids.size,)),
                   vector((num_experts,)), vector((4,))],
        grid=(1,),
        # Whole arrays, read and written by masked loads and stores: Triton's blocks are powers of two.
        in_specs=[pl.no_block_spec] * 4,
        out_specs=[pl.no_block_spec] * 10,
        # expert_in_slot updated in its own buffer (the state's, donated): a new one was a copy into it after the step
        input_output_aliases={1: 3},
        interpret=not on_gpu,
        compiler_params=TRITON_PARAMS if on_gpu else None,
        name="fetch_plan",
    )(slots.slot_of_expert, slots.expert_in_slot, victim_order, ids.reshape(-1).astype(jnp.int32))
    (misses, into_cache, slot_of_expert, expert_in_slot, cache_slot_ids, scratch_misses, into_scratch,
     scratch_slot_ids, past_scratch, counts) = outputs
    return FetchPlan(misses, into_cache, slot_of_expert, expert_in_slot, cache_slot_ids.reshape(ids.shape),
                     scratch_misses, into_scratch, scratch_slot_ids.reshape(ids.shape), past_scratch > 0,
                     *counts)


def _iota(size: int) -> jax.Array:
    return jax.lax.broadcasted_iota(jnp.int32, (pl.next_power_of_2(size),), 0)


def _load(ref, size: int, other: int) -> jax.Array:
    """A vector ref's values padded to a power of two with `other`."""
    index = _iota(size)
    return pltriton.load(ref.at[pl.ds(0, index.shape[0])], mask=index < size, other=other)


def _store(ref, values, size: int):
    pltriton.store(ref.at[pl.ds(0, values.shape[0])], values, mask=_iota(size) < size)


def _lookup(keys, table, positions, empty: int = -1):
    """At each key, table[j] for the position j equal to it (positions distinct), `empty` where none is."""
    match = keys[:, None] == positions[None, :]
    found = jnp.max(jnp.where(match, 1, 0), axis=1) > 0
    return jnp.where(found, jnp.sum(jnp.where(match, table[None, :], 0), axis=1), empty)


def _rank(marked) -> jax.Array:
    """Each marked element's rank among the marked ones, first first (-1: not marked)."""
    return jnp.where(marked, jnp.cumsum(marked.astype(jnp.int32)) - 1, -1)


def _plan_kernel(soe_ref, eis_ref, order_ref, ids_ref, misses_ref, into_cache_ref, soe_out, eis_out, cache_ids_ref,
                 scratch_misses_ref, into_scratch_ref, scratch_ids_ref, past_ref, counts_ref, *, experts, cache,
                 victims, pairs, most_missed, num_scratch, on_gpu):
    """fetch_plan_in_xla's steps, in its order, on vectors padded to powers of two (pad experts count as cached,
    pad pairs, victims and slots as -1)."""
    expert, rows = _iota(experts), _iota(most_missed)
    ids = _load(ids_ref, pairs, -1)
    slot_of_expert = _load(soe_ref, experts, 0)
    expert_in_slot = _load(eis_ref, cache, -1)
    order = _load(order_ref, victims, -1)
    needed = jnp.max(jnp.where(ids[:, None] == expert[None, :], 1, 0), axis=0) > 0
    routed = jnp.sum((ids >= 0).astype(jnp.int32))
    hits = jnp.sum(jnp.where(ids >= 0, jnp.where(soe_ref[jnp.clip(ids, 0, experts - 1)] >= 0, 1, 0), 0))
    missing = needed & (slot_of_expert < 0)
    copied = jnp.minimum(jnp.sum(missing.astype(jnp.int32)), most_missed)
    rank = _rank(missing)
    misses = _lookup(rows, expert, rank, empty=0)  # nonzero's order and fill
    # The victims the step may use: the manager's order less slots holding an expert it needs, compacted.
    held = jnp.where(order >= 0, eis_ref[jnp.clip(order, 0, cache - 1)], -1)
    protected = (held >= 0) & (jnp.max(jnp.where(held[:, None] == ids[None, :], 1, 0), axis=1) > 0)
    usable = (order >= 0) & jnp.logical_not(protected)
    into_cache = jnp.where(rows < copied, _lookup(rows, order, _rank(usable)), -1)
    admitting = into_cache >= 0
    admitted = jnp.sum(admitting.astype(jnp.int32))
    evicted = jnp.where(admitting, eis_ref[jnp.clip(into_cache, 0, cache - 1)], -1)
    gone = jnp.max(jnp.where(evicted[None, :] == expert[:, None], 1, 0), axis=1) > 0
    slot_of_expert = jnp.where(gone, -1, slot_of_expert)
    slot_of_expert = _lookup(expert, into_cache, jnp.where(admitting, misses, -1), empty=slot_of_expert)
    expert_in_slot = _lookup(_iota(cache), misses, jnp.where(admitting, into_cache, -1), empty=expert_in_slot)
    # Every thread reads expert_in_slot before any writes it (its buffer is the output's); interpreted, in order.
    if on_gpu:
        pltriton.debug_barrier()
    # The misses past the admitted ones go to scratch, in rank order.
    shifted = jnp.minimum(admitted + rows, most_missed - 1)
    scratch_slot = jnp.where((rank >= admitted) & (rank < copied), rank - admitted, -1)
    _store(misses_ref, misses, most_missed)
    _store(into_cache_ref, into_cache, most_missed)
    _store(soe_out, slot_of_expert, experts)
    _store(eis_out, expert_in_slot, cache)
    _store(cache_ids_ref, _lookup(ids, slot_of_expert, expert), pairs)
    _store(scratch_misses_ref, _lookup(shifted, misses, rows, empty=0), most_missed)
    _store(into_scratch_ref, jnp.where(rows < copied - admitted, rows, -1), most_missed)
    _store(scratch_ids_ref, _lookup(ids, scratch_slot, expert), pairs)
    _store(past_ref, (missing & (rank >= num_scratch)).astype(jnp.int32), experts)
    counts = (routed, hits, copied, jnp.sum((evicted >= 0).astype(jnp.int32)))
    field = _iota(len(counts))
    _store(counts_ref, functools.reduce(lambda out, j: jnp.where(field == j, counts[j], out), range(len(counts)),
                                        jnp.zeros(field.shape, jnp.int32)), len(counts))
