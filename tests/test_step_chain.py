"""A deep model's generation step as a chain of layer programs (jmoe.decode.chain): the same tokens as transformers
and as the one-program step, and one program for every block of alike layers whatever the depth."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import jmoe
from jmoe.decode import chain
from jmoe.decode.sampling import SamplingParams
from jmoe.serve import RequestParams, ServingEngine
from test_disk_tier import budget_for

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def chained(path, monkeypatch, layers_per_program: int, **options):
    """The model at `path` with its steps chained in blocks of `layers_per_program`, however few its layers."""
    monkeypatch.setattr(chain, "LAYERS_PER_PROGRAM", layers_per_program)
    monkeypatch.setattr(jmoe.api, "chains", lambda config, engine: True)
    model = jmoe.load(path, progress=False, **options)
    assert model.step_chain is not None
    return model


# Dense and MoE layers alternating (Qwen2-MoE's sparse step), a first dense layer with DeepSeek's latent attention,
# GPT-OSS's alternating sliding windows with sinks, and Mixtral's window with tied embeddings: blocks of one layer
# each, so that every kind of layer is a block of its own.
@pytest.mark.parametrize("name", ["qwen2_moe_sparse_step_norm", "deepseek_v3_qlora_groups", "gpt_oss_e4k2_window",
                                  "mixtral_e8k3_mqa_tied_window"])
def test_chained_steps_and_logits_are_what_transformers_computes(name, hf_checkpoints, monkeypatch):
    path, reference = hf_checkpoints[name]
    model = chained(path, monkeypatch, 1)
    expected = reference.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)[0, len(PROMPT):]
    assert model.generate(PROMPT, max_new_tokens=12)[0] == expected.tolist()
    ids = np.random.RandomState(0).randint(0, model.config.vocab_size, (2, 13))
    logits, routing = model.logits_and_routing(ids)
    np.testing.assert_allclose(np.asarray(logits), reference(torch.tensor(ids)).logits.detach().numpy(), atol=1e-4,
                               rtol=0)
    assert routing.shape == (model.config.num_moe_layers, 2, 13, model.config.num_experts_per_tok)


# Router prefetch handed on between blocks, across a dense layer (Qwen2-MoE's sparse step); planned admissions of
# the last step's misses computed on the host (DeepSeek-V3's first dense layer, MLA); misses read in place with
# prefetch (GPT-OSS's windows); parameters in pinned host memory, the tied embedding and the first layer's queries
# (Mixtral): blocks of one layer.
@pytest.mark.parametrize("name, options, kinds", [
    ("qwen2_moe_sparse_step_norm", dict(cache=1, prefetch=1), 2),
    ("deepseek_v3_qlora_groups", dict(cache=2, miss_mode="host"), 2),
    ("gpt_oss_e4k2_window", dict(cache=2, prefetch=1, miss_mode="direct"), 2),
    ("mixtral_e8k3_mqa_tied_window", dict(cache=2, offload_params=["embed", r"re:layers\.0\.attn\.q\.kernel"]), 2),
    # the first MoE layer resident: the second prefetches nothing from it, as in one program
    ("qwen2_moe_sparse_step_norm", dict(cache=[None, 1], prefetch=1), 3)])
def test_offloaded_chains_compute_and_cache_what_the_one_program_step_does(name, options, kinds, hf_checkpoints,
                                                                           monkeypatch):
    path, reference = hf_checkpoints[name]
    whole = jmoe.load(path, progress=False, **options)
    assert whole.step_chain is None
    model = chained(path, monkeypatch, 1, **options)
    expected = reference.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)[0, len(PROMPT):]
    for m in (whole, model):
        assert m.generate(PROMPT, max_new_tokens=12)[0] == expected.tolist()
    # the same hits, misses, copies and evictions in every layer: each block's slots and tables are the ones the
    # one-program step would have used
    assert model.stats() == whole.stats()
    assert any(layer["misses"] for layer in model.stats())
    ids = np.random.RandomState(0).randint(0, model.config.vocab_size, (2, 13))
    np.testing.assert_allclose(np.asarray(model.logits_and_routing(ids)[0]),
                               reference(torch.tensor(ids)).logits.detach().numpy(), atol=1e-4, rtol=0)
    # `kinds` of layer (dense and MoE, two windows, queries in host memory or not, experts resident or offloaded), one
    # program each for the prompt step, the decode step and the logits: the first MoE block, whose carry comes from
    # the embedding, is alike the later ones
    blocks = [key for key in model.step_chain.pieces if key[0] in model.step_chain._layer_fns.values()]
    assert len(blocks) == kinds * 3


def test_a_chained_model_reads_from_disk_what_the_one_program_step_reads(hf_checkpoints, monkeypatch):
    path, reference = hf_checkpoints["olmoe_e8k4_clip"]
    options = dict(cache=1, host_budget_gb=budget_for(path, 2))  # one slot, two host rows of 8 experts a layer
    expected = reference.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)[0, len(PROMPT):]
    with jmoe.load(path, progress=False, **options) as whole, chained(path, monkeypatch, 1, **options) as model:
        for m in (whole, model):
            assert m.generate(PROMPT, max_new_tokens=8)[0] == expected.tolist()
        assert model.stats() == whole.stats()  # the same disk reads, host rows and slots in every layer
        assert all(layer["disk_reads"] for layer in model.stats())
        blocks = [key for key in model.step_chain.pieces if key[0] in model.step_chain._layer_fns.values()]
        assert len(blocks) == 2  # the prompt step's and the decode step's: each layer reads from disk by its position


def test_blocks_start_after_the_first_dense_layers_and_chain_where_that_halves_the_compiled_layers():
    deepseek_v3 = (False,) * 3 + (True,) * 58
    assert chain.layer_blocks(deepseek_v3, 8) == [(0, 1), (1, 2), (2, 3), *((s, s + 8) for s in range(3, 59, 8)),
                                                  (59, 60), (60, 61)]
    assert chain.layer_blocks((True,) * 12, 8) == [(0, 8), (8, 9), (9, 10), (10, 11), (11, 12)]
    assert chain.layer_blocks((True,) * 13, 8) == [(0, 8), (8, 13)]

    def config(layers, dense=0):
        return SimpleNamespace(num_layers=layers, moe_layers=(False,) * dense + (True,) * (layers - dense),
                               sliding_windows=(None,) * layers)

    def engine(layout):
        return SimpleNamespace(block_span=lambda start, stop: (None, layout(start, stop)),
                               block_host_params=lambda start, end: ((),) * (end - start),
                               block_fetched_params=lambda start, end: ((),) * (end - start))

    resident, unlike = engine(lambda start, stop: None), engine(lambda start, stop: start)
    assert chain.chains(config(16), resident) and not chain.chains(config(12), resident)
    assert not chain.chains(config(4), resident)  # four blocks of one layer: no full block
    assert chain.chains(config(61, 3), resident) and not chain.chains(config(8, 3), resident)
    assert not chain.chains(config(61, 3), unlike)  # an engine that lays every block out its own way


@pytest.mark.quick
def test_alike_layers_share_one_program_and_sampling_matches_the_one_program_step(hf_checkpoints, monkeypatch):
    path, _ = hf_checkpoints["qwen3_moe_headdim_tied"]  # two alike layers
    whole = jmoe.load(path, progress=False)
    assert whole.step_chain is None  # no deeper than LAYERS_PER_PROGRAM
    monkeypatch.setattr(chain, "LAYERS_PER_PROGRAM", 1)
    assert chain.chains(whole.config, whole.engine)  # one program for its two layers: half of them
    model = chained(path, monkeypatch, 1)
    sampling = dict(max_new_tokens=10, temperature=0.9, top_k=20, seed=7)
    assert model.generate(PROMPT, **sampling) == whole.generate(PROMPT, **sampling)
    # per step shape (the prompt's 16-token bucket, decode): the embedding, one program for both layers, the head
    pieces = model.step_chain.pieces
    blocks = [key for key in pieces if key[0] in model.step_chain._layer_fns.values()]
    assert len(pieces) == 6 and len(blocks) == 2 and model.compiled_programs == 2
    model.generate(PROMPT, max_new_tokens=10)
    assert len(pieces) == 8 and model.compiled_programs == 4  # greedy steps add their own heads only
    # a step's HLO: its pieces in the order they run, the embedding, the one block program twice, the head
    assert [step["hlo"].count("HloModule ") for step in model.compiled_steps()] == [4] * 4


def test_forced_routing_reaches_each_block_s_own_layers(hf_checkpoints, monkeypatch):
    path, _ = hf_checkpoints["qwen2_moe_sparse_step_norm"]  # MoE layers 1 and 3 of 4: blocks [0], [1, 2], [3]
    whole, model = jmoe.load(path, progress=False), chained(path, monkeypatch, 2)
    rng = np.random.default_rng(0)
    num_moe, top_k, experts = whole.config.num_moe_layers, whole.config.num_experts_per_tok, whole.config.num_experts

    def forced(step, shape):
        return np.stack([rng.permutation(experts)[:top_k] for _ in range(num_moe * shape[0] * shape[1])]).reshape(
            num_moe, *shape, top_k)

    results = []
    for m in (whole, model):
        rng = np.random.default_rng(0)
        results.append(m.generate_detailed([PROMPT], 6, SamplingParams(0.0, 0, 1.0), routing_override=forced).tokens)
    assert results[0] == results[1]


@pytest.mark.parametrize("options", [{}, dict(cache=2, prefetch=1)], ids=["resident", "offloaded"])
def test_a_chained_model_serves_what_it_generates(options, hf_checkpoints, monkeypatch):
    """The serving engine's prefill (first chunks, later chunks, a conversation's second turn in the row its first
    left) and decode programs, chained and compiled by its program cache, as a batch with rows at different columns."""
    path, _ = hf_checkpoints["deepseek_v3_qlora_groups"]  # a dense first layer, MLA's latent cache written per row
    model = chained(path, monkeypatch, 1, **options)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, model.config.vocab_size, n).tolist() for n in (5, 40, 3)]
    lengths = (9, 4, 7)
    engine = ServingEngine(model, max_batch=2, context=64)
    programs = [*engine.prefill_programs.values(), *engine.decode_programs.values()]
    assert all(isinstance(program, chain.ChainedProgram) for program in programs)

    def serve(prompts):
        requests = [engine.submit(p, RequestParams(max_tokens=n, temperature=0.0, ignore_eos=True))
                    for p, n in zip(prompts, lengths)]
        for _ in range(500):
            if all(r.done for r in requests):
                return requests
            engine.step()
        raise AssertionError("the engine did not finish its requests")

    first = serve(prompts)
    second = serve([r.prompt + r.tokens + prompts[2] for r in first])
    for requests in (first, second):
        expected = [model.generate(r.prompt, max_new_tokens=n)[0] for r, n in zip(requests, lengths)]
        assert [r.tokens[:len(e)] for r, e in zip(requests, expected)] == expected  # generate stops at an EOS
    assert max(r.cached_tokens for r in second) > 0
