"""A decode step's attention as one kernel (jmoe.kernels.decode_attention), interpreted here as a GPU runs it lowered
to Triton, against the XLA form every other platform runs (bench.gpu_check's checks, bench.gpu.decode_attention),
and inside whole models' decode steps."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmoe
from bench.gpu.decode_attention import CASES, LATENT_CASES, attention_agrees, latent_attention_agrees
from jmoe.config import load_config
from jmoe.model import attention, mla
from jmoe.model.transformer import empty_kv_cache, step_context
from jmoe.plan.hlo import triton_grids
from jmoe.plan.programs import PLUGIN_HINT, plugin_available


@pytest.mark.quick
@pytest.mark.parametrize("case", CASES, ids=[f"{c[:6]}-w{c[6]}-sinks{c[7]}-{c[8]}-{c[9]}-rot{c[10]}" for c in CASES])
def test_the_kernel_computes_what_xla_does(case):
    same, detail = attention_agrees(case, on_gpu=False)
    assert same, detail


@pytest.mark.quick
@pytest.mark.parametrize("case", LATENT_CASES, ids=[f"{c[:8]}-interleaved{c[8]}-{c[9]}-{c[10]}" for c in LATENT_CASES])
def test_the_latent_kernel_computes_what_xla_does(case):
    same, detail = latent_attention_agrees(case, on_gpu=False)
    assert same, detail


@pytest.mark.parametrize("window", [None, 1, 5, 100])
def test_decode_columns_are_the_decode_mask(window, hf_checkpoints):
    cfg = load_config(hf_checkpoints["gpt_oss_e4k2_window"][0])
    rng = np.random.default_rng(window or 0)
    write_index = jnp.asarray(rng.integers(0, 40, 6), jnp.int32)
    pad_len = jnp.asarray(rng.integers(0, 45, 6), jnp.int32)  # some past their row's token: it sees nothing
    for index in (write_index, write_index[0]):  # per row (serving) and one for every row (generate)
        context = step_context(cfg, (6, 1), 48, index, pad_len)
        first, last = np.asarray(context.decode_columns(window)).T
        cols = np.arange(48)
        np.testing.assert_array_equal((cols >= first[:, None]) & (cols <= last[:, None]),
                                      np.asarray(context.mask(window))[:, 0])


def decode_logits(module, cfg, prompt, pad_len, steps: int, per_row: bool):
    """float32 logits [steps, B, V] of greedy decode steps after `prompt` [B, T] (left-padded by pad_len [B]), each
    step's write column one per row (a serving step's) or one for all rows."""
    batch, length = prompt.shape
    cache = empty_kv_cache(cfg, batch, length + steps + 3, jnp.float32)
    out = module(prompt, cache, 0, pad_len, visible_len=length)
    logits = []
    for step in range(steps):
        token = jnp.argmax(out.logits[:, -1], axis=-1)[:, None]
        column = length + step
        out = module(token, out.kv_cache, jnp.full((batch,), column, jnp.int32) if per_row else column, pad_len)
        logits.append(out.logits[:, -1])
    return np.asarray(jnp.stack(logits))


def padded_rows_logits(model, steps: int = 6):
    """decode_logits of `model` (a jmoe.Model) for two rows, the first left-padded by 2, each step's write column one
    per row (a serving step's)."""
    prompt = jnp.asarray([[0, 0, 5, 9, 2, 7], [4, 1, 8, 3, 6, 2]], jnp.int32)
    return decode_logits(model.module(), model.config, prompt, jnp.asarray([2, 0], jnp.int32), steps, per_row=True)


def gpu_branches_of_layers(monkeypatch, taken) -> list:
    """jmoe.model.layers' platform choices made as a GPU makes them where `taken(cuda branch)` says so, XLA's form
    elsewhere; returns the list of the cuda branches offered, filled as steps are traced."""
    from jmoe.model import layers

    offered = []

    def choose(*args, cuda=None, default, **_):
        offered.append(cuda)
        return (cuda if cuda is not None and taken(cuda) else default)(*args)

    monkeypatch.setattr(layers, "platform_dependent", choose)
    return offered


@pytest.mark.parametrize("name", ["gpt_oss_e4k2_window", "qwen3_moe_headdim_tied", "deepseek_v3_qlora_groups",
                                  "deepseek_v3_yarn_plain_q"])
def test_a_model_decodes_the_same_through_the_kernel(name, hf_checkpoints, monkeypatch):
    """GPT-OSS (sinks, a window of 4 on every other layer), Qwen3 (per-head q/k norms, two query heads a kv head) and
    DeepSeek-V3 (latent attention; interleaved rope pairs, then YaRN): two left-padded rows' logits over 8 greedy
    decode steps, every decode attention through the interpreted kernel (as a GPU chooses it, in parts of 16
    columns) and through XLA's form."""
    model = jmoe.load(hf_checkpoints[name][0])
    module, cfg = model.module(), model.config
    prompt = jnp.asarray([[0, 0, 5, 9, 2, 7], [4, 1, 8, 3, 6, 2]], jnp.int32)
    pad_len = jnp.asarray([2, 0], jnp.int32)
    want = [decode_logits(module, cfg, prompt, pad_len, 8, per_row) for per_row in (False, True)]
    for module_of_form, form in ((attention, "one_token_by_kernel"), (mla, "latent_one_token_by_kernel")):
        monkeypatch.setattr(module_of_form, "platform_dependent", lambda *args, cuda, default: cuda(*args))
        monkeypatch.setattr(module_of_form, form, functools.partial(getattr(module_of_form, form), on_gpu=False,
                                                                    columns_per_part=16))
    for per_row, logits in zip((False, True), want):
        np.testing.assert_allclose(decode_logits(module, cfg, prompt, pad_len, 8, per_row), logits, atol=2e-5)


def test_on_the_cpu_decode_attention_is_xla_s(hf_checkpoints):
    model = jmoe.load(hf_checkpoints["gpt_oss_e4k2_window"][0])
    module, cfg = model.module(), model.config
    cache = empty_kv_cache(cfg, 1, 8, jnp.float32)
    step = str(jax.make_jaxpr(lambda token: module(token, cache, 3, jnp.zeros(1, jnp.int32)).logits)(
        jnp.ones((1, 1), jnp.int32)))
    assert "pallas_call" not in step and "dot_general" in step


@pytest.mark.skipif(not plugin_available(), reason=PLUGIN_HINT)
def test_an_h100_decode_attends_by_one_latent_kernel_a_layer(hf_checkpoints):
    """DeepSeek-V3's decode step compiled for an H100: every layer's latent attention is the kernel, a program per
    row and block of 16 heads (4 heads: one block) at a 64-column cache (one part), its queries absorbed by another
    (a program per head and 128 latent columns: one), with no score-sized product and no weight transposed."""
    plan = jmoe.plan(hf_checkpoints["deepseek_v3_qlora_groups"][0], target="h100", context=64)
    decode, layers = plan.programs["decode"], plan.config.num_layers
    assert decode.error is None, decode.error
    assert triton_grids(decode.hlo_text, "attend_latent_one_token") == [(1, 1, 1)] * layers
    assert triton_grids(decode.hlo_text, "absorbed_queries") == [(plan.config.num_heads, 1, 1)] * layers
    assert " transpose(" not in decode.hlo_text
    assert "bthr,bsr->bhts" not in decode.hlo_text and "bhts,bsr->bhtr" not in decode.hlo_text  # XLA's products
