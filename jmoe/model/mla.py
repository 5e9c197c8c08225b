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

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.config import MLA_NORM_EPS, ModelConfig
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

    def _rope(self, x: jax.Array, rope: RoPE) -> jax.Array:
        return apply_rope(deinterleave(x) if self.cfg.mla.rope_interleave else x, rope)

    def __call__(self, x, latent_cache, rope_cache, context: StepContext, window: int | None):
        """As Attention.__call__, over the latent cache pair."""
        cfg, m = self.cfg, self.cfg.mla
        rope, write_index, mask = context.rope, context.write_index, context.mask(window)
        b, t, _ = x.shape
        dn, r = m.qk_nope_head_dim, m.kv_lora_rank
        q = self.q_b(self.q_a_norm(self.q_a(x))) if m.q_lora_rank else self.q(x)
        q = q.reshape(b, t, cfg.num_heads, dn + m.qk_rope_head_dim)
        q_nope, q_rope = q[..., :dn], self._rope(q[..., dn:], rope)
        compressed = self.kv_a(x)
        latent = self.kv_a_norm(compressed[..., :r])[:, :, None, :]
        k_rope = self._rope(compressed[..., None, r:], rope)
        latent_cache = write_cache(latent_cache, latent, write_index)
        rope_cache = write_cache(rope_cache, k_rope, write_index)
        visible = mask.shape[-1]  # the cache columns any query can see (a prompt step: its own)
        c = latent_cache[:b, :visible, 0].astype(x.dtype)  # [B, S, r]: the step's rows (see Attention)
        kr = rope_cache[:b, :visible, 0].astype(x.dtype)  # [B, S, dr]
        w_kv = weight_for(self.kv_b.kernel[...], c).reshape(cfg.num_heads, dn + m.v_head_dim, r)  # stored [out, in]
        w_k, w_v = w_kv[:, :dn], w_kv[:, dn:]
        rope_scores = jnp.einsum("bthd,bsd->bhts", q_rope, kr)
        if t == 1:  # absorbed: queries meet the latents themselves
            q_latent = jnp.einsum("bthn,hnr->bthr", q_nope, w_k)
            scores = jnp.einsum("bthr,bsr->bhts", q_latent, c) + rope_scores
        else:  # expanded: every cached latent up-projected to its keys
            scores = jnp.einsum("bthn,bshn->bhts", q_nope, jnp.einsum("bsr,hnr->bshn", c, w_k)) + rope_scores
        # Softmax in float32, as the reference implementation does.
        scores = scores.astype(jnp.float32) * m.softmax_scale
        scores = jnp.where(mask[:, None], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        if t == 1:
            out = jnp.einsum("bhtr,hvr->bthv", jnp.einsum("bhts,bsr->bhtr", probs, c), w_v)
        else:
            out = jnp.einsum("bhts,bshv->bthv", probs, jnp.einsum("bsr,hvr->bshv", c, w_v))
        return self.o(out.reshape(b, t, -1)), latent_cache, rope_cache
