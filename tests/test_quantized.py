"""Quantized experts: each format against a NumPy decoder written from its definition, moe_ffn on quantized
weights against the reference on the dequantized ones (every backend), and the whole engine with quantized
experts: results independent of the cache size within a format, the bytes counted, the converter, bad input."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jmoe
from h100_child import run_in_h100_child
from hf_models import VOCAB, write_checkpoint
from jmoe.kernels import FORMATS, QuantizedTensor, moe_ffn, quantize
from jmoe.kernels.quantized import quantized_shapes
from jmoe.plan.programs import PLUGIN_HINT, plugin_available

BACKENDS = ["reference", "gather", "xla", "xla_tiled", "pairs", "auto", "pallas"]
PROMPTS = [list(np.random.RandomState(1).randint(0, VOCAB, 9)), list(np.random.RandomState(2).randint(0, VOCAB, 3))]


# ---- NumPy decoders written from the formats' definitions (independent of jmoe.kernels.quantized) ----

def e4m3_value(byte: int) -> float:
    """float8_e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal; 0x7f/0xff NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 7
    if exponent == 0xF and mantissa == 7:
        return float("nan")
    if exponent == 0:
        return sign * mantissa / 8 * 2.0 ** -6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def e2m1_value(code: int) -> float:
    """e2m1: sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is subnormal (0 or 0.5)."""
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    if exponent == 0:
        return sign * mantissa * 0.5
    return sign * (1 + mantissa / 2) * 2.0 ** (exponent - 1)


def unpack_halves(packed: np.ndarray) -> np.ndarray:
    """Two 4-bit codes per byte: row r in the low nibble, row r + K/2 in the high one."""
    return np.concatenate([packed & 15, packed >> 4], axis=-2).astype(np.int64)


def numpy_dequantize(q: QuantizedTensor) -> np.ndarray:
    values, scales = np.asarray(q.values), np.asarray(q.scales)
    k, n = q.shape[-2:]
    if q.fmt == "int8":
        return values.astype(np.float64) * scales
    if q.fmt == "int4":
        codes = unpack_halves(values) - 8
        return codes * np.repeat(scales, q.group, axis=-2)
    if q.fmt == "fp8":
        decoded = np.vectorize(e4m3_value)(values.astype(np.int64))
        scale = np.repeat(np.repeat(scales, 128, axis=-2), 128, axis=-1)[..., :k, :n]
        return decoded * scale
    decoded = np.vectorize(e2m1_value)(unpack_halves(values))
    return decoded * np.repeat(2.0 ** (scales.astype(np.float64) - 127), q.group, axis=-2)


def weights(seed, shape, outliers=True):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=shape).astype(np.float32) * 0.05
    if outliers:
        w.reshape(-1)[rng.integers(0, w.size, 5)] *= 40  # a few large values, as real weights have
    w.reshape(-1)[:3] = 0  # exact zeros
    return w


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.quick
def test_dequantize_matches_the_format_definition_and_rounds_to_nearest(fmt):
    w = weights(0, (3, 256, 160))
    q = quantize(w, fmt)
    assert q.shape == w.shape
    ref = numpy_dequantize(q)
    # jmoe's dequantization equals the definition exactly (float32 products of exact values).
    np.testing.assert_array_equal(np.asarray(q.dequantize(jnp.float32)), ref.astype(np.float32))
    # Round to nearest: no representable value is closer to w than the one chosen (within float32 rounding).
    if fmt in ("int8", "int4"):
        top = 127 if fmt == "int8" else 7
        step = np.asarray(q.scales) if fmt == "int8" else np.repeat(np.asarray(q.scales), q.group, axis=-2)
        assert np.all(np.abs(w - ref) <= step / 2 * (1 + 1e-5))
        codes = np.asarray(q.values) if fmt == "int8" else unpack_halves(np.asarray(q.values)) - 8
        assert np.abs(codes).max() == top  # the group maximum maps to the largest code
    else:
        table = (np.array([e4m3_value(b) for b in range(256)]) if fmt == "fp8"
                 else np.array([e2m1_value(c) for c in range(16)]))
        table = table[np.isfinite(table)]
        if fmt == "fp8":
            scale = np.repeat(np.repeat(np.asarray(q.scales), 128, -2), 128, -1)[..., :256, :160]
        else:
            scale = np.repeat(2.0 ** (np.asarray(q.scales).astype(np.float64) - 127), 32, axis=-2)
        scaled = w / scale
        nearest = np.abs(scaled[..., None] - table).min(axis=-1)
        assert np.all(np.abs(scaled - ref / scale) <= nearest + 1e-6)


@pytest.mark.quick
def test_scales_follow_the_documented_formulas():
    w = weights(1, (2, 64, 256))
    np.testing.assert_array_equal(quantize(w, "int8").scales, np.abs(w).max(axis=-2, keepdims=True) / 127)
    int4 = quantize(w, "int4", 16)
    np.testing.assert_array_equal(int4.scales, np.abs(w.reshape(2, 4, 16, 256)).max(axis=-2) / 7)
    mx = quantize(w, "mxfp4")
    amax = np.abs(w.reshape(2, 2, 32, 256)).max(axis=-2)
    expected = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2 + 127, 0)
    np.testing.assert_array_equal(mx.scales, expected.astype(np.uint8))
    fp8 = quantize(w, "fp8")
    assert fp8.scales.shape == (2, 1, 2)
    np.testing.assert_array_equal(fp8.scales[:, 0, 1], np.abs(w[:, :, 128:]).max(axis=(-2, -1)) / 448)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.quick
def test_quantization_is_deterministic_and_sized_as_documented(fmt):
    w = weights(2, (4, 128, 96))
    a, b = quantize(w, fmt), quantize(w.copy(), fmt)
    assert a.values.tobytes() == b.values.tobytes() and a.scales.tobytes() == b.scales.tobytes()
    values_shape, values_dtype, scales_shape, scales_dtype = quantized_shapes(fmt, a.group, w.shape)
    assert (a.values.shape, a.values.dtype, a.scales.shape, a.scales.dtype) == (values_shape, values_dtype,
                                                                                scales_shape, scales_dtype)


@pytest.mark.parametrize("fmt,shape,group,match", [
    ("int4", (2, 48, 8), None, "group size 64 must divide the input dimension 48"),
    ("int4", (2, 64, 8), 3, "even whole number"),
    ("mxfp4", (2, 48, 8), None, "group size 32 must divide the input dimension 48"),
    ("int4", (2, 7, 8), 2, "must be even"),
    ("int8", (2, 64, 8), 64, "applies to int4 only"),
    ("int3", (2, 64, 8), None, "unknown expert format 'int3'"),
])
@pytest.mark.quick
def test_bad_formats_and_group_sizes_are_clear_errors(fmt, shape, group, match):
    with pytest.raises(ValueError, match=match):
        quantize(np.zeros(shape, np.float32), fmt, group)


def test_non_finite_weights_are_refused():
    w = np.zeros((1, 64, 8), np.float32)
    w[0, 3, 2] = np.nan
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize(w, "int8")


# ---- the kernels ----

_JITTED = {b: jax.jit(functools.partial(moe_ffn, backend=b)) for b in BACKENDS}


def kernel_inputs(seed, num_tokens, top_k, num_slots, d, f, dtype, pad_fraction):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(num_tokens, d)), dtype)
    ids = rng.integers(0, num_slots, size=(num_tokens, top_k))
    ids[rng.random(ids.shape) < pad_fraction] = -1
    router = jnp.asarray(rng.random((num_tokens, top_k)), jnp.float32)
    w_gate_up = weights(seed + 1, (num_slots, d, 2 * f))
    w_down = weights(seed + 2, (num_slots, f, d))
    return x, jnp.asarray(ids, jnp.int32), router, w_gate_up, w_down


@settings(max_examples=5, deadline=None, derandomize=True)
@given(fmt=st.sampled_from(FORMATS), num_tokens=st.sampled_from([1, 3, 8, 33]), top_k=st.integers(1, 3),
       num_slots=st.integers(1, 6), d=st.sampled_from([64, 128]), f=st.sampled_from([32, 64, 96]),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16]), pad=st.sampled_from([0.0, 0.3]), seed=st.integers(0, 99),
       int4_group=st.sampled_from([16, 32]))
def test_every_backend_on_quantized_weights_matches_the_reference_on_dequantized(fmt, num_tokens, top_k, num_slots,
                                                                                   d, f, dtype, pad, seed, int4_group):
    x, ids, router, w_gate_up, w_down = kernel_inputs(seed, num_tokens, top_k, num_slots, d, f, dtype, pad)
    group = int4_group if fmt == "int4" else None
    q_gate_up, q_down = quantize(w_gate_up, fmt, group), quantize(w_down, fmt, group)
    expected = np.asarray(moe_ffn(x, ids, router, q_gate_up.dequantize(dtype), q_down.dequantize(dtype),
                                  backend="reference"), np.float32)
    scale = max(1.0, float(np.abs(expected).max()))
    tolerance = 2e-5 if dtype == jnp.float32 else 3e-2
    for backend in BACKENDS:
        got = np.asarray(_JITTED[backend](x, ids, router, q_gate_up, q_down), np.float32)
        np.testing.assert_allclose(got, expected, rtol=0, atol=tolerance * scale, err_msg=f"{backend} {fmt}")


@pytest.mark.parametrize("fmt", [None, *FORMATS])
def test_a_one_row_step_computes_the_same_as_matrix_vector_programs_and_as_row_tiles(fmt):
    """A step of one row runs the Pallas kernels as matrix-vector programs, a program per (choice, output block)
    with no tile layout (#54 item 5); through the row tiles, and in the reference on the dequantized weights, the
    same row gives the same output: a choice of no slot (-1) among them, expert biases, each format's blocks."""
    from jmoe.kernels.pallas_grouped import moe_ffn_pallas

    x, _, router, w_gate_up, w_down = kernel_inputs(5, 1, 3, 4, 64, 64, jnp.float32, 0.0)
    ids = jnp.asarray([[2, -1, 0]], jnp.int32)
    rng = np.random.default_rng(6)
    biases = (jnp.asarray(rng.normal(size=(4, 128)), jnp.float32), jnp.asarray(rng.normal(size=(4, 64)), jnp.float32))
    experts = (w_gate_up, w_down) if fmt is None else (quantize(w_gate_up, fmt), quantize(w_down, fmt))
    plain = experts if fmt is None else tuple(w.dequantize(jnp.float32) for w in experts)
    expected = np.asarray(moe_ffn(x, ids, router, *plain, b_gate_up=biases[0], b_down=biases[1], backend="reference"))
    tolerance = 2e-5 * max(1.0, float(np.abs(expected).max()))
    for gemv in (True, False):
        got = moe_ffn_pallas(x, ids, router, *experts, *biases, one_row_gemv=gemv)
        np.testing.assert_allclose(np.asarray(got), expected, rtol=0, atol=tolerance, err_msg=f"{fmt} gemv={gemv}")


def test_a_float_weight_in_the_other_dtype_is_cast_per_slot():
    x, ids, router, w_gate_up, w_down = kernel_inputs(3, 5, 2, 4, 64, 32, jnp.float32, 0.2)
    gate_up16, down16 = jnp.asarray(w_gate_up, jnp.bfloat16), jnp.asarray(w_down, jnp.bfloat16)
    expected = moe_ffn(x, ids, router, gate_up16.astype(jnp.float32), down16.astype(jnp.float32), backend="reference")
    for backend in BACKENDS:
        np.testing.assert_allclose(_JITTED[backend](x, ids, router, gate_up16, down16), expected, rtol=0, atol=1e-5)


@pytest.mark.quick
def test_mixed_or_mismatched_weights_and_triton_are_clear_errors():
    x, ids, router, w_gate_up, w_down = kernel_inputs(4, 2, 2, 3, 64, 64, jnp.float32, 0)
    with pytest.raises(ValueError, match="both plain or both QuantizedTensors of one format"):
        moe_ffn(x, ids, router, quantize(w_gate_up, "int8"), w_down)
    with pytest.raises(ValueError, match="both plain or both QuantizedTensors of one format"):
        moe_ffn(x, ids, router, quantize(w_gate_up, "int8"), quantize(w_down, "int4"))
    with pytest.raises(ValueError, match="backend='triton' takes plain float weights"):
        moe_ffn(x, ids, router, quantize(w_gate_up, "int8"), quantize(w_down, "int8"), backend="triton")


GPU_KERNEL_COMPILE = """
from jmoe.kernels import ExpertWeights, moe_ffn, quantize
from jmoe.kernels.expert_copy import copy_experts
from jmoe.plan.hlo import control_flow
out = {}
for fmt in sys.argv[1:]:
    q_gate_up, q_down = quantize(np.ones((8, 128, 128), np.float32), fmt), quantize(np.ones((8, 64, 128), np.float32), fmt)
    q_gate_up, q_down = (jax.tree.map(shaped, q) for q in (q_gate_up, q_down))
    args = (shaped(jnp.zeros((4, 128), jnp.bfloat16)), shaped(jnp.zeros((4, 2), jnp.int32)),
            shaped(jnp.zeros((4, 2), jnp.float32)), q_gate_up, q_down)
    experts = ExpertWeights(q_gate_up, q_down)
    slots = jax.tree.map(lambda a: jax.ShapeDtypeStruct((2, *a.shape[1:]), a.dtype, sharding=on_gpu), experts)
    entries = shaped(jnp.zeros((2,), jnp.int32))
    hlo = compiled(functools.partial(moe_ffn, backend="pallas"), *args)
    copy_hlo = compiled(functools.partial(copy_experts, on_gpu=True), slots, experts, entries, entries)
    out[fmt] = control_flow(hlo).as_dict(), control_flow(copy_hlo).as_dict()
print(json.dumps(out))
"""


@pytest.mark.skipif(not plugin_available(), reason=PLUGIN_HINT)
def test_quantized_pallas_kernels_compile_to_triton_for_an_h100():
    """The dequantizing Pallas kernels and the expert copies lower to Triton for a GPU (compiled here, for an H100,
    in a child process whose JAX starts on the CPU platform; running them needs a GPU)."""
    flows = run_in_h100_child(GPU_KERNEL_COMPILE, *FORMATS)
    for fmt in FORMATS:
        ffn, copy = flows[fmt]
        assert ffn["triton_kernels"] == 2 and ffn["conditionals"] == 0, (fmt, ffn)
        # Quantized experts are copied into slots by one kernel too, values and scales alike
        # (tests/test_expert_copy.py).
        assert copy["triton_kernels"] == 1 and copy["data_dependent_loops"] == 0, (fmt, copy)


# ---- the engine ----

@pytest.fixture(scope="module")
def quant_dir(tmp_path_factory):
    """8 experts, top-2, hidden size and expert width 64 (every format's groups divide them)."""
    directory = tmp_path_factory.mktemp("quant") / "qwen3"
    write_checkpoint(directory, "qwen3_moe", seed=11, hidden_size=64, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                     head_dim=32, norm_topk_prob=True)
    return directory


# Cache sizes 0, 2 (host miss mode) and E - 1 for int4, 0 and 2 for mxfp4; one offloaded cache for the others, which
# share every code path with them but the decoding of a block.
CACHES = {"int4": ((0, "fetch"), (2, "host"), (7, "fetch")), "mxfp4": ((0, "fetch"), (2, "host")),
          "int8": ((3, "fetch"),), "fp8": ((3, "host"),)}


@pytest.fixture(scope="module")
def float_logits(quant_dir):
    """The unquantized model's logits of PROMPTS[0], loaded and compiled once for every format."""
    return np.asarray(jmoe.load(quant_dir, progress=False).logits([PROMPTS[0]]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_results_do_not_depend_on_the_cache_within_a_format(quant_dir, float_logits, fmt):
    resident = jmoe.load(quant_dir, expert_dtype=fmt, progress=False)
    ref_tokens = resident.generate(PROMPTS, max_new_tokens=6)
    ref_logits = np.asarray(resident.logits([PROMPTS[0]]))
    assert not np.array_equal(ref_logits, float_logits)  # the experts really are quantized
    for cache, miss_mode in CACHES[fmt]:
        model = jmoe.load(quant_dir, cache=cache, expert_dtype=fmt, miss_mode=miss_mode, progress=False)
        assert isinstance(model.module().moe_blocks()[0].experts.weights().w_gate_up, QuantizedTensor)
        assert model.generate(PROMPTS, max_new_tokens=6) == ref_tokens, (cache, miss_mode)
        np.testing.assert_allclose(np.asarray(model.logits([PROMPTS[0]])), ref_logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_experts_live_in_pinned_host_and_bytes_moved_are_the_packed_sizes(quant_dir, fmt):
    model = jmoe.load(quant_dir, cache=2, expert_dtype=fmt, progress=False)
    experts = model.module().moe_blocks()[0].experts
    assert experts.w_gate_up[...].sharding.memory_kind == "pinned_host"
    assert experts.w_gate_up_scale[...].sharding.memory_kind == "pinned_host"
    cfg = model.config
    per_expert = 0
    for shape in ((cfg.hidden_size, 2 * cfg.expert_intermediate_size), (cfg.expert_intermediate_size, cfg.hidden_size)):
        values_shape, values_dtype, scales_shape, scales_dtype = quantized_shapes(fmt, cfg.expert_group, shape)
        per_expert += np.prod(values_shape) * values_dtype.itemsize + np.prod(scales_shape) * scales_dtype.itemsize
    assert model.placement_plan.expert_bytes == per_expert
    model.generate(PROMPTS, max_new_tokens=6)
    for layer in model.stats():
        assert layer["bytes_moved"] > 0 and layer["bytes_moved"] % per_expert == 0
    float_bytes = 4 * 3 * cfg.hidden_size * cfg.expert_intermediate_size
    assert per_expert <= {"int8": 0.30, "int4": 0.17}[fmt] * float_bytes


@pytest.mark.quick
def test_a_device_budget_fits_more_quantized_experts(quant_dir):
    full = jmoe.plan(quant_dir, device_budget_gb=0.0034, compile=False).placement
    packed = jmoe.plan(quant_dir, device_budget_gb=0.0034, expert_dtype="int4", compile=False).placement
    assert full.caches == (2, 2)  # 2 of 8 experts per layer fit next to the dense weights and KV cache
    assert packed.offloaded_layers == ()  # all 8 fit at about a seventh of the bytes


def test_bfloat16_experts_in_a_float32_model(quant_dir):
    model = jmoe.load(quant_dir, cache=3, expert_dtype="bfloat16", progress=False)
    assert model.module().moe_blocks()[0].experts.w_down[...].dtype == jnp.bfloat16
    assert model.module().embed[...].dtype == jnp.float32
    resident = jmoe.load(quant_dir, expert_dtype="bfloat16", progress=False)
    assert model.generate(PROMPTS, max_new_tokens=6) == resident.generate(PROMPTS, max_new_tokens=6)


def test_converter_stores_quantized_experts_and_they_load_as_stored(quant_dir, tmp_path):
    from jmoe.checkpoint.convert import convert_checkpoint

    full = convert_checkpoint(quant_dir, tmp_path / "f32", progress=False)
    packed = convert_checkpoint(quant_dir, tmp_path / "int4", expert_dtype="int4", expert_group_size=32,
                                progress=False)
    manifest = json.loads((packed / "jmoe_manifest.json").read_text())
    assert manifest["expert_dtype"] == "int4" and manifest["expert_group"] == 32
    assert manifest["params"]["layers.0.mlp.experts.w_down"]["dtype"] == "uint8"

    def disk(path):
        return sum(p.stat().st_size for p in (path / "params").rglob("*") if p.is_file())

    assert disk(packed) < 0.5 * disk(full)
    restored = jmoe.load(packed, cache=2, progress=False)
    loaded = jmoe.load(quant_dir, cache=2, expert_dtype="int4", expert_group_size=32, progress=False)
    np.testing.assert_array_equal(np.asarray(restored.logits([PROMPTS[0]])), np.asarray(loaded.logits([PROMPTS[0]])))
    with pytest.raises(jmoe.InputError, match="stores its experts as int4 .* expert_dtype='int8'"):
        jmoe.load(packed, expert_dtype="int8", progress=False)


def test_bad_expert_dtype_arguments_are_clear_errors(quant_dir, small_mixtral_dir, capsys):
    with pytest.raises(jmoe.InputError, match="expert_dtype must be None or one of .*int4.*found 'int2'"):
        jmoe.load(quant_dir, expert_dtype="int2", progress=False)
    with pytest.raises(jmoe.InputError, match="group size 48 must divide the input dimension 64"):
        jmoe.load(quant_dir, expert_dtype="int4", expert_group_size=48, progress=False)
    with pytest.raises(jmoe.InputError, match="applies to expert_dtype='int4' only"):
        jmoe.load(quant_dir, expert_dtype="int8", expert_group_size=32, progress=False)
    # The small Mixtral's hidden size is 32: int4's default group of 64 cannot divide it.
    with pytest.raises(jmoe.InputError, match=r"w_gate_up \(hidden_size\).*group size 64 must divide .* 32"):
        jmoe.plan(small_mixtral_dir, expert_dtype="int4", compile=False)
    from jmoe.cli.generate import main

    assert main(["--model", str(quant_dir), "--prompt", "w1", "--expert-dtype", "int4",
                 "--expert-group-size", "48"]) == 2
    assert "group size 48 must divide" in capsys.readouterr().err


@pytest.mark.quick
def test_plan_counts_quantized_bytes_as_load_allocates(quant_dir):
    plan = jmoe.plan(quant_dir, cache=2, expert_dtype="mxfp4", compile=False)
    model = jmoe.load(quant_dir, cache=2, expert_dtype="mxfp4", progress=False)
    assert plan.placement.expert_bytes == model.placement_plan.expert_bytes
    assert plan.placement.totals() == model.placement_plan.totals()


def test_random_model_refuses_a_quantized_config(quant_dir):
    from jmoe.config import load_config, with_expert_dtype

    with pytest.raises(jmoe.InputError, match="random_model makes float experts"):
        jmoe.random_model(with_expert_dtype(load_config(quant_dir), "int8"))
