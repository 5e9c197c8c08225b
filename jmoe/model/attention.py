"""Grouped-query attention over a KV cache, with the per-family q/k norms, biases, clipping and sinks."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.config import ModelConfig
from jmoe.kernels.decode_attention import COLUMNS_PER_PART, attend_one_token
from jmoe.kernels.target import platform_dependent
from jmoe.model.layers import Linear, RMSNorm
from jmoe.model.rope import RoPE, apply_rope

if TYPE_CHECKING:
    from jmoe.model.transformer import StepContext


def write_cache(cache: jax.Array, new: jax.Array, write_index) -> jax.Array:
    """cache [B, S, ...] with new [b, T, ...] (b <= B: the first b rows) written from column `write_index`: a
    scalar (every row, b = B) or int32 [b], one column per row. Per-row columns are scattered, and a column
    past the cache is dropped (a padded prompt chunk may reach past it), never clamped back onto real ones."""
    if jnp.ndim(write_index) == 0:
        return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), (0, write_index, 0, 0))
    rows = jnp.arange(new.shape[0])[:, None]
    cols = write_index[:, None] + jnp.arange(new.shape[1])
    return cache.at[rows, cols].set(new.astype(cache.dtype), mode="drop")


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        d, h, kvh, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.q = Linear(d, h * hd, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.k = Linear(d, kvh * hd, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.v = Linear(d, kvh * hd, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.o = Linear(h * hd, d, bias=cfg.o_bias, dtype=dtype, rngs=rngs)
        norm_dims = {"none": None, "per_head": (hd, hd), "full": (h * hd, kvh * hd)}[cfg.qk_norm]
        # In XLA's form on a GPU too: it fuses them into the rope's kernel, where as norm kernels they were two more a
        # layer (the default model's 8-row decode step: 80 -> 88 kernels).
        norm = functools.partial(RMSNorm, eps=cfg.rms_norm_eps, dtype=dtype, kernel_on_gpu=False)
        self.q_norm = norm(norm_dims[0]) if norm_dims else None
        self.k_norm = norm(norm_dims[1]) if norm_dims else None
        self.sinks = nnx.Param(jnp.zeros((h,), dtype)) if cfg.attention_sinks else None

    def __call__(self, x, k_cache, v_cache, context: StepContext, window: int | None):
        """(output [B, T, d], k_cache, v_cache) of the layer's attention of x [B, T, d] (written at the context's
        columns, seeing what `context.mask(window)` lets each query see)."""
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
        groups = cfg.num_heads // cfg.num_kv_heads
        sinks = None if self.sinks is None else self.sinks[...].reshape(cfg.num_kv_heads, groups)
        forms = dict(sinks=sinks, scale=cfg.head_dim ** -0.5)
        args = (q, k, v, k_cache, v_cache, context.rope, context.write_index, context.mask(window))
        if t == 1:  # decode: one kernel on a GPU, which reads only the columns a row sees
            out, k_cache, v_cache = platform_dependent(
                *args, context.decode_columns(window), cuda=functools.partial(one_token_by_kernel, **forms),
                default=functools.partial(written_and_attended, **forms))
        else:
            out, k_cache, v_cache = written_and_attended(*args, **forms)
        out = out.reshape(b, cfg.num_kv_heads, t, groups, cfg.head_dim)
        out = out.transpose(0, 2, 1, 3, 4).reshape(b, t, -1).astype(x.dtype)
        return self.o(out), k_cache, v_cache


def written_and_attended(q, k, v, k_cache, v_cache, rope: RoPE, write_index, mask, columns=None, *, sinks,
                         scale: float):
    """(out [B, Hkv, T*G, hd], k_cache, v_cache) in XLA: queries q [B, T, H, hd] and keys k [B, T, Hkv, hd] roped,
    keys and values v written into the caches [Bc, S, Hkv, hd] from `write_index` (write_cache), then the queries
    attending to the cache columns mask [B, T, S'] shows (S' <= S: the first S'); out holds each kv head's G = H / Hkv
    query heads, token-major. `sinks` [Hkv, G] (each head's sink logit) or None; `columns`: unused, the kernel's form
    of a decode step's mask (one_token_by_kernel)."""
    b, t, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    q, k = apply_rope(q, rope), apply_rope(k, rope)
    k_cache, v_cache = write_cache(k_cache, k, write_index), write_cache(v_cache, v, write_index)
    # Each kv head's queries as the rows of one matrix (row = token * groups + group), so both products
    # are plain batched matmuls: XLA:CPU then moves no score-sized array between layouts (3x faster
    # at 512 tokens than contracting [B, T, Hkv, G, hd] directly).
    groups = heads // kv_heads
    q = q.reshape(b, t, kv_heads, groups, head_dim).transpose(0, 2, 1, 3, 4).reshape(b, kv_heads, t * groups, head_dim)
    visible = mask.shape[-1]  # the cache columns any query can see (a prompt step: its own)
    # The first b rows: a serving step may run fewer rows than its cache holds.
    keys = k_cache[:b, :visible].astype(q.dtype).transpose(0, 2, 1, 3)  # [B, Hkv, S, hd]
    values = v_cache[:b, :visible].transpose(0, 2, 1, 3)
    if t == visible:  # a prompt from column 0: query i sees columns <= i, so a block of queries needs no later one
        bounds = causal_block_bounds(t)
        out = jnp.concatenate([_attend(q[:, :, lo * groups:hi * groups], keys[:, :, :hi], values[:, :, :hi],
                                       mask[:, lo:hi, :hi], sinks, scale) for lo, hi in zip((0, *bounds), bounds)],
                              axis=2)
    else:
        out = _attend(q, keys, values, mask, sinks, scale)
    return out, k_cache, v_cache


def one_token_by_kernel(q, k, v, k_cache, v_cache, rope: RoPE, write_index, mask, columns, *, sinks, scale: float,
                        on_gpu: bool = True, columns_per_part: int = COLUMNS_PER_PART):
    """written_and_attended of one token per row (T = 1) as the Pallas kernel (interpreted where not on_gpu): `columns`
    int32 [B, 2], each row's first and last visible column, says what its mask does (and the last is where the
    token is written: write_index, unused). The queries and keys, roped, and the values go to the kernel as one
    array, made by one fusion: roped apart, the queries and keys were a kernel each, and a projection's bias made
    the values' cast one more."""
    b, _, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    roped = apply_rope(jnp.concatenate([q, k], axis=2), rope)
    qkv = jnp.concatenate([roped, v.astype(roped.dtype)], axis=2).reshape(b, heads + 2 * kv_heads, head_dim)
    return attend_one_token(qkv, k_cache, v_cache, columns, sinks, groups=heads // kv_heads, scale=scale,
                            on_gpu=on_gpu, columns_per_part=columns_per_part)


def _attend(q, keys, values, mask, sinks, scale: float):
    """q [B, Hkv, M*G, hd] (M queries, G query heads per kv head), keys/values [B, Hkv, S, hd], mask [B, M, S],
    sinks [Hkv, G] or None -> [B, Hkv, M*G, hd]."""
    b, kv_heads, rows, _ = q.shape
    queries, visible = mask.shape[1], keys.shape[2]
    groups = rows // queries
    # Scores in the activation dtype, softmax in float32 (as the reference implementations do).
    scores = jnp.einsum("bkmd,bksd->bkms", q, keys).astype(jnp.float32).reshape(b, kv_heads, queries, groups, visible)
    scores = scores * scale
    scores = jnp.where(mask[:, None, :, None], scores, jnp.finfo(jnp.float32).min)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:  # each head's sink logit joins the softmax as one more column, then is dropped
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kv_heads, 1, groups, 1), (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    probs = probs.astype(values.dtype).reshape(b, kv_heads, rows, visible)
    return jnp.einsum("bkms,bksd->bkmd", probs, values)


# Prompt queries per causal block: a block reads only the keys up to its last query, which skips most of the
# masked half of the scores (Mixtral-like 2 kv heads x 4 groups x 64, one layer's attention on a Zen 4 pair, ms:
# 512 tokens 4.6 in one block, 3.0 in 2, 2.5 in 4; 1,024 tokens 47 / 28 / 22); below 128 the blocks gain nothing.
MIN_CAUSAL_BLOCK = 128
MAX_CAUSAL_BLOCKS = 4


def causal_block_bounds(num_queries: int) -> tuple[int, ...]:
    """The ends of the prompt's query blocks (the last is num_queries)."""
    count = max(1, min(MAX_CAUSAL_BLOCKS, num_queries // MIN_CAUSAL_BLOCK))
    return tuple(num_queries * (i + 1) // count for i in range(count))
