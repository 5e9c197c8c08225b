"""DeepSeek's multi-head latent attention (MLA) over a compressed KV cache.

The cache of a layer holds, per token, the normalised latent `c` [kv_lora_rank] and the roped shared key
`k_rope` [qk_rope_head_dim], stored as (latent [B, S, 1, r], k_rope [B, S, 1, dr]) in the (k, v) pair the
decoder passes every attention, so cache-handling code needs no MLA case. `kv_b` maps a latent to each
head's un-roped key [dn] and value [dv].

A single query (decode) uses the absorbed form: the key part of kv_b is folded into the query and the value
part applied after attention, so a step reads the latent cache as it is (cost per cached token ~ H * r).
Several queries (prefill) up-project the cache once and attend as ordinary attention, cheaper when the
queries are many. Both compute the same function; they differ only in rounding.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.config import MLA, MLA_NORM_EPS, ModelConfig
from jmoe.kernels.decode_attention import COLUMNS_PER_PART
from jmoe.kernels.latent_attention import absorbed_queries, attend_latent_one_token
from jmoe.kernels.target import platform_dependent
from jmoe.model.attention import write_cache
from jmoe.model.layers import Linear, RMSNorm, weight_for
from jmoe.model.rope import RoPE, apply_rope, deinterleave

if TYPE_CHECKING:
    from jmoe.model.transformer import StepContext


class MLAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        m, d, h = cfg.mla, cfg.hidden_size, cfg.num_heads
        self.cfg = cfg
        q_out = h * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        if m.q_lora_rank:
            self.q_a = Linear(d, m.q_lora_rank, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
            self.q_a_norm = RMSNorm(m.q_lora_rank, eps=MLA_NORM_EPS, dtype=dtype)
            self.q_b = Linear(m.q_lora_rank, q_out, bias=False, dtype=dtype, rngs=rngs)
        else:
            self.q = Linear(d, q_out, bias=False, dtype=dtype, rngs=rngs)
        self.kv_a = Linear(d, m.kv_lora_rank + m.qk_rope_head_dim, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.kv_a_norm = RMSNorm(m.kv_lora_rank, eps=MLA_NORM_EPS, dtype=dtype)
        self.kv_b = Linear(m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim), bias=False, dtype=dtype,
                           rngs=rngs)
        self.o = Linear(h * m.v_head_dim, d, bias=cfg.o_bias, dtype=dtype, rngs=rngs)

    def __call__(self, x, latent_cache, rope_cache, context: StepContext, window: int | None):
        """As Attention.__call__, over the latent cache pair."""
        cfg, m = self.cfg, self.cfg.mla
        b, t, _ = x.shape
        dn, r = m.qk_nope_head_dim, m.kv_lora_rank
        q = self.q_b(self.q_a_norm(self.q_a(x))) if m.q_lora_rank else self.q(x)
        q = q.reshape(b, t, cfg.num_heads, dn + m.qk_rope_head_dim)
        compressed = self.kv_a(x)
        latent = self.kv_a_norm(compressed)[:, :, None, :]  # its first r columns
        args = (q, latent, compressed[..., None, r:], latent_cache, rope_cache, self.kv_b.kernel[...], context.rope,
                context.write_index, context.mask(window))
        if t == 1:  # decode: one kernel on a GPU, which reads only the columns a row sees
            out, latent_cache, rope_cache = platform_dependent(
                *args, context.decode_columns(window), cuda=functools.partial(latent_one_token_by_kernel, mla=m),
                default=functools.partial(latent_written_and_attended, mla=m))
        else:
            out, latent_cache, rope_cache = latent_written_and_attended(*args, mla=m)
        return self.o(out.reshape(b, t, -1)), latent_cache, rope_cache


def latent_written_and_attended(q, latent, k_rope, latent_cache, rope_cache, kv_b, rope: RoPE, write_index, mask,
                                columns=None, *, mla: MLA):
    """(out [B, T, H, dv], latent_cache, rope_cache) in XLA: the queries q [B, T, H, dn + dr] (their rope parts
    unroped), the tokens' latents [B, T, 1, r] and shared keys k_rope [B, T, 1, dr] (unroped) written into the caches
    from `write_index`, then each query attending to the columns mask [B, T, S'] shows, through kv_b
    [H * (dn + dv), r] (stored [out, in]). `columns`: unused, the kernel's form of a decode step's mask."""
    b, t, heads, _ = q.shape
    q_nope, q_rope = q[..., :mla.qk_nope_head_dim], q[..., mla.qk_nope_head_dim:]
    q_rope, k_rope = rope_of(q_rope, rope, mla), rope_of(k_rope, rope, mla)
    latent_cache = write_cache(latent_cache, latent, write_index)
    rope_cache = write_cache(rope_cache, k_rope, write_index)
    visible = mask.shape[-1]  # the cache columns any query can see (a prompt step: its own)
    c = latent_cache[:b, :visible, 0].astype(q_nope.dtype)  # [B, S, r]: the step's rows (see Attention)
    kr = rope_cache[:b, :visible, 0].astype(q_nope.dtype)  # [B, S, dr]
    w_k, w_v = latent_weights(kv_b, c, heads, mla)
    rope_scores = jnp.einsum("bthd,bsd->bhts", q_rope, kr)
    if t == 1:  # absorbed: queries meet the latents themselves
        q_latent = jnp.einsum("bthn,hnr->bthr", q_nope, w_k)
        scores = jnp.einsum("bthr,bsr->bhts", q_latent, c) + rope_scores
    else:  # expanded: every cached latent up-projected to its keys
        scores = jnp.einsum("bthn,bshn->bhts", q_nope, jnp.einsum("bsr,hnr->bshn", c, w_k)) + rope_scores
    # Softmax in float32, as the reference implementation does.
    scores = scores.astype(jnp.float32) * mla.softmax_scale
    scores = jnp.where(mask[:, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q_nope.dtype)
    if t == 1:
        out = jnp.einsum("bhtr,hvr->bthv", jnp.einsum("bhts,bsr->bhtr", probs, c), w_v)
    else:
        out = jnp.einsum("bhts,bshv->bthv", probs, jnp.einsum("bsr,hvr->bshv", c, w_v))
    return out, latent_cache, rope_cache


def latent_one_token_by_kernel(q, latent, k_rope, latent_cache, rope_cache, kv_b, rope: RoPE, write_index, mask,
                               columns, *, mla: MLA, on_gpu: bool = True, columns_per_part: int = COLUMNS_PER_PART):
    """latent_written_and_attended of one token per row (T = 1), absorbed, its queries' product with kv_b and its
    attention Pallas kernels (interpreted where not on_gpu): `columns` int32 [B, 2], each row's first and last
    visible column, says what its mask does (the last is where the token is written). The queries' and the key's
    rope parts are roped as one array, which the kernel reads as it is."""
    b, _, heads, _ = q.shape
    dn = mla.qk_nope_head_dim
    q_latent = absorbed_queries(q[:, 0], kv_b, nope_dim=dn, value_dim=mla.v_head_dim, on_gpu=on_gpu)
    _, w_v = latent_weights(kv_b, q, heads, mla)
    ropes = rope_of(jnp.concatenate([q[..., dn:], k_rope], axis=2), rope, mla).reshape(b, heads + 1, -1)
    out, latent_cache, rope_cache = attend_latent_one_token(
        q_latent, ropes, latent[:, 0, 0], latent_cache, rope_cache, columns, scale=mla.softmax_scale, on_gpu=on_gpu,
        columns_per_part=columns_per_part)
    return jnp.einsum("bhr,hvr->bhv", out, w_v)[:, None], latent_cache, rope_cache


def rope_of(x: jax.Array, rope: RoPE, mla: MLA) -> jax.Array:
    """x [B, T, H, dr] roped (its pairs first reordered where the checkpoint interleaves them)."""
    return apply_rope(deinterleave(x) if mla.rope_interleave else x, rope)


def latent_weights(kv_b, x, heads: int, mla: MLA):
    """(w_k [H, dn, r], w_v [H, dv, r]): kv_b [H * (dn + dv), r] split, for products with x (weight_for)."""
    w_kv = weight_for(kv_b, x).reshape(heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
    return w_kv[:, :mla.qk_nope_head_dim], w_kv[:, mla.qk_nope_head_dim:]
