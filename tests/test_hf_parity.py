"""jmoe computes what Hugging Face transformers computes, for every family and several shapes."""

import numpy as np
import pytest
import torch

import jmoe
from hf_models import FAMILY_CASES, VOCAB, BuiltOnFirstUse
from jmoe.model import attention

CASES = sorted(FAMILY_CASES)


@pytest.fixture(scope="module")
def loaded(hf_checkpoints):
    return BuiltOnFirstUse(lambda name: jmoe.load(hf_checkpoints[name][0], progress=False))


# Prompts of 1 and 13 tokens for every case (13 is past every sliding window); 5 tokens, which runs the same
# program at another length, only where it is a prompt of several tokens inside a sliding window (6).
LENGTHS = [(length, name) for name in CASES for length in (1, 5, 13)
           if length != 5 or FAMILY_CASES[name][1].get("sliding_window", 0) > length]


@pytest.mark.parametrize("length,name", [  # the quick tier: every family's 13-token prompt
    pytest.param(length, name, id=f"{length}-{name}", marks=[pytest.mark.quick] if length == 13 else [])
    for length, name in LENGTHS])
def test_logits_match_transformers(name, length, hf_checkpoints, loaded):
    ids = np.random.RandomState(length).randint(0, VOCAB, (2, length))
    ref = hf_checkpoints[name][1](torch.tensor(ids)).logits.detach().numpy()
    out = np.asarray(loaded[name].logits(ids))
    assert out.dtype == np.float32 and out.shape == ref.shape
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", CASES)
def test_greedy_32_tokens_match_transformers_generate(name, hf_checkpoints, loaded):
    prompt = list(np.random.RandomState(7).randint(0, VOCAB, 9))
    ref = hf_checkpoints[name][1].generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)
    assert loaded[name].generate(prompt, max_new_tokens=32)[0] == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", ["mixtral_e8k3_mqa_tied_window", "qwen2_moe_shared_dense",
                                  "deepseek_v3_yarn_plain_q"])  # MLA: absorbed decode against expanded prefill
def test_kv_cached_decoding_equals_full_recompute(name, loaded):
    """Greedy tokens from the KV-cached decode loop are the argmax of a cache-free forward over the result."""
    model = loaded[name]
    prompt = list(np.random.RandomState(3).randint(0, VOCAB, 5))
    generated = model.generate(prompt, max_new_tokens=12)[0]
    logits = np.asarray(model.logits([prompt + generated[:-1]]))[0]
    assert np.argmax(logits[len(prompt) - 1:], axis=-1).tolist() == generated


def test_batch_of_different_lengths_equals_one_by_one(loaded):
    model = loaded["qwen3_moe_headdim_tied"]
    rng = np.random.RandomState(11)
    prompts = [list(rng.randint(0, VOCAB, n)) for n in (3, 17, 8)]
    batched = model.generate(prompts, max_new_tokens=10)
    assert batched == [model.generate(p, max_new_tokens=10)[0] for p in prompts]


@pytest.mark.parametrize("name", ["gpt_oss_e4k2_window", "mixtral_e8k3_mqa_tied_window", "olmoe_e8k4_clip",
                                  "qwen3_moe_headdim_tied"])  # sinks, sliding windows, clipping, q/k norms
def test_prompts_attended_in_causal_query_blocks_match_transformers(name, hf_checkpoints, monkeypatch):
    """Blocks of 4 queries (128 in use) over left-padded prompts of 13 and 9 tokens: each block reads only the keys
    up to its last query, and the logits are transformers' still."""
    monkeypatch.setattr(attention, "MIN_CAUSAL_BLOCK", 4)
    assert attention.causal_block_bounds(13) == (4, 8, 13)
    model = jmoe.load(hf_checkpoints[name][0], progress=False)  # its own compiled steps, traced with the blocks
    rng = np.random.RandomState(5)
    prompts = [list(rng.randint(0, VOCAB, n)) for n in (13, 9)]
    for prompt in prompts:
        ref = hf_checkpoints[name][1](torch.tensor([prompt])).logits.detach().numpy()
        np.testing.assert_allclose(np.asarray(model.logits([prompt])), ref, atol=1e-4, rtol=0)
        expected = hf_checkpoints[name][1].generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
        assert model.generate(prompt, max_new_tokens=6)[0] == expected[0, len(prompt):].tolist()
    assert model.generate(prompts, max_new_tokens=6) == [model.generate(p, max_new_tokens=6)[0] for p in prompts]
