"""jmoe.kernels.moe_ffn: every backend runnable here against the reference, the layout the
grouped kernels share, backend selection, and input validation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jmoe.kernels import ExpertWeights, grouping, moe_ffn
from jmoe.kernels.dispatch import cpu_backend, moe_ffn_auto
from jmoe.kernels.pallas_grouped import choose_blocks
from jmoe.kernels.target import compiling_for_gpu, platform_dependent
from jmoe.kernels.triton_grouped import triton_launch

ON_GPU = jax.default_backend() == "gpu"
CPU_BACKENDS = ["gather", "xla", "xla_tiled", "pairs", "auto"]
# Tolerance relative to max |y_ref|: f32 differs from the reference only in summation order;
# bf16 rounds h to bf16 before the down projection in both, but at different sums.
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}

ID_PATTERNS = ["random", "one_slot", "padded", "empty_slots", "all_padding_rows"]


def make_slot_ids(rng, pattern, num_tokens, top_k, num_slots):
    ids = rng.integers(0, num_slots, size=(num_tokens, top_k))
    if pattern == "one_slot":
        ids[:] = rng.integers(0, num_slots)
    elif pattern == "padded":
        ids[rng.random(ids.shape) < 0.3] = -1
    elif pattern == "empty_slots":  # only the lower half of the slots is ever referenced
        ids = rng.integers(0, max(1, num_slots // 2), size=ids.shape)
    elif pattern == "all_padding_rows":
        ids[rng.random(num_tokens) < 0.5] = -1
        ids[0] = -1
    return jnp.asarray(ids, jnp.int32)


def make_inputs(seed, num_tokens, top_k, num_slots, d, f, dtype, pattern="random"):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(num_tokens, d)), dtype)
    slot_ids = make_slot_ids(rng, pattern, num_tokens, top_k, num_slots)
    weights = jnp.asarray(rng.random((num_tokens, top_k)), jnp.float32)
    w_gate_up = jnp.asarray(rng.normal(size=(num_slots, d, 2 * f)) / d**0.5, dtype)
    w_down = jnp.asarray(rng.normal(size=(num_slots, f, d)) / f**0.5, dtype)
    return x, slot_ids, weights, w_gate_up, w_down


def per_expert_copies(experts: ExpertWeights) -> tuple[ExpertWeights, ...]:
    """Each expert as its own [1, ...] arrays: the layout of jmoe.kernels.per_expert_views, as copies."""
    return tuple(jax.tree.map(lambda a: jnp.asarray(a[e:e + 1]), experts) for e in range(experts.num_experts))


def numpy_swiglu(gate, up):
    return gate / (1 + np.exp(-gate)) * up


def numpy_clamped_swiglu(gate, up, limit=7.0, alpha=1.702):
    """GPT-OSS's activation as transformers writes it (gate clamped above, up both ways)."""
    gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
    return (up + 1) * gate / (1 + np.exp(-alpha * gate))


def numpy_moe(x, slot_ids, weights, w_gate_up, w_down, b_gate_up=None, b_down=None, act=numpy_swiglu):
    """Loop-by-loop float64 definition, to pin the reference itself."""
    x, w_gu, w_d = (np.asarray(a, np.float64) for a in (x, w_gate_up, w_down))
    f = w_d.shape[1]
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(slot_ids.shape[1]):
            s = int(slot_ids[t, j])
            if s < 0:
                continue
            gu = x[t] @ w_gu[s] + (0 if b_gate_up is None else np.asarray(b_gate_up[s], np.float64))
            out = act(gu[:f], gu[f:]) @ w_d[s] + (0 if b_down is None else np.asarray(b_down[s], np.float64))
            y[t] += float(weights[t, j]) * out
    return y


def assert_close(y, y_ref, dtype):
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    y, y_ref = np.asarray(y, np.float32), np.asarray(y_ref, np.float32)
    scale = max(1.0, float(np.abs(y_ref).max()))
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=TOL[dtype] * scale)


_JITTED = {b: jax.jit(functools.partial(moe_ffn, backend=b)) for b in
           ["reference", "gather", "xla", "xla_tiled", "pairs", "pallas", "triton", "auto"]}


def run(backend, inputs):
    return _JITTED[backend](*inputs)


@pytest.mark.quick
def test_reference_matches_numpy_loop():
    inputs = make_inputs(0, 9, 3, 5, 8, 12, jnp.float32, "padded")
    y = run("reference", inputs)
    np.testing.assert_allclose(np.asarray(y), numpy_moe(*inputs), rtol=1e-5, atol=1e-5)
    assert y.dtype == jnp.float32


@pytest.mark.parametrize("backend", ["auto", "pallas", "reference"])
def test_numpy_inputs_outside_jit(backend):
    """Called eagerly with NumPy arrays (the platform-chosen backends trace every branch)."""
    inputs = [np.asarray(a) for a in make_inputs(1, 5, 2, 3, 16, 16, jnp.float32)]
    y = moe_ffn(*inputs, backend=backend)
    np.testing.assert_allclose(np.asarray(y), numpy_moe(*inputs), rtol=1e-4, atol=1e-4)
    assert moe_ffn(*inputs, backend=backend, out_dtype=jnp.bfloat16).dtype == jnp.bfloat16


shapes = st.fixed_dictionaries(
    dict(
        num_tokens=st.sampled_from([1, 5, 33]),
        top_k=st.sampled_from([1, 2, 8]),
        num_slots=st.sampled_from([1, 3, 8]),
        d=st.sampled_from([8, 16]),
        f=st.sampled_from([8, 12]),
        dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
        pattern=st.sampled_from(ID_PATTERNS),
        seed=st.integers(0, 2**16),
    )
)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@settings(max_examples=6, deadline=None)
@given(shape=shapes)
def test_backend_matches_reference(backend, shape):
    dtype = shape.pop("dtype")
    pattern, seed = shape.pop("pattern"), shape.pop("seed")
    inputs = make_inputs(seed, **shape, dtype=dtype, pattern=pattern)
    assert_close(run(backend, inputs), run("reference", inputs), dtype)


@settings(max_examples=5, deadline=None)
@given(shape=shapes)
def test_pallas_interpret_matches_reference(shape):
    dtype = shape.pop("dtype")
    pattern, seed = shape.pop("pattern"), shape.pop("seed")
    inputs = make_inputs(seed, **shape, dtype=dtype, pattern=pattern)
    assert_close(run("pallas", inputs), run("reference", inputs), dtype)


@pytest.mark.parametrize("backend", CPU_BACKENDS + ["pallas"])
def test_long_prefill_and_padding_rows(backend):
    inputs = make_inputs(1, 1024, 2, 4, 8, 8, jnp.float32, "all_padding_rows")
    y = run(backend, inputs)
    assert_close(y, run("reference", inputs), jnp.float32)
    all_padding = np.asarray((inputs[1] < 0).all(axis=1))
    assert all_padding.any()
    assert not np.asarray(y)[all_padding].any()  # whole rows of -1 give exactly zero


@pytest.mark.parametrize(
    "backend",
    ["reference", "gather", "xla_tiled", "pairs", "pallas", "auto", "xla"],  # xla: zeroes unused slots on CPU (dense ragged_dot)
)
@pytest.mark.parametrize("num_tokens", [40])
@pytest.mark.quick
def test_unreferenced_and_padding_slots_are_never_read(backend, num_tokens):
    num_slots = 6
    x, _, weights, w_gate_up, w_down = make_inputs(2, num_tokens, 2, num_slots, 8, 8, jnp.float32)
    rng = np.random.default_rng(3)
    # Slots 1..3 are used; 0 (where a naive clamp of -1 lands), 4 and S-1 (where -1 wraps)
    # hold NaN and are never referenced.
    ids = rng.integers(1, 4, size=(num_tokens, 2))
    ids[rng.random(ids.shape) < 0.4] = -1
    ids[0] = [1, -1] if num_tokens == 1 else [-1, -1]
    slot_ids = jnp.asarray(ids, jnp.int32)
    poison = jnp.array([0, 4, num_slots - 1])
    w_gate_up = w_gate_up.at[poison].set(jnp.nan)
    w_down = w_down.at[poison].set(jnp.nan)
    y = run(backend, (x, slot_ids, weights, w_gate_up, w_down))
    assert np.isfinite(np.asarray(y)).all()
    if num_tokens > 1:
        assert not np.asarray(y)[0].any()


@pytest.mark.parametrize("num_tokens,top_k,num_slots,expected", [
    (2, 2, 8, "pairs"), (4, 2, 8, "pairs"), (6, 2, 8, "xla_tiled"),  # 8 slots: pairs up to 4 tokens of 2
    (8, 8, 64, "pairs"), (9, 8, 64, "xla_tiled"),  # many slots: up to one pair per slot too, no fixed cap
    (1, 4, 1, "pairs"), (2, 4, 1, "xla_tiled"),  # one slot (a disk tier round): a token puts one pair on it
])
def test_auto_on_cpu_runs_pairs_up_to_one_pair_per_slot_else_the_tiled_kernel_never_interpreted_pallas(
        num_tokens, top_k, num_slots, expected):
    inputs = make_inputs(0, num_tokens, top_k, num_slots, 16, 12, jnp.float32)
    assert cpu_backend(num_tokens, top_k, num_slots) == expected
    text = jax.jit(moe_ffn_auto).lower(*inputs).as_text()
    assert "pallas" not in text and "ragged_dot" not in text
    # The tiled kernel sorts the pairs into row tiles; pairs loops over them unsorted.
    assert ("sort" in text) == (expected == "xla_tiled")
    assert_close(moe_ffn(*inputs, backend="auto"), moe_ffn(*inputs, backend=expected), jnp.float32)


@pytest.mark.quick
def test_auto_on_cpu_switches_to_expert_chunks_past_one_pair_per_slot_on_per_expert_arrays():
    """On per-expert arrays, 8 tokens of 2 over 16 slots run `pairs` (no sort); 9 tokens run xla_tiled's per-expert
    chunks, which sort the pairs by slot."""
    def lowered(num_tokens):
        x, ids, weights, w_gate_up, w_down = make_inputs(0, num_tokens, 2, 16, 16, 12, jnp.float32)
        per_expert = per_expert_copies(ExpertWeights(w_gate_up, w_down))
        return jax.jit(lambda *a: moe_ffn_auto(*a[:5], per_expert=a[5])).lower(
            x, ids, weights, w_gate_up, w_down, per_expert).as_text()

    assert "sort" not in lowered(8)
    assert "sort" in lowered(9)


_tile_layout = jax.jit(grouping.tile_layout, static_argnums=(2, 3))  # on this CPU: one token's per pair, else by sort
_tile_layout_by_sort = jax.jit(grouping.tile_layout_by_sort, static_argnums=(2, 3))
_tile_layout_by_comparison = jax.jit(grouping.tile_layout_by_comparison, static_argnums=(2, 3))


@settings(max_examples=8, deadline=None)
@given(
    num_tokens=st.sampled_from([1, 7, 40]),
    top_k=st.sampled_from([1, 3]),
    num_slots=st.sampled_from([1, 4, 9]),
    block_m=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_tile_layout_groups_rows_by_slot(num_tokens, top_k, num_slots, block_m, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(-1, num_slots, size=(num_tokens, top_k)).astype(np.int32)
    weights = rng.random((num_tokens, top_k)).astype(np.float32)
    layout = _tile_layout(jnp.asarray(ids), jnp.asarray(weights), num_slots, block_m)
    num_rows = grouping.num_padded_rows(num_tokens * top_k, num_slots, block_m)
    row_of_pair = np.asarray(layout.row_of_pair)
    tile_group = np.asarray(layout.tile_group)
    assert layout.row_token.shape == (num_rows,) and num_rows % block_m == 0
    flat = ids.reshape(-1)
    valid_rows = row_of_pair[flat >= 0]
    assert (row_of_pair[flat < 0] == num_rows).all()  # -1 pairs get no row
    assert len(set(valid_rows.tolist())) == len(valid_rows)  # one row per pair
    assert (tile_group[valid_rows // block_m] == flat[flat >= 0]).all()  # tile owns its slot
    used_tiles = set((valid_rows // block_m).tolist())
    assert all(tile_group[t] == -1 or t in used_tiles for t in range(len(tile_group)))
    token = np.asarray(layout.row_token)[valid_rows]
    assert (token == np.nonzero(flat >= 0)[0] // top_k).all()
    np.testing.assert_array_equal(np.asarray(layout.row_weight)[valid_rows], weights.reshape(-1)[flat >= 0])
    padding = np.setdiff1d(np.arange(num_rows), valid_rows)
    assert (np.asarray(layout.row_token)[padding] == num_tokens).all()
    assert (np.asarray(layout.row_weight)[padding] == 0).all()
    if num_tokens == 1 and num_slots >= top_k:  # a tile a pair, in the order of the choices
        assert (tile_group == np.where(flat >= 0, flat, -1)).all()
    # A GPU lays out few pairs (a decode step's of several rows) by comparisons instead: the sort's layout.
    sorted_layout = _tile_layout_by_sort(jnp.asarray(ids), jnp.asarray(weights), num_slots, block_m)
    compared = _tile_layout_by_comparison(jnp.asarray(ids), jnp.asarray(weights), num_slots, block_m)
    for name, by_comparison, by_sort in zip(grouping.TileLayout._fields, compared, sorted_layout):
        np.testing.assert_array_equal(np.asarray(by_comparison), np.asarray(by_sort), err_msg=name)


def test_pallas_block_choice():
    # Decode: small row tiles; prefill: large; every block a power of two dividing its dim.
    bm, bf, bd = choose_blocks(8, 8, 4096, 14336, on_gpu=True)
    assert (bm, bf, bd) == (16, 128, 128)
    bm, bf, bd = choose_blocks(4096 * 8, 128, 2048, 768, on_gpu=True)
    assert bm == 128 and 768 % bf == 0 and 2048 % bd == 0
    assert choose_blocks(8, 8, 8, 12, on_gpu=False)[1:] == (4, 8)
    with pytest.raises(ValueError, match="divisible by 16.*backend='xla'"):
        choose_blocks(8, 8, 24, 64, on_gpu=True)


def test_triton_launch_grid_covers_all_rows():
    launch = triton_launch(num_pairs=16 * 2, num_slots=8, d=4096, f=14336)
    assert launch["block_m"] == 16
    assert launch["num_rows"] == grouping.num_padded_rows(32, 8, 16)
    num_tiles = launch["num_rows"] // launch["block_m"]
    assert launch["gate_up_grid"] == (num_tiles, 14336 // launch["block_f"])
    assert launch["down_grid"] == (num_tiles, 4096 // launch["block_d"])
    with pytest.raises(ValueError, match="divisible by 16"):
        triton_launch(num_pairs=4, num_slots=2, d=8, f=64)


@pytest.mark.skipif(ON_GPU, reason="checks what is traced where there is no GPU")
def test_without_a_gpu_only_the_branch_of_the_platform_lowered_for_is_traced():
    traced = []

    def branch(name):
        return lambda x: traced.append(name) or x + len(name)

    def program(x):
        return platform_dependent(x, cpu=branch("cpu"), cuda=branch("cuda"), default=branch("default"))

    assert float(jax.jit(program)(1.0)) == 4.0 and traced == ["cpu"]
    traced.clear()
    with compiling_for_gpu(90):  # what jmoe.plan's compile worker does for an H100 target
        jax.jit(program).lower(1.0)
    assert traced == ["cuda"]
    traced.clear()
    with compiling_for_gpu(90):  # no CUDA branch: the default one
        jax.jit(lambda x: platform_dependent(x, cpu=branch("cpu"), default=branch("default"))).lower(1.0)
    assert traced == ["default"]


@pytest.mark.skipif(ON_GPU, reason="checks the error raised where there is no GPU")
@pytest.mark.quick
def test_triton_without_gpu_raises_clear_error():
    inputs = make_inputs(0, 2, 2, 4, 16, 16, jnp.float32)
    with pytest.raises(RuntimeError, match="backend='triton' needs a GPU.*backend='xla'"):
        moe_ffn(*inputs, backend="triton")


@pytest.mark.parametrize("backend", ["pallas", "triton"])
def test_gpu_backends_match_reference(backend):
    if not ON_GPU:
        pytest.skip(f"backend={backend!r} compiled for GPU needs a GPU; none here")
    if backend == "triton":
        pytest.importorskip("jax_triton", reason="backend='triton' needs jax-triton")
    for num_tokens, pattern in [(1, "random"), (16, "padded"), (512, "empty_slots")]:
        inputs = make_inputs(4, num_tokens, 4, 8, 64, 128, jnp.bfloat16, pattern)
        assert_close(run(backend, inputs), run("reference", inputs), jnp.bfloat16)


def _ok():
    return make_inputs(0, 4, 2, 3, 8, 6, jnp.float32)


@pytest.mark.parametrize(
    "index, bad, match",
    [
        (0, jnp.zeros((4, 2, 8)), r"x must have rank 2, got shape \(4, 2, 8\)"),
        (1, jnp.zeros((5, 2), jnp.int32), r"slot_ids must be \[T=4, k\], got \(5, 2\)"),
        (1, jnp.zeros((4, 2), jnp.int64 if jax.config.x64_enabled else jnp.float32),
         "slot_ids must be int32"),
        (2, jnp.zeros((4, 3)), r"weights must match slot_ids \(4, 2\)"),
        (3, jnp.zeros((3, 9, 12)), r"w_gate_up must be \[S, d=8, 2f\]"),
        (3, jnp.zeros((3, 8, 11)), "2\\*f .* odd 11"),
        (4, jnp.zeros((3, 5, 8)), r"w_down must be \[S=3, f=6, d=8\], got \(3, 5, 8\)"),
        (4, jnp.zeros((2, 6, 8)), r"w_down must be \[S=3, f=6, d=8\], got \(2, 6, 8\)"),
        (4, jnp.zeros((3, 6, 8), jnp.int8), "w_down must be float32, bfloat16 or a jmoe.kernels.QuantizedTensor"),
    ],
)
@pytest.mark.quick
def test_bad_inputs_raise_clear_value_error(index, bad, match):
    args = list(_ok())
    args[index] = bad
    with pytest.raises(ValueError, match=match):
        moe_ffn(*args)


def test_unknown_backend_and_activation():
    with pytest.raises(ValueError, match="unknown backend 'cuda'.*expected one of"):
        moe_ffn(*_ok(), backend="cuda")
    with pytest.raises(ValueError, match="unknown activation 'gelu'.*swiglu"):
        moe_ffn(*_ok(), activation="gelu")
    with pytest.raises(ValueError, match=r"unknown activation 'clamped_swiglu'.*clamped_swiglu:<limit>:<alpha>"):
        moe_ffn(*_ok(), activation="clamped_swiglu")
    with pytest.raises(ValueError, match="not numbers"):
        moe_ffn(*_ok(), activation="clamped_swiglu:7:x")


@pytest.mark.parametrize("backend", ["reference", "gather", "xla", "xla_tiled", "pairs", "pallas", "auto"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_expert_biases_and_the_clamped_swiglu_match_the_definition(backend, dtype):
    """GPT-OSS experts: biases after both projections, before the router weight; large activations so the
    clamps are exercised; -1 padding."""
    x, slot_ids, weights, w_gate_up, w_down = make_inputs(5, 9, 2, 4, 16, 16, jnp.float32, "padded")
    x = x * 8  # gate and up values beyond the limit of 7
    rng = np.random.default_rng(6)
    b_gate_up, b_down = rng.normal(size=(4, 32)).astype(np.float32), rng.normal(size=(4, 16)).astype(np.float32)
    expected = numpy_moe(x, slot_ids, weights, w_gate_up, w_down, b_gate_up, b_down, numpy_clamped_swiglu)
    inputs = [jnp.asarray(a, dtype) for a in (x, w_gate_up, w_down, b_gate_up, b_down)]
    y = moe_ffn(inputs[0], slot_ids, weights, inputs[1], inputs[2], b_gate_up=inputs[3], b_down=inputs[4],
                backend=backend, activation="clamped_swiglu:7.0:1.702", out_dtype=jnp.float32)
    assert_close(y, jnp.asarray(expected, jnp.float32), dtype)


def test_bias_shapes_are_checked():
    x, slot_ids, weights, w_gate_up, w_down = _ok()
    with pytest.raises(ValueError, match=r"b_down must be None or float32/bfloat16 \[3, 8\]"):
        moe_ffn(x, slot_ids, weights, w_gate_up, w_down, b_down=jnp.zeros((3, 6)))


@pytest.mark.parametrize("backend", ["reference", "gather", "xla", "xla_tiled", "pairs", "pallas", "auto"])
@pytest.mark.quick
def test_out_of_range_slot_ids_and_nan_in_unused_slots(backend):
    x, slot_ids, weights, w_gate_up, w_down = make_inputs(3, 6, 2, 4, 16, 16, jnp.float32)
    slot_ids = jnp.asarray(np.array(slot_ids) % 3)  # slot 3 is never used ...
    w_gate_up, w_down = w_gate_up.at[3].set(jnp.nan), w_down.at[3].set(jnp.nan)  # ... and holds NaN
    expected = numpy_moe(x, np.where(np.array(slot_ids) == 0, -1, slot_ids), weights, w_gate_up, w_down)
    with pytest.raises(ValueError, match=r"slot_ids must be in \[-1, 4\) \(-1 = none\), found \[1, 7\]"):
        moe_ffn(x, jnp.where(slot_ids == 0, 7, slot_ids), weights, w_gate_up, w_down, backend=backend)
    # Traced, an id out of range contributes nothing, as -1 does: in row tiles and in a one-row step (the Pallas
    # kernels' matrix-vector form checks the range itself).
    for bad in (7, -5):
        for rows in (3, 1):
            y = _JITTED[backend](x[:rows], jnp.where(slot_ids == 0, bad, slot_ids)[:rows], weights[:rows], w_gate_up,
                                 w_down)
            np.testing.assert_allclose(np.asarray(y), expected[:rows], rtol=1e-4, atol=1e-4,
                                       err_msg=f"id {bad}, {rows} rows")
