"""Expert FFNs computed on the host (miss mode "host") against the reference kernel."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmoe.kernels import ExpertWeights, moe_ffn_reference
from jmoe.memory import PINNED_HOST, sharding_for
from jmoe.offload.host_compute import experts_on_host

pytestmark = pytest.mark.quick  # the quick tier: all of this module


HOST = sharding_for(PINNED_HOST)
swiglu_on_host = jax.jit(functools.partial(experts_on_host, activation="swiglu"))


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_listed_experts_on_host_match_the_reference(dtype, atol):
    e, d, f, t, k = 6, 16, 8, 5, 2
    keys = jax.random.split(jax.random.key(0), 4)
    gate_up = jax.random.normal(keys[0], (e, d, 2 * f), jnp.float32).astype(dtype)
    down = jax.random.normal(keys[1], (e, f, d), jnp.float32).astype(dtype)
    x = jax.random.normal(keys[2], (t, d), jnp.float32).astype(dtype)
    weights = jax.random.uniform(keys[3], (t, k)).astype(dtype)
    ids = jnp.array([[0, 5], [2, -1], [3, 3], [5, 1], [-1, -1]], jnp.int32)
    listed = jnp.array([5, 3, 0, 4], jnp.int32)  # expert 4 is listed but unused; 2 and 1 are used but unlisted
    count = jnp.int32(3)  # only the first three entries count

    y = swiglu_on_host(x, ids, weights, listed, count, jax.device_put(ExpertWeights(gate_up, down), HOST))

    only_listed = jnp.where(jnp.isin(ids, listed[:3]), ids, -1)
    expected = moe_ffn_reference(x, only_listed, weights, gate_up, down).astype(jnp.float32)
    assert y.dtype == jnp.float32 and y.sharding.memory_kind == "device"
    np.testing.assert_allclose(np.asarray(y), np.asarray(expected), atol=atol, rtol=atol)
    assert np.abs(np.asarray(y)[4]).max() == 0.0  # a row that chose nothing gets nothing


def test_the_expert_compute_is_marked_for_the_host():
    e, d, f = 4, 8, 4
    args = (jnp.ones((1, d)), jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2)), jnp.arange(2, dtype=jnp.int32),
            jnp.int32(2), jax.device_put(ExpertWeights(jnp.ones((e, d, 2 * f)), jnp.ones((e, f, d))), HOST))
    text = swiglu_on_host.lower(*args).as_text()
    assert '_xla_compute_type = "host"' in text


def test_each_call_of_the_transform_spelling_gets_its_own_host_computation():
    # jax 0.11's compute_on is jax 0.10's compute_on2. One traced host function with several callers (one per
    # layer) aborted XLA:GPU's compile on jax 0.11.2; each call must lower to a computation of its own.
    from jax.experimental import compute_on as compute_on_module

    from jmoe.memory import to_device, to_host, transformed_at_each_call

    transform = getattr(compute_on_module, "compute_on2", compute_on_module.compute_on)
    doubled_on_host = transformed_at_each_call(lambda h: h * 2.0, transform)

    def three_layers(x):
        for _ in range(3):
            x = to_device(doubled_on_host(to_host(x)) + 1.0)
        return x

    step = jax.jit(three_layers)
    text = step.lower(jnp.ones(4)).as_text()
    host_functions = {line.split("@")[1].split("(")[0] for line in text.splitlines()
                      if "func.func private @compute_on" in line}
    assert len(host_functions) == 3 and text.count("call @compute_on") == 3
    np.testing.assert_array_equal(np.asarray(step(jnp.ones(4))), np.full(4, 15.0))
