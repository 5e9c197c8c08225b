"""A decode step's bookkeeping kernels, interpreted here as a GPU runs them lowered to Triton, against the XLA
computations every other platform runs (bench.gpu_check's checks, bench.gpu.bookkeeping): the choice of experts
(jmoe.kernels.routing) and miss mode "fetch"'s plan (jmoe.offload.fetch_plan)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.gpu.bookkeeping import plan_agrees, routing_agrees
from jmoe.kernels.routing import choose_by_kernel, choose_experts
from jmoe.offload.fetch_plan import fetch_plan_fits

# Routing (tokens, experts, top-k, normalize, eps, scale, groups, router bias): Mixtral's, GPT-OSS's (a router bias)
# and a sigmoid router's options (with and without groups, groups of two experts), an expert count and a top-k that
# are no powers of two (Triton's blocks are), every expert chosen; the last of several tokens padding.
ROUTINGS = [(1, 8, 2, True, 0.0, 1.0, (1, 1), False), (5, 60, 4, False, 0.0, 1.0, (1, 1), True),
            (3, 256, 8, True, 1e-20, 2.5, (8, 4), False), (2, 6, 6, True, 0.0, 1.0, (1, 1), False),
            (3, 12, 3, True, 1e-20, 1.0, (6, 2), False), (2, 64, 6, False, 1e-20, 1.0, (1, 1), False),
            (3, 128, 4, True, 0.0, 1.0, (1, 1), True)]
# The plan (experts, cache slots, tokens, top-k, scratch slots): one-row steps whose misses are all admitted or partly
# go to scratch, batches that repeat experts, more misses than scratch slots, sizes no powers of two.
PLANS = [(8, 2, 1, 2, 2), (8, 4, 3, 2, 2), (60, 6, 2, 4, 3), (16, 3, 4, 3, 1), (32, 8, 1, 4, 4)]
CHECKS = [(routing_agrees, case) for case in ROUTINGS] + [(plan_agrees, case) for case in PLANS]


@pytest.mark.quick
@pytest.mark.parametrize("agrees,case", CHECKS, ids=[f"{check.__name__}{case}" for check, case in CHECKS])
def test_each_kernel_computes_what_xla_does(agrees, case):
    same, detail = agrees(case, on_gpu=False)
    assert same, detail


def kernel_ids(scores, top_k):
    """The routing kernel's choice for every row of scores, all valid."""
    return np.asarray(choose_by_kernel(scores, jnp.ones(scores.shape[0], bool), None, top_k=top_k,
                                       groups=(1, 1), normalize=False, eps=0.0, scale=1.0, dtype=jnp.float32,
                                       on_gpu=False)[0])


def test_ties_and_minus_infinity_choose_the_lower_expert_first():
    scores = jnp.asarray([[0.5, 0.5, 0.5, 0.5, 0.5, 0.5],  # all equal
                          [-jnp.inf, 1.0, -jnp.inf, -jnp.inf, 2.0, -jnp.inf]])  # two finite, top-4
    ids = kernel_ids(scores, 4)
    np.testing.assert_array_equal(ids, [[0, 1, 2, 3], [4, 1, 0, 2]])
    np.testing.assert_array_equal(ids, jax.lax.top_k(scores, 4)[1])


def test_a_nan_score_still_gives_distinct_experts():
    scores = jnp.asarray([[0.1, jnp.nan, 0.3, 0.2]])
    ids = kernel_ids(scores, 3)[0]
    assert len(set(ids)) == 3 and set(ids) <= {0, 1, 2, 3}


def test_on_the_cpu_the_choice_is_xla_s():
    scores = jnp.asarray([[0.1, 0.7, 0.2]])
    assert "pallas_call" not in str(jax.make_jaxpr(
        lambda s: choose_experts(s, jnp.ones(1, bool), top_k=2, normalize=True, dtype=jnp.bfloat16))(scores))


def test_large_steps_keep_xla_s_plan():
    assert fetch_plan_fits(128, 40, 40, 4) and fetch_plan_fits(256, 16, 16, 8)
    assert not fetch_plan_fits(256, 16, 16, 64)  # a batch of 8 tokens of top-8 over 256 experts
    assert not fetch_plan_fits(8, 2, 0, 2)  # a static policy offers no victims
