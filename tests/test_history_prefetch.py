"""History prefetch in the engine (prefetch_trace): the replay's recommended predictor, split between the
manager (scores from earlier tokens) and the step (this token's earlier layers), copying experts by the
replay's rule. Checked against the replay on the same routing, and for exactness."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmoe
import jmoe.api
from hf_models import VOCAB, write_checkpoint
from jmoe.decode import chain
from jmoe.decode.sampling import SamplingParams
from jmoe.kernels import ExpertWeights
from jmoe.memory import PINNED_HOST, sharding_for
from jmoe.offload.history_prefetch import BEST, best_predictor
from jmoe.offload.slots import LayerSlots, prefetch_by_score
from jmoe.offload.policies import make_policy
from jmoe.traces.forced_routing import TraceRouting
from jmoe.traces.load import load_trace, split_trace
from jmoe.traces.replay import replay

LAYERS, EXPERTS, TOP_K, CACHE = 4, 32, 4, 8  # GPT-OSS-20B's experts and top-k, 4 of its 24 layers


def markov_trace(tokens: int, seed: int) -> np.ndarray:
    """int [tokens, L, k]: routing with structure a history predictor can learn: each layer's experts
    mostly follow from the layer before's, and a token often repeats the previous token's choice."""
    rng = np.random.default_rng(seed)
    follow = rng.permutation(EXPERTS)
    trace = np.zeros((tokens, LAYERS, TOP_K), np.int64)
    for t in range(tokens):
        for layer in range(LAYERS):
            if t and rng.random() < 0.5:
                chosen = trace[t - 1, layer]
            elif layer and rng.random() < 0.8:
                chosen = follow[trace[t, layer - 1]]
            else:
                chosen = rng.choice(EXPERTS, TOP_K, replace=False)
            trace[t, layer] = chosen if len(set(chosen)) == TOP_K else rng.choice(EXPERTS, TOP_K, replace=False)
    return trace


def test_the_engine_split_of_the_scores_adds_up_to_the_predictor():
    trace = markov_trace(300, seed=1)
    predictor = best_predictor(trace[:200], EXPERTS)
    history, coming = trace[200:240], trace[240]
    base = predictor.next_token_base(history)
    within = predictor.within_token_evidence()
    split = base.copy()
    for index, lag in enumerate(predictor.within_token_lags()):
        for layer in range(lag, LAYERS):
            split[layer] += within[index, layer, coming[layer - lag]].sum(axis=0)
    np.testing.assert_allclose(split, predictor.scores(coming[None], history)[0], atol=1e-5)


@pytest.mark.parametrize("predicted", [[], [11], [11, 12, 13, 14, 15]])
@pytest.mark.quick
def test_a_step_copies_only_the_experts_the_rule_takes(predicted):
    """A layer's cache holds 4 experts in 8 slots; the predictor adds `predicted` (best first) to them. The
    step copies min(len(predicted), budget = 4) experts, each into a free slot, and says so: the copies run
    in a loop of that many trips (before issue 33, always 4 copies, the unwanted ones dropped writes)."""
    num_experts, d, f, cache = 16, 4, 3, 8
    rng = np.random.default_rng(0)
    host = jax.device_put(ExpertWeights(jnp.asarray(rng.standard_normal((num_experts, d, 2 * f)), jnp.float32),
                                        jnp.asarray(rng.standard_normal((num_experts, f, d)), jnp.float32)),
                          sharding_for(PINNED_HOST))
    held = np.array([5, 9, 2, 7, -1, -1, -1, -1])
    slot_of_expert = np.full(num_experts, -1)
    slot_of_expert[held[:4]] = np.arange(4)
    buffers = jax.tree.map(lambda a: jnp.zeros((cache, *a.shape[1:]), a.dtype).at[:4].set(np.asarray(a)[held[:4]]),
                           host)
    scores = np.full(num_experts, -1.0, np.float32)
    scores[held[:4]] = 5.0
    scores[np.array(predicted, int)] = 3.0 - 0.1 * np.arange(len(predicted))
    slots = LayerSlots(buffers, jnp.asarray(slot_of_expert, jnp.int32), jnp.asarray(held, jnp.int32))
    step = jax.jit(functools.partial(prefetch_by_score, **BEST))
    after, evicted, copied = step(slots, host, jnp.asarray(scores))
    taken = np.array(predicted[:BEST["budget"]], int)
    assert int(copied) == len(taken) and int(evicted) == 0
    expected_held = np.concatenate([held[:4], taken, np.full(4 - len(taken), -1)])
    np.testing.assert_array_equal(after.expert_in_slot, expected_held)
    for slot, expert in enumerate(expected_held):
        if expert >= 0:
            assert int(after.slot_of_expert[expert]) == slot
            np.testing.assert_array_equal(after.buffers.w_gate_up[slot], np.asarray(host.w_gate_up)[expert])
            np.testing.assert_array_equal(after.buffers.w_down[slot], np.asarray(host.w_down)[expert])
        else:
            assert not np.asarray(after.buffers.w_down[slot]).any()  # an empty slot stays unwritten


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("history") / "mixtral"
    write_checkpoint(directory, "mixtral", seed=3, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                     num_hidden_layers=LAYERS, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1)
    return directory


def test_engine_stall_free_rate_matches_the_replay(checkpoint):
    """GPT-OSS-20B's routing (its first 4 MoE layers): fitted on the tuning split, driven by 48 tokens of
    the report split."""
    split = split_trace(load_trace("gptoss"), None)
    tuning, rows = split["tune_ids"][:, :LAYERS], split["eval_ids"][:48, :LAYERS]
    predictor = best_predictor(tuning, EXPERTS)
    rates = {}
    for label, options in (("demand", {}), ("history", {"prefetch_trace": tuning})):
        model = jmoe.load(checkpoint, cache=CACHE, policy="lfru", progress=False, **options)
        routing = TraceRouting(rows, prompt_len=1, config=model.config)
        model.generate_detailed([[1]], routing.max_new_tokens, SamplingParams(), routing_override=routing)
        hits = sum(layer["hits"] for layer in model.stats())
        misses = sum(layer["misses"] for layer in model.stats())
        assert hits + misses == rows.size
        replayed = replay(rows, EXPERTS, CACHE, make_policy("lfru", LAYERS, EXPERTS),
                          predictor=predictor if options else None, prefetch_budget=BEST["budget"] if options else 0,
                          prefetch_min_gain=BEST["min_gain"] if options else 0.0)
        rates[label] = hits / rows.size
        assert abs(rates[label] - replayed["stall_free_rate"]) <= 0.02, (label, rates[label], replayed)
        # The engine copies what the replay copies (issue 33: no copies the rule does not take).
        copied = sum(layer["bytes_moved"] for layer in model.stats()) // model.placement_plan.expert_bytes
        assert copied <= 1.1 * replayed["bytes_moved"], (label, copied, replayed)
    assert rates["history"] > rates["demand"] + 0.1  # the replay: 0.49 -> 0.69


def test_history_prefetch_changes_no_result(checkpoint):
    prompts = [list(np.random.RandomState(i).randint(0, VOCAB, 6)) for i in range(3)]
    expected = jmoe.load(checkpoint, progress=False).generate(prompts, max_new_tokens=8)
    model = jmoe.load(checkpoint, cache=3, prefetch_trace=markov_trace(500, seed=5), progress=False)
    assert model.generate(prompts, max_new_tokens=8) == expected
    assert model.generate(prompts, max_new_tokens=8) == expected  # with the history of the first generation


@pytest.mark.quick
def test_bad_prefetch_trace(checkpoint, tmp_path):
    with pytest.raises(jmoe.InputError, match="either prefetch=2 .* or prefetch_trace"):
        jmoe.load(checkpoint, cache=3, prefetch=2, prefetch_trace=markov_trace(50, seed=0), progress=False)
    with pytest.raises(jmoe.InputError, match="expected a .npy routing trace"):
        jmoe.load(checkpoint, cache=3, prefetch_trace=tmp_path / "missing.npy", progress=False)
    with pytest.raises(jmoe.InputError, match=r"prefetch_trace: expert_ids: expected expert ids in \[0, 32\)"):
        jmoe.load(checkpoint, cache=3, prefetch_trace=np.full((10, LAYERS, TOP_K), 99), progress=False)
    wrong_layers = markov_trace(50, seed=0)[:, :3]
    with pytest.raises(jmoe.InputError, match="for 3 MoE layers x 32 experts, the model has 4 x 32"):
        jmoe.load(checkpoint, cache=3, prefetch_trace=wrong_layers, progress=False)


def test_a_chained_step_prefetches_what_the_one_program_step_prefetches(checkpoint, monkeypatch):
    """Blocks of one layer (jmoe.decode.chain): each block's first layer is predicted from the ids of every earlier
    layer of the token, handed on between the blocks, so the copies, hits and misses are the one program's."""
    trace = markov_trace(500, seed=5)
    rows = trace[400:448]
    options = dict(cache=CACHE, prefetch_trace=trace[:400], progress=False)
    whole = jmoe.load(checkpoint, **options)
    monkeypatch.setattr(chain, "LAYERS_PER_PROGRAM", 1)
    monkeypatch.setattr(jmoe.api, "chains", lambda config, engine: True)
    model = jmoe.load(checkpoint, **options)
    assert whole.step_chain is None and model.step_chain is not None
    for m in (whole, model):
        routing = TraceRouting(rows, prompt_len=1, config=m.config)
        m.generate_detailed([[1]], routing.max_new_tokens, SamplingParams(), routing_override=routing)
    assert model.stats() == whole.stats()
    assert sum(layer["bytes_moved"] for layer in model.stats()) > 0
    # one block program for the four layers per step shape (the one-token prompt, decode): the first block, handed
    # the embedding's carry, is alike the others
    assert len([key for key in model.step_chain.pieces if key[0] in model.step_chain._layer_fns.values()]) == 2
