"""jmoe.kernels.expert_copy: whole experts copied into slots by one kernel, interpreted here, against the loop a CPU
runs (jmoe.offload.slots.copy_by_loop) and a NumPy reference; its H100 compile is in tests/test_quantized.py (every
format) and tests/test_gpu_step.py (the steps' copy sites)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmoe.kernels import FORMATS, ExpertWeights, QuantizedTensor, quantize
from jmoe.kernels.expert_copy import CHUNK, as_words, copy_experts
from jmoe.kernels.pallas_grouped import gpu_shapes_supported, triton_addressable
from jmoe.offload.slots import copy_by_loop

# (expert, destination) entries: the wanted ones first, then a destination of -1 (moves nothing).
EXPERTS = [5, 7, 3, 0, 1]
DESTINATIONS = [2, 0, 3, -1, -1]


def expected(buffers, sources):
    """NumPy: the buffers with slot d holding expert e for every entry whose e and d are both >= 0."""
    out = [np.array(leaf) for leaf in jax.tree.leaves(buffers)]
    for e, d in zip(EXPERTS, DESTINATIONS):
        if e >= 0 and d >= 0:
            for leaf, source in zip(out, jax.tree.leaves(sources)):
                leaf[d] = np.asarray(source)[e]
    return out


def bits(leaf) -> np.ndarray:
    """The leaf's bytes, so that equal NaNs compare equal in every dtype (bfloat16's too)."""
    return np.ascontiguousarray(leaf).view(np.uint8)


def copied_both_ways(buffers, sources):
    experts, destinations = jnp.asarray(EXPERTS, jnp.int32), jnp.asarray(DESTINATIONS, jnp.int32)
    by_kernel = jax.jit(lambda b, s: copy_experts(b, s, experts, destinations, on_gpu=False))(buffers, sources)
    by_loop = jax.jit(lambda b, s: copy_by_loop(b, s, experts, destinations))(buffers, sources)
    return [np.asarray(leaf) for leaf in jax.tree.leaves(by_kernel)], [np.asarray(leaf) for leaf in
                                                                        jax.tree.leaves(by_loop)]


@pytest.mark.quick
def test_the_kernel_copies_the_wanted_entries_and_nothing_else():
    """bfloat16 and float32 leaves, one of them longer than a chunk and not a multiple of it (its last program is
    masked); slots not written keep their bytes (NaN here, so a write of anything else would show)."""
    rng = np.random.default_rng(0)
    sources = ExpertWeights(jnp.asarray(rng.standard_normal((8, 3, CHUNK + 5)), jnp.bfloat16),
                            jnp.asarray(rng.standard_normal((8, 20, 24)), jnp.float32))
    buffers = jax.tree.map(lambda a: jnp.full((4, *a.shape[1:]), jnp.nan, a.dtype), sources)
    by_kernel, by_loop = copied_both_ways(buffers, sources)
    for kernel_leaf, loop_leaf, want in zip(by_kernel, by_loop, expected(buffers, sources)):
        np.testing.assert_array_equal(bits(kernel_leaf), bits(want))  # NaN where nothing was written, in both
        np.testing.assert_array_equal(bits(loop_leaf), bits(want))
    assert np.isnan(by_kernel[0][1]).all()  # no entry wanted slot 1


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_experts_are_copied_values_and_scales_alike(fmt):
    rng = np.random.default_rng(1)
    sources = ExpertWeights(quantize(rng.standard_normal((8, 128, 256)).astype(np.float32), fmt),
                            quantize(rng.standard_normal((8, 128, 128)).astype(np.float32), fmt))
    buffers = jax.tree.map(lambda a: jnp.zeros((4, *a.shape[1:]), a.dtype), sources)
    by_kernel, by_loop = copied_both_ways(buffers, sources)
    for kernel_leaf, loop_leaf, want in zip(by_kernel, by_loop, expected(buffers, sources)):
        np.testing.assert_array_equal(bits(kernel_leaf), bits(want))
        np.testing.assert_array_equal(bits(loop_leaf), bits(want))


def test_byte_leaves_move_as_32_bit_words_where_their_rows_allow():
    """Pallas' Triton lowering offsets an array of at most 4 GiB with signed 32-bit integers: a 2-4 GiB array of bytes
    (a layer's fp8 or int4 codes) would overflow, as words it cannot. A row whose bytes are no multiple of 4 stays
    bytes; both copy the wanted experts exactly."""
    words = as_words(jnp.zeros((3, 8, 6), jnp.uint8))
    assert words.shape == (3, 12) and words.dtype == jnp.uint32
    assert as_words(jnp.zeros((3, 3, 5), jnp.uint8)).dtype == jnp.uint8
    rng = np.random.default_rng(2)
    sources = ExpertWeights(jnp.asarray(rng.integers(0, 256, (8, 8, 6)), jnp.uint8),
                            jnp.asarray(rng.integers(0, 256, (8, 3, 5)), jnp.uint8))
    buffers = jax.tree.map(lambda a: jnp.zeros((4, *a.shape[1:]), a.dtype), sources)
    by_kernel, by_loop = copied_both_ways(buffers, sources)
    for kernel_leaf, loop_leaf, want in zip(by_kernel, by_loop, expected(buffers, sources)):
        np.testing.assert_array_equal(kernel_leaf, want)
        np.testing.assert_array_equal(loop_leaf, want)


def test_arrays_triton_cannot_address_are_known_before_a_gpu_reads_them():
    """More than 2^31 one-byte elements in at most 4 GiB (a DeepSeek-V3 layer's fp8 w_down, 3.76 GB) wrap Pallas'
    32-bit offsets: the grouped GEMM falls back to XLA's kernel for them (miss mode "direct" refuses), and the
    copy kernel takes them as 32-bit words, which it can address. Checked on shapes alone, nothing allocated."""
    codes = jax.ShapeDtypeStruct((256, 2048, 7168), jnp.uint8)
    assert not triton_addressable(codes)
    assert triton_addressable(jax.ShapeDtypeStruct((256, 2048, 7168), jnp.bfloat16))  # > 4 GiB: 64-bit offsets
    assert triton_addressable(jax.ShapeDtypeStruct((8, 128, 128), jnp.uint8))
    assert triton_addressable(jax.eval_shape(as_words, codes))
    scales = jax.ShapeDtypeStruct((256, 16, 56), jnp.float32)
    fp8 = QuantizedTensor(codes, scales, "fp8", 128)
    small = QuantizedTensor(jax.ShapeDtypeStruct((8, 128, 256), jnp.uint8), jax.ShapeDtypeStruct((8, 1, 2), jnp.float32),
                            "fp8", 128)
    assert not gpu_shapes_supported(small, fp8) and gpu_shapes_supported(small, small)
