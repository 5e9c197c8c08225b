"""A deep model's generation step as a chain of programs, so that compiling it costs what a few layers cost.

XLA compiles every layer of a program anew, and its passes grow faster than the layers (a 32-layer step of the
shipped model's width: 2.3 s of passes against 0.16 s at 4 layers); a loop over stacked layers would compile once but
copies each layer's weights before its products read them, on a CPU and on a GPU alike (bench/results/depth.md). So a
model deeper than LAYERS_PER_PROGRAM runs its step as programs dispatched one after another: the embedding, the
decoder layers in blocks of LAYERS_PER_PROGRAM consecutive layers, and the output head with the next token's choice.
Blocks whose layers are alike (their modules' structure and sliding windows) are one program, compiled once and run
at every such block with that block's own weights and caches as its arguments (read in place, donated caches written
in place). JAX dispatches asynchronously, so the chain is enqueued at once and `Model`'s run ahead holds.

Only an engine whose experts a layer reads by itself chains (`engine.layer_local`: the resident one without a mesh,
host parameters or layer groups); the offload engine's state spans its layers, and its step stays one program.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmoe.decode.sampling import greedy_tokens, sample
from jmoe.model import empty_kv_cache
from jmoe.model.moe import MoEBlock
from jmoe.model.transformer import output_logits, run_decoder_layers, step_context

# Decoder layers a chained step's block program holds. A block of 8 compiles in about a quarter of a 32-layer step
# and the chain of the shipped width's 32 layers (6 programs) decodes as fast as one program (bench/results/depth.md).
LAYERS_PER_PROGRAM = 8

# compile(program name, tokens shape, cache columns, greedy (None: either), jitted, args) -> the program compiled for
# those arguments (Model's: each compiled once, timed, logged)
Compile = Callable[[str, tuple, int, "bool | None", Callable, tuple], jax.stages.Compiled]


def layer_blocks(moe_layers: tuple[bool, ...], size: int) -> list[tuple[int, int]]:
    """[start, end) of each block of at most `size` consecutive layers. The dense layers before the first MoE layer
    (DeepSeek's first_k_dense_replace) are blocks of their own, so that the MoE layers' blocks start alike: DeepSeek-V3's
    61 layers make 3 programs of 3, 8 and 2 layers, where blocks from layer 0 would make 3 of 8, 8 and 5."""
    first_moe = next((i for i, moe in enumerate(moe_layers) if moe), 0)
    starts = [*range(0, first_moe, size), *range(first_moe, len(moe_layers), size)]
    return list(zip(starts, [*starts[1:], len(moe_layers)]))


def chains(config, engine) -> bool:
    """Whether `engine`'s steps of a model of `config` run as a chain (module docstring): where its distinct blocks hold
    at most half the model's layers, since each program of the chain costs a dispatch a step and the compile of a
    program besides its layers (a 12-layer model would compile blocks of 8 and 4 layers: no fewer)."""
    blocks = layer_blocks(config.moe_layers, LAYERS_PER_PROGRAM)
    kinds = {tuple(zip(config.moe_layers[start:end], config.sliding_windows[start:end])) for start, end in blocks}
    return engine.layer_local and 2 * sum(map(len, kinds)) <= config.num_layers


class StepChain:
    """The generation step of a deep model (module docstring): `chain(greedy, args)` takes `steps.make_step_fn`'s
    program's arguments and gives its results, each program compiled through `compile` the first time it is needed.
    The embedding and the layer blocks are the same programs for greedy and sampled steps."""

    def __init__(self, module, engine, compile: Compile):
        cfg = module.cfg
        self.config, self.engine, self.compile = cfg, engine, compile
        self.layer_defs = tuple(nnx.graphdef(layer) for layer in module.layers)
        self.norm_def = nnx.graphdef(module.final_norm)
        self.tied = module.lm_head is None
        self.blocks = layer_blocks(cfg.moe_layers, LAYERS_PER_PROGRAM)
        moe_before = np.cumsum([0, *cfg.moe_layers])
        self.moe_ranges = [(int(moe_before[start]), int(moe_before[end])) for start, end in self.blocks]
        self._embed = jax.jit(lambda embed, tokens: jnp.take(embed, tokens, axis=0))
        self._heads = {greedy: jax.jit(functools.partial(self._head_fn, greedy)) for greedy in (True, False)}
        self._all_logits = jax.jit(self._all_logits_fn)
        self._layer_fns: dict[tuple, Callable] = {}  # jitted layer programs by their layers' signature
        self._block_fns: dict[tuple, Callable] = {}  # the same by (block, tokens a row)
        self._programs: dict[tuple, jax.stages.Compiled] = {}  # by (jitted, step layout): no pytree walk a step
        self._flat_params = (None, None)  # (the parameters, each block's flattened layer parameters)

    def __call__(self, greedy: bool, args: tuple):
        params, engine_state, tokens, kv_cache, write_index, pad_len, key, step, sampling, forced_routing = args
        layout = (tokens.shape, kv_cache[0][0].shape, forced_routing is None)
        x, new_cache, routing, finite = self._layers(layout, params, tokens, kv_cache, write_index, pad_len,
                                                     forced_routing)
        outputs, routing = self._program(self._heads[greedy], "head", layout, greedy,
                                         (params["final_norm"], self._head_weight(params), x, routing, finite, key,
                                          step, sampling))
        return outputs, routing, tuple(new_cache), engine_state, self.engine.readback(engine_state)

    def logits(self, params, engine_state, tokens, kv_dtype):
        """`steps.make_logits_fn`'s program, chained: float32 logits [B, T, V] of tokens [B, T], their routing, the
        engine state and its readback. Its layer programs are a prompt step's of T tokens in a T-column cache."""
        kv_cache = empty_kv_cache(self.config, tokens.shape[0], tokens.shape[1], kv_dtype)
        layout = (tokens.shape, kv_cache[0][0].shape, True)
        x, _, routing, _ = self._layers(layout, params, tokens, kv_cache, jnp.int32(0),
                                        jnp.zeros(tokens.shape[0], jnp.int32), None)
        logits, routing = self._program(self._all_logits, "logits", layout, None,
                                        (params["final_norm"], self._head_weight(params), x, routing))
        return logits, routing, engine_state, self.engine.readback(engine_state)

    def _layers(self, layout: tuple, params, tokens, kv_cache, write_index, pad_len, forced_routing):
        """The embedding and every block: (the last layer's output, the new cache pairs, each block's routing and
        finite flags)."""
        x = self._program(self._embed, "embedding", layout, None, (params["embed"][...], tokens))
        new_cache, routing, finite = [], [], []
        for block, ((start, end), (moe_start, moe_end)) in enumerate(zip(self.blocks, self.moe_ranges)):
            forced = None if forced_routing is None else forced_routing[moe_start:moe_end]
            leaves, treedef = self._block_params(params)[block]
            jitted = self._layer_fn(block, treedef, tokens.shape[1])
            x, cache, block_routing, block_finite = self._program(
                jitted, f"{end - start} layers", layout, None, (leaves, x, kv_cache[start:end], write_index, pad_len,
                                                                forced))
            new_cache += cache
            routing.append(block_routing)
            finite.append(block_finite)
        return x, new_cache, routing, finite

    def _head_weight(self, params):
        return params["embed"][...] if self.tied else params["lm_head"][...]

    def _program(self, jitted: Callable, name: str, layout: tuple, greedy: bool | None, args: tuple):
        """jitted(*args) through its compiled program for this step's layout (tokens and cache shapes, forced
        routing or not), which fixes every argument's shape."""
        program = self._programs.get((jitted, layout))
        if program is None:
            program = self._programs[jitted, layout] = self.compile(name, layout[0], layout[1][1], greedy, jitted,
                                                                    args)
        return program(*args)

    def _block_params(self, params) -> list[tuple[list, object]]:
        """Each block's layer parameters as flat leaves and their treedef, made once for a parameters object
        (flattening NNX states is Python work that a step should not repeat)."""
        if self._flat_params[0] is not params:
            flat = [jax.tree.flatten([params["layers"][i] for i in range(start, end)]) for start, end in self.blocks]
            self._flat_params = (params, flat)
        return self._flat_params[1]

    def _layer_fn(self, block: int, treedef, num_tokens: int) -> Callable:
        """The jitted program of a block's layers: one for every block of alike layers (module docstring); looked
        up by block first, since hashing the layers' signature costs more than dispatching a program."""
        jitted = self._block_fns.get((block, num_tokens))
        if jitted is None:
            start, end = self.blocks[block]
            signature = (self.layer_defs[start:end], self.config.sliding_windows[start:end], treedef, num_tokens)
            jitted = self._layer_fns.get(signature)
            if jitted is None:
                jitted = self._layer_fns[signature] = jax.jit(self._layers_fn(*signature), donate_argnums=(1, 2))
            self._block_fns[block, num_tokens] = jitted
        return jitted

    def _layers_fn(self, layer_defs: tuple, windows: tuple, treedef, num_tokens: int) -> Callable:
        cfg, engine = self.config, self.engine

        def run(leaves, x, kv_cache, write_index, pad_len, forced_routing):
            layer_states = jax.tree.unflatten(treedef, leaves)
            layers = [nnx.merge(graphdef, state) for graphdef, state in zip(layer_defs, layer_states)]
            views = [layer.mlp.view() for layer in layers if isinstance(layer.mlp, MoEBlock)]
            compute, _ = engine.bind((), views, tokens_shape=x.shape[:2])
            # As steps.make_step_fn: a prompt's attention reads its own columns only.
            visible = num_tokens if num_tokens > 1 else kv_cache[0][0].shape[1]
            context = step_context(cfg, x.shape[:2], visible, write_index, pad_len)
            x, new_cache, routing, finite = run_decoder_layers(cfg, layers, windows, x, kv_cache, context,
                                                               expert_compute=compute, backend=engine.backend,
                                                               forced_routing=forced_routing)
            return x, tuple(new_cache), routing, finite

        return run

    def _all_logits_fn(self, norm_state, head, x, routing):
        logits = output_logits(nnx.merge(self.norm_def, norm_state), head.T if self.tied else head, x, False)
        return logits, jnp.concatenate(routing)

    def _head_fn(self, greedy, norm_state, head, x, routing, finite, key, step, sampling):
        logits = output_logits(nnx.merge(self.norm_def, norm_state), head.T if self.tied else head, x, True)[:, -1]
        next_tokens = greedy_tokens(logits) if greedy else sample(logits, jax.random.fold_in(key, step), sampling)
        return (next_tokens, jnp.concatenate(finite)), jnp.concatenate(routing)
