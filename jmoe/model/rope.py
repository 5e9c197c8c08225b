"""Rotary position embeddings (rotate-half convention) with the scalings config.json can ask for.

The tables span `cfg.rope_dim` dimensions: the whole head, the leading part of it (partial rotary), or
MLA's separate rotary head. Frequencies follow transformers' float32 computation so logits match it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmoe.config import ModelConfig
from jmoe.config_rope import Yarn


class RoPE(NamedTuple):
    cos: jax.Array  # [B, T, rope_dim], float32
    sin: jax.Array


def _yarn_inv_freq(dim: int, base: float, yarn: Yarn) -> np.ndarray:
    """Blend of interpolated (long-wavelength) and extrapolated (short-wavelength) frequencies, ramped
    linearly between the dimensions that turn beta_slow and beta_fast times over the original context."""
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoids dividing by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    return ((1.0 / (yarn.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
            ).astype(np.float32)


def inv_freq(cfg: ModelConfig) -> np.ndarray:
    dim = cfg.rope_dim
    if cfg.rope_yarn is not None:
        return _yarn_inv_freq(dim, cfg.rope_theta, cfg.rope_yarn)
    pos_freqs = np.float32(cfg.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    return (1.0 / pos_freqs / np.float32(cfg.rope_linear_factor)).astype(np.float32)


def rope_tables(positions: jax.Array, cfg: ModelConfig) -> RoPE:
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq(cfg))
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    scale = 1.0 if cfg.rope_yarn is None else cfg.rope_yarn.attention_factor
    return RoPE(jnp.cos(emb) * scale, jnp.sin(emb) * scale)


def apply_rope(x: jax.Array, rope: RoPE) -> jax.Array:
    """x [B, T, H, hd]; rotate-half convention over the first rope_dim dimensions, the rest pass through."""
    rot = rope.cos.shape[-1]
    cos = rope.cos[:, :, None, :].astype(x.dtype)
    sin = rope.sin[:, :, None, :].astype(x.dtype)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = jnp.split(x_rot, 2, axis=-1)
    out = x_rot * cos + jnp.concatenate([-x2, x1], axis=-1) * sin
    return jnp.concatenate([out, x_pass], axis=-1) if x_pass.shape[-1] else out


def deinterleave(x: jax.Array) -> jax.Array:
    """Interleaved rotary pairs (x0, x1), (x2, x3), ... reordered to rotate-half layout (evens, then odds): applied
    to queries and keys alike, it leaves their dot products those of DeepSeek's interleaved rotation."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
