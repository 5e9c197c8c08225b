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
from jmoe.model.layers import INIT_STD, DenseMLP, RMSNorm, normal_param, weight_for
from jmoe.model.mla import MLAttention
from jmoe.model.moe import MoEBlock, MoELayerView
from jmoe.model.rope import rope_tables

# (moe layer position, x [N, d], expert ids [N, k] with -1 = none, router weights [N, k]) -> y [N, d]
ExpertCompute = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]
# (decoder layer index, residual stream x [B, T, d]) -> x, run as each layer starts (e.g. to fetch weights)
BeforeLayer = Callable[[int, jax.Array], jax.Array]


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
        self.lm_head = None if cfg.tie_word_embeddings else normal_param(rngs, (cfg.hidden_size, cfg.vocab_size),
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
        cfg = self.cfg
        b, t = tokens.shape
        s = kv_cache[0][0].shape[1] if visible_len is None else visible_len
        q_cols = jnp.reshape(write_index, (-1, 1)) + jnp.arange(t)  # [1 or B, T]
        cols = jnp.arange(s)
        positions = jnp.maximum(q_cols - pad_len[:, None], 0)
        rope = rope_tables(positions, cfg)
        base_mask = (cols <= q_cols[..., None]) & (cols >= pad_len[:, None, None])  # [B, T, S]
        token_valid = q_cols >= pad_len[:, None]
        if valid_len is not None:
            token_valid = token_valid & (jnp.arange(t) < valid_len[:, None])
        token_valid = jnp.broadcast_to(token_valid, (b, t)).reshape(-1)

        def mask_for(window):
            if window is None:
                return base_mask
            return base_mask & (q_cols[..., None] - cols < window)

        x = jnp.take(self.embed[...], tokens, axis=0)
        new_cache, routing, finite = [], [], []
        for i, layer in enumerate(self.layers):
            if before_layer is not None:
                x = before_layer(i, x)
            k_cache, v_cache = kv_cache[i]
            attn_out, k_cache, v_cache = layer.attn(layer.input_norm(x), rope, k_cache, v_cache, write_index,
                                                    mask_for(cfg.sliding_windows[i]))
            new_cache.append((k_cache, v_cache))
            x = x + attn_out
            h = layer.post_norm(x).reshape(b * t, -1)
            if isinstance(layer.mlp, MoEBlock):
                forced = None if forced_routing is None else forced_routing[len(routing)].reshape(b * t, -1)
                ids, weights = layer.mlp.route(h, token_valid, forced)
                if expert_compute is None:
                    y = layer.mlp.resident_experts(h, ids, weights, backend)
                else:
                    y = expert_compute(len(routing), h, ids, weights)
                y = y + layer.mlp.shared(h)
                routing.append(ids.reshape(b, t, -1))
            else:
                y = layer.mlp(h)
            x = x + y.reshape(b, t, -1)
            finite.append(jnp.isfinite(x).all())  # one reduction per layer, read back with the step
        if last_only:
            x = x[:, -1:] if valid_len is None else jnp.take_along_axis(
                x, jnp.maximum(valid_len - 1, 0)[:, None, None], axis=1)
        x = self.final_norm(x)
        head = self.embed[...].T if self.lm_head is None else self.lm_head[...]
        logits = jnp.einsum("btd,dv->btv", x, weight_for(head, x)).astype(jnp.float32)
        routing_ids = (jnp.stack(routing) if routing
                       else jnp.zeros((0, b, t, cfg.num_experts_per_tok), jnp.int32))
        return ForwardOut(logits, tuple(new_cache), routing_ids, jnp.stack(finite))


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
