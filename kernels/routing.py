"""A MoE layer's choice of experts from its router's scores: each token's top-k experts, their weights (the chosen
scores, normalised, scaled, cast) and -1 for the ids of tokens that route nowhere (padding).

Where the program is lowered for a CUDA GPU this is one Pallas kernel (Triton), a program per token, which also
applies the router's bias, rounding and softmax or sigmoid to its sums. XLA:GPU made it three kernels after the
router's own (a sort for top_k, the chosen scores' gather, their normalisation and cast), one more where the router
had a bias or a sigmoid, four more for DeepSeek-V3's groups (the sort of each group's best two, their sums, the
groups' sort, the mask), each a launch in a one-row decode step, whose kernels are a few microseconds of work each
(gpu_check's Mixtral-shaped resident step on an H100, 2026-11-27: 93 kernels, 1.24-1.66 ms against 0.28 ms of HBM
reads). Elsewhere it is the same computation in XLA (`chosen_weights` after lax.top_k);
tests/test_bookkeeping_kernels.py holds the kernel, interpreted, to it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jmoe.kernels.target import platform_dependent

# One warp: a program reads one token's scores (at most a few hundred experts).
TRITON_PARAMS = pltriton.CompilerParams(num_warps=1, num_stages=1)


def choose_experts(scores, valid, *, top_k: int, bias=None, groups: tuple[int, int] = (1, 1),
                   activation: str | None = None, logits_bias=None, logits_dtype=None, normalize: bool,
                   eps: float = 0.0, scale: float = 1.0, dtype):
    """ids int32 [N, top_k] and weights [N, top_k] of `dtype` for scores float32 [N, E] and valid bool [N].

    `activation` ("softmax" or "sigmoid", ROUTER_ACTIVATIONS) is applied to the scores first (they are then a
    router's float32 sums), after `logits_bias` [E] (a linear router's bias) is added and the
    sum rounded to `logits_dtype` (if given; as jmoe.model.layers.project rounds): in the kernel, where XLA made the
    bias and rounding, or a sigmoid, a kernel of its own after the router's product. A token's ids are the `top_k`
    experts of the highest selection scores, highest first (ties: the lower expert first, as lax.top_k; -inf scores
    are never preferred to finite ones), -1 where not `valid`. The selection scores are the scores plus `bias`
    ([E], if given), limited to the experts of the best groups[1] of groups[0] equal groups (`group_limited`). Its
    weights are the chosen experts' scores (without `bias`), divided by their sum plus `eps` if `normalize`, times
    `scale`."""
    args = (scores, valid, bias, logits_bias)
    options = dict(top_k=top_k, groups=tuple(groups), activation=activation, logits_dtype=logits_dtype,
                   normalize=normalize, eps=eps, scale=scale, dtype=dtype)
    return platform_dependent(*args, cuda=functools.partial(choose_by_kernel, on_gpu=True, **options),
                              default=functools.partial(choose_in_xla, **options))


def router_logits(sums, logits_bias=None, logits_dtype=None):
    """A linear router's logits from its float32 sums [N, E]: plus its bias [E], rounded to `logits_dtype`."""
    if logits_bias is not None:
        sums = sums + logits_bias.astype(jnp.float32)
    return sums if logits_dtype is None else sums.astype(logits_dtype)


def activated(logits, activation: str | None):
    """A router's float32 scores from its logits [N, E] (None: the logits are the scores)."""
    if activation is None:
        return logits
    return ROUTER_ACTIVATIONS[activation](logits.astype(jnp.float32))


# Router activations the choice applies, by name: functions of float32 logits [N, E].
ROUTER_ACTIVATIONS = {"softmax": functools.partial(jax.nn.softmax, axis=-1), "sigmoid": jax.nn.sigmoid}


def group_limited(scores, num_groups: int, top_groups: int):
    """scores [N, E] with -inf outside the `top_groups` best of `num_groups` equal groups of experts, a group scored
    by the sum of its best two (DeepSeek-V3's node-limited routing; ties: the lower group first)."""
    if num_groups == 1:
        return scores
    grouped = scores.reshape(scores.shape[0], num_groups, -1)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
    _, best_groups = jax.lax.top_k(group_scores, top_groups)
    eligible = jnp.any(best_groups[:, :, None] == jnp.arange(num_groups), axis=1)
    return jnp.where(eligible[:, :, None], grouped, -jnp.inf).reshape(scores.shape)


def chosen_weights(ids, weigh, valid, *, normalize: bool, eps: float = 0.0, scale: float = 1.0, dtype):
    """What `choose_experts` returns for chosen `ids` [N, k] (a router's, or forced ones)."""
    weights = jnp.take_along_axis(weigh, ids, axis=-1)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + eps)
    if scale != 1.0:
        weights = weights * scale
    return jnp.where(valid[:, None], ids.astype(jnp.int32), -1), weights.astype(dtype)


def choose_in_xla(scores, valid, bias, logits_bias=None, *, top_k, groups, activation=None, logits_dtype=None,
                  **options):
    """`choose_experts` in XLA (a bias None: none), what every platform but a GPU runs."""
    if activation is not None:
        scores = activated(router_logits(scores, logits_bias, logits_dtype), activation)
    selection = group_limited(scores if bias is None else scores + bias.astype(jnp.float32), *groups)
    return chosen_weights(jax.lax.top_k(selection, top_k)[1], scores, valid, **options)


def choose_by_kernel(scores, valid, bias, logits_bias=None, *, top_k, groups, normalize, eps, scale, dtype,
                     on_gpu: bool, activation=None, logits_dtype=None):
    """`choose_experts` as the Pallas kernel (a bias None: none): Triton where on_gpu, else interpreted (tests)."""
    num_tokens, num_experts = scores.shape
    # In their own dtype: the kernel casts them (a cast before it would be a kernel of its own).
    biases = tuple(b.reshape(1, -1) for b in (logits_bias, bias) if b is not None)
    kernel = functools.partial(_choose_kernel, top_k=top_k, num_experts=num_experts, groups=groups,
                               activation=activation, logits_bias=logits_bias is not None, logits_dtype=logits_dtype,
                               normalize=normalize, eps=eps, scale=scale)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((num_tokens, top_k), jnp.int32),
                   jax.ShapeDtypeStruct((num_tokens, top_k), dtype)),
        grid=(num_tokens,),
        # Whole arrays, read and written by masked loads and stores: Triton's blocks are powers of two, E and k
        # need not be.
        in_specs=[pl.no_block_spec] * (2 + len(biases)),
        out_specs=[pl.no_block_spec] * 2,
        interpret=not on_gpu,
        compiler_params=TRITON_PARAMS if on_gpu else None,
        name="choose_experts",
    )(scores, valid.astype(jnp.int32), *biases)


def _choose_kernel(scores_ref, valid_ref, *refs, top_k, num_experts, groups, activation, logits_bias,
                   logits_dtype, normalize, eps, scale):
    """One token: its scores (activated), its selection scores (group_limited's groups, each a round over the
    experts), then top_k rounds of "the highest score not yet taken, the lowest expert among equals"."""
    *bias_refs, ids_ref, weights_ref = refs  # the logits' bias, the selection's, where given
    logits_bias_ref, bias_refs = (bias_refs[0], bias_refs[1:]) if logits_bias else (None, bias_refs)
    token = pl.program_id(0)
    experts = jax.lax.broadcasted_iota(jnp.int32, (1, pl.next_power_of_2(num_experts)), 1)
    ranks = jax.lax.broadcasted_iota(jnp.int32, (1, pl.next_power_of_2(top_k)), 1)
    real = experts < num_experts
    row = (pl.ds(token, 1), pl.ds(0, experts.shape[1]))
    scores = pltriton.load(scores_ref.at[row], mask=real, other=-jnp.inf).astype(jnp.float32)
    if activation is not None:  # as jax.nn's: padding experts' -inf logits give 0
        sums_bias = None if logits_bias_ref is None else pltriton.load(logits_bias_ref.at[(pl.ds(0, 1), row[1])],
                                                                       mask=real, other=0.0).astype(jnp.float32)
        scores = activated(router_logits(scores, sums_bias, logits_dtype), activation)
    weigh = scores  # the weights are the chosen scores before the selection's bias (padding experts never chosen)
    for ref in bias_refs:
        scores = scores + pltriton.load(ref.at[(pl.ds(0, 1), row[1])], mask=real, other=0.0).astype(jnp.float32)
    scores = _group_limited(scores, experts, num_experts, *groups)
    taken = jnp.logical_not(real)
    ids = jnp.zeros(ranks.shape, jnp.int32)
    weights = jnp.zeros(ranks.shape, jnp.float32)
    for rank in range(top_k):
        best = jnp.max(jnp.where(taken, -jnp.inf, scores), axis=1, keepdims=True)
        candidates = jnp.logical_and(scores == best, jnp.logical_not(taken))
        # A NaN score equals nothing: the lowest expert not taken then, so an id always names an expert.
        first_free = jnp.min(jnp.where(taken, num_experts, experts), axis=1, keepdims=True)
        chosen = jnp.min(jnp.where(candidates, experts, num_experts), axis=1, keepdims=True)
        chosen = jnp.where(chosen < num_experts, chosen, first_free)
        hit = experts == chosen
        taken = jnp.logical_or(taken, hit)
        ids = jnp.where(ranks == rank, chosen, ids)
        weights = jnp.where(ranks == rank, jnp.sum(jnp.where(hit, weigh, 0.0), axis=1, keepdims=True), weights)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=1, keepdims=True) + eps)
    if scale != 1.0:
        weights = weights * scale
    ids = jnp.where(valid_ref[pl.ds(token, 1)][:, None] != 0, ids, -1)
    out = (pl.ds(token, 1), pl.ds(0, ranks.shape[1]))
    pltriton.store(ids_ref.at[out], ids, mask=ranks < top_k)
    pltriton.store(weights_ref.at[out], weights.astype(weights_ref.dtype), mask=ranks < top_k)


def _group_limited(scores, experts, num_experts: int, num_groups: int, top_groups: int):
    """group_limited for one token's scores [1, E'] inside the kernel: each group's best two, then each group's rank
    among the groups (better ones, and equal ones of a lower index), its experts kept where the rank is below
    top_groups."""
    if num_groups == 1:
        return scores
    group = experts // (num_experts // num_groups)  # padding experts fall in no group
    group_scores = []
    for g in range(num_groups):
        inside = group == g
        best = jnp.max(jnp.where(inside, scores, -jnp.inf), axis=1, keepdims=True)
        at = jnp.min(jnp.where(jnp.logical_and(inside, scores == best), experts, num_experts), axis=1, keepdims=True)
        second = jnp.max(jnp.where(jnp.logical_and(inside, experts != at), scores, -jnp.inf), axis=1, keepdims=True)
        group_scores.append(best + second)
    kept = None
    for g, score in enumerate(group_scores):
        # Groups ahead of g: better, or as good and earlier.
        ahead = [(other >= score if h < g else other > score).astype(jnp.int32)
                 for h, other in enumerate(group_scores) if h != g]
        keep = jnp.logical_and(group == g, functools.reduce(jnp.add, ahead) < top_groups)
        kept = keep if kept is None else jnp.logical_or(kept, keep)
    return jnp.where(kept, scores, -jnp.inf)
