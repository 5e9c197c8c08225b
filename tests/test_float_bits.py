"""16-bit float experts carried as their uint16 bits on a CPU (jmoe.kernels.float_bits): views at no memory cost,
read by every kernel as the floats they hold, and decode steps whose temporaries hold no float32 copy of them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmoe
from hf_models import VOCAB, write_checkpoint
from jmoe.kernels import BACKENDS, ExpertWeights, FloatBits, float_bits_views, moe_ffn
from jmoe.kernels.xla import VECTOR_BLOCK_ROWS, dot_by_blocks
from jmoe.memory import PINNED_HOST

GPU_ONLY = ("triton",)


def experts(dtype, count=5, d=16, f=24) -> ExpertWeights:
    rng = np.random.default_rng(0)
    return ExpertWeights(*(jnp.asarray(rng.standard_normal(shape), dtype)
                           for shape in ((count, d, 2 * f), (count, f, d), (count, 2 * f), (count, d))))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.quick
def test_views_hold_the_bits_of_the_same_buffers(dtype):
    stacked = experts(dtype)
    views = float_bits_views(stacked)
    assert views is not None
    for view, array in zip(jax.tree.leaves(views, is_leaf=lambda a: isinstance(a, FloatBits)),
                           jax.tree.leaves(stacked)):
        assert isinstance(view, FloatBits) and view.dtype == array.dtype and view.shape == array.shape
        assert view.bits.dtype == jnp.uint16 and view.bits.unsafe_buffer_pointer() == array.unsafe_buffer_pointer()
        np.testing.assert_array_equal(np.asarray(view.astype(jnp.float32)), np.asarray(array, np.float32))
        np.testing.assert_array_equal(np.asarray(view[2:4].astype(array.dtype)), np.asarray(array[2:4]))


def test_no_views_for_float32_experts():
    assert float_bits_views(experts(jnp.float32)) is None


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b not in GPU_ONLY])
@pytest.mark.parametrize("num_tokens", [1, 6])
def test_every_cpu_backend_reads_the_bits_as_the_floats_they_hold(backend, num_tokens):
    stacked = experts(jnp.bfloat16)
    bits = float_bits_views(stacked)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((num_tokens, 16)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(-1, 5, (num_tokens, 2)), jnp.int32)
    weights = jnp.asarray(rng.random((num_tokens, 2)), jnp.float32)

    def run(w: ExpertWeights):
        return np.asarray(moe_ffn(x, ids, weights, w.w_gate_up, w.w_down, b_gate_up=w.b_gate_up, b_down=w.b_down,
                                  backend=backend, out_dtype=jnp.float32))

    np.testing.assert_array_equal(run(bits), run(stacked))


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bits")
    write_checkpoint(directory, "mixtral", seed=5, num_local_experts=8, num_experts_per_tok=2, hidden_size=64,
                     intermediate_size=96, num_attention_heads=2, num_key_value_heads=1)
    return directory


@pytest.mark.cpu_hlo
@pytest.mark.parametrize("cache", [0, 3])
def test_an_offloaded_bf16_decode_step_copies_bits_and_holds_no_float32_copy_of_the_experts(bf16_checkpoint, cache):
    """XLA:CPU slices and updates bfloat16 arrays through float32 and hoists the conversion of a loop's invariant
    arrays: before the bits, this step's temporaries were 1.55 MB, over five times a layer's experts (0.29 MB);
    0.16 MB with them."""
    prompt = list(np.random.default_rng(2).integers(0, VOCAB, 7))
    resident = jmoe.load(bf16_checkpoint, dtype="bfloat16", progress=False)
    model = jmoe.load(bf16_checkpoint, cache=cache, dtype="bfloat16", progress=False)
    assert model.generate(prompt, max_new_tokens=6)[0] == resident.generate(prompt, max_new_tokens=6)[0]
    for block in nnx.merge(model.graphdef, model.params).moe_blocks():
        host = block.experts.weights()
        assert isinstance(host.w_gate_up, FloatBits) and host.w_gate_up.bits.sharding.memory_kind == PINNED_HOST
    state = model.engine.state
    assert all(isinstance(leaf, FloatBits) for leaf in (state.scratch.w_gate_up, *(b.w_down for b in state.buffers)))
    (decode,) = [program for (_, _, _, inputs), program in model._programs.items() if inputs[0][0][1] == 1]
    layer_experts = sum(a.nbytes for a in jax.tree.leaves(model.engine.host_experts[0]))
    assert decode.memory_analysis().temp_size_in_bytes < layer_experts
    assert "f32[8,64,192]" not in decode.as_text()  # a layer's w_gate_up as float32


@pytest.mark.parametrize("rows", [2 * VECTOR_BLOCK_ROWS, 2 * VECTOR_BLOCK_ROWS + 22, VECTOR_BLOCK_ROWS - 5])
@pytest.mark.quick
def test_a_matrix_vector_product_on_bits_goes_by_blocks_of_rows_to_the_same_values(rows):
    """`pairs` multiplies a FloatBits weight VECTOR_BLOCK_ROWS rows of K at a time, a last partial block included
    (jmoe.kernels.xla.dot_by_blocks): the same products as float64 up to float32's sums, every slot its own."""
    rng = np.random.default_rng(4)
    weight = jnp.asarray(rng.standard_normal((3, rows, 40)), jnp.bfloat16)
    xs = jnp.asarray(rng.standard_normal((2, rows)), jnp.bfloat16)
    for slot in range(3):
        y = jax.jit(dot_by_blocks)(xs, FloatBits(jax.lax.bitcast_convert_type(weight, jnp.uint16), jnp.bfloat16),
                                    slot)
        expected = np.asarray(xs, np.float64) @ np.asarray(weight[slot], np.float64)
        np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.quick
def test_pairs_on_bits_matches_pairs_on_the_floats_with_experts_wider_than_a_block():
    """The decode kernel on FloatBits (by blocks) against the same kernel on bfloat16 arrays (one dot): K of 2.3
    blocks in both products."""
    d, f = 2 * VECTOR_BLOCK_ROWS + 22, 2 * VECTOR_BLOCK_ROWS + 9
    stacked = experts(jnp.bfloat16, count=4, d=d, f=f)
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((1, d)), jnp.bfloat16)
    ids, weights = jnp.asarray([[3, 0]], jnp.int32), jnp.asarray([[0.7, 0.3]], jnp.float32)

    def run(w: ExpertWeights):
        return np.asarray(moe_ffn(x, ids, weights, w.w_gate_up, w.w_down, b_gate_up=w.b_gate_up, b_down=w.b_down,
                                  backend="pairs", out_dtype=jnp.float32))

    expected = run(stacked)
    np.testing.assert_allclose(run(float_bits_views(stacked)), expected, rtol=2e-2, atol=2e-2 * np.abs(expected).max())
