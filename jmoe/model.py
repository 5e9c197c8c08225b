"""The Flax NNX MoE transformer shared by every supported family.

Layout choices the offload engine and the kernels rely on:
- linear kernels are stored [in, out];
- the experts of a MoE layer are stacked: `w_gate_up` [E, d, 2f] (gate then up on the last axis) and
  `w_down` [E, f, d];
- all expert computation goes through one `ExpertCompute` callable, so the offload engine can swap
  where the expert weights come from without touching the rest of the model.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.config import ModelConfig
from jmoe.kernels import moe_ffn

# (moe layer position, x [N, d], expert ids [N, k] with -1 = none, router weights [N, k]) -> y [N, d]
ExpertCompute = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]
# (decoder layer index, residual stream x [B, T, d]) -> x, run as each layer starts (e.g. to fetch weights)
BeforeLayer = Callable[[int, jax.Array], jax.Array]

_INIT_STD = 0.02


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype) -> nnx.Param:
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * _INIT_STD).astype(dtype))


class Linear(nnx.Module):
    def __init__(self, d_in: int, d_out: int, *, bias: bool, dtype, rngs: nnx.Rngs):
        self.kernel = _normal(rngs, (d_in, d_out), dtype)
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x @ self.kernel[...]
        return y + self.bias[...] if self.bias is not None else y


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float, dtype):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        # Normalise in float32 and cast back before the scale, as the reference implementations do.
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * normed.astype(x.dtype)


def swiglu_mlp(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array) -> jax.Array:
    gate, up = jnp.split(x @ w_gate_up, 2, axis=-1)
    return (jax.nn.silu(gate) * up) @ w_down


class DenseMLP(nnx.Module):
    """SwiGLU MLP with gate and up fused, used by non-MoE layers and the shared expert."""

    def __init__(self, d: int, f: int, *, dtype, rngs: nnx.Rngs):
        self.w_gate_up = _normal(rngs, (d, 2 * f), dtype)
        self.w_down = _normal(rngs, (f, d), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return swiglu_mlp(x, self.w_gate_up[...], self.w_down[...])


class Experts(nnx.Module):
    """The E experts of one MoE layer, stacked."""

    def __init__(self, e: int, d: int, f: int, *, dtype, rngs: nnx.Rngs):
        self.w_gate_up = _normal(rngs, (e, d, 2 * f), dtype)
        self.w_down = _normal(rngs, (e, f, d), dtype)


class RoPE(NamedTuple):
    cos: jax.Array  # [B, T, head_dim], float32
    sin: jax.Array


def rope_tables(positions: jax.Array, cfg: ModelConfig) -> RoPE:
    half = jnp.arange(0, cfg.head_dim, 2, dtype=jnp.float32) / cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** half) / cfg.rope_linear_factor
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return RoPE(jnp.cos(emb), jnp.sin(emb))


def apply_rope(x: jax.Array, rope: RoPE) -> jax.Array:
    """x [B, T, H, hd]; rotate-half convention."""
    cos = rope.cos[:, :, None, :].astype(x.dtype)
    sin = rope.sin[:, :, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        d, h, kvh, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.q = Linear(d, h * hd, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.k = Linear(d, kvh * hd, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.v = Linear(d, kvh * hd, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.o = Linear(h * hd, d, bias=cfg.o_bias, dtype=dtype, rngs=rngs)
        norm_dims = {"none": None, "per_head": (hd, hd), "full": (h * hd, kvh * hd)}[cfg.qk_norm]
        self.q_norm = RMSNorm(norm_dims[0], eps=cfg.rms_norm_eps, dtype=dtype) if norm_dims else None
        self.k_norm = RMSNorm(norm_dims[1], eps=cfg.rms_norm_eps, dtype=dtype) if norm_dims else None

    def __call__(self, x, rope: RoPE, k_cache, v_cache, write_index, mask):
        cfg = self.cfg
        b, t, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        if cfg.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if cfg.clip_qkv is not None:
            q, k, v = (jnp.clip(a, -cfg.clip_qkv, cfg.clip_qkv) for a in (q, k, v))
        q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, write_index, 0, 0))
        v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, write_index, 0, 0))
        groups = cfg.num_heads // cfg.num_kv_heads
        q = q.reshape(b, t, cfg.num_kv_heads, groups, cfg.head_dim)
        # Scores in the activation dtype, softmax in float32 (as the reference implementations do).
        scores = jnp.einsum("btkgd,bskd->bkgts", q, k_cache.astype(q.dtype)).astype(jnp.float32)
        scores = scores * cfg.head_dim ** -0.5
        scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, v_cache).reshape(b, t, -1).astype(x.dtype)
        return self.o(out), k_cache, v_cache


class MoEBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.cfg = cfg
        self.router = Linear(d, cfg.num_experts, bias=False, dtype=dtype, rngs=rngs)
        self.experts = Experts(cfg.num_experts, d, cfg.expert_intermediate_size, dtype=dtype, rngs=rngs)
        fs = cfg.shared_expert_intermediate_size
        self.shared_expert = DenseMLP(d, fs, dtype=dtype, rngs=rngs) if fs else None
        self.shared_expert_gate = Linear(d, 1, bias=False, dtype=dtype, rngs=rngs) if fs else None

    def route(self, x: jax.Array, token_valid: jax.Array,
              forced_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Softmax top-k routing: expert ids [N, k] (-1 for padding tokens) and weights [N, k].

        `forced_ids` [N, k] (benchmarks only) replaces the router's choice, e.g. by a recorded trace, so
        that a random-weight model sees real cache behaviour; the weights are the router's
        probabilities of the forced experts.
        """
        probs = jax.nn.softmax(self.router(x).astype(jnp.float32), axis=-1)
        if forced_ids is None:
            weights, ids = jax.lax.top_k(probs, self.cfg.num_experts_per_tok)
        else:
            ids, weights = forced_ids, jnp.take_along_axis(probs, forced_ids, axis=-1)
        if self.cfg.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        ids = jnp.where(token_valid[:, None], ids.astype(jnp.int32), -1)
        return ids, weights.astype(x.dtype)

    def resident_experts(self, x, ids, weights, backend: str):
        return moe_ffn(x, ids, weights, self.experts.w_gate_up[...], self.experts.w_down[...], backend=backend)

    def shared(self, x: jax.Array) -> jax.Array:
        if self.shared_expert is None:
            return jnp.zeros_like(x)
        return jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.post_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        if cfg.moe_layers[layer]:
            self.mlp = MoEBlock(cfg, dtype=dtype, rngs=rngs)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.dense_intermediate_size, dtype=dtype, rngs=rngs)


class ForwardOut(NamedTuple):
    logits: jax.Array  # float32 [B, T or 1, V]
    kv_cache: tuple  # per layer (k [B, S, Hkv, hd], v [B, S, Hkv, hd])
    routing: jax.Array  # int32 [num_moe_layers, B, T, k]: expert ids chosen (-1 for padding)


class MoETransformer(nnx.Module):
    """Decoder-only MoE language model. Weights are loaded from a checkpoint or initialised randomly."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=None):
        dtype = jnp.dtype(dtype or cfg.dtype)
        self.cfg = cfg
        self.embed = nnx.Param((jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size)) * _INIT_STD
                                ).astype(dtype))
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = None if cfg.tie_word_embeddings else _normal(rngs, (cfg.hidden_size, cfg.vocab_size), dtype)

    def moe_blocks(self) -> list[MoEBlock]:
        return [self.layers[i].mlp for i in self.cfg.moe_layer_indices]

    def __call__(self, tokens: jax.Array, kv_cache: tuple, write_index, pad_len: jax.Array, *,
                 expert_compute: ExpertCompute | None = None, backend: str = "reference",
                 last_only: bool = False, forced_routing: jax.Array | None = None,
                 before_layer: BeforeLayer | None = None) -> ForwardOut:
        """Run `tokens` [B, T] whose first row entries sit at cache column `write_index`.

        Row b is left-padded by `pad_len[b]` columns: those cache columns are never attended to and its
        token positions count from its first real token. `expert_compute` replaces the resident expert
        computation (the offload engine passes its own); routing is returned for the cache manager.
        `forced_routing` int32 [L_moe, B, T, k] (benchmarks only) replaces every MoE layer's expert choice.
        `before_layer` runs as each decoder layer starts (the offload engine fetches layer weights with it).
        """
        cfg = self.cfg
        b, t = tokens.shape
        s = kv_cache[0][0].shape[1]
        q_cols = write_index + jnp.arange(t)
        cols = jnp.arange(s)
        positions = jnp.maximum(q_cols[None, :] - pad_len[:, None], 0)
        rope = rope_tables(positions, cfg)
        base_mask = (cols[None, :] <= q_cols[:, None])[None] & (cols[None, :] >= pad_len[:, None])[:, None, :]
        token_valid = (q_cols[None, :] >= pad_len[:, None]).reshape(-1)

        def mask_for(window):
            if window is None:
                return base_mask
            return base_mask & (q_cols[:, None] - cols[None, :] < window)[None]

        x = jnp.take(self.embed[...], tokens, axis=0)
        new_cache, routing = [], []
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
        if last_only:
            x = x[:, -1:]
        x = self.final_norm(x)
        head = self.embed[...].T if self.lm_head is None else self.lm_head[...]
        logits = jnp.einsum("btd,dv->btv", x, head).astype(jnp.float32)
        routing_ids = (jnp.stack(routing) if routing
                       else jnp.zeros((0, b, t, cfg.num_experts_per_tok), jnp.int32))
        return ForwardOut(logits, tuple(new_cache), routing_ids)


def empty_kv_cache(cfg: ModelConfig, batch: int, length: int, dtype) -> tuple:
    shape = (batch, length, cfg.num_kv_heads, cfg.head_dim)
    return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers))
