"""Rotary position embeddings (rotate-half convention) with the scalings config.json can ask for."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jmoe.config import ModelConfig


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
