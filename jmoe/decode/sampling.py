"""Next-token selection: greedy, temperature, top-k and top-p, applied in that order (as transformers does)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jmoe.errors import InputError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Hashable so it can be a static jit argument; temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1.0 = no nucleus filter

    def __post_init__(self):
        if self.temperature < 0:
            raise InputError(f"temperature must be >= 0 (0 = greedy), found {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (0 = off), found {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must be in (0, 1] (1 = off), found {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample(logits: jax.Array, key: jax.Array, params: SamplingParams) -> jax.Array:
    """logits float32 [B, V] -> token ids int32 [B]."""
    if params.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / params.temperature
    neg_inf = jnp.finfo(logits.dtype).min
    if params.top_k:
        kth = jax.lax.top_k(logits, min(params.top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, neg_inf, logits)
    if params.top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # Drop a token once the tokens before it already reach top_p; the most likely token always stays.
        drop_sorted = (cumulative - jax.nn.softmax(sorted_logits, axis=-1)) >= params.top_p
        drop = jnp.zeros_like(drop_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(drop_sorted)
        logits = jnp.where(drop, neg_inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
