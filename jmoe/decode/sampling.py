"""Next-token selection: greedy, or temperature, top-k and top-p applied in that order (as transformers does).

The sampling parameters reach the jitted step as traced per-row arrays (`SamplingArrays`), so one
compiled program serves every temperature / top_k / top_p. Greedy decoding (temperature 0 for every row)
has a program of its own that only takes the argmax: the stochastic program sorts the vocabulary every
step, which greedy decoding has no use for.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmoe.arguments import is_whole_number
from jmoe.errors import InputError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """The user's choice, checked once; temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1.0 = no nucleus filter

    def __post_init__(self):
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float, np.number)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InputError(f"temperature must be a finite number >= 0 (0 = greedy), found {self.temperature!r}")
        if not is_whole_number(self.top_k) or self.top_k < 0:
            raise InputError(f"top_k must be a whole number >= 0 (0 = off), found {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float, np.number)) \
                or not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must be a number in (0, 1] (1 = off), found {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def arrays(self, batch: int) -> SamplingArrays:
        """The parameters as the step's traced inputs, one entry per row."""
        return SamplingArrays(np.full(batch, self.temperature, np.float32), np.full(batch, self.top_k, np.int32),
                              np.full(batch, self.top_p, np.float32))


class SamplingArrays(NamedTuple):
    temperature: jax.Array  # float32 [B], > 0
    top_k: jax.Array  # int32 [B], 0 = off
    top_p: jax.Array  # float32 [B], 1 = off


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """logits float32 [B, V] -> the most likely token of every row, int32 [B]."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def sample(logits: jax.Array, key: jax.Array, params: SamplingArrays) -> jax.Array:
    """logits float32 [B, V] -> token ids int32 [B] drawn after temperature, top-k and top-p filtering."""
    logits = logits / params.temperature[:, None]
    neg_inf = jnp.finfo(logits.dtype).min
    order = jnp.argsort(-logits, axis=-1)  # most likely first
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    vocab = logits.shape[-1]
    # top-k: keep the tokens at least as likely as the k-th (ties with it stay, as in transformers).
    kth = jnp.take_along_axis(sorted_logits, jnp.clip(params.top_k - 1, 0, vocab - 1)[:, None], axis=-1)
    top_k_on = (params.top_k > 0)[:, None]
    logits = jnp.where(top_k_on & (logits < kth), neg_inf, logits)
    sorted_logits = jnp.where(top_k_on & (sorted_logits < kth), neg_inf, sorted_logits)
    # top-p: drop a token once the tokens before it already reach top_p; the most likely token always stays.
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    drop_sorted = ((jnp.cumsum(probs, axis=-1) - probs) >= params.top_p[:, None]) & (params.top_p < 1.0)[:, None]
    drop = jnp.zeros_like(drop_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(drop_sorted)
    logits = jnp.where(drop, neg_inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
