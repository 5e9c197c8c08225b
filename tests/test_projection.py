"""A decode step's product with a large dense weight as one kernel (jmoe.kernels.projection), interpreted here as a GPU
runs it lowered to Triton, against the XLA form every other shape and platform runs (bench.gpu_check's checks,
bench.gpu.projection); and where XLA:GPU's own matrix-vector rewrite stops, which decides where it runs."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

import jmoe
from bench.gpu.projection import CASES, projection_agrees
from jmoe.kernels import projection
from jmoe.kernels.projection import LARGE_WEIGHT, MAX_ROWS, projected_rows, read_by_kernel
from jmoe.model import layers
from jmoe.plan.programs import PLUGIN_HINT, plugin_available
from tests.h100_child import run_in_h100_child
from tests.test_decode_attention import gpu_branches_of_layers, padded_rows_logits


@pytest.mark.quick
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[1]}x{c[2]}-bias{c[3]}-{c[4]}" for c in CASES])
def test_the_kernel_computes_what_xla_does(case):
    same, detail = projection_agrees(case, on_gpu=False)
    assert same, detail


def test_rows_past_a_program_s_or_a_weight_of_another_width_are_refused():
    with pytest.raises(ValueError, match=r"x \[N <= 16, K\] and a weight \[O, K\]; got x \(17, 8\)"):
        projected_rows(jnp.ones((MAX_ROWS + 1, 8)), jnp.ones((4, 8)), on_gpu=False)
    with pytest.raises(ValueError, match=r"got x \(2, 8\), weight \(4, 9\)"):
        projected_rows(jnp.ones((2, 8)), jnp.ones((4, 9)), on_gpu=False)


def test_only_a_decode_step_s_products_with_large_weights_of_its_dtype_are_the_kernel_s():
    large = jnp.ones((2048, LARGE_WEIGHT // 2048 + 1), jnp.bfloat16)
    row = jnp.ones((1, 1, large.shape[1]), jnp.bfloat16)
    assert read_by_kernel(row, large)
    assert not read_by_kernel(jnp.ones((1, MAX_ROWS + 1, large.shape[1]), jnp.bfloat16), large)  # a prompt's rows
    assert not read_by_kernel(row, large[:, :-2])  # under 10M elements
    assert not read_by_kernel(row.astype(jnp.float32), large)  # XLA's product of two dtypes


XLA_REWRITE_COMPILE = """
from jmoe.model.layers import project
from jmoe.plan.hlo import entry_computation, kernel_count, triton_grids
out = {}
for k in (4864, 4928):  # a weight [2048, k] of 9.96M and 10.09M elements
    x, w = (jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=on_gpu) for shape in ((1, 1, k), (2048, k)))
    mine = compiled(project, x, w)
    xla = compiled(lambda x, w: jnp.einsum("btk,ok->bto", x, w, preferred_element_type=jnp.float32).astype(x.dtype),
                   x, w, for_gpu=False)
    out[k] = dict(kernels=kernel_count(mine), grids=triton_grids(mine, "projected_rows"),
                  xla_reduction="input_reduce_fusion" in entry_computation(xla), xla_kernels=kernel_count(xla))
print(json.dumps(out))
"""


@pytest.mark.skipif(not plugin_available(), reason=PLUGIN_HINT)
def test_an_h100_reads_a_weight_past_xla_s_rewrite_by_the_kernel():
    """Compiled for an H100 (a child process whose JAX starts on the CPU platform): XLA reads a row times a weight of
    under LARGE_WEIGHT elements as one reduction kernel, which `project` leaves it; one more element and XLA made a
    GEMM and a kernel summing its pieces, which `project` replaces by the kernel, a program per 16 outputs."""
    small, large = run_in_h100_child(XLA_REWRITE_COMPILE).values()
    assert small == dict(kernels=1, grids=[], xla_reduction=True, xla_kernels=1)
    assert large == dict(kernels=1, grids=[[2048 // 16, 1, 1]], xla_reduction=False, xla_kernels=2)


@pytest.mark.parametrize("name", ["gpt_oss_e4k2_window", "deepseek_v3_qlora_groups"])
def test_a_model_runs_the_same_through_the_kernel(name, hf_checkpoints, monkeypatch):
    """GPT-OSS (biased projections) and DeepSeek-V3 (q_a, kv_a, the shared expert): two left-padded rows' logits
    over 6 greedy decode steps after a prompt, with every dense projection of at most 16 rows (the test models'
    weights are small: as if every one were past XLA's rewrite) through the interpreted kernel and through XLA's
    form."""
    model = jmoe.load(hf_checkpoints[name][0])
    want = padded_rows_logits(model)
    monkeypatch.setattr(layers, "read_by_kernel", lambda x, weight: math.prod(x.shape[:-1]) <= MAX_ROWS)
    offered = gpu_branches_of_layers(monkeypatch, lambda cuda: cuda is layers._projected_by_kernel)
    monkeypatch.setattr(layers, "projected_rows",
                        lambda *args, on_gpu: projection.projected_rows(*args, on_gpu=False))
    np.testing.assert_allclose(padded_rows_logits(model), want, atol=2e-5)
    assert offered.count(layers._projected_by_kernel) >= 6 * model.config.num_layers
