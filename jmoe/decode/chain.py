"""A deep model's programs as chains of programs, so that compiling one costs what a few layers cost.

XLA compiles every layer of a program anew, and its passes grow faster than the layers (a 32-layer step of the
shipped model's width: 2.3 s of passes against 0.16 s at 4 layers); a loop over stacked layers would compile once but
copies each layer's weights before its products read them, on a CPU and on a GPU alike (bench/results/depth.md). So a
deep model's generation steps, logits and serving programs run as programs dispatched one after another: the
embedding, the decoder layers in blocks of LAYERS_PER_PROGRAM consecutive layers, and a head (the next token's choice,
the logits). Blocks whose layers are alike (their modules' structure and sliding windows, and what the engine's layout
and the parameters in host memory say of them) run one program, compiled once and called at every such block with that
block's own weights and caches as its arguments (read in place, the donated caches written in place). JAX dispatches
asynchronously, so a chain is enqueued at once and run ahead holds.

A `ChainedProgram` is lowered and compiled as a jitted function is (`lower(*args).compile()`, arrays or shape structs),
so `Model` and the serving engine's program cache compile and time it as one program; its pieces are compiled once
for every program that shares them (the same block in a prompt step and in `Model.logits`).

The engine state goes through the chain: each block takes its own part (`engine.block_state`: the offload engine's
slots and host rows of the block's layers, its tables and scratch) and binds it as the block's layout says
(`engine.bind_block`), and what router and history prefetch need of earlier layers is handed on between blocks (a
carry; the embedding's program makes the first block's, from which nothing is prefetched, so that the first block
is alike the others; the disk tier's read-ahead into the next block's first layer reads its row of the stacked host
row table). Over an expert mesh each block's program is a shard_map of its own (`engine.spmd`), and each block
copies in its own parameters in host memory (those of layer groups a few layers ahead within the block).
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmoe.decode.sampling import choose_tokens, greedy_tokens
from jmoe.model.moe import MoEBlock
from jmoe.model.transformer import (chunk_cache, chunk_written, kv_cache_shapes, output_logits, run_decoder_layers,
                                    step_context)
from jmoe.offload.layer_groups import layer_fetch_hook
from jmoe.offload.resident import fetched

# Decoder layers a block program holds. A block of 8 compiles in about a quarter of a 32-layer step, and the chained
# steps of the shipped width at 32 layers run as fast as one program (bench/results/depth.md).
LAYERS_PER_PROGRAM = 8

# call(jitted, args) -> jitted(*args) as a chain's run makes it: compiled and evaluated on shapes, or run
Call = Callable[[Callable, tuple], Any]


def layer_blocks(moe_layers: tuple[bool, ...], size: int) -> list[tuple[int, int]]:
    """[start, end) of each block: `size` consecutive layers, and where a run of layers ends short of a full block,
    the rest as one block or, when it is at most half a block, as blocks of one layer (alike one-layer blocks share one
    program, so r layers compile as one, not r, for r - 1 more dispatches a step). The dense layers before the first
    MoE layer (DeepSeek's first_k_dense_replace) are a run of their own, so that the MoE layers' blocks start alike:
    DeepSeek-V3's 61 layers make 3 + 7 + 2 blocks, whose programs hold 1, 8 and 1 layers."""
    first_moe = next((i for i, moe in enumerate(moe_layers) if moe), 0)
    blocks = []
    for run_start, run_end in ((0, first_moe), (first_moe, len(moe_layers))):
        full_end = run_start + (run_end - run_start) // size * size
        blocks += [(start, start + size) for start in range(run_start, full_end, size)]
        if run_end - full_end > size // 2:
            blocks.append((full_end, run_end))
        else:
            blocks += [(start, start + 1) for start in range(full_end, run_end)]
    return blocks


def chains(config, engine) -> bool:
    """Whether `engine`'s programs of a model of `config` run as chains (module docstring): where a block is full and
    the distinct blocks hold at most half the model's layers, since each program of a chain costs a dispatch a step
    and the compile of a program besides its layers (a 12-layer model would compile blocks of 8 and 1 layers, most of
    its own; a 4-layer one would run four one-layer blocks for nothing)."""
    blocks = layer_blocks(config.moe_layers, LAYERS_PER_PROGRAM)
    moe_before = np.cumsum([0, *config.moe_layers])
    # What the config and the engine's layout say differs between layers; their modules are otherwise alike (one
    # family, one attention).
    kinds = {(tuple(zip(config.moe_layers[start:end], config.sliding_windows[start:end])),
              engine.block_span(moe_before[start], moe_before[end])[1], engine.block_host_params(start, end),
              engine.block_fetched_params(start, end))
             for start, end in blocks}
    full = any(end - start == LAYERS_PER_PROGRAM for start, end in blocks)
    return full and 2 * sum(len(kind[0]) for kind in kinds) <= config.num_layers


def _shapes(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=_kept_sharding(a))
                        if isinstance(a, (jax.Array, np.ndarray)) else a, tree)


def _kept_sharding(array):
    """The array's sharding as a shape struct keeps it: none for an array JAX may still move (uncommitted, as a
    jitted function would take it), a single device's as a NamedSharding over a mesh of that device, since jax 0.10
    traces a shape struct with a pinned-host SingleDeviceSharding as a device array (its aval has no host memory
    space), which broke the chained host-compute miss mode."""
    sharding = getattr(array, "sharding", None)
    if not getattr(array, "committed", True):
        return None
    if not isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    mesh = jax.sharding.Mesh(np.array(list(sharding.device_set)), ("device",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind=sharding.memory_kind)


class ChainedProgram:
    """A program run as a chain of jitted pieces by `run(call, args)`, which hands every piece to `call` in the same
    order whatever the arrays. Compiled like a jitted function (`lower(*args).compile()`), or called directly (compiled
    the first time its arguments' shapes are seen). `pieces` holds the compiled pieces of every program of a chain."""

    def __init__(self, run: Callable[[Call, tuple], Any], pieces: dict, side_by_side: bool = True):
        self._run, self._pieces, self._compiled, self._side_by_side = run, pieces, {}, side_by_side

    def lower(self, *args) -> "_Lowered":
        return _Lowered(self, args)

    def compile_for(self, args: tuple) -> "ChainedCompiled":
        """Every piece compiled from the shapes of `args` (their outputs' shapes carried along, nothing run): lowered
        in turn, each from the shapes the one before gives, then the new ones compiled side by side on threads (XLA
        compiles without Python's lock). Not `side_by_side` (where a piece's outputs may lie elsewhere than the
        default device: the next piece must be lowered for where they are, which only the compiled piece says), each
        is compiled before the next is lowered."""
        order, lowered = [], {}

        def call(jitted, piece_args):
            piece_args = _shapes(piece_args)
            shapes = tuple((a.shape, a.dtype) for a in jax.tree.leaves(piece_args))
            key = (jitted, jax.tree.structure(piece_args), shapes)
            order.append(key)
            if key in self._pieces:
                return self._pieces[key].out_info
            if key not in lowered:
                lowered[key] = jitted.lower(*piece_args)
                if not self._side_by_side:
                    self._pieces[key] = lowered.pop(key).compile()
                    return self._pieces[key].out_info
            return lowered[key].out_info

        self._run(call, _shapes(args))
        if lowered:
            with ThreadPoolExecutor(min(len(lowered), os.cpu_count() or 1)) as pool:
                self._pieces.update(zip(lowered, pool.map(lambda piece: piece.compile(), lowered.values())))
        return ChainedCompiled(self._run, [self._pieces[key] for key in order])

    def __call__(self, *args):
        key = (jax.tree.structure(args), tuple((a.shape, a.dtype) for a in jax.tree.leaves(args)))
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = self.compile_for(args)
        return compiled(*args)


class _Lowered:
    def __init__(self, program: ChainedProgram, args: tuple):
        self._program, self._args = program, args

    def compile(self) -> "ChainedCompiled":
        return self._program.compile_for(self._args)


class ChainedCompiled:
    """A ChainedProgram compiled for one set of argument shapes: called with arrays of those shapes."""

    def __init__(self, run: Callable[[Call, tuple], Any], pieces: list):
        self._run, self._pieces = run, pieces

    def __call__(self, *args):
        pieces = iter(self._pieces)
        return self._run(lambda jitted, piece_args: next(pieces)(*piece_args), args)

    @property
    def pieces(self) -> list:
        """The compiled pieces, in the order they run."""
        return list(self._pieces)

    def as_text(self) -> str:
        """The pieces' optimized HLO, in the order they run."""
        return "\n".join(piece.as_text() for piece in self.pieces)


class StepChain:
    """The chained programs of one model (module docstring): `Model`'s generation steps and logits, the serving
    engine's prefill and decode. Each run function only slices its arguments and hands pieces to `call`."""

    def __init__(self, module, engine):
        cfg = module.cfg
        self.config, self.engine = cfg, engine
        self.layer_defs = tuple(nnx.graphdef(layer) for layer in module.layers)
        self.norm_def = nnx.graphdef(module.final_norm)
        self.tied = module.lm_head is None
        self.blocks = layer_blocks(cfg.moe_layers, LAYERS_PER_PROGRAM)
        moe_before = np.cumsum([0, *cfg.moe_layers])
        # each block's first MoE layer, where it reads forced routing from (benchmarks; host scalars: a chain may be
        # made where no device can hold an array, compiling for a GPU the machine lacks)
        self.moe_starts = [np.int32(moe_before[start]) for start, _ in self.blocks]
        self.spans = [engine.block_span(int(moe_before[start]), int(moe_before[end])) for start, end in self.blocks]
        # parameters in host memory: each block copies in its layers' (named within the layer; those of layer groups
        # a few layers ahead, the first ones as it starts), the embedding and the head theirs
        self.host_params = [(engine.block_host_params(start, end), engine.block_fetched_params(start, end))
                            for start, end in self.blocks]
        self.host_keys = engine.host_param_keys
        self.pieces: dict[tuple, jax.stages.Compiled] = {}  # compiled pieces, shared by all the programs below
        self._embed = jax.jit(functools.partial(_embed, engine, self.host_keys))
        self._layer_fns: dict[tuple, Callable] = {}  # jitted block programs by their layers and body
        self._block_fns: dict[tuple, Callable] = {}  # the same by (block, treedef, body)
        self._flat_params = (None, None)  # (the parameters, each block's flattened layer parameters)
        self._step_heads = {greedy: jax.jit(functools.partial(self._step_head, greedy)) for greedy in (True, False)}
        self._logits_head_fn, self._prefill_head_fn = jax.jit(self._logits_head), jax.jit(self._prefill_head)
        self._decode_head_fn = jax.jit(self._decode_head)
        # the tables the manager reads, as arrays of their own: the state's are donated to the next step
        self._readback = jax.jit(lambda state: jax.tree.map(jnp.copy, engine.readback(state)))

    # ---- the programs ---------------------------------------------------------------------------------------------
    def step_program(self, greedy: bool) -> ChainedProgram:
        """`steps.make_step_fn`'s program, chained: the same arguments and results."""

        def run(call, args):
            params, engine_state, tokens, kv_cache, write_index, pad_len, key, step, sampling, forced_routing = args
            visible = tokens.shape[1] if tokens.shape[1] > 1 else None  # a prompt reads its own columns only
            x, new_cache, routing, finite, engine_state = self._layers(
                call, params, engine_state, tokens, kv_cache, ("step", visible, forced_routing is not None),
                lambda block: (write_index, pad_len, forced_routing,
                               None if forced_routing is None else self.moe_starts[block]))
            outputs, routing = call(self._step_heads[greedy], (params["final_norm"], self._head_weight(params), x,
                                                               routing, finite, key, step, sampling))
            return outputs, routing, new_cache, engine_state, self._read_back(call, engine_state)

        return self._program(run)

    def logits_program(self, kv_dtype) -> ChainedProgram:
        """`steps.make_logits_fn`'s program, chained; its blocks are a prompt step's of T tokens in a T-column cache."""

        def run(call, args):
            params, engine_state, tokens = args

            def empty_cache(start, end):  # made as its block runs and let go after it, not the whole cache at once
                k_shape, v_shape = kv_cache_shapes(self.config, *tokens.shape)
                return tuple((jnp.zeros(k_shape, kv_dtype), jnp.zeros(v_shape, kv_dtype)) for _ in range(start, end))

            write_index, pad_len = jnp.int32(0), jnp.zeros(tokens.shape[:1], jnp.int32)  # every row from column 0
            x, _, routing, _, engine_state = self._layers(call, params, engine_state, tokens, empty_cache,
                                                          ("step", tokens.shape[1], False),
                                                          lambda block: (write_index, pad_len, None, None))
            logits, routing = call(self._logits_head_fn, (params["final_norm"], self._head_weight(params), x, routing))
            return logits, routing, engine_state, self._read_back(call, engine_state)

        return self._program(run)

    def prefill_program(self, visible: int) -> ChainedProgram:
        """jmoe.serve.programs.make_prefill_fn's program, chained (its docstring says what it does)."""

        def run(call, args):
            params, engine_state, kv_cache, tokens, rows, start, valid = args
            first_chunks = visible == tokens.shape[1]
            x, new_cache, routing, finite, engine_state = self._layers(call, params, engine_state, tokens, kv_cache,
                                                                       ("prefill", visible, first_chunks),
                                                                       lambda block: (rows, start, valid))
            outputs, routing = call(self._prefill_head_fn, (params["final_norm"], self._head_weight(params), x,
                                                            routing, finite, valid))
            return outputs, routing, new_cache, engine_state, self._read_back(call, engine_state)

        return self._program(run)

    def decode_program(self, visible: int) -> ChainedProgram:
        """jmoe.serve.programs.make_decode_fn's program, chained."""

        def run(call, args):
            params, engine_state, kv_cache, tokens, positions, active = args
            x, new_cache, routing, finite, engine_state = self._layers(call, params, engine_state, tokens, kv_cache,
                                                                       ("decode", visible),
                                                                       lambda block: (positions, active))
            outputs, routing = call(self._decode_head_fn, (params["final_norm"], self._head_weight(params), x,
                                                           routing, finite))
            return outputs, routing, new_cache, engine_state, self._read_back(call, engine_state)

        return self._program(run)

    def _program(self, run: Callable[[Call, tuple], Any]) -> ChainedProgram:
        # A lowered piece says nothing of where its outputs lie (the compiled one does), and the next piece is lowered
        # from them: as if on the default device, which holds for one device and no engine state in host memory
        # (the disk tier's host rows pass through the blocks).
        side_by_side = self.engine.mesh is None and not self.engine.placement.host_rows
        # the parameters come as StepParams, as to every step program; the run functions read the NNX state
        return ChainedProgram(lambda call, args: run(call, (args[0].state, *args[1:])), self.pieces,
                              side_by_side=side_by_side)

    # ---- the pieces -----------------------------------------------------------------------------------------------
    def _layers(self, call: Call, params, engine_state, tokens, kv_cache, body: tuple,
                block_args: Callable[[int], tuple]):
        """The embedding and every block: (the last layer's output, the new cache pairs, each block's routing and
        finite flags, the engine state). `kv_cache`: every layer's cache pair, or a function (start, end) -> those of
        layers [start, end), whose new pairs are then dropped (none returned). `body` names what a block does around
        its layers (_block_fn), `block_args(block)` its arguments after (weights, x, its layers' caches, its part of
        the engine state, the carry from the block before)."""
        x, carry = call(self._embed, (params["embed"].get_value(), tokens))
        new_cache, routing, finite = [], [], []
        for block, ((start, end), (leaves, treedef), span) in enumerate(zip(self.blocks, self._block_params(params),
                                                                             self.spans)):
            jitted = self._block_program(block, treedef, body)
            cache = kv_cache(start, end) if callable(kv_cache) else kv_cache[start:end]
            x, cache, block_routing, block_finite, block_state, carry = call(
                jitted, (leaves, x, cache, self.engine.block_state(engine_state, span), carry, *block_args(block)))
            engine_state = self.engine.with_block_state(engine_state, span, block_state)
            if not callable(kv_cache):
                new_cache += cache
            routing.append(block_routing)
            finite.append(block_finite)
        return x, tuple(new_cache), routing, finite, engine_state

    def _read_back(self, call: Call, engine_state):
        """The engine's readback of the state after the last block, copied by a program of its own (none without)."""
        readback = self.engine.readback(engine_state)
        return call(self._readback, (engine_state,)) if jax.tree.leaves(readback) else readback

    def _head_weight(self, params):
        return params["embed"].get_value() if self.tied else params["lm_head"].get_value()

    def _block_params(self, params) -> list[tuple[list, object]]:
        """Each block's layer parameters as flat leaves and their treedef, made once for the parameters a step runs
        with (flattening NNX states is Python work that a step should not repeat). Shape structs (a compile, maybe on
        the serving engine's thread behind the steps) are flattened apart and never replace the arrays'."""
        cached_params, cached = self._flat_params
        if cached_params is params:
            return cached
        flat = [jax.tree.flatten([params["layers"][i] for i in range(start, end)]) for start, end in self.blocks]
        if not any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in flat[0][0]):
            self._flat_params = (params, flat)
        return flat

    def _block_program(self, block: int, treedef, body: tuple) -> Callable:
        """The jitted program of a block with `body` around its layers: one for every block of alike layers. Looked up
        by block first: hashing the layers' signature costs more than running a step of the shipped width."""
        jitted = self._block_fns.get((block, treedef, body))
        if jitted is None:
            start, end = self.blocks[block]
            signature = (self.layer_defs[start:end], self.config.sliding_windows[start:end], self.spans[block][1],
                         self.host_params[block], treedef, body)
            jitted = self._layer_fns.get(signature)
            if jitted is None:
                jitted = self._layer_fns[signature] = jax.jit(self._block_fn(*signature), donate_argnums=(1, 2, 3))
            self._block_fns[block, treedef, body] = jitted
        return jitted

    def _block_fn(self, layer_defs: tuple, windows: tuple, layout, host_params: tuple, treedef,
                  body: tuple) -> Callable:
        """A block's program (its engine state bound as `layout`, the engine's block_span says; `host_params`: the
        parameters in host memory it copies in, as it starts and by layer group): `body` is ("step", visible, forced)
        for Model's steps (`forced`: routing forced by an int32 [L_moe, B, T, k] array read from the block's first MoE
        layer), ("prefill", visible, first_chunks) and ("decode", visible) for the serving engine's batch
        (jmoe.serve.programs says what those do)."""
        cfg, engine = self.config, self.engine

        def layers_of(leaves, x, kv_cache, engine_state, carry, write_index, pad_len, visible, valid_len=None,
                      forced=None):
            def run(layer_states, engine_state, inputs):  # on every device of the engine's mesh (engine.spmd)
                x, kv_cache, carry, write_index, pad_len, valid_len, forced = inputs
                by_pattern, by_group = host_params
                layers = [nnx.merge(graphdef, fetched(state, keys))
                          for graphdef, state, keys in zip(layer_defs, layer_states, by_pattern)]
                before_layer = (layer_fetch_hook(engine.placement.layer_groups, by_group, layers) if any(by_group)
                                else None)
                views = [layer.mlp.view() for layer in layers if isinstance(layer.mlp, MoEBlock)]
                compute, finish = engine.bind_block(engine_state, views, x.shape[:2], layout, carry)
                if forced is not None:
                    forced_all, first = forced
                    forced = jax.lax.dynamic_slice_in_dim(forced_all, first, len(views))
                context = step_context(cfg, x.shape[:2], visible, write_index, pad_len, valid_len)
                x, new_cache, routing, finite = run_decoder_layers(cfg, layers, windows, x, kv_cache, context,
                                                                   expert_compute=compute, backend=engine.backend,
                                                                   forced_routing=forced, before_layer=before_layer)
                engine_state, carry = finish()
                return (x, tuple(new_cache), routing, finite, carry), engine_state

            visible = kv_cache[0][0].shape[1] if visible is None else visible
            layer_states = jax.tree.unflatten(treedef, leaves)
            (x, new_cache, routing, finite, carry), engine_state = engine.spmd(run, layer_states)(
                layer_states, engine_state, (x, kv_cache, carry, write_index, pad_len, valid_len, forced))
            return x, new_cache, routing, finite, engine_state, carry

        kind, visible, *flag = body
        if kind == "step":
            def step(leaves, x, kv_cache, engine_state, carry, write_index, pad_len, forced_routing, moe_start):
                forced = (forced_routing, moe_start) if flag[0] else None
                return layers_of(leaves, x, kv_cache, engine_state, carry, write_index, pad_len, visible,
                                 forced=forced)
            return step
        if kind == "prefill":
            def prefill(leaves, x, kv_cache, engine_state, carry, rows, start, valid):
                x, new_cache, *rest = layers_of(leaves, x, chunk_cache(kv_cache, rows, x.shape[:2], flag[0]),
                                                engine_state, carry, start, jnp.zeros_like(start), visible, valid)
                return x, chunk_written(kv_cache, rows, new_cache, flag[0]), *rest
            return prefill

        def decode(leaves, x, kv_cache, engine_state, carry, positions, active):
            return layers_of(leaves, x, kv_cache, engine_state, carry, positions, jnp.zeros_like(positions), visible,
                             active.astype(jnp.int32))
        return decode

    # ---- the heads (each after the last block) ---------------------------------------------------------------------
    def _logits(self, norm_state, head, x, last_only, valid_len=None):
        norm = nnx.merge(self.norm_def, fetched(norm_state, self.host_keys, ("final_norm",)))
        head = fetched(head, self.host_keys, ("embed" if self.tied else "lm_head",))
        return output_logits(norm, head, x, last_only, valid_len)

    def _step_head(self, greedy, norm_state, head, x, routing, finite, key, step, sampling):
        next_tokens = choose_tokens(self._logits(norm_state, head, x, True)[:, -1], greedy, key, step, sampling)
        return (next_tokens[:, None], jnp.concatenate(finite)), jnp.concatenate(routing)

    def _logits_head(self, norm_state, head, x, routing):
        return self._logits(norm_state, head, x, False), jnp.concatenate(routing)

    def _prefill_head(self, norm_state, head, x, routing, finite, valid):
        return (self._logits(norm_state, head, x, True, valid)[:, 0], jnp.concatenate(finite)), jnp.concatenate(routing)

    def _decode_head(self, norm_state, head, x, routing, finite):
        logits = self._logits(norm_state, head, x, True)[:, 0]
        return (logits, greedy_tokens(logits), jnp.concatenate(finite)), \
            jnp.concatenate(routing)


def _embed(engine, host_keys, embed, tokens):
    """The embedding of tokens [B, T], or of [R] (a serving decode step's, one a row) as [R, 1], from the table copied
    in if `host_keys` name it (offloaded by pattern); and the carry the first block's engine binding takes
    (`engine.first_carry`)."""
    x = jnp.take(fetched(embed, host_keys, ("embed",)), tokens if tokens.ndim == 2 else tokens[:, None], axis=0)
    return x, engine.first_carry(x)
