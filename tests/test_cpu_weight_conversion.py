"""jmoe.model.layers.weight_for: on CPU, XLA converts 16-bit float weights to float32 for every product; weight_for
ties each weight to its product's input so that the conversions are not all hoisted to the program's start and
held together (1.1 GB of temporaries in a 24-layer bfloat16 step), and changes no value."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmoe.model.layers import weight_for

pytestmark = pytest.mark.quick  # the quick tier: all of this module


D, LAYERS = 512, 8


def chain(weights, x, ordered: bool):
    for w in weights:
        x = jnp.tanh(x @ (weight_for(w, x) if ordered else w))
    return x


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_weight_for_changes_no_bit(dtype):
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((D, D)), dtype)
    w = w.at[0, :4].set(jnp.asarray([0.0, -0.0, jnp.inf, -jnp.inf], dtype))  # signed zeros and infinities too
    x = jnp.asarray(rng.standard_normal((3, D)), dtype)
    got = jax.jit(weight_for)(w, x)
    assert got.dtype == w.dtype
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(w).view(np.uint16))
    assert jnp.array_equal(jax.jit(lambda w, x: x @ weight_for(w, x))(w, x), x @ w)


def test_float32_weights_pass_through_untouched():
    w = jnp.ones((4, 4), jnp.float32)
    assert weight_for(w, jnp.ones((1, 4), jnp.float32)) is w


@pytest.mark.cpu_hlo
def test_a_chain_of_bfloat16_products_holds_one_converted_weight_at_a_time():
    rng = np.random.default_rng(1)
    weights = [jnp.asarray(rng.standard_normal((D, D)) / D ** 0.5, jnp.bfloat16) for _ in range(LAYERS)]
    x = jnp.asarray(rng.standard_normal((1, D)), jnp.bfloat16)
    converted = D * D * 4  # one weight in float32

    def temp_bytes(ordered):
        compiled = jax.jit(chain, static_argnums=2).lower(weights, x, ordered).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    unordered, ordered = temp_bytes(False), temp_bytes(True)
    assert unordered >= (LAYERS - 1) * converted  # what the order prevents: XLA:CPU holds them all at once
    assert ordered <= 2 * converted + 1024
    np.testing.assert_array_equal(np.asarray(chain(weights, x, True)), np.asarray(chain(weights, x, False)))
