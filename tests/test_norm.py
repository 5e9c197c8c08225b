"""RMSNorm and the residual add before it as one kernel (jmoe.kernels.norm), interpreted here as a GPU runs it lowered
to Triton, against the XLA form every other platform runs (bench.gpu_check's checks, bench.gpu.norm), and inside
whole models' steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmoe
from bench.gpu.norm import CASES, norm_agrees
from jmoe.kernels import norm
from jmoe.model import layers
from jmoe.plan.hlo import triton_grids
from jmoe.plan.programs import PLUGIN_HINT, plugin_available
from tests.test_decode_attention import gpu_branches_of_layers, padded_rows_logits


@pytest.mark.quick
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[1]}-scale{c[2]}-added{c[3]}-{c[4]}-{c[5]}-bad{c[6]}"
                                             for c in CASES])
def test_the_kernel_computes_what_xla_does(case):
    same, detail = norm_agrees(case, on_gpu=False)
    assert same, detail


def test_an_addend_of_another_width_is_refused():
    x = jnp.ones((2, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"must both be \[\.\.\., 8\]"):
        norm.added_and_normalised(x, jnp.ones((2, 4)), jnp.ones(8), eps=1e-5, on_gpu=False)
    with pytest.raises(ValueError, match=r"must both be \[\.\.\., 4\]"):  # leading columns only without an add
        norm.added_and_normalised(x, x, jnp.ones(4), eps=1e-5, on_gpu=False)


@pytest.mark.parametrize("name", ["mixtral_e4k2_gqa2", "qwen3_moe_headdim_tied", "deepseek_v3_qlora_groups"])
def test_a_model_runs_the_same_through_the_kernel(name, hf_checkpoints, monkeypatch):
    """Mixtral, Qwen3 (per-head q/k norms, XLA's form on a GPU too) and DeepSeek-V3 (the q and latent norms, the
    latent read from its projection's wider output): two left-padded rows' logits over 6 greedy decode steps after a
    prompt (whose final norm is a row's), every norm of a decode step and the residual add before it through the
    interpreted kernel and through XLA's form."""
    model = jmoe.load(hf_checkpoints[name][0])
    want = padded_rows_logits(model)
    offered = gpu_branches_of_layers(monkeypatch, lambda cuda: True)
    monkeypatch.setattr(layers, "added_and_normalised",
                        lambda *args, on_gpu, **kwargs: norm.added_and_normalised(*args, on_gpu=False, **kwargs))
    np.testing.assert_allclose(padded_rows_logits(model), want, atol=2e-5)
    assert any(cuda is not None for cuda in offered)


def test_on_the_cpu_norms_are_xla_s(hf_checkpoints):
    model = jmoe.load(hf_checkpoints["mixtral_e4k2_gqa2"][0])
    step = str(jax.make_jaxpr(lambda token: model.module()(
        token, jmoe.model.transformer.empty_kv_cache(model.config, 1, 8, jnp.float32), 3,
        jnp.zeros(1, jnp.int32)).logits)(jnp.ones((1, 1), jnp.int32)))
    assert "rms_norm" not in step and "rsqrt" in step


@pytest.mark.skipif(not plugin_available(), reason=PLUGIN_HINT)
def test_an_h100_step_normalises_by_one_kernel_a_norm(hf_checkpoints):
    """Mixtral's decode step compiled for an H100: each layer's two norms (each after its residual add but the first
    layer's input norm) and the final norm are the kernel, a program per row; no XLA reduction is left of them."""
    plan = jmoe.plan(hf_checkpoints["mixtral_e4k2_gqa2"][0], target="h100", context=64)
    decode, layers_count = plan.programs["decode"], plan.config.num_layers
    assert decode.error is None, decode.error
    assert triton_grids(decode.hlo_text, "rms_norm") == [(1, 1, 1)] * (2 * layers_count + 1)
    assert " rsqrt(" not in decode.hlo_text
