"""The Flax NNX decoder-only MoE transformer shared by every supported family.

All expert computation goes through one `ExpertCompute` callable, so the offload engine can swap where
the expert weights come from without touching the rest of the model.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.config import ModelConfig
from jmoe.model.attention import Attention
from jmoe.model.layers import INIT_STD, DenseMLP, RMSNorm, normal_param, project
from jmoe.model.mla import MLAttention
from jmoe.model.moe import MoEBlock, MoELayerView
from jmoe.model.rope import RoPE, rope_tables

# (moe layer position, x [N, d], expert ids [N, k] with -1 = none, router weights [N, k]) -> y [N, d]
ExpertCompute = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]
# (decoder layer index, residual stream: x [B, T, d] and the last layer's output not yet added to it, or None) -> the
# same, run as each layer starts (e.g. to fetch weights)
BeforeLayer = Callable[[int, tuple], tuple]


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.attn = (MLAttention if cfg.mla else Attention)(cfg, dtype=dtype, rngs=rngs)
        self.post_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        if cfg.moe_layers[layer]:
            self.mlp = MoEBlock(cfg, dtype=dtype, rngs=rngs)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.dense_intermediate_size, dtype=dtype, rngs=rngs)


class ForwardOut(NamedTuple):
    logits: jax.Array  # float32 [B, T or 1, V]
    kv_cache: tuple  # per layer (k [B, S, Hkv, hd], v [B, S, Hkv, hd]); MLA: see empty_kv_cache
    routing: jax.Array  # int32 [num_moe_layers, B, T, k]: expert ids chosen (-1 for padding)
    finite: jax.Array  # bool [num_layers]: whether each decoder layer's output is free of NaN and inf


class MoETransformer(nnx.Module):
    """Decoder-only MoE language model. Weights are loaded from a checkpoint or initialised randomly."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=None):
        dtype = jnp.dtype(dtype or cfg.dtype)
        self.cfg = cfg
        self.embed = nnx.Param((jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size)) * INIT_STD
                                ).astype(dtype))
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = None if cfg.tie_word_embeddings else normal_param(rngs, (cfg.vocab_size, cfg.hidden_size),
                                                                           dtype)

    def moe_blocks(self) -> list[MoEBlock]:
        return [self.layers[i].mlp for i in self.cfg.moe_layer_indices]

    def moe_layer_views(self) -> list[MoELayerView]:
        """Per MoE layer, the expert weights and router an expert engine computes with."""
        return [block.view() for block in self.moe_blocks()]

    def __call__(self, tokens: jax.Array, kv_cache: tuple, write_index, pad_len: jax.Array, *,
                 expert_compute: ExpertCompute | None = None, backend: str = "reference",
                 last_only: bool = False, forced_routing: jax.Array | None = None,
                 before_layer: BeforeLayer | None = None, visible_len: int | None = None,
                 valid_len: jax.Array | None = None) -> ForwardOut:
        """Run `tokens` [B, T] whose first row entries sit at cache column `write_index`: one column for every
        row (a scalar), or int32 [B], one per row (rows of a serving batch sit at different positions; then
        `kv_cache` may hold more rows than `tokens`, and the step reads and writes its first B).

        Row b is left-padded by `pad_len[b]` columns: those cache columns are never attended to and its
        token positions count from its first real token. `valid_len` int32 [B] (None = all T): only the first
        valid_len[b] tokens of row b are real; the rest are right padding that routes to no expert, and
        `last_only` then keeps each row's last real token. `expert_compute` replaces the resident expert
        computation (the offload engine passes its own; without one, experts run from the model's own
        weights with kernel `backend`); routing is returned for the cache manager.
        `forced_routing` int32 [L_moe, B, T, k] (benchmarks) replaces every MoE layer's expert choice.
        `before_layer` runs as each decoder layer starts (the offload engine fetches layer weights with it).
        `visible_len` (static): no query sees a cache column past it, so attention reads only those columns
        (a prompt written from column 0 passes its length); None = the whole cache.
        """
        s = kv_cache[0][0].shape[1] if visible_len is None else visible_len
        context = step_context(self.cfg, tokens.shape, s, write_index, pad_len, valid_len)
        x, new_cache, routing, finite = run_decoder_layers(
            self.cfg, list(self.layers), self.cfg.sliding_windows, self.embed_tokens(tokens), kv_cache, context,
            expert_compute=expert_compute, backend=backend, forced_routing=forced_routing, before_layer=before_layer)
        return ForwardOut(self.head(x, last_only, valid_len), tuple(new_cache), routing, finite)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embed[...], tokens, axis=0)

    def head(self, x: jax.Array, last_only: bool, valid_len: jax.Array | None = None) -> jax.Array:
        head = self.embed[...] if self.lm_head is None else self.lm_head[...]
        return output_logits(self.final_norm, head, x, last_only, valid_len)


def output_logits(final_norm: RMSNorm, head: jax.Array, x: jax.Array, last_only: bool,
                  valid_len: jax.Array | None = None) -> jax.Array:
    """float32 logits [B, T or 1, V] of the last layer's output x [B, T, d] through the final norm and the output
    projection `head` [V, d], the embedding's layout (`last_only`: each row's last real token, `valid_len` as in
    MoETransformer.__call__)."""
    if last_only:
        x = x[:, -1:] if valid_len is None else jnp.take_along_axis(
            x, jnp.maximum(valid_len - 1, 0)[:, None, None], axis=1)
    x = final_norm(x)
    return project(x, head).astype(jnp.float32)


class StepContext(NamedTuple):
    """What every decoder layer of a step reads besides its own weights and cache (MoETransformer.__call__ says
    what the inputs mean)."""

    rope: RoPE
    write_index: jax.Array  # int32 scalar or [B]
    q_cols: jax.Array  # int32 [1 or B, T]: each query's cache column
    cols: jax.Array  # int32 [S]: the cache columns attention reads
    base_mask: jax.Array  # bool [B, T, S]: causal and past each row's left padding
    token_valid: jax.Array  # bool [B * T]: real tokens (padding routes to no expert)
    pad_len: jax.Array  # int32 [B]: each row's left padding, its first visible column

    def mask(self, window: int | None) -> jax.Array:
        if window is None:
            return self.base_mask
        return self.base_mask & (self.q_cols[..., None] - self.cols < window)

    def decode_columns(self, window: int | None) -> jax.Array:
        """int32 [B, 2]: the first and last column each row's one query sees (a step of one token per row, whose
        mask(window) is that range of columns)."""
        last = jnp.broadcast_to(self.q_cols[:, 0], self.pad_len.shape)
        first = self.pad_len if window is None else jnp.maximum(self.pad_len, last - (window - 1))
        return jnp.stack([first, last], axis=1).astype(jnp.int32)


def step_context(cfg: ModelConfig, tokens_shape: tuple[int, int], visible: int, write_index, pad_len: jax.Array,
                 valid_len: jax.Array | None = None) -> StepContext:
    """The StepContext of tokens [B, T] written from `write_index`, attention reading `visible` cache columns."""
    b, t = tokens_shape
    q_cols = jnp.reshape(write_index, (-1, 1)) + jnp.arange(t)  # [1 or B, T]
    cols = jnp.arange(visible)
    positions = jnp.maximum(q_cols - pad_len[:, None], 0)
    base_mask = (cols <= q_cols[..., None]) & (cols >= pad_len[:, None, None])  # [B, T, S]
    token_valid = q_cols >= pad_len[:, None]
    if valid_len is not None:
        token_valid = token_valid & (jnp.arange(t) < valid_len[:, None])
    token_valid = jnp.broadcast_to(token_valid, (b, t)).reshape(-1)
    return StepContext(rope_tables(positions, cfg), write_index, q_cols, cols, base_mask, token_valid, pad_len)


def run_decoder_layers(cfg: ModelConfig, layers: list[DecoderLayer], windows: tuple, x: jax.Array, kv_cache,
                       context: StepContext, *, expert_compute: ExpertCompute | None, backend: str,
                       forced_routing: jax.Array | None = None, before_layer: BeforeLayer | None = None):
    """`layers` (consecutive decoder layers, each with its sliding window in `windows` and its cache pair in
    `kv_cache`) on the residual stream x [B, T, d]: returns (x, their new cache pairs, routing int32
    [their MoE layers, B, T, k], finite bool [len(layers)]). MoE layers count from 0 here, for
    `expert_compute` and `forced_routing` alike; `before_layer` gets the position in `layers`."""
    b, t, _ = x.shape
    new_cache, routing, finite = [], [], []
    output = None  # the last layer's MLP output: the next norm adds it to x (on a GPU in its kernel)
    for i, layer in enumerate(layers):
        if before_layer is not None:
            x, output = before_layer(i, (x, output))
        x, normed, layer_finite = layer.input_norm.after_adding(x, output)
        if layer_finite is not None:
            finite.append(layer_finite.all())  # one reduction per layer, read back with the step
        k_cache, v_cache = kv_cache[i]
        attn_out, k_cache, v_cache = layer.attn(normed, k_cache, v_cache, context, windows[i])
        new_cache.append((k_cache, v_cache))
        x, h, _ = layer.post_norm.after_adding(x, attn_out)
        h = h.reshape(b * t, -1)
        if isinstance(layer.mlp, MoEBlock):
            forced = None if forced_routing is None else forced_routing[len(routing)].reshape(b * t, -1)
            ids, weights = layer.mlp.route(h, context.token_valid, forced)
            if expert_compute is None:
                y = layer.mlp.resident_experts(h, ids, weights, backend)
            else:
                y = expert_compute(len(routing), h, ids, weights)
            y = y + layer.mlp.shared(h)
            routing.append(ids.reshape(b, t, -1))
        else:
            y = layer.mlp(h)
        output = y.reshape(b, t, -1)
    x = x + output
    finite.append(jnp.isfinite(x).all())
    routing_ids = (jnp.stack(routing) if routing
                   else jnp.zeros((0, b, t, cfg.num_experts_per_tok), jnp.int32))
    return x, new_cache, routing_ids, jnp.stack(finite)


def kv_cache_shapes(cfg: ModelConfig, batch: int, length: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of one layer's cache pair: keys and values [B, S, Hkv, hd], or for MLA the compressed latent
    [B, S, 1, kv_lora_rank] and the roped shared key [B, S, 1, qk_rope_head_dim] (jmoe.model.mla)."""
    if cfg.mla is not None:
        return (batch, length, 1, cfg.mla.kv_lora_rank), (batch, length, 1, cfg.mla.qk_rope_head_dim)
    shape = (batch, length, cfg.num_kv_heads, cfg.head_dim)
    return shape, shape


def kv_bytes_per_token(cfg: ModelConfig, dtype) -> int:
    """Bytes the KV cache holds per token of one row, over all layers."""
    per_layer = sum(math.prod(shape) for shape in kv_cache_shapes(cfg, 1, 1))
    return cfg.num_layers * per_layer * jnp.dtype(dtype).itemsize


def empty_kv_cache(cfg: ModelConfig, batch: int, length: int, dtype) -> tuple:
    k_shape, v_shape = kv_cache_shapes(cfg, batch, length)
    return tuple((jnp.zeros(k_shape, dtype), jnp.zeros(v_shape, dtype)) for _ in range(cfg.num_layers))


def chunk_cache(kv_cache, rows: jax.Array, tokens_shape: tuple[int, int], first_chunks: bool):
    """The cache a serving batch's prefill chunk of tokens [P, T] runs on: the batch cache's rows `rows` (clipped: a
    row index past the cache reads its last row), or, where every entry starts its prompt (`first_chunks`), zeros in
    the shape of their first T columns, the only ones it writes."""
    if first_chunks:
        return jax.tree.map(lambda c: jnp.zeros((tokens_shape[0], tokens_shape[1], *c.shape[2:]), c.dtype), kv_cache)
    return jax.tree.map(lambda c: jnp.take(c, rows, axis=0, mode="clip"), kv_cache)


def chunk_written(kv_cache, rows: jax.Array, new, first_chunks: bool):
    """The batch cache with a chunk's cache `new` (chunk_cache's, written) put back into rows `rows`: whole rows, or
    with `first_chunks` their first columns only (rows past the cache dropped)."""
    if first_chunks:
        columns = jnp.arange(jax.tree.leaves(new)[0].shape[1])
        return jax.tree.map(lambda c, n: c.at[rows[:, None], columns[None, :]].set(n, mode="drop"), kv_cache, new)
    return jax.tree.map(lambda c, n: c.at[rows].set(n, mode="drop"), kv_cache, new)
