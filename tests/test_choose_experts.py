"""The choice of experts as one kernel (jmoe.kernels.routing, interpreted here as a GPU runs it lowered to Triton)
against the XLA computation every other platform runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.gpu.bookkeeping import routing_agrees
from jmoe.kernels.routing import choose_by_kernel, choose_experts

# (tokens, experts, top-k, normalize, eps, scale): Mixtral's and a sigmoid router's options, an expert count and a
# top-k that are no powers of two (Triton's blocks are), every expert chosen; the last of several tokens padding.
CASES = [(1, 8, 2, True, 0.0, 1.0), (5, 60, 4, False, 0.0, 1.0), (3, 256, 8, True, 1e-20, 2.5),
         (2, 6, 6, True, 0.0, 1.0)]


def kernel_ids(scores, top_k):
    """The kernel's choice for every row of scores, all valid."""
    return np.asarray(choose_by_kernel(scores, scores, jnp.ones(scores.shape[0], bool), top_k=top_k, normalize=False,
                                       eps=0.0, scale=1.0, dtype=jnp.float32, on_gpu=False)[0])


@pytest.mark.quick
@pytest.mark.parametrize("case", CASES)
def test_the_kernel_chooses_and_weighs_as_xla_does(case):
    agrees, detail = routing_agrees(case, on_gpu=False)  # bench.gpu_check's check, here with the kernel interpreted
    assert agrees, detail


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
