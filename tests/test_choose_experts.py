"""The choice of experts as one kernel (jmoe.kernels.routing, interpreted here as a GPU runs it lowered to Triton)
against the XLA computation every other platform runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmoe.kernels.routing import _choose_by_kernel, _choose_in_xla, choose_experts

# (tokens, experts, top-k, normalize, eps, scale): Mixtral's and a sigmoid router's options, an expert count and a
# top-k that are no powers of two (Triton's blocks are), every expert chosen.
CASES = [(1, 8, 2, True, 0.0, 1.0), (5, 60, 4, False, 0.0, 1.0), (3, 256, 8, True, 1e-20, 2.5),
         (2, 6, 6, True, 0.0, 1.0)]


def both(scores, valid, weigh=None, **options):
    args = (scores, scores if weigh is None else weigh, valid)
    return _choose_in_xla(*args, **options), _choose_by_kernel(*args, on_gpu=False, **options)


def kernel_ids(scores, top_k):
    """The kernel's choice for every row of scores, all valid."""
    return np.asarray(_choose_by_kernel(scores, scores, jnp.ones(scores.shape[0], bool), top_k=top_k, normalize=False,
                                        eps=0.0, scale=1.0, dtype=jnp.float32, on_gpu=False)[0])


@pytest.mark.quick
@pytest.mark.parametrize("tokens,experts,top_k,normalize,eps,scale", CASES)
def test_the_kernel_chooses_and_weighs_as_xla_does(tokens, experts, top_k, normalize, eps, scale):
    rng = np.random.default_rng(experts)
    scores = rng.standard_normal((tokens, experts)).astype(np.float32)
    scores[0, :3] = scores[0, 3]  # a tie among the best of row 0 (perhaps): the lower expert first
    weigh = jax.nn.sigmoid(jnp.asarray(scores)) if eps else None  # a sigmoid router weighs by other scores
    valid = jnp.arange(tokens) != 1  # row 1 routes nowhere (padding)
    options = dict(top_k=top_k, normalize=normalize, eps=eps, scale=scale, dtype=jnp.float32)
    (ids, weights), (kernel_ids, kernel_weights) = both(jnp.asarray(scores), valid, weigh, **options)
    np.testing.assert_array_equal(kernel_ids, ids)
    np.testing.assert_allclose(kernel_weights, weights, rtol=1e-6)
    assert (np.asarray(ids)[1] == -1).all() if tokens > 1 else True


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
