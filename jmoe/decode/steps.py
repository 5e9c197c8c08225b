"""The jitted programs a Model runs: a full forward for logits, and one generation step (a deep model's, chained in
blocks of layers, are jmoe.decode.chain's, which runs the same layer code).

Each program merges the NNX model from (graphdef, params) inside jit (the parameters passed flat, StepParams), hands
the expert engine the MoE layers' weights and routers and gets back the function that computes experts (resident
weights, or device slots fed from pinned host memory), and returns the engine's updated state next to the model's
outputs, with a copy of what the manager reads of it (`engine.readback`): caches and engine state are donated,
and a step may be dispatched on that state before the host has read the last step's tables.
`abstract_step_inputs` gives the shapes of a step's other inputs, so that jmoe.plan can compile the very same step
for a GPU it does not have.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.decode.sampling import choose_tokens
from jmoe.model import empty_kv_cache
from jmoe.model.params import StepParams


def forward(graphdef, params: StepParams, engine, engine_state, tokens, kv_cache, write_index, pad_len, *, last_only,
            forced_routing=None, visible_len=None, valid_len=None):
    """The model's forward inside a jitted program, its experts computed by `engine` (MoETransformer.__call__
    says what each argument means; every program takes the parameters as StepParams); returns (ForwardOut, the
    engine's updated state, its readback: arrays of their own, which outlive the state's donation to the next
    step). The engine's `spmd` runs it on every device of its mesh when the experts are split over several."""

    def run(params, engine_state, inputs):
        tokens, kv_cache, write_index, pad_len, forced_routing, valid_len = inputs
        model = nnx.merge(graphdef, engine.prepare_params(params))
        compute, finish = engine.bind(engine_state, model.moe_layer_views(), tokens_shape=tokens.shape)
        out = model(tokens, kv_cache, write_index, pad_len, expert_compute=compute, last_only=last_only,
                    forced_routing=forced_routing, before_layer=engine.layer_hook(model), visible_len=visible_len,
                    valid_len=valid_len)
        return out, finish()

    inputs = (tokens, kv_cache, write_index, pad_len, forced_routing, valid_len)
    params = params.state
    out, engine_state = engine.spmd(run, params)(params, engine_state, inputs)
    return out, engine_state, engine.readback(engine_state)


def make_logits_fn(graphdef, engine, kv_dtype):
    """tokens [B, T] -> float32 logits [B, T, V] (and the engine state after the forward, and its readback)."""

    def logits_fn(params, engine_state, tokens):
        kv_cache = empty_kv_cache(engine.config, tokens.shape[0], tokens.shape[1], kv_dtype)
        pad_len = jnp.zeros((tokens.shape[0],), jnp.int32)
        out, engine_state, readback = forward(graphdef, params, engine, engine_state, tokens, kv_cache, 0, pad_len,
                                              last_only=False)
        return out.logits, out.routing, engine_state, readback

    return jax.jit(logits_fn, donate_argnums=(1,))


def make_step_fn(graphdef, engine, greedy: bool):
    """One generation step: feed tokens [B, T] at `write_index`, pick the next token of every row.

    Returns (next tokens int32 [B, 1] (the next step's tokens as it takes them: no program to reshape them), bool
    [L] whether each decoder layer's output is finite, routing ids [L_moe, B, T, k], kv cache, engine state, the
    engine's readback). Used for the prompt (T = padded prompt length, written from cache column 0: its attention
    reads only its own T columns) and for every decode step (T = 1). `sampling` is None when `greedy`,
    else the traced SamplingArrays (so every temperature / top_k / top_p shares the program);
    `forced_routing` is None, or int32 [L_moe, B, T, k] expert ids to use instead of the router's.
    """

    def step_fn(params, engine_state, tokens, kv_cache, write_index, pad_len, key, step, sampling, forced_routing):
        out, engine_state, readback = forward(
            graphdef, params, engine, engine_state, tokens, kv_cache, write_index, pad_len, last_only=True,
            forced_routing=forced_routing, visible_len=tokens.shape[1] if tokens.shape[1] > 1 else None)
        next_tokens = choose_tokens(out.logits[:, -1], greedy, key, step, sampling)
        return (next_tokens[:, None], out.finite), out.routing, out.kv_cache, engine_state, readback

    return jax.jit(step_fn, donate_argnums=(1, 3))


def abstract_step_inputs(cfg, batch: int, num_tokens: int, cache_len: int, kv_dtype) -> tuple:
    """Shapes and dtypes of a greedy generation step's inputs after (params, engine state), as Model.run_step
    passes them: tokens [B, T], the KV cache of `cache_len` tokens, write index, pad lengths, key, step
    number, then no sampling arrays (greedy) and no forced routing. Nothing is allocated."""
    return jax.eval_shape(lambda: (jnp.zeros((batch, num_tokens), jnp.int32),
                                   empty_kv_cache(cfg, batch, cache_len, kv_dtype), jnp.int32(0),
                                   jnp.zeros((batch,), jnp.int32), jax.random.PRNGKey(0), jnp.int32(0))) + (None, None)
