"""The offload engine: device slots for the experts of offloaded MoE layers, fed from pinned host memory.

It plugs into the jitted steps through the expert-engine interface (see jmoe.offload.resident): its state
(slot buffers, slot tables, the manager's victim order and planned copies) goes into every step and comes
back updated; between steps the SlotManager reads the step's routing and the new tables (both part of
the step's single device-to-host read) and writes the next victim order and plan.

A decode step (one token per row) serves a layer's experts from its cache slots and, for the misses,
by miss mode: "fetch" copies them in (a batch that misses more than the scratch slots hold computes the rest
on the host); "host" computes them on the host and the manager admits them at the start of the next step
(`plan`, the planned copies that admit something); "direct" is "host" with the device computing them from host
memory. History prefetch (`prefetch_trace`, jmoe.offload.history_prefetch) copies the experts its rule takes,
router prefetch the router's picks. Longer steps (prompts) stream every missing expert through chunked
step-local buffers. Every such copy moves only the experts wanted (`jmoe.offload.slots.copy_into_slots`: on a
GPU one kernel, no loop).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmoe.config import ModelConfig
from jmoe.memory import PINNED_HOST, sharding_for, to_device
from jmoe.model import MoELayerView, router_probabilities
from jmoe.offload.history_prefetch import BEST, HistoryPrefetch, best_predictor
from jmoe.offload.host_tier import HostTier, disk_experts, write_row
from jmoe.offload.manager import SlotManager
from jmoe.offload.options import COMPUTED_WHERE_THEY_LIE, OffloadOptions
from jmoe.offload.placement import Placement
from jmoe.offload.policies import CachePolicy
from jmoe.offload.resident import ResidentEngine
from jmoe.offload.slots import (LayerSlots, Scratch, copy_into_slots, copy_wanted, empty_slots, fetch_and_compute,
                                prefetch, prefetch_by_score, prefill_experts)
from jmoe.offload.where_they_lie import compute_misses_where_they_lie


def steps_run_ahead(placement: Placement, options: OffloadOptions) -> bool:
    """Whether a step may be dispatched before the last one's after_step (the manager's tables then reach the step
    after next). Not with a disk tier: after_step writes host rows from the reads the step made, which a step
    dispatched ahead would be making at the same time (and its in-step reads wait on the same reader). Not with
    history prefetch: its scores from the tokens before the step (`predict_base`) would miss the last one, and on the
    GPT-OSS-20B trace (tests/test_history_prefetch.py) its stall-free rate fell from the replay's 0.686 to 0.616."""
    return not placement.host_rows and options.prefetch_trace is None


class EngineState(NamedTuple):
    """Per offloaded layer l with S_l cache slots (layers may differ); M scratch slots shared by all."""

    buffers: tuple  # per layer: ExpertWeights of its S_l cache slots on the device
    scratch: object  # ExpertWeights of the M shared scratch slots on the device
    slot_of_expert: jax.Array  # int32 [Lo, E]
    expert_in_slot: tuple  # per layer: int32 [S_l]
    victim_order: jax.Array  # int32 [Lo, max S_l] from the manager: row l's first S_l entries, then -1 ([Lo, 0]: none)
    plan_experts: jax.Array  # int32 [Lo, W]: experts the manager copies in as the step starts ...
    plan_slots: jax.Array  # int32 [Lo, W]: ... into these cache slots (-1 = no copy)
    predict_base: jax.Array  # float32 [L_moe, E]: history prefetch's scores known before the step ([0, E]: off)
    counts: jax.Array  # int32 [Lo, 4]: the last step's hits, misses, experts copied, evictions per layer
    # Per offloaded layer its position l, an int32 scalar array of its own, at which the step reads row l of
    # slot_of_expert, victim_order, plan_experts, plan_slots and host_row_of_expert: a row read at a constant puts the
    # constant in the kernels that read it, and XLA:GPU compiles a kernel once for all its places only where they are
    # identical (bench/results/depth.md: an H100 compile of 24 DeepSeek-V3 layers 17% shorter). A block's layers are
    # consecutive positions, so the step writes its rows of slot_of_expert and counts at once from its first.
    layer_index: tuple
    # The disk tier (jmoe.offload.host_tier; () without a host budget): per layer ExpertWeights of its H host
    # rows in pinned host memory, and int32 [Lo, E] the row of each expert (-1 = on disk only).
    host_tier: tuple = ()
    host_row_of_expert: object = ()
    # History prefetch's within-token evidence tables (HistoryPrefetch.within, [D, L_moe, E + 1, E]; () when off):
    # an argument, so that a chained step's block programs, which read them at traced layers, do not each hold them
    # as a constant.
    history_evidence: object = ()


# The state's fields that hold a tuple of one entry per offloaded layer (the others are stacked over the layers, or
# shared by them): what a block of a chained step takes of them is its own layers' entries.
PER_LAYER = ("buffers", "expert_in_slot", "layer_index", "host_tier")


class Carry(NamedTuple):
    """What a chained step's block hands the next (bind_block): None where the engine needs no part of it."""

    router: tuple | None  # router prefetch: the last MoE layer's input [N, d], routing [N, k], whether it is offloaded
    history: tuple | None  # history prefetch: the next MoE layer's place (int32) and this token's ids [L_moe, N, k]


class BlockLayout(NamedTuple):
    """What a step's program needs to know of a run of consecutive MoE layers (the whole step's, or a chained step's
    block: jmoe.decode.chain) to bind their slots: the same for every run of alike layers wherever it sits, so that
    alike blocks share one program."""

    positions: tuple  # per MoE layer of the run: its position among the run's offloaded layers, or None (resident)
    caches: tuple  # per offloaded layer of the run: its cache slots
    # The run's first MoE layer takes router prefetch from the MoE layer before it, by bind_block's carry (a traced
    # flag in it says whether that layer was offloaded and prefetched): so the first block of a chain, given a carry
    # from no layer (first_carry), is alike the ones after it.
    prefetch_in: bool
    # The run's last MoE layer reads ahead from disk the experts history prefetch predicts for the offloaded MoE layer
    # after the run (the disk tier's read_ahead), whose host rows are the next block's.
    reads_ahead_out: bool = False


class OffloadEngine(ResidentEngine):
    """Expert slots for the offloaded MoE layers (the other layers' experts stay resident); parameters
    offloaded by pattern or layer group are fetched as in ResidentEngine."""

    def __init__(self, config: ModelConfig, placement: Placement, options: OffloadOptions, backend: str = "auto"):
        super().__init__(config, placement, backend)
        self.prefetch = options.prefetch  # experts per layer copied ahead from the next layer's router guess
        self.side_stream = options.side_stream_copies  # those copies, and the others made ahead, on a second stream
        # "fetch": a missed expert is copied to the device and computed there; "host": computed on the host;
        # "direct": computed by the device reading its weights in host memory.
        self.miss_mode = options.miss_mode
        self.layers = placement.offloaded_layers
        self.caches = placement.caches  # cache slots of each offloaded layer
        # Copies the manager plans per layer and step: host and direct mode admit one of the last step's misses.
        self.plan_width = 1 if self.miss_mode in COMPUTED_WHERE_THEY_LIE else 0
        self.initial_policy = options.policy
        self._history_predictor = (None if options.prefetch_trace is None
                                   else best_predictor(options.prefetch_trace, config.num_experts))
        self.history = None  # HistoryPrefetch of prefetch_trace's predictor, made fresh by reset
        # With a disk tier (jmoe.offload.host_tier) the predictor reads `read_ahead` experts of the next offloaded
        # layer ahead from disk as each layer routes, instead of copying experts to the device.
        self.history_reads_ahead = bool(placement.host_rows)
        self.read_ahead = options.read_ahead
        self.runs_ahead = steps_run_ahead(placement, options)
        self.host_experts: list = []  # ExpertWeights of each offloaded layer in pinned host memory, from attach
        self.state = None  # allocated by attach, once the experts' shapes are known
        self._install = jax.jit(self.filled_slots, donate_argnums=(0,))
        self._write_row = write_row()
        self.tier_reader = None  # an expert reader of the checkpoint, set by jmoe.load with a host budget
        self.tier: HostTier | None = None

    def attach(self, layers: list[MoELayerView]) -> None:
        """Take the offloaded layers' expert arrays in pinned host memory (copies come from them) and
        allocate the slots."""
        self.host_experts = [layers[i].experts for i in self.layers]
        if self.tier_reader is not None:
            self.tier = HostTier(self.tier_reader, tuple(self.config.moe_layer_indices[i] for i in self.layers),
                                 self.host_experts, self.placement.host_rows, self.config.num_experts,
                                 queue_depth=self.config.num_experts_per_tok, read_ahead=self.read_ahead)
        self.reset(self.initial_policy)

    def close(self) -> None:
        """Stop the disk tier's reader threads and close its files (nothing else holds any)."""
        if self.tier is not None:
            self.tier.close()

    def reset(self, policy: str | CachePolicy) -> None:
        """Empty every slot and start over with `policy` (same compiled programs: only data changes)."""
        self.state = None  # release the old slot buffers before allocating new ones
        self.start_managing(policy)
        self.state = self.empty_state()
        self.install_pinned()  # a static policy installs its experts now

    def start_managing(self, policy: str | CachePolicy) -> None:
        """reset's host side: a fresh manager with `policy` (and history predictor); no device memory."""
        if self._history_predictor is not None:
            self.history = HistoryPrefetch(self._history_predictor, self.config.num_moe_layers,
                                           self.config.num_experts)
        self.manager = SlotManager(policy, self.config.num_experts, self.caches, self.placement.expert_bytes,
                                   self.plan_width)

    def empty_state(self) -> EngineState:
        lo = len(self.layers)
        return EngineState(
            buffers=tuple(empty_slots(host, cache) for host, cache in zip(self.host_experts, self.caches)),
            scratch=empty_slots(self.host_experts[0], self.placement.scratch),
            slot_of_expert=jnp.full((lo, self.config.num_experts), -1, jnp.int32),
            expert_in_slot=tuple(jnp.full((cache,), -1, jnp.int32) for cache in self.caches),
            **{name: jnp.asarray(table) for name, table in self.manager_tables().items()},
            counts=jnp.zeros((lo, 4), jnp.int32),
            layer_index=tuple(jnp.int32(i) for i in range(lo)),
            **self.tier_state(),
            history_evidence=() if self.history is None else self.history.within,
        )

    def tier_state(self) -> dict:
        """The state's disk-tier fields: the host rows as first filled, and their table."""
        if self.tier is None:
            return {}
        rows = self.tier.initial_rows()
        return {"host_tier": rows, "host_row_of_expert": jnp.asarray(self.tier.row_of_expert)}

    def manager_tables(self) -> dict[str, np.ndarray]:
        """The state's fields the manager writes between steps, as NumPy arrays."""
        victim_order, plan_experts, plan_slots = self.manager.next_step()
        base = (np.zeros((0, self.config.num_experts), np.float32) if self.history is None
                else self.history.base())
        return {"victim_order": victim_order, "plan_experts": plan_experts, "plan_slots": plan_slots,
                "predict_base": base}

    def abstract_state(self, layers: list[MoELayerView]) -> EngineState:
        """The state's shapes and dtypes for the (abstract) MoE layers `layers`, allocating nothing: what
        the steps take when they are compiled ahead of time for another device (jmoe.plan)."""
        self.host_experts = [layers[i].experts for i in self.layers]
        self.start_managing(self.initial_policy)
        return jax.eval_shape(self.empty_state)

    # ---- a run of consecutive layers: the whole step, or a block of a chained one (jmoe.decode.chain) -------------
    def block_span(self, moe_start: int, moe_stop: int):
        """The offloaded positions [first, stop) of MoE layers [moe_start, moe_stop), and their BlockLayout."""
        offloaded = [moe_start <= moe < moe_stop for moe in self.layers]
        first = offloaded.index(True) if any(offloaded) else 0
        stop = first + sum(offloaded)
        local = {moe - moe_start: i - first for i, moe in enumerate(self.layers) if moe_start <= moe < moe_stop}
        first_cached = 0 in local and self.caches[first] > 0  # the run's first MoE layer, offloaded with a cache
        reads_ahead = self.history_reads_ahead and self._history_predictor is not None and bool(self.read_ahead)
        layout = BlockLayout(tuple(local.get(m) for m in range(moe_stop - moe_start)), self.caches[first:stop],
                             prefetch_in=bool(self.prefetch) and first_cached,
                             reads_ahead_out=reads_ahead and moe_stop - 1 in self.layers and moe_stop in self.layers)
        return (first, stop), layout

    def first_carry(self, x) -> "Carry | None":
        """A chained decode step's first carry (bind_block's), from the embedded tokens x [B, 1, d]: with router
        prefetch, a router input and routing like a MoE layer's, marked as coming from no offloaded layer, so that the
        first block prefetches nothing; with history prefetch, MoE layer 0 as the next and no layer's ids seen."""
        if x.shape[1] > 1 or (not self.prefetch and self._history_predictor is None):
            return None  # a prompt step prefetches nothing
        tokens, k = x.shape[0] * x.shape[1], self.config.num_experts_per_tok
        router = (jnp.zeros((tokens, x.shape[-1]), x.dtype), jnp.full((tokens, k), -1, jnp.int32), jnp.asarray(False))
        history = (jnp.int32(0), jnp.full((self.config.num_moe_layers, tokens, k), -1, jnp.int32))
        return Carry(router if self.prefetch else None, history if self._history_predictor is not None else None)

    def block_state(self, state: EngineState, span) -> EngineState | tuple:
        """What a block's program takes of the state: its layers' slots, host rows and positions, the tables and
        scratch."""
        (first, stop), _ = span
        if first == stop:
            return ()
        return state._replace(**{name: getattr(state, name)[first:stop] for name in PER_LAYER})

    @staticmethod
    def with_block_state(state: EngineState, span, block: EngineState | tuple) -> EngineState:
        """The state with what a block's program returned in place of what it took."""
        (first, stop), _ = span
        if first == stop:
            return state
        return block._replace(**{name: getattr(state, name)[:first] + getattr(block, name) + getattr(state, name)[stop:]
                                 for name in PER_LAYER})

    # ---- inside the jitted step -------------------------------------------------------------------
    def bind(self, state: EngineState, layers: list[MoELayerView], tokens_shape: tuple[int, int]):
        compute, finish = self.bind_block(state, layers, tokens_shape, self.block_span(0, len(layers))[1], None)
        return compute, lambda: finish()[0]

    def bind_block(self, state: EngineState, layers: list[MoELayerView], tokens_shape: tuple[int, int],
                   layout: "BlockLayout", carry):
        """bind for a run of MoE layers (`layers`, counted from 0) laid out as `layout`, `state` holding their slots
        (block_state); `carry`: what router and history prefetch need of the MoE layers before the run (a Carry from
        the block before, or first_carry's; None in one program over every layer). finish() gives the state and the
        carry for the run after."""
        cfg = self.config
        caches = layout.caches
        lo = len(caches)
        position = {moe: i for moe, i in enumerate(layout.positions) if i is not None}
        kernel = self.kernel
        decode = tokens_shape[1] == 1  # one new token per row; prompts stream

        def row(table, i):
            """Row i of a per-layer table of the state, read at the layer's own position array (EngineState)."""
            return jax.lax.dynamic_index_in_dim(table, state.layer_index[i], keepdims=False)

        layer_slots = [LayerSlots(state.buffers[i], row(state.slot_of_expert, i), state.expert_in_slot[i])
                       for i in range(lo)]
        victim_order = [row(state.victim_order, i)[:cache] for i, cache in enumerate(caches)]
        copied = [jnp.int32(0)] * lo  # experts copied ahead of each layer (plan, prefetch)
        evicted = [jnp.int32(0)] * lo
        counts = [None] * lo
        scratch = [Scratch(state.scratch) if lo else None]  # threaded through the layers: each uses it in turn
        # the next block's router carry: the run's last MoE layer's router input and routing (as it came where the run
        # has no MoE layer)
        handed_on = [None if carry is None else carry.router]
        # History prefetch: the first layer's place among the MoE layers (an int in one program, traced in a chain's
        # block) and this token's expert ids of every MoE layer so far ([L_moe, N, k], -1 = not yet; made at the first
        # MoE layer in one program)
        first_moe, seen = (0, [None]) if carry is None or carry.history is None else (carry.history[0],
                                                                                       [carry.history[1]])
        if decode and self.plan_width:
            # The manager's planned admissions, copied as the step starts: on a second stream (side_stream_copies)
            # they can overlap the attention and the layers before theirs.
            for moe, i in position.items():
                layer_slots[i], evicted[i], copied[i] = copy_wanted(
                    layer_slots[i], layers[moe].experts, row(state.plan_experts, i), row(state.plan_slots, i),
                    side_stream=self.side_stream)
        by_history = decode and self.history is not None
        copies_ahead = by_history and not self.history_reads_ahead  # into the device's slots
        reads_ahead = by_history and self.history_reads_ahead  # from disk into the host tier

        def predict_into(moe_index):
            """History prefetch: copy the experts predicted for MoE layer `moe_index` into its cache."""
            i = position.get(moe_index)
            if i is None or not caches[i]:
                return
            scores = self.history.in_step_scores(state.predict_base[first_moe + moe_index], first_moe + moe_index,
                                                 seen[0], state.history_evidence)
            layer_slots[i], ahead_evicted, ahead_copied = prefetch_by_score(
                layer_slots[i], layers[moe_index].experts, scores, **BEST, side_stream=self.side_stream)
            copied[i] = copied[i] + ahead_copied
            evicted[i] = evicted[i] + ahead_evicted

        def router_prefetch(nxt, upcoming: MoELayerView, x, routed, enabled=True):
            """Guess the next layer's experts with its router on this layer's input; the copies are independent of
            this layer's compute, so they can overlap it (`enabled` False, traced: none)."""
            # A layer group may not have fetched that router yet: to_device is a no-op if it has.
            probs = self.own_scores(router_probabilities(cfg, to_device(upcoming.router), x))
            scores = jnp.max(jnp.where((routed >= 0).any(-1, keepdims=True), probs, 0.0), axis=0)
            layer_slots[nxt], victim_order[nxt], ahead_evicted, ahead_copied = prefetch(
                layer_slots[nxt], victim_order[nxt], upcoming.experts, scores,
                count=min(self.prefetch, caches[nxt]), side_stream=self.side_stream, enabled=enabled)
            copied[nxt] = copied[nxt] + ahead_copied
            evicted[nxt] = evicted[nxt] + ahead_evicted

        if copies_ahead:
            predict_into(0)  # from the tokens before this one only
        if decode and layout.prefetch_in and carry is not None:  # a chained block's (bind gives no carry)
            router_prefetch(position[0], layers[0], *carry.router)

        def read_ahead_guesses(moe_index):
            """int32 [read_ahead]: the experts in no host row that the history predictor scores best for the next
            MoE layer given this token's layers so far (-1 where fewer); None: no read-ahead there. The next layer
            may be the next block's (layout.reads_ahead_out): its row of the stacked table is this layer's plus one."""
            after_run = layout.reads_ahead_out and moe_index == len(layers) - 1
            if not reads_ahead or (moe_index + 1 not in position and not after_run):
                return None
            scores = self.history.in_step_scores(state.predict_base[first_moe + moe_index + 1],
                                                 first_moe + moe_index + 1, seen[0], state.history_evidence)
            next_rows = jax.lax.dynamic_index_in_dim(state.host_row_of_expert,
                                                     state.layer_index[position[moe_index]] + 1, keepdims=False)
            scores = jnp.where(next_rows >= 0, -jnp.inf, scores)
            best, experts = jax.lax.top_k(scores, min(self.read_ahead, scores.shape[-1]))  # at most all of them
            return jnp.where(best > -jnp.inf, experts, -1)

        def compute(moe_index, x, routed, weights):
            layer = layers[moe_index]
            if by_history:
                if seen[0] is None:
                    seen[0] = jnp.full((cfg.num_moe_layers, *routed.shape), -1, jnp.int32)
                seen[0] = jax.lax.dynamic_update_index_in_dim(seen[0], routed.astype(jnp.int32),
                                                              first_moe + moe_index, 0)
            if copies_ahead:
                predict_into(moe_index + 1)
            ids = self.owned(routed)
            if handed_on[0] is not None and moe_index == len(layers) - 1:  # the next block's first layer prefetches
                handed_on[0] = (x, routed, jnp.asarray(moe_index in position))  # from it, if it is offloaded
            if moe_index not in position:
                return self.combine(self.resident_experts(layer, x, ids, weights), x)
            i = position[moe_index]
            nxt = position.get(moe_index + 1)
            if decode and nxt is not None and self.prefetch and caches[nxt]:
                router_prefetch(nxt, layers[moe_index + 1], x, routed)
            host, tier = layer.experts, {}
            if self.tier is not None:  # host rows, and the experts in none of them read from disk
                # One expert a round, the next k in flight: a round's buffers are host memory the size of its
                # experts, so a round of k held k experts at once, and none computed before all k had arrived.
                host = state.host_tier[i]
                tier = {"host_rows": row(state.host_row_of_expert, i), "disk": functools.partial(
                    disk_experts, like=layer.experts, read_expert=self.tier.read_expert,
                    position=state.layer_index[i], kernel=kernel, ahead=read_ahead_guesses(moe_index))}
            if decode and self.miss_mode in COMPUTED_WHERE_THEY_LIE:
                y, counts[i] = compute_misses_where_they_lie(layer_slots[i], layer.experts, x, ids, weights,
                                                             kernel=kernel, miss_mode=self.miss_mode)
            elif decode:
                y, layer_slots[i], scratch[0], counts[i] = fetch_and_compute(
                    layer_slots[i], scratch[0], victim_order[i], host, x, ids, weights, kernel=kernel, **tier)
            else:
                y, counts[i] = prefill_experts(layer_slots[i], host, x, ids, weights, kernel=kernel,
                                               chunk_size=self.placement.scratch, **tier)
            return self.combine(y, x)  # the one rounding of the float32 partial outputs

        def finish() -> tuple[EngineState, "Carry | None"]:
            carry_out = None if carry is None else Carry(
                handed_on[0], None if carry.history is None else (carry.history[0] + len(layers), seen[0]))
            if not lo:
                return state, carry_out
            layer_counts = [jnp.stack([c.hits, c.misses, c.copied + copied[i], c.evicted + evicted[i]])
                            for i, c in enumerate(counts)]
            # The block's layers are consecutive rows from its first position: each table is written once, where a
            # row a layer was a kernel a layer on a GPU.
            slot_of_expert, step_counts = (
                jax.lax.dynamic_update_slice_in_dim(table, jnp.stack(rows), state.layer_index[0], 0)
                for table, rows in ((state.slot_of_expert, [s.slot_of_expert for s in layer_slots]),
                                    (state.counts, layer_counts)))
            return state._replace(buffers=tuple(s.buffers for s in layer_slots), scratch=scratch[0].buffers,
                                  slot_of_expert=slot_of_expert,
                                  expert_in_slot=tuple(s.expert_in_slot for s in layer_slots),
                                  counts=step_counts), carry_out

        return compute, finish

    def varying_shapes(self) -> tuple:
        """The victim order's: empty under a policy that admits no miss (reset may switch to or from one), and a
        decode step's program differs with it (jmoe.offload.slots.fetch_and_compute)."""
        return self.state.victim_order.shape

    # ---- between steps ----------------------------------------------------------------------------
    def readback(self, state: EngineState):
        return state.slot_of_expert, state.counts

    def after_step(self, tables, routing: np.ndarray) -> None:
        """routing int [L_moe, ...] for every MoE layer; only the offloaded ones are managed. The manager's tables go
        into the latest state: a step dispatched since (`runs_ahead`) keeps the ones it was given, a step older."""
        first_observation = self.observe(tables, routing)
        # As NumPy arrays (new ones each step): the next step's call takes them in its own transfer, where a
        # jnp.asarray each dispatches a program of its own (four cost a tenth of the shipped model's decode token).
        self.state = self.state._replace(**self.manager_tables())
        if self.tier is not None:
            self.state = self.admit_disk_reads(self.state)
            if self.history is not None:
                self.tier.read_ahead_first_layer(np.asarray(self.state.predict_base[self.layers[0]]))
        if first_observation:  # policy="static": its table comes from this first step
            self.install_pinned()

    def admit_disk_reads(self, state: EngineState) -> EngineState:
        """The experts the last step read from disk (or read ahead), admitted into host rows as the policy ranks
        them (rows whose expert sits in a device slot kept: inclusive)."""
        # The manager always has a policy here: the static one, which starts without, is refused with a host budget.
        priority = np.asarray(self.manager.policy.priority(), np.float64)
        tiers = list(state.host_tier)
        for position, row, _, weights in self.tier.admissions(priority, self.manager.slot_of_expert >= 0):
            expert = jax.device_put(weights, sharding_for(PINNED_HOST))
            tiers[position] = self._write_row(tiers[position], expert, np.int32(row))
        return state._replace(host_tier=tuple(tiers), host_row_of_expert=jnp.asarray(self.tier.row_of_expert))

    def observe(self, tables, routing: np.ndarray) -> bool:
        """after_step's host side: the manager (and history predictor) record the step. Returns whether it
        was the first step a static policy saw (its experts are to be installed now)."""
        slot_of_expert, counts = tables
        first_observation = self.manager.policy is None
        if self.history is not None:
            self.history.observe(routing)
        self.manager.record(routing[list(self.layers)], np.asarray(slot_of_expert), np.asarray(counts))
        return first_observation

    def install_pinned(self) -> None:
        """A policy that never admits misses (static) gets its pinned experts installed up front."""
        pinned = self.manager.pinned_experts() if any(self.caches) else None
        if pinned is not None:
            self.install(pinned)

    def install(self, experts: list[np.ndarray]) -> None:
        """Fill every offloaded layer's cache slots with `experts` (per layer, int [S_l]; a donated update)."""
        experts = [np.asarray(e, np.int32) for e in experts]
        self.state = self._install(self.state, self.host_experts, tuple(jnp.asarray(e) for e in experts))
        self.note_installed(experts)

    def note_installed(self, experts: list[np.ndarray]) -> None:
        """The manager's table once `experts` (per layer, int [S_l]) fill the slots."""
        slot_of_expert = np.full((len(self.layers), self.config.num_experts), -1, np.int32)
        for row, layer_experts in zip(slot_of_expert, experts):
            row[layer_experts] = np.arange(len(layer_experts))
        self.manager.slot_of_expert = slot_of_expert

    @staticmethod
    def filled_slots(state: EngineState, host, experts: tuple):
        buffers, slot_of_expert = [], []
        num_experts = state.slot_of_expert.shape[1]
        for layer_buffers, layer_host, layer_experts in zip(state.buffers, host, experts):
            slots_range = jnp.arange(layer_experts.shape[0], dtype=jnp.int32)
            buffers.append(copy_into_slots(layer_buffers, layer_host, layer_experts, slots_range))
            slot_of_expert.append(jnp.full((num_experts,), -1, jnp.int32).at[layer_experts].set(slots_range))
        return state._replace(buffers=tuple(buffers), slot_of_expert=jnp.stack(slot_of_expert),
                              expert_in_slot=experts)

    def stats(self) -> list[dict]:
        stats = self.manager.stats(tuple(self.config.moe_layer_indices[i] for i in self.layers))
        if self.tier is not None:
            for position, layer in enumerate(stats):
                reads, ahead = int(self.tier.disk_reads[position]), int(self.tier.read_ahead_reads[position])
                layer.update(host_rows=self.tier.rows, disk_reads=reads,
                             disk_bytes=(reads - int(self.tier.read_ahead_used[position]) + ahead)
                             * self.placement.expert_bytes,
                             read_ahead_reads=ahead, read_ahead_used=int(self.tier.read_ahead_used[position]))
        return stats


def make_engine(config: ModelConfig, placement: Placement, options: OffloadOptions, backend: str):
    """The resident engine when no expert is offloaded, else the offload engine."""
    if not placement.offloaded_layers:
        return ResidentEngine(config, placement, backend)
    return OffloadEngine(config, placement, options, backend)
