"""The router guess, evaluated offline: guess MoE layer l+1's experts by applying its router to layer l's input.

This is the guess the offload engine's in-step prefetch makes (``OffloadEngine.bind``): while MoE layer
``l`` computes its experts on ``h_l`` (the post-attention-norm hidden state its own router sees), the
engine scores the experts of MoE layer ``l + 1`` with ``softmax(router_{l+1}(h_l))``
(:func:`jmoe.model.router_probabilities`, the one function routing and prefetch use). Layers are counted among MoE layers only, as the engine counts them
(dense layers in between are skipped). The first MoE layer has no layer before it in the same token, so
guesses exist for MoE layers ``1 .. L-1``.

:func:`router_guesses` runs the model once and returns those probabilities per token, in the
``[tokens, layers, E]`` score layout of :mod:`jmoe.offload.predictors`, so that ``top_experts`` and
:func:`jmoe.traces.evaluation.precision_recall` score them like the history predictors (per token: batch-1
decode semantics; the engine max-pools the probabilities over a batch's tokens instead).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmoe.errors import InputError
from jmoe.model import empty_kv_cache, router_probabilities
from jmoe.offload.resident import ResidentEngine
from jmoe.offload.predictors import top_experts
from jmoe.traces.evaluation import precision_recall


@dataclasses.dataclass(frozen=True)
class RouterGuesses:
    """Guesses and actual routing of N real tokens (padding removed), in row-major token order.

    probs[:, i] is the guess for MoE layer i + 1, made from MoE layer i's input.
    """

    probs: np.ndarray  # float32 [N, L-1, E]: router_probabilities of router l+1 on h_l, l = 0 .. L-2
    ids: np.ndarray  # int32 [N, L, k]: the experts each MoE layer chose

    @property
    def guessed_ids(self) -> np.ndarray:
        """int32 [N, L-1, k]: the experts of MoE layers 1 .. L-1, the ones the guesses are for."""
        return self.ids[:, 1:]

    def predicted(self, count: int) -> np.ndarray:
        """bool [N, L-1, E]: the `count` most probable experts of each guess."""
        return top_experts(self.probs, count)

    def precision_recall(self, count: int) -> dict:
        """`evaluation.precision_recall` of the top-`count` guesses; its layer i is MoE layer i + 1."""
        return precision_recall(self.predicted(count), self.guessed_ids)


def router_guesses(model, tokens, mask=None) -> RouterGuesses:
    """Run `model` (a resident jmoe.Model) on `tokens` int [B, T] and return its router guesses.

    mask: bool [B, T], True at real tokens (default: all real). Padding must sit after the real
    tokens of its row (causal attention then keeps it from changing them); padded positions are
    left out of the result.
    """
    cfg = model.config
    tokens, mask = _check_input(model, tokens, mask)
    probs, routing = _forward(model.module(), jnp.asarray(tokens), model.engine.backend)
    b, t = tokens.shape
    probs = np.asarray(probs).reshape(b, t, cfg.num_moe_layers - 1, cfg.num_experts)
    ids = np.asarray(routing).transpose(1, 2, 0, 3)  # [B, T, L, k]
    return RouterGuesses(probs[mask], ids[mask])


@partial(nnx.jit, static_argnames="backend")
def _forward(module, tokens, backend: str):
    """(guesses float32 [B*T, L-1, E], routing int32 [L, B, T, k]) from one forward with resident experts."""
    blocks = module.moe_blocks()
    guesses = []

    def compute(moe_index, x, ids, weights):
        if moe_index + 1 < len(blocks):
            # Exactly the engine's prefetch score, before its max over the step's tokens.
            guesses.append(router_probabilities(module.cfg, blocks[moe_index + 1].router_params(), x))
        return blocks[moe_index].resident_experts(x, ids, weights, backend)

    b, t = tokens.shape
    kv_cache = empty_kv_cache(module.cfg, b, t, module.embed[...].dtype)
    out = module(tokens, kv_cache, 0, jnp.zeros((b,), jnp.int32), expert_compute=compute, backend=backend)
    return jnp.stack(guesses, axis=1), out.routing


def _check_input(model, tokens, mask) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32 [B, T], mask bool [B, T]) or an InputError saying what to change."""
    cfg = model.config
    if cfg.num_moe_layers < 2:
        raise InputError(f"router_guesses: expected a model with at least 2 MoE layers (the guess for one "
                         f"comes from the one before), found {cfg.num_moe_layers}")
    if not isinstance(model.engine, ResidentEngine):
        raise InputError("router_guesses: expected a model with every expert on the device, found an "
                         "offloaded one; load it without cache= (routing does not depend on the cache)")
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise InputError(f"router_guesses: expected integer token ids shaped [batch, tokens], found "
                         f"{tokens.dtype} {list(tokens.shape)}; add a batch axis with tokens[None]")
    if tokens.shape[1] > cfg.max_position_embeddings:
        raise InputError(f"router_guesses: found rows of {tokens.shape[1]} tokens, more than the model's "
                         f"max_position_embeddings ({cfg.max_position_embeddings}); cut them into windows")
    bad = np.argwhere((tokens < 0) | (tokens >= cfg.vocab_size))
    if bad.size:
        raise InputError(f"router_guesses: expected token ids in [0, {cfg.vocab_size}), found "
                         f"{int(tokens[tuple(bad[0])])} at {bad[0].tolist()}; pad with a valid id such as 0")
    mask = np.ones(tokens.shape, bool) if mask is None else np.asarray(mask)
    if mask.shape != tokens.shape or mask.dtype != bool:
        raise InputError(f"router_guesses: expected a bool mask shaped like the tokens {list(tokens.shape)}, "
                         f"found {mask.dtype} {list(mask.shape)}")
    # A real token after padding would attend to the padding before it.
    late = np.flatnonzero((mask[:, 1:] & ~mask[:, :-1]).any(axis=1))
    if late.size:
        raise InputError(f"router_guesses: expected padding only after the real tokens of a row, found a real "
                         f"token after padding in row {int(late[0])}; move each row's padding to its end")
    return tokens.astype(np.int32), mask
