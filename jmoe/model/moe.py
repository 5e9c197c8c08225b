"""The MoE block: router, stacked experts, optional shared expert.

The router's probabilities are computed in one place, `router_probabilities`: the block's own routing,
the offload engine's prefetch guess (the next layer's router applied to this layer's input) and the
offline evaluation of that guess (jmoe.traces) all call it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.config import ModelConfig
from jmoe.kernels import ExpertKernel, ExpertWeights
from jmoe.model.layers import DenseMLP, Experts, Linear


def router_probabilities(cfg: ModelConfig, router: tuple[jax.Array, ...], x: jax.Array) -> jax.Array:
    """float32 [N, E]: how strongly each token of x [N, d] prefers each expert, from the router's
    parameters `router` (its kernel [d, E])."""
    (kernel,) = router
    return jax.nn.softmax((x @ kernel).astype(jnp.float32), axis=-1)


class MoELayerView(NamedTuple):
    """What an expert engine needs from one MoE layer while a step is traced: the stacked expert weights
    and the router's parameters (wherever they live)."""

    experts: ExpertWeights
    router: tuple[jax.Array, ...]  # the arguments router_probabilities takes


class MoEBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.cfg = cfg
        self.router = Linear(d, cfg.num_experts, bias=False, dtype=dtype, rngs=rngs)
        self.experts = Experts(cfg.num_experts, d, cfg.expert_intermediate_size, dtype=dtype, rngs=rngs,
                               expert_dtype=cfg.expert_dtype, group=cfg.expert_group)
        fs = cfg.shared_expert_intermediate_size
        self.shared_expert = DenseMLP(d, fs, dtype=dtype, rngs=rngs) if fs else None
        self.shared_expert_gate = Linear(d, 1, bias=False, dtype=dtype, rngs=rngs) if fs else None

    def router_params(self) -> tuple[jax.Array, ...]:
        return (self.router.kernel.get_value(),)  # get_value: see Experts.weights

    def route(self, x: jax.Array, token_valid: jax.Array,
              forced_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Top-k routing: expert ids [N, k] (-1 for padding tokens) and weights [N, k].

        `forced_ids` [N, k] (benchmarks) replaces the router's choice, e.g. by a recorded trace, so that
        a random-weight model sees real cache behaviour; the weights are the router's probabilities of
        the forced experts.
        """
        probs = router_probabilities(self.cfg, self.router_params(), x)
        if forced_ids is None:
            weights, ids = jax.lax.top_k(probs, self.cfg.num_experts_per_tok)
        else:
            ids, weights = forced_ids, jnp.take_along_axis(probs, forced_ids, axis=-1)
        if self.cfg.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        ids = jnp.where(token_valid[:, None], ids.astype(jnp.int32), -1)
        return ids, weights.astype(x.dtype)

    def view(self) -> MoELayerView:
        return MoELayerView(self.experts.weights(), self.router_params())

    def resident_experts(self, x, ids, weights, backend: str):
        return ExpertKernel(backend, self.cfg.expert_activation)(x, ids, weights, self.experts.weights())

    def shared(self, x: jax.Array) -> jax.Array:
        if self.shared_expert is None:
            return jnp.zeros_like(x)
        return jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
