"""bench.gpu_check's check of a decode step's bookkeeping kernels on the device: the choice of experts from a
router's sums (jmoe.kernels.routing: its bias, softmax or sigmoid, top-k and weights) and miss mode "fetch"'s plan
(jmoe.offload.fetch_plan), each as its kernel (Triton on a GPU, interpreted elsewhere) against the XLA computation
it replaces there, on random inputs with ties and padding: the same ids and plans, weights within
WEIGHT_TOLERANCE. The offload and family sections would show a wrong kernel only
as wrong tokens; these name it."""

from __future__ import annotations

import functools

import numpy as np

WEIGHT_TOLERANCE = 1e-6  # float32 sums of at most k weights, in another order
# (tokens, experts, top-k, normalize, eps, scale, (groups, best groups kept), router bias): Mixtral's, GPT-OSS-120B's
# (its router's bias), DeepSeek-V3's sigmoid router (bias-corrected, the best 4 of 8 groups), and an expert count and
# top-k that are no powers of two over a few tokens. A case with eps is a sigmoid router's (float32 logits; biased
# choice, unbiased weights), the others a softmax router's (its sums plus its bias, if any, rounded to bfloat16).
ROUTING_CASES = [(1, 8, 2, True, 0.0, 1.0, (1, 1), False), (1, 128, 4, True, 0.0, 1.0, (1, 1), True),
                 (1, 256, 8, True, 1e-20, 2.5, (8, 4), False), (4, 60, 6, False, 0.0, 1.0, (1, 1), True)]
# (experts, cache slots, tokens, top-k, scratch slots): one-row steps, all admitted or partly to scratch, a batch.
PLAN_CASES = [(8, 2, 1, 2, 2), (128, 40, 1, 4, 4), (60, 6, 2, 4, 3), (32, 8, 4, 2, 4)]


def random_scores(rng, tokens: int, experts: int) -> np.ndarray:
    """float32 router scores [tokens, experts], the first row's best few tied."""
    scores = rng.standard_normal((tokens, experts)).astype(np.float32)
    scores[0, :3] = scores[0].max()
    return scores


def random_layer(rng, num_experts: int, num_cache: int, tokens: int, top_k: int):
    """(slot_of_expert, expert_in_slot, victim order, ids) of an offloaded layer: consistent tables with some empty
    slots, a victim order (a permutation of the slots, some left out) and the routing of a few tokens (distinct
    experts a token, the last token padding)."""
    expert_in_slot = np.full(num_cache, -1, np.int32)
    filled = rng.choice(num_cache, rng.integers(0, num_cache + 1), replace=False)
    expert_in_slot[filled] = rng.choice(num_experts, len(filled), replace=False)
    slot_of_expert = np.full(num_experts, -1, np.int32)
    slot_of_expert[expert_in_slot[filled]] = filled
    order = rng.permutation(num_cache).astype(np.int32)
    order[rng.random(num_cache) < 0.2] = -1
    ids = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    if tokens > 1:
        ids[-1] = -1
    return slot_of_expert, expert_in_slot, order, ids


def check(result, on_gpu: bool) -> None:
    """Each case a check of `result` (a SectionResult), whatever the time: a few small programs."""
    for case in ROUTING_CASES:
        result.attempt(f"choose_experts kernel / (T, E, k) = {case[:3]}, groups {case[6]}, router bias {case[7]}", None,
                       functools.partial(routing_agrees, case, on_gpu))
    for case in PLAN_CASES:
        result.attempt(f"fetch_plan kernel / (E, S, T, k, M) = {case}", None,
                       functools.partial(plan_agrees, case, on_gpu))


def routing_agrees(case, on_gpu: bool) -> tuple[bool, str]:
    """(whether the kernel's choice equals XLA's for a ROUTING_CASES case, what differed)."""
    import jax
    import jax.numpy as jnp

    from jmoe.kernels.routing import choose_by_kernel, choose_in_xla

    tokens, experts, top_k, normalize, eps, scale, groups, router_bias = case
    rng = np.random.default_rng(experts)
    sums = jnp.asarray(random_scores(rng, tokens, experts))
    bias = jnp.asarray(rng.normal(scale=0.1, size=experts), jnp.float32)
    args = (sums, jnp.arange(tokens) < max(1, tokens - 1),  # the last of several tokens: padding
            bias if eps else None, bias.astype(jnp.bfloat16) if router_bias else None)
    options = dict(top_k=top_k, groups=groups, normalize=normalize, eps=eps, scale=scale, dtype=jnp.float32)
    if eps:  # chosen by sigmoid scores plus a bias, weighed by the sigmoid scores
        options.update(activation="sigmoid")
    else:
        options.update(activation="softmax", logits_dtype=jnp.bfloat16)
    (ids, weights), (kernel_ids, kernel_weights) = (
        jax.jit(functools.partial(choose_in_xla, **options))(*args),
        jax.jit(functools.partial(choose_by_kernel, on_gpu=on_gpu, **options))(*args))
    error = float(np.abs(np.asarray(kernel_weights) - np.asarray(weights)).max())
    same = np.array_equal(kernel_ids, ids)
    return same and error <= WEIGHT_TOLERANCE, f"ids {'equal' if same else 'differ'}, weights differ by {error:.1e}"


def plan_agrees(case, on_gpu: bool) -> tuple[bool, str]:
    """(whether the kernel's plan equals XLA's, field by field, in 4 random layers of a PLAN_CASES case, which
    fields differed)."""
    import jax
    import jax.numpy as jnp

    from jmoe.offload.fetch_plan import fetch_plan_by_kernel
    from jmoe.offload.slots import LayerSlots, fetch_plan_in_xla

    experts, cache, tokens, top_k, scratch = case
    rng = np.random.default_rng(experts + cache)
    differing = []
    for trial in range(4):
        slot_of_expert, expert_in_slot, order, ids = random_layer(rng, experts, cache, tokens, top_k)
        most_needed = min(tokens * top_k, experts)
        all_admitted = cache >= most_needed and trial % 2 == 0
        if all_admitted:  # the order names every slot
            order = rng.permutation(cache).astype(np.int32)
        options = dict(most_missed=most_needed if all_admitted else min(scratch, most_needed), num_scratch=scratch)
        args = (LayerSlots(None, jnp.asarray(slot_of_expert), jnp.asarray(expert_in_slot)), jnp.asarray(order),
                jnp.asarray(ids))
        want = jax.jit(functools.partial(fetch_plan_in_xla, **options))(*args)
        got = jax.jit(functools.partial(fetch_plan_by_kernel, on_gpu=on_gpu, **options))(*args)
        differing += [f"{field} (trial {trial})" for field, value in want._asdict().items()
                      if not np.array_equal(getattr(got, field), value)]
    return not differing, "every field equal in 4 layers" if not differing else "differ: " + ", ".join(differing)
