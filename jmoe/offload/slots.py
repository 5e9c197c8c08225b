"""In-program expert slots: copy experts from pinned host memory into device slots, then run the MoE FFN.

Every offloaded MoE layer owns `S` cache slots that persist across steps (an ExpertWeights whose every
leaf has the slot axis first), with tables (int32, -1 = empty) `slot_of_expert[E]` and
`expert_in_slot[S]`. All layers share `M` scratch slots that hold, during one layer of a decode step, the
experts it missed (layers run one after another, so one scratch pool serves them all). The manager hands
every step a `victim_order`: every cache slot, first choice to overwrite first ([S]; in miss modes "host" and
"direct" less the slots its planned admissions take, -1 after), or none ([0]) under a policy that admits no miss,
so that a step knows from the order's shape whether its misses can all be admitted.
Everything here runs inside the jitted step with static shapes; the only data read from host memory are
experts of the pinned-host expert arrays.

Control flow, as a GPU sees it: a loop whose trip count is data makes the GPU copy its predicate to the host and
wait for it every iteration, and an unrolled copy from host memory moves its bytes whether its write is kept or
dropped. Every copy of experts into slots therefore goes through `copy_into_slots`: a list of (expert, slot) entries
with -1 for the unwanted ones, on a GPU one Triton kernel whose programs of unwanted entries move nothing
(`jmoe.kernels.expert_copy`), elsewhere a loop over the wanted ones (a CPU has no round trip to avoid). The demand
copies of a decode step in miss mode "fetch" (`fetch_and_compute`), the streamed chunks of a prefill, router and
history prefetch and the manager's planned admissions (`copy_wanted`) all take it, so no step has a `conditional` or,
on a GPU, a loop with an unknown trip count (but the disk tier's reads, `host_tier`, which wait for the host anyway).
A fetched expert is copied straight into the cache slot that admits it, so an admission moves its bytes once.
Partial outputs are float32 and summed before the one rounding to the activation dtype.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jmoe.kernels import ExpertKernel, ExpertWeights
from jmoe.kernels.expert_copy import copy_experts
from jmoe.kernels.target import platform_dependent
from jmoe.memory import on_second_stream, to_device
from jmoe.offload.fetch_plan import FetchPlan, fetch_plan_by_kernel, fetch_plan_fits
from jmoe.offload.host_compute import experts_on_host


class LayerSlots(NamedTuple):
    buffers: ExpertWeights  # [S, ...] per leaf, on the device: the layer's cache slots
    slot_of_expert: jax.Array  # int32 [E]: cache slot holding the expert, -1 = not cached
    expert_in_slot: jax.Array  # int32 [S]: expert held by each cache slot, -1 = empty


class Scratch(NamedTuple):
    """The M scratch slots all offloaded layers share, one after another."""

    buffers: ExpertWeights  # [M, ...] per leaf, on the device
    # None, or an array computed after the last read of `buffers` (the previous layer's compute): the next copies
    # into them wait for it (ordered_after), so XLA updates them in place.
    free: jax.Array | None = None


class StepCounts(NamedTuple):
    hits: jax.Array  # int32: (token, choice) pairs served from a cache slot filled before the layer started
    misses: jax.Array  # int32: the other pairs (stalls)
    copied: jax.Array  # int32: experts copied from host memory
    evicted: jax.Array  # int32: cached experts overwritten


def empty_slots(like: ExpertWeights, count: int) -> ExpertWeights:
    """Zeroed device buffers of `count` slots shaped like the experts in `like` (abstract or real arrays), stacked
    only (slots hold no per-expert views)."""
    return jax.tree.map(lambda a: jnp.zeros((count, *a.shape[1:]), a.dtype), like.stacked())


def device_copy(host: ExpertWeights, expert) -> ExpertWeights:
    """One expert's weights from pinned host memory into device memory: slice, then device_put, per leaf of the
    stacked arrays (the host's per-expert views, if any, hold the same values)."""
    return jax.tree.map(lambda a: to_device(jax.lax.dynamic_slice_in_dim(a, expert, 1, axis=0)), host.stacked())


def put_slot(buffers: ExpertWeights, expert_weights: ExpertWeights, slot) -> ExpertWeights:
    """`buffers` with slot `slot` replaced by the single expert in `expert_weights` (a slot out of range, -1 too,
    drops the write)."""
    slot = jnp.where(slot >= 0, slot, buffers.num_experts)  # .at[] would count -1 from the end
    return jax.tree.map(lambda b, e: b.at[slot].set(e[0], mode="drop"), buffers, expert_weights)


def copy_into_slots(buffers: ExpertWeights, host: ExpertWeights, experts, destinations, *,
                    side_stream: bool = False) -> ExpertWeights:
    """`buffers` with slot destinations[j] holding host expert experts[j] for every j whose destination and expert
    are >= 0 (wanted), the others moving nothing. The wanted entries come first, their experts and destinations
    distinct.
    On a GPU one Triton kernel (`jmoe.kernels.expert_copy`): no loop, no host round trip, the buffers updated in
    place, on the compute stream or, with `side_stream` (copies made ahead of need), in an asynchronous call on a
    second stream; elsewhere `copy_by_loop`."""
    if not experts.shape[0] or not buffers.num_experts:  # no entries (a static policy's layer of no slots)
        return buffers
    kernel = functools.partial(copy_experts, on_gpu=True)
    return platform_dependent(buffers, host.stacked(), experts, destinations,
                              cuda=on_second_stream(kernel) if side_stream else kernel, default=copy_by_loop)


def copy_by_loop(buffers: ExpertWeights, host: ExpertWeights, experts, destinations) -> ExpertWeights:
    """copy_into_slots as a loop over the wanted copies, its trip count their number."""
    return jax.lax.fori_loop(0, jnp.sum((destinations >= 0) & (experts >= 0), dtype=jnp.int32),
                             lambda j, b: put_slot(b, device_copy(host, experts[j]), destinations[j]), buffers)


def first_slots(count, size: int) -> jax.Array:
    """int32 [size]: j for j < count, else -1: the destinations that fill slots 0 .. count - 1 in order."""
    j = jnp.arange(size, dtype=jnp.int32)
    return jnp.where(j < count, j, -1)


def needed_experts(ids: jax.Array, num_experts: int) -> jax.Array:
    """bool [E]: experts some token routes to (ids -1 ignored). A comparison against every expert id and a
    reduction, which XLA fuses with what reads the result: on a GPU one kernel fewer per layer than a scatter."""
    return jnp.any(id_matches(ids.reshape(-1), num_experts), axis=0)


def id_matches(ids, size: int, where=None) -> jax.Array:
    """bool [n, size]: ids[j] == i (and where[j], when given); ids outside [0, size), such as -1, match none."""
    matches = ids[:, None] == jnp.arange(size, dtype=ids.dtype)
    return matches if where is None else matches & where[:, None]


def count_hits(slot_of_expert, ids) -> jax.Array:
    """(token, choice) pairs whose expert sits in a cache slot."""
    return jnp.sum((ids >= 0) & (slot_of_expert[jnp.maximum(ids, 0)] >= 0), dtype=jnp.int32)


def slot_ids_of(slot_of_expert, ids) -> jax.Array:
    """int32 [T, k]: the slot each (token, choice) reads (-1: none)."""
    return jnp.where(ids >= 0, slot_of_expert[jnp.maximum(ids, 0)], -1)


def rank_among(marked) -> jax.Array:
    """int [E]: each marked expert's rank among the marked ones, lowest id first (-1: not marked)."""
    return jnp.where(marked, jnp.cumsum(marked) - 1, -1)


def chunk_slot_ids(token_rank, first, size: int) -> jax.Array:
    """int32 [T, k]: the slot each (token, choice) reads in the chunk holding ranks [first, first + size), from its
    expert's rank `token_rank` (-1: none, or another chunk's)."""
    local = token_rank - first
    return jnp.where((token_rank >= 0) & (local >= 0) & (local < size), local, -1)


def admitted_tables(slots: LayerSlots, experts, destinations) -> tuple[LayerSlots, jax.Array]:
    """`slots` with the tables saying that expert experts[j] sits in cache slot destinations[j] (-1 = not
    admitted), its buffers as given; and the number of cached experts evicted."""
    num_experts, num_cache = slots.slot_of_expert.shape[0], slots.expert_in_slot.shape[0]
    cached = destinations >= 0
    evicted = jnp.where(cached, slots.expert_in_slot[jnp.clip(destinations, 0, num_cache - 1)], -1)
    # The tables' updates as comparisons against every id and selects (the experts and the destinations are
    # distinct): elementwise work that XLA fuses, where scatters would be a kernel each on a GPU.
    slot_of_expert = jnp.where(jnp.any(id_matches(evicted, num_experts), axis=0), -1, slots.slot_of_expert)
    admitted_to = index_of_match(experts, destinations, num_experts, cached)  # -1: not admitted
    slot_of_expert = jnp.where(admitted_to >= 0, admitted_to, slot_of_expert)
    admitted = index_of_match(destinations, experts, num_cache, cached)
    expert_in_slot = jnp.where(admitted >= 0, admitted, slots.expert_in_slot)
    # Made once, here: XLA:GPU had fused the selects into every later reader (the step's readback among them), which
    # then read the old tables after the new ones were written in place, so it copied each expert_in_slot first (a
    # kernel a layer in miss mode "direct").
    slot_of_expert, expert_in_slot, evicted = jax.lax.optimization_barrier((slot_of_expert, expert_in_slot, evicted))
    return LayerSlots(slots.buffers, slot_of_expert, expert_in_slot), jnp.sum(evicted >= 0, dtype=jnp.int32)


def index_of_match(keys, values, size: int, where) -> jax.Array:
    """int [size]: at i, values[j] for the one j (where `where` holds) with keys[j] == i; -1 where none does."""
    return jnp.max(jnp.where(id_matches(keys, size, where), values[:, None], -1), axis=0)


def ordered_after(indices, value):
    """`indices` (int, each > INT_MIN) unchanged, but computed from `value` (any array): an in-place update indexed by
    them runs after every read that fed `value`. Without a data dependence XLA cannot order a read of a
    donated buffer before its update and copies the whole buffer first (an optimization barrier does not
    survive to XLA:CPU's copy insertion). The max with INT_MIN or INT_MIN + 1 cannot be folded away."""
    low = jnp.iinfo(indices.dtype).min + (jnp.sum(value) > 0).astype(indices.dtype)
    return jnp.maximum(indices, low)


def copy_wanted(slots: LayerSlots, host: ExpertWeights, experts, destinations, *,
                side_stream: bool = False) -> tuple[LayerSlots, jax.Array, jax.Array]:
    """Copy experts[j] from host memory into cache slot destinations[j] for the j that have one (-1 = not
    wanted; `copy_into_slots`, so an unwanted one moves nothing; `side_stream` passed on). The experts must be
    distinct; a cached one is not wanted. Returns the slots, the number of cached experts evicted and the number of
    experts copied."""
    if not slots.expert_in_slot.shape[0] or not experts.shape[0]:
        return slots, jnp.int32(0), jnp.int32(0)
    # An expert cached already is not copied again: a manager's plan one step old (Model.dispatch_step) may name
    # an expert that the step in between admitted.
    wanted = (destinations >= 0) & (slots.slot_of_expert[jnp.maximum(experts, 0)] < 0)
    destinations = jnp.where(wanted, destinations, -1)
    if experts.shape[0] > 1:  # the wanted copies first
        order = jnp.argsort(~wanted, stable=True)
        experts, destinations = experts[order], destinations[order]
    buffers = copy_into_slots(slots.buffers, host, experts, destinations, side_stream=side_stream)
    slots, evicted = admitted_tables(slots._replace(buffers=buffers), experts, destinations)
    return slots, evicted, jnp.sum(wanted, dtype=jnp.int32)


def usable_victims(slots: LayerSlots, victim_order, protected) -> jax.Array:
    """The manager's victim order minus slots holding `protected` experts, compacted to the front (-1 after)."""
    held = jnp.where(victim_order >= 0, slots.expert_in_slot[jnp.maximum(victim_order, 0)], -1)
    usable = (victim_order >= 0) & ~((held >= 0) & protected[jnp.maximum(held, 0)])
    return jnp.where(usable, victim_order, -1)[jnp.argsort(~usable, stable=True)]


def fetch_and_compute(slots: LayerSlots, scratch: Scratch, victim_order, host: ExpertWeights, x, ids,
                      weights, *, kernel: ExpertKernel, host_rows=None,
                      disk=None) -> tuple[jax.Array, LayerSlots, Scratch, StepCounts]:
    """Decode path, miss mode "fetch": the missed experts (lowest ids first, up to M) are copied from host memory
    straight into the cache slots the manager offers (its victim order, never a slot holding an expert this step
    needs), which admits them, and computed there; the misses past the offered slots are copied into the shared
    scratch slots and computed from there, not admitted. So an admission moves an expert's bytes once, from the
    host into its slot (`copy_into_slots`), with no device-to-device copy after. A batch that misses more than M
    experts computes the rest on the host. Where the order names every slot and the slots outnumber the experts
    the step can route to, every miss is admitted: the scratch copy and its expert kernel are left out (on a GPU,
    their kernels a layer). Which copies go where, and the tables after them: `plan_fetch`. Returns (float32 y
    [T, d], slots, scratch, counts)."""
    num_experts, num_scratch = slots.slot_of_expert.shape[0], scratch.buffers.num_experts
    num_cache, most_needed = slots.expert_in_slot.shape[0], min(ids.size, num_experts)
    all_admitted = victim_order.shape[0] == num_cache >= most_needed
    y_disk = on_disk = None
    if host_rows is not None:  # the disk tier: `host` holds rows, host_rows[e] expert e's (-1: on disk only)
        on_disk = needed_experts(ids, num_experts) & (slots.slot_of_expert < 0) & (host_rows < 0)
        y_disk = disk(x, ids, weights, on_disk)
    # The step misses at most `most_missed` experts (its choices, distinct), the first M of them on the device:
    # only that many copy entries (a GPU launches no programs for more).
    most_missed = most_needed if all_admitted else min(num_scratch, most_needed)
    plan = plan_fetch(slots, victim_order, ids, most_missed=most_missed, num_scratch=num_scratch, on_disk=on_disk)

    def sources(misses):
        return misses if host_rows is None else host_rows[misses]

    if num_cache:
        slots = LayerSlots(copy_into_slots(slots.buffers, host, sources(plan.misses), plan.into_cache),
                           plan.slot_of_expert, plan.expert_in_slot)
        y = kernel(x, plan.cache_slot_ids, weights, slots.buffers, out_dtype=jnp.float32)
    else:
        y = jnp.zeros(x.shape, jnp.float32)
    if not all_admitted:
        into = plan.into_scratch if scratch.free is None else ordered_after(plan.into_scratch, scratch.free)
        buffers = copy_into_slots(scratch.buffers, host, sources(plan.scratch_misses), into)
        y = y + kernel(x, plan.scratch_slot_ids, weights, buffers, out_dtype=jnp.float32)
        if most_needed > num_scratch:  # this step's shape can miss more experts than M
            y = y + experts_on_host_where(plan.past_scratch, x, ids, weights, host, kernel, host_rows)
        # The scratch slots' last reader is the layer's compute: the next layer's copies into them wait for it.
        scratch = Scratch(buffers, y)
    if y_disk is not None:
        y = y + y_disk
    counts = StepCounts(plan.hits, plan.routed - plan.hits, plan.copied, plan.evicted)
    return y, slots, scratch, counts


def plan_fetch(slots: LayerSlots, victim_order, ids, *, most_missed: int, num_scratch: int,
               on_disk=None) -> FetchPlan:
    """What `fetch_and_compute` copies where, and the tables after it (`FetchPlan`; `on_disk`: bool [E], misses
    the disk tier reads, left out). On a GPU one kernel (`jmoe.offload.fetch_plan`), where XLA made it eight a
    layer, for a decode step of few choices without a disk tier; elsewhere `fetch_plan_in_xla`."""
    args = (LayerSlots(None, slots.slot_of_expert, slots.expert_in_slot), victim_order, ids)  # the tables only
    options = dict(most_missed=most_missed, num_scratch=num_scratch)
    in_xla = functools.partial(fetch_plan_in_xla, on_disk=on_disk, **options)
    if on_disk is not None or not fetch_plan_fits(slots.slot_of_expert.shape[0], slots.expert_in_slot.shape[0],
                                                  victim_order.shape[0], ids.size):
        return in_xla(*args)
    return platform_dependent(*args, cuda=functools.partial(fetch_plan_by_kernel, on_gpu=True, **options),
                              default=in_xla)


def fetch_plan_in_xla(slots: LayerSlots, victim_order, ids, *, most_missed: int, num_scratch: int,
                      on_disk=None) -> FetchPlan:
    """`plan_fetch` as XLA computations."""
    num_experts = slots.slot_of_expert.shape[0]
    needed = needed_experts(ids, num_experts)
    hits = count_hits(slots.slot_of_expert, ids)
    missing = needed & (slots.slot_of_expert < 0)
    if on_disk is not None:
        missing = missing & ~on_disk
    copied = jnp.minimum(jnp.sum(missing, dtype=jnp.int32), most_missed)
    misses = jnp.nonzero(missing, size=most_missed, fill_value=0)[0].astype(jnp.int32)
    rank = rank_among(missing)  # of each expert among the misses
    evicted, admitted, into_cache = jnp.int32(0), jnp.int32(0), jnp.full((most_missed,), -1, jnp.int32)
    if slots.expert_in_slot.shape[0]:
        victims = usable_victims(slots, victim_order, needed)
        victims = jnp.pad(victims, (0, max(0, most_missed - victims.shape[0])), constant_values=-1)[:most_missed]
        into_cache = jnp.where(first_slots(copied, most_missed) >= 0, victims, -1)  # compacted: wanted first
        admitted = jnp.sum(into_cache >= 0, dtype=jnp.int32)
        slots, evicted = admitted_tables(slots, misses, into_cache)
    # The misses ranked past the admitted ones: scratch slot j holds the one ranked admitted + j.
    shifted = jnp.minimum(admitted + jnp.arange(most_missed), most_missed - 1)
    scratch_slot = jnp.where((rank >= admitted) & (rank < copied), rank - admitted, -1)
    return FetchPlan(misses, into_cache, slots.slot_of_expert, slots.expert_in_slot,
                     slot_ids_of(slots.slot_of_expert, ids), misses[shifted],
                     first_slots(copied - admitted, most_missed), slot_ids_of(scratch_slot, ids),
                     missing & (rank >= num_scratch), jnp.sum(ids >= 0, dtype=jnp.int32), hits, copied, evicted)


def experts_on_host_where(missing, x, ids, weights, host: ExpertWeights, kernel: ExpertKernel,
                          host_rows=None) -> jax.Array:
    """float32 [T, d]: the contribution of the experts marked in `missing` (bool [E]), computed on the host (from
    host rows, `host_rows` [E] the row of each expert, with a disk tier)."""
    if host_rows is not None:  # in row space: row r stands for the expert it holds
        ids, missing = slot_ids_of(host_rows, ids), rows_marked(host_rows, missing, host.num_experts)
    num_experts = missing.shape[0]
    miss_ids = jnp.nonzero(missing, size=min(num_experts, ids.size), fill_value=0)[0].astype(jnp.int32)
    return experts_on_host(x, ids, weights, miss_ids, jnp.sum(missing, dtype=jnp.int32), host,
                           activation=kernel.activation)


def prefetch(slots: LayerSlots, victim_order, host: ExpertWeights, scores, *, count: int, side_stream: bool = False,
             enabled=True):
    """Copy the `count` highest-scoring experts (scores [E]) that are not cached into the first `count`
    victim cache slots, ahead of the layer that will use them (`copy_wanted`: fewer when fewer than `count`
    experts are uncached or the policy offers fewer victims; `side_stream` passed on). Returns (slots, the victim
    order left, evicted, the experts copied). `enabled` False (a traced bool) copies nothing and leaves every victim."""
    wanted = jax.lax.top_k(jnp.where(slots.slot_of_expert < 0, scores, -jnp.inf), count)[1].astype(jnp.int32)
    # Fewer than `count` experts uncached (a cache of nearly E slots): the extra picks are cached already, and
    # copy_wanted admits nothing for them.
    offered = jnp.pad(victim_order, (0, max(0, count - victim_order.shape[0])), constant_values=-1)[:count]
    slots, evicted, copied = copy_wanted(slots, host, wanted, jnp.where(enabled, offered, -1), side_stream=side_stream)
    # The slots just filled become the last choice (a guess the layer does not route to may still give way to a
    # miss), so the order still names every slot and the layer's misses are admitted as without prefetch.
    remaining = jnp.roll(victim_order, -min(count, victim_order.shape[0]))
    return slots, jnp.where(enabled, remaining, victim_order), evicted, copied


def prefetch_by_score(slots: LayerSlots, host: ExpertWeights, scores, *, count: int, min_score: float,
                      budget: int, min_gain: float, side_stream: bool = False) -> tuple[LayerSlots, jax.Array,
                                                                                         jax.Array]:
    """Prefetch by predictor scores (float32 [E], higher = more likely next), the replay's rule
    (jmoe.traces.replay.prefetch_step) in static shapes: the predicted set is the `count` best-scored
    experts with score >= `min_score`; its uncached experts, best first, at most `budget`, fill the empty
    slots, then replace cached experts outside the predicted set, lowest score first, each only if it
    beats its victim's score by `min_gain`. At most `budget` copies, only those the rule takes
    (`copy_wanted`, `side_stream` passed on). Returns (slots, evicted, experts copied)."""
    num_experts, num_cache = scores.shape[0], slots.expert_in_slot.shape[0]
    budget = min(budget, num_cache, num_experts)
    if not budget:
        return slots, jnp.int32(0), jnp.int32(0)
    # Rank by descending score, ties to the lower id (top_k and a stable sort both do that).
    predicted = jnp.any(id_matches(jax.lax.top_k(scores, min(count, num_experts))[1], num_experts), axis=0)
    predicted &= scores >= min_score
    wanted = predicted & (slots.slot_of_expert < 0)
    wanted_scores, candidates = jax.lax.top_k(jnp.where(wanted, scores, -jnp.inf), budget)
    is_wanted = wanted[candidates]
    held = slots.expert_in_slot
    empty = held < 0
    n_free = jnp.sum(empty, dtype=jnp.int32)
    free_slots = jnp.nonzero(empty, size=budget, fill_value=-1)[0].astype(jnp.int32)
    evictable = ~empty & ~predicted[jnp.maximum(held, 0)]
    victim_scores = jnp.where(evictable, scores[jnp.maximum(held, 0)], jnp.inf)
    # Lowest score first, ties to the lower expert id (the replay's choose_victims).
    by_victim = jnp.lexsort((jnp.where(evictable, held, num_experts), victim_scores))[:budget]
    j = jnp.arange(budget)
    victim = jnp.clip(j - n_free, 0, budget - 1)
    uses_free = j < n_free
    room = uses_free | (j - n_free < jnp.sum(evictable))
    gain = jnp.where(uses_free, jnp.inf, wanted_scores - victim_scores[by_victim[victim]])
    passing = is_wanted & room & (gain >= min_gain)
    n_fetch = jnp.sum(passing)  # the replay takes this many, best first
    destinations = jnp.where(j < n_fetch, jnp.where(uses_free, free_slots[j], by_victim[victim]), -1)
    return copy_wanted(slots, host, candidates.astype(jnp.int32), destinations.astype(jnp.int32),
                       side_stream=side_stream)


def rows_marked(host_rows, marked, num_rows: int) -> jax.Array:
    """bool [E] over experts -> bool [H] over the rows holding them."""
    return jnp.any(id_matches(host_rows, num_rows, marked), axis=0)


def prefill_experts(slots: LayerSlots, host: ExpertWeights, x, ids, weights, *, kernel: ExpertKernel,
                    chunk_size: int, host_rows=None, disk=None) -> tuple[jax.Array, StepCounts]:
    """Prefill path, chosen by the platform the step is lowered for: on a GPU the missing experts stream
    through chunk buffers (`stream_and_compute`); on CPU, where host and device memory are the same RAM,
    every expert is read where it lives (`experts_in_place`). The counts are the same on both: `copied` is
    what a device copies in. Returns float32 y [T, d] and the counts."""
    compute = functools.partial(
        platform_dependent, cpu=functools.partial(experts_in_place, kernel=kernel),
        default=functools.partial(stream_and_compute, kernel=kernel, chunk_size=chunk_size))
    if host_rows is None:
        y = compute(slots, host, x, ids, weights)
    else:  # the disk tier: the rows hold every cached expert (inclusive), the disk the rest
        # The same two paths over the rows, as if the rows were the layer's experts: on a GPU only the needed
        # rows no slot holds stream in, never the whole tier.
        y = compute(rows_as_slots(slots, host_rows, jax.tree.leaves(host)[0].shape[0]), host, x,
                    slot_ids_of(host_rows, ids), weights)
        on_disk = needed_experts(ids, host_rows.shape[0]) & (host_rows < 0)
        y = y + disk(x, ids, weights, on_disk)
    hits = count_hits(slots.slot_of_expert, ids)
    n_miss = jnp.sum(needed_experts(ids, slots.slot_of_expert.shape[0]) & (slots.slot_of_expert < 0), dtype=jnp.int32)
    return y, StepCounts(hits, jnp.sum(ids >= 0, dtype=jnp.int32) - hits, n_miss, jnp.int32(0))


def rows_as_slots(slots: LayerSlots, host_rows, rows: int) -> LayerSlots:
    """`slots` indexed by host row instead of expert (the disk tier: `host_rows` int32 [E] is each expert's row,
    -1 = on disk only; `rows` of them): which slot holds each row's expert, which row each slot's."""
    expert_in_row = index_of_match(host_rows, jnp.arange(host_rows.shape[0], dtype=jnp.int32), rows, host_rows >= 0)
    return LayerSlots(slots.buffers, slot_ids_of(slots.slot_of_expert, expert_in_row),
                      slot_ids_of(host_rows, slots.expert_in_slot))


def experts_in_place(slots: LayerSlots, host: ExpertWeights, x, ids, weights, *, kernel: ExpertKernel) -> jax.Array:
    """CPU prefill: the whole layer's experts read from host memory in one kernel call, as if resident, through
    their per-expert views when the layer has them (jmoe.kernels.per_expert_views; the kernel then computes each
    expert's rows in place). XLA:CPU compiles the device_put of a whole host array to nothing
    (tests/test_gpu_step.py checks that the program copies no expert array), so nothing is copied; cached experts
    are read from the host too (the same values), which keeps one call for every expert. Returns float32 y [T, d]."""
    del slots  # the cache holds copies of host experts; the host has every one
    return kernel(x, ids, weights, to_device(host), out_dtype=jnp.float32)


def stream_and_compute(slots: LayerSlots, host: ExpertWeights, x, ids, weights, *, kernel: ExpertKernel,
                       chunk_size: int) -> jax.Array:
    """GPU prefill path: cached experts from their slots, every other needed expert streamed from host
    memory in chunks of `chunk_size`, each copied into a step-local buffer of its own and then computed. The
    chunks are unrolled (at most E / chunk_size of them), so chunk c + 1's copy does not depend on chunk c's
    compute (both are kernels on one GPU stream, the copy jmoe.kernels.expert_copy's; on a second stream, as
    side_stream_copies puts decode's copies ahead, XLA's scheduler still ran each chunk's copy with nothing beside
    it in an H100 compile, so prefill keeps one stream), with two chunk buffers alive at once. Exact for
    any number of distinct experts; the cache is left unchanged. Returns float32 y [T, d]."""
    num_experts = slots.slot_of_expert.shape[0]
    num_chunks = -(-num_experts // chunk_size)
    y = jnp.zeros(x.shape, jnp.float32)
    if slots.expert_in_slot.shape[0]:
        y = kernel(x, slot_ids_of(slots.slot_of_expert, ids), weights, slots.buffers, out_dtype=jnp.float32)

    missing = needed_experts(ids, num_experts) & (slots.slot_of_expert < 0)
    n_miss = jnp.sum(missing, dtype=jnp.int32)
    miss_ids = jnp.nonzero(missing, size=num_chunks * chunk_size, fill_value=0)[0].astype(jnp.int32)
    # Rank of each expert among the missing ones: chunk c holds ranks [c*chunk_size, (c+1)*chunk_size).
    token_rank = slot_ids_of(rank_among(missing), ids)

    def compute(buffer, first):
        return kernel(x, chunk_slot_ids(token_rank, first, chunk_size), weights, buffer, out_dtype=jnp.float32)

    for c in range(num_chunks):
        first = c * chunk_size
        into = first_slots(n_miss - first, chunk_size)
        buffer = copy_into_slots(empty_slots(host, chunk_size), host, miss_ids[first:first + chunk_size], into)
        # Chunks past the last missing expert copy nothing and compute nothing, masked (every slot id is -1)
        # rather than branched on: a branch makes a GPU wait for the host.
        y = y + compute(buffer, first)
    return y
