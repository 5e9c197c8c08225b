"""Experts held one per array on a CPU: views that share the stacked parameters' memory, read in place by the CPU
kernels, giving what the stacked weights give."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import jmoe
from hf_models import VOCAB, write_checkpoint
from jmoe.kernels import ExpertKernel, ExpertWeights, moe_ffn, per_expert_views, quantize
from jmoe.kernels import per_expert as per_expert_module
from jmoe.kernels import xla as xla_kernels
from jmoe.memory import PINNED_HOST
from jmoe.plan.hlo import copied_arrays
from test_gpu_step import squeezed
from test_kernels import assert_close, make_inputs, per_expert_copies, run

# 3 MiB per float32 expert: over MIN_EXPERT_BYTES (2 MiB).
D, F = 256, 1024


def big_experts(count: int, dtype=jnp.float32, f: int = F) -> ExpertWeights:
    rng = np.random.default_rng(0)
    return ExpertWeights(jnp.asarray(rng.standard_normal((count, D, 2 * f)), dtype),
                         jnp.asarray(rng.standard_normal((count, f, D)), dtype),
                         jnp.asarray(rng.standard_normal((count, 2 * f)), dtype),
                         jnp.asarray(rng.standard_normal((count, D)), dtype))


@pytest.mark.parametrize("dtype, f", [(jnp.float32, F), (jnp.bfloat16, 2 * F)])  # 3 MiB an expert
@pytest.mark.quick
def test_views_share_the_stacked_arrays_memory(dtype, f):
    experts = big_experts(3, dtype, f)
    views = per_expert_views(experts)
    assert views is not None and len(views) == experts.num_experts
    for e, view in enumerate(views):
        for part, stacked in zip(jax.tree.leaves(view), jax.tree.leaves(experts)):
            assert part.shape == (1, *stacked.shape[1:]) and part.dtype == stacked.dtype
            assert part.unsafe_buffer_pointer() == stacked.unsafe_buffer_pointer() + e * part.nbytes
            np.testing.assert_array_equal(np.asarray(part), np.asarray(stacked[e:e + 1]))


@pytest.mark.quick
def test_quantized_experts_get_views_of_values_and_scales():
    rng = np.random.default_rng(1)
    # int8: 3 MiB an expert.
    w_gate_up, w_down = (jax.tree.map(jnp.asarray, quantize(rng.standard_normal(shape, np.float32), "int8"))
                         for shape in ((3, 2 * D, 4 * F), (3, 2 * F, 2 * D)))
    experts = ExpertWeights(w_gate_up, w_down)
    views = per_expert_views(experts)
    assert views is not None
    assert views[2].w_down.values.unsafe_buffer_pointer() == w_down.values.unsafe_buffer_pointer() + 2 * views[2].w_down.values.nbytes
    assert views[1].w_gate_up.fmt == "int8"
    x, ids, weights = jnp.ones((1, 2 * D)), jnp.asarray([[2, 0]], jnp.int32), jnp.asarray([[0.7, 0.3]])
    np.testing.assert_array_equal(moe_ffn(x, ids, weights, w_gate_up, w_down, per_expert=views, backend="pairs"),
                                  moe_ffn(x, ids, weights, w_gate_up, w_down, backend="pairs"))


def test_no_views_where_they_would_cost_memory_or_gain_nothing(monkeypatch):
    small = ExpertWeights(jnp.ones((4, 8, 16)), jnp.ones((4, 8, 8)))
    assert per_expert_views(small) is None  # 768 bytes an expert: the copy stays in the cache
    big = big_experts(3)
    monkeypatch.setattr(per_expert_module, "MAX_EXPERTS", 2)
    assert per_expert_views(big) is None  # compile time grows with layers x experts


@pytest.mark.parametrize("backend", ["pairs", "xla_tiled", "auto"])
@pytest.mark.parametrize("num_tokens", [1, 3, 40])
def test_cpu_kernels_read_the_per_expert_arrays(backend, num_tokens):
    """With the stacked weights all NaN and the per-expert arrays clean, the result is the clean one: the kernels
    never slice the stacked weights (and -1 pairs still read nothing)."""
    x, ids, weights, w_gate_up, w_down = make_inputs(5, num_tokens, 2, 6, 8, 12, jnp.float32, "all_padding_rows")
    rng = np.random.default_rng(2)
    b_gate_up, b_down = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in ((6, 24), (6, 8)))
    clean = ExpertWeights(w_gate_up, w_down, b_gate_up, b_down)
    poisoned = jax.tree.map(lambda a: jnp.full_like(a, jnp.nan), clean)
    y = ExpertKernel(backend, "swiglu")(x, ids, weights, poisoned._replace(per_expert=per_expert_copies(clean)))
    assert_close(y, ExpertKernel("reference", "swiglu")(x, ids, weights, clean), jnp.float32)


@pytest.mark.quick
def test_per_expert_chunks_cover_every_group_size_exactly_once():
    """xla_tiled on per-expert arrays (CPU): each expert's sorted rows in chunks of 24, then 16 rows (block_m 24),
    for groups of every size around the chunk boundaries (0 to 49 rows), -1 pairs, and a NaN token: chunks reaching
    past a group compute rows of the next experts, which must end with their own values, and of -1 pairs (the last
    group's 49 rows take 64), which must give nothing."""
    assert xla_kernels.chunk_sizes(24) == (24, 16) and xla_kernels.chunk_sizes(16) == (16,)
    sizes = [0, 1, 15, 16, 17, 18, 23, 24, 25, 34, 41, 42, 49]
    ids = np.concatenate([np.full(n, e) for e, n in enumerate(sizes)] + [np.full(5, -1)]).astype(np.int32)
    ids = np.random.default_rng(3).permutation(ids).reshape(-1, 2)
    x, _, weights, w_gate_up, w_down = make_inputs(7, ids.shape[0], 2, len(sizes), 8, 12, jnp.float32)
    nan_token = int(np.nonzero((ids == 10).any(axis=1) & (ids != -1).all(axis=1))[0][0])
    x = x.at[nan_token].set(jnp.nan)
    clean = ExpertWeights(w_gate_up, w_down)
    poisoned = jax.tree.map(lambda a: jnp.full_like(a, jnp.nan), clean)
    chunked = jax.jit(functools.partial(xla_kernels.moe_ffn_tiled, block_m=24, per_expert=per_expert_copies(clean)))
    y = np.asarray(chunked(x, jnp.asarray(ids), weights, poisoned.w_gate_up, poisoned.w_down))
    expected = np.asarray(run("reference", (x, jnp.asarray(ids), weights, w_gate_up, w_down)))
    assert np.isnan(y[nan_token]).all() and not np.isnan(np.delete(y, nan_token, axis=0)).any()
    np.testing.assert_allclose(np.delete(y, nan_token, axis=0), np.delete(expected, nan_token, axis=0), atol=1e-5)


def test_other_backends_read_the_stacked_weights_which_hold_the_same_values():
    inputs = make_inputs(6, 4, 2, 5, 8, 8, jnp.float32)
    parts = per_expert_copies(ExpertWeights(*inputs[3:]))
    for backend in ("reference", "gather", "xla", "pallas"):
        assert_close(moe_ffn(*inputs, backend=backend, per_expert=parts), run("reference", inputs), jnp.float32)


@pytest.mark.parametrize("change, message", [
    (lambda parts: parts[:-1], "one ExpertWeights per slot \\(5\\), got 4"),
    (lambda parts: parts[:-1] + (parts[0]._replace(w_down=parts[0].w_down[:, :4]),),
     "per_expert\\[4\\] must be slot 4's weights with a leading axis of 1.*got .*\\(1, 4, 8\\)"),
    (lambda parts: (tuple(parts[0]),) + parts[1:], "per_expert\\[0\\].*in tuple"),
])
def test_bad_per_expert_arrays_are_refused_with_what_to_change(change, message):
    inputs = make_inputs(6, 2, 2, 5, 8, 8, jnp.float32)
    with pytest.raises(ValueError, match=message):
        moe_ffn(*inputs, per_expert=change(per_expert_copies(ExpertWeights(*inputs[3:]))))


@pytest.fixture(scope="module")
def big_expert_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("big") / "m"
    hf = write_checkpoint(directory, "mixtral", hidden_size=D, intermediate_size=F, num_local_experts=4,
                          num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2)
    return directory, hf


def test_a_resident_model_on_cpu_reads_experts_in_place_and_matches_transformers(big_expert_checkpoint):
    directory, hf = big_expert_checkpoint
    model = jmoe.load(directory, progress=False)
    for block in nnx.merge(model.graphdef, model.params).moe_blocks():  # what the Model's steps read
        stacked = block.experts.weights()
        assert stacked.per_expert is not None
        assert stacked.per_expert[3].w_down.unsafe_buffer_pointer() == (
            stacked.w_down.unsafe_buffer_pointer() + 3 * stacked.per_expert[3].w_down.nbytes)
    ids = np.random.RandomState(0).randint(0, VOCAB, (1, 9))
    np.testing.assert_allclose(np.asarray(model.logits(ids)), hf(torch.tensor(ids)).logits.detach().numpy(),
                               atol=1e-4, rtol=0)
    prompt = list(ids[0])
    reference = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    assert model.generate(prompt, max_new_tokens=8)[0] == reference


@pytest.mark.cpu_hlo
def test_offloaded_experts_are_read_in_place_by_the_prompt_step_and_slots_stay_stacked(big_expert_checkpoint):
    """On a CPU an offloaded layer's experts in pinned host memory get views as well (the same RAM): the prompt step
    reads each expert in place, copying no expert; the cache slots and the copies that fill them stay stacked."""
    directory, hf = big_expert_checkpoint
    model = jmoe.load(directory, cache=2, progress=False)
    for block in nnx.merge(model.graphdef, model.params).moe_blocks():
        host = block.experts.weights()
        assert host.w_down.sharding.memory_kind == PINNED_HOST and host.per_expert is not None
        view = host.per_expert[3].w_down
        assert view.sharding.memory_kind == PINNED_HOST
        assert view.unsafe_buffer_pointer() == host.w_down.unsafe_buffer_pointer() + 3 * view.nbytes
    assert all(slots.per_expert is None for slots in (*model.engine.state.buffers, model.engine.state.scratch))
    prompt = list(np.random.RandomState(1).randint(0, VOCAB, 40))
    reference = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
    assert model.generate(prompt, max_new_tokens=6)[0] == reference
    (prefill,) = [step["hlo"] for step in model.compiled_steps() if step["tokens"][1] > 1]
    d, f = model.config.hidden_size, model.config.expert_intermediate_size
    # Read through the stacked host arrays instead, every row tile would first copy its expert's slice.
    assert not {(d, 2 * f), (f, d)} & {squeezed(dims) for dims in copied_arrays(prefill)}


def test_the_module_handed_to_research_code_reads_its_own_weights(big_expert_checkpoint):
    """Model.module() has no per-expert views: they alias the stacked weights, so a weight update would leave them
    stale; the module computes with whatever its stacked weights hold."""
    model = jmoe.load(big_expert_checkpoint[0], progress=False)
    module = model.module()
    assert all(block.experts.weights().per_expert is None for block in module.moe_blocks())
    experts = module.moe_blocks()[0].experts
    experts.w_down.set_value(jnp.zeros_like(experts.w_down.get_value()))
    x = jnp.asarray(np.random.RandomState(2).standard_normal((5, D)), jnp.float32)
    routing = jnp.asarray([[0, 1]] * 5, jnp.int32)
    y = ExpertKernel("auto", "swiglu")(x, routing, jnp.ones((5, 2)), experts.weights())
    assert not np.asarray(y).any()  # zeroed down projections, read from the stacked weights
