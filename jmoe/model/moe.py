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
from jmoe.kernels.routing import activated, choose_experts, chosen_weights, group_limited, router_logits
from jmoe.model.layers import DenseMLP, Experts, Linear, normal_param, products, project


def router_probabilities(cfg: ModelConfig, router: tuple[jax.Array, ...], x: jax.Array) -> jax.Array:
    """float32 [N, E]: how strongly each token of x [N, d] prefers each expert, from the router's
    parameters `router` (its kernel [E, d], and for "sigmoid_grouped" its score bias [E]). Its top-k is the
    router's choice, for every router: "sigmoid_grouped" returns the bias-corrected sigmoid scores with the
    experts of groups outside the best `topk_group` at -inf."""
    if cfg.router == "softmax":
        kernel, *bias = router  # a bias (GPT-OSS) when the config has one
        return activated(project(x, kernel, *bias), "softmax")
    _, bias = router
    return group_limited(activated(_sigmoid_logits(router, x), "sigmoid") + bias.astype(jnp.float32), cfg.n_group,
                         cfg.topk_group)


def _sigmoid_logits(router: tuple[jax.Array, ...], x: jax.Array) -> jax.Array:
    # In float32 from float32 operands, as transformers computes this router whatever the model's dtype.
    return project(x.astype(jnp.float32), router[0].astype(jnp.float32))


class ScoreRouter(nnx.Module):
    """The sigmoid router's parameters: its kernel and the per-expert bias added for selection only (kept in
    float32, as transformers keeps it)."""

    def __init__(self, d: int, e: int, *, dtype, rngs: nnx.Rngs):
        self.kernel = normal_param(rngs, (e, d), dtype)
        self.score_bias = nnx.Param(jnp.zeros((e,), jnp.float32))


class MoELayerView(NamedTuple):
    """What an expert engine needs from one MoE layer while a step is traced: the stacked expert weights
    and the router's parameters (wherever they live)."""

    experts: ExpertWeights
    router: tuple[jax.Array, ...]  # the arguments router_probabilities takes


class MoEBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.cfg = cfg
        if cfg.router == "softmax":
            self.router = Linear(d, cfg.num_experts, bias=cfg.router_bias, dtype=dtype, rngs=rngs)
        else:
            self.router = ScoreRouter(d, cfg.num_experts, dtype=dtype, rngs=rngs)
        self.experts = Experts(cfg.num_experts, d, cfg.expert_intermediate_size, dtype=dtype, rngs=rngs,
                               expert_dtype=cfg.expert_dtype, group=cfg.expert_group, bias=cfg.expert_bias)
        fs = cfg.shared_expert_intermediate_size
        self.shared_expert = DenseMLP(d, fs, dtype=dtype, rngs=rngs) if fs else None
        gated = fs and cfg.shared_expert_gate
        self.shared_expert_gate = Linear(d, 1, bias=False, dtype=dtype, rngs=rngs) if gated else None

    def router_params(self) -> tuple[jax.Array, ...]:
        if self.cfg.router == "softmax":  # get_value: see Experts.weights
            bias = () if self.router.bias is None else (self.router.bias.get_value(),)
            return (self.router.kernel.get_value(), *bias)
        return (self.router.kernel.get_value(), self.router.score_bias.get_value())

    def route(self, x: jax.Array, token_valid: jax.Array,
              forced_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Top-k routing: expert ids [N, k] (-1 for padding tokens) and weights [N, k].

        `forced_ids` [N, k] (benchmarks) replaces the router's choice, e.g. by a recorded trace, so that
        a random-weight model sees real cache behaviour; the weights are the router's probabilities of
        the forced experts.
        """
        cfg, router = self.cfg, self.router_params()
        if cfg.router == "softmax":  # its bias, rounding and softmax, like the choice, in the choice's kernel on a GPU
            kernel, *bias = router
            sums = products(x, kernel)
            logits = dict(logits_bias=bias[0] if bias else None, logits_dtype=x.dtype)
            choice, options = {}, dict(activation="softmax")
        else:  # chosen by the bias-corrected scores of the best groups (router_probabilities), weighed unbiased
            sums, logits = _sigmoid_logits(router, x), {}
            choice = dict(bias=router[1], groups=(cfg.n_group, cfg.topk_group))
            options = dict(activation="sigmoid", eps=1e-20, scale=cfg.routed_scaling_factor)
        options.update(normalize=cfg.norm_topk_prob, dtype=x.dtype)
        if forced_ids is None:
            return choose_experts(sums, token_valid, top_k=cfg.num_experts_per_tok, **logits, **choice, **options)
        scores = activated(router_logits(sums, **logits), options.pop("activation"))
        return chosen_weights(forced_ids, scores, token_valid, **options)

    def view(self) -> MoELayerView:
        return MoELayerView(self.experts.weights(), self.router_params())

    def resident_experts(self, x, ids, weights, backend: str):
        return ExpertKernel(backend, self.cfg.expert_activation)(x, ids, weights, self.experts.weights())

    def shared(self, x: jax.Array) -> jax.Array:
        if self.shared_expert is None:
            return jnp.zeros_like(x)
        if self.shared_expert_gate is None:
            return self.shared_expert(x)
        return jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
