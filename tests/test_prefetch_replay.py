"""Predictors (jmoe.offload.predictors), their evaluation and replay with prefetch (jmoe.traces, bench/replay.py)."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jmoe.traces.replay as replay_module
from jmoe.offload.policies import make_policy
from jmoe.offload.predictors import (
    Predictor,
    load_predictor,
    make_predictor,
    step_before,
    steps_back,
    top_experts,
)
from jmoe.traces.evaluation import precision_recall
from jmoe.traces.load import CROSSLAYER_TABLE, TraceError, load_trace, split_trace
from jmoe.traces.replay import PREFETCH_SETTINGS, build_predictor, prefetch_step, replay, run_one
from replay_cli import run_cli

# E = 4, L = 2, k = 1; rows are tokens, columns layers.
SMALL = np.array([[0, 1], [0, 2], [1, 2], [0, 1]], dtype=np.int64)[:, :, None]


def test_step_before_follows_layer_order():
    # (t, 1) follows (t, 0); (t, 0) follows (t - 1, 1); nothing precedes (0, 0) without history.
    assert step_before(SMALL)[:, :, 0].tolist() == [[-1, 0], [1, 0], [2, 1], [2, 0]]
    assert step_before(SMALL, history=np.array([[[3], [2]]]))[0, 0, 0] == 2


def test_steps_back_counts_steps_across_tokens():
    # Steps in order: (0,0)=0 (0,1)=1 (1,0)=0 (1,1)=2 (2,0)=1 (2,1)=2 (3,0)=0 (3,1)=1.
    np.testing.assert_array_equal(steps_back(SMALL, None, 1), step_before(SMALL))
    assert steps_back(SMALL, None, 3)[:, :, 0].tolist() == [[-1, -1], [-1, 0], [1, 0], [2, 1]]
    # Lag L = 2: the same layer at the previous token.
    assert steps_back(SMALL, None, 2)[1:, :, 0].tolist() == SMALL[:-1, :, 0].tolist()
    assert steps_back(SMALL, np.array([[[3], [2]]]), 3)[0, :, 0].tolist() == [-1, 3]
    with pytest.raises(ValueError, match="lag >= 1"):
        steps_back(SMALL, None, 0)


@pytest.mark.quick
def test_previous_token_precision_recall_hand_computed():
    # Each step predicts the expert its layer used at the previous token (none at t0).
    # Layer 0: t1 {0} vs 0 yes, t2 {0} vs 1 no, t3 {1} vs 0 no -> 1 correct of 3 predicted,
    # of 4 used. Layer 1: t1 {1} vs 2 no, t2 {2} vs 2 yes, t3 {2} vs 1 no -> 1 of 3, of 4.
    predictor = make_predictor("previous").fit(SMALL, 4)
    result = precision_recall(predictor.predict(SMALL), SMALL)
    assert result["layer_precision"] == pytest.approx([1 / 3, 1 / 3])
    assert result["layer_recall"] == pytest.approx([1 / 4, 1 / 4])
    assert (result["precision"], result["recall"]) == pytest.approx((2 / 6, 2 / 8))
    assert result["predicted_per_step"] == pytest.approx(6 / 8)


@pytest.mark.quick
def test_crosslayer_precision_recall_hand_computed():
    # Fitted on SMALL itself, count 1, smoothing 1. With k = 1 the score is log P(b | a).
    # Layer 1 (step before = layer 0 of the same token): pairs 0->1, 0->2, 1->2, 0->1.
    #   prior P(b) = (used + 1) / (steps + 2): b1 = b2 = 3/6, b0 = b3 = 1/6.
    #   P(1 | 0) = (2 + 1 * 3/6) / (3 + 1) = 0.625 > P(2 | 0) = (1 + 0.5) / 4 = 0.375 -> 1;
    #   P(2 | 1) = (1 + 0.5) / 2 = 0.75 > P(1 | 1) = 0.25 -> 2.
    #   Predictions t0..t3: 1, 1, 2, 1 vs used 1, 2, 2, 1 -> 3 of 4.
    # Layer 0 (step before = layer 1 of the previous token): pairs 1->0, 2->1, 2->0 (t0 has none).
    #   prior: b0 = (2 + 1) / 5 = 0.6, b1 = 0.4, b2 = b3 = 0.2.
    #   t0: prior only -> 0 (used 0, yes). t1: a = 1: P(0 | 1) = (1 + 0.6) / 2 = 0.8 -> 0 (yes).
    #   t2, t3: a = 2: P(0 | 2) = (1 + 0.6) / 3 > P(1 | 2) = (1 + 0.4) / 3 -> 0: t2 no, t3 yes.
    #   -> 3 of 4.
    predictor = make_predictor("crosslayer", count=1).fit(SMALL, 4)
    scores = predictor.scores(SMALL)
    assert scores[1, 1, 1] == pytest.approx(np.log(0.625), rel=1e-6)
    assert scores[0, 0].argmax() == 0 and scores[0, 0, 0] == pytest.approx(np.log(0.6), rel=1e-6)
    assert predictor.predict(SMALL)[:, :, :].argmax(axis=2).tolist() == [[0, 1], [0, 1], [0, 2], [0, 1]]
    result = precision_recall(predictor.predict(SMALL), SMALL)
    assert result["layer_precision"] == pytest.approx([3 / 4, 3 / 4])
    assert result["layer_recall"] == pytest.approx([3 / 4, 3 / 4])


def test_lags_token_evidence_hand_computed():
    # Only the same layer's previous token (lag L = 2 steps), no recency, fitted on SMALL.
    # Layer 0 at lag 2: pairs 0->0 (t1), 0->1 (t2), 1->0 (t3); steps 3, used e0 2, e1 1:
    #   P(b) = (used + 1) / 5: e0 0.6, e1 0.4; the lag-1 prior of layer 0 is the same here.
    #   t2 (previous token used 0): P(1 | 0) = (1 + 0.4) / (2 + 1), P(0 | 0) = (1 + 0.6) / 3.
    predictor = make_predictor("lags", step_weights=(0.0,), token_weight=1.0,
                               recency_weight=0.0).fit(SMALL, 4)
    scores = predictor.scores(SMALL)
    assert scores[2, 0, 1] == pytest.approx(np.log(1.4 / 3), rel=1e-6)
    assert scores[2, 0, 0] == pytest.approx(np.log(1.6 / 3), rel=1e-6)
    assert scores[0, 0, 0] == pytest.approx(np.log(0.6), rel=1e-6)  # no previous token: prior
    assert set(predictor.tables) == {1, 2}  # lag 1 for the prior, lag 2 for the evidence


def test_lags_with_one_step_equals_mix():
    trace = random_trace(1, 60, 3, 6, 2)
    mix = make_predictor("mix", recency_decay=0.8, context=32).fit(trace, 6)
    lags = make_predictor("lags", step_weights=(1.0,), token_weight=0.0, recency_decay=0.8,
                          recency_weight=mix.recency_weight).fit(trace, 6)
    np.testing.assert_allclose(lags.scores(trace), mix.scores(trace), rtol=1e-5, atol=1e-5)


def test_lags_copy_tables_from_equals_a_fit():
    trace = random_trace(2, 60, 3, 6, 2)
    fitted = make_predictor("lags").fit(trace, 6)
    weights = {"step_weights": (1.0, 0.2), "token_weight": 0.5, "recency_weight": 0.0}
    copied = make_predictor("lags", **weights).copy_tables_from(fitted)
    np.testing.assert_array_equal(copied.scores(trace),
                                  make_predictor("lags", **weights).fit(trace, 6).scores(trace))
    with pytest.raises(ValueError, match="tables for lags"):
        make_predictor("lags", step_weights=(1.0, 1.0, 1.0, 1.0)).copy_tables_from(fitted)


def test_lags_scores_do_not_depend_on_chunking():
    trace = random_trace(4, 40, 3, 6, 2)
    predictor = make_predictor("lags", step_weights=(0.7, 0.5, 0.3, 0.2), token_weight=0.3,
                               recency_context=1).fit(trace, 6)
    assert predictor.context == 2  # lag 4 steps reaches 2 tokens back from layer 0
    whole = predictor.scores(trace)
    parts = [predictor.scores(trace[s : s + 3], trace[max(0, s - 2) : s]) for s in range(0, 40, 3)]
    np.testing.assert_allclose(np.concatenate(parts), whole, rtol=1e-6, atol=1e-6)


def test_prefetch_min_gain_skips_swaps_not_free_slots():
    # One layer, E = 4, C = 2; predicted {1, 2}; scores e0 0.5, e1 3, e2 2, e3 0.
    scores = np.array([[0.5, 3.0, 2.0, 0.0]])
    predicted = np.array([[False, True, True, False]])
    order = np.argsort(-scores, axis=1, kind="stable")

    def step(resident_ids, min_gain):
        resident = np.zeros((1, 4), dtype=bool)
        resident[0, resident_ids] = True
        fetched = prefetch_step(scores, predicted, order, resident,
                                resident.sum(axis=1), 2, 2, min_gain)
        return fetched, np.flatnonzero(resident[0]).tolist()

    # Full cache {0, 1}: fetching 2 evicts 0, a gain of 2 - 0.5 = 1.5.
    fetched, resident = step([0, 1], 1.0)
    assert fetched[0].tolist() == [False, False, True, False] and resident == [1, 2]
    assert step([0, 1], 2.0) == (None, [0, 1])
    # One free slot {0}: 1 goes there whatever the gain; 2 would evict 0 (gain 1.5) and waits.
    fetched, resident = step([0], 100.0)
    assert fetched[0].tolist() == [False, True, False, False] and resident == [0, 1]


def test_top_experts_threshold_and_ties():
    scores = np.array([[0.5, 0.9, 0.5, 0.1]])
    # 0.9 first; experts 0 and 2 tie at 0.5 and the lower id, 0, is taken.
    assert top_experts(scores, 2).tolist() == [[True, True, False, False]]
    assert top_experts(scores, 3, min_score=0.6).tolist() == [[False, True, False, False]]
    assert not top_experts(scores, 0).any()


def test_mix_scores_do_not_depend_on_chunking():
    rng = np.random.default_rng(0)
    trace = np.stack([rng.permutation(6)[:2] for _ in range(60 * 3)]).reshape(60, 3, 2)
    predictor = make_predictor("mix", recency_decay=0.5, context=5).fit(trace, 6)
    whole = predictor.scores(trace)
    parts = [predictor.scores(trace[s : s + 7], trace[max(0, s - 5) : s]) for s in range(0, 60, 7)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)


class ScriptedPredictor(Predictor):
    """Scores fixed up front (one row per token of the trace it will be replayed on)."""

    name = "scripted"

    def __init__(self, table, count=1):
        super().__init__(count, min_score=0.5)
        self.table = np.asarray(table, dtype=np.float32)
        self.num_experts = self.table.shape[-1]

    def scores(self, expert_ids, history=None):
        start = 0 if history is None else len(history)  # context 0: history is always empty
        return self.table[start : start + len(expert_ids)]


def scripted(predicted_ids, num_experts):
    """A scripted one-layer predictor naming one expert per token (score 1, others 0)."""
    table = np.zeros((len(predicted_ids), 1, num_experts))
    table[np.arange(len(predicted_ids)), 0, predicted_ids] = 1.0
    return ScriptedPredictor(table)


@pytest.mark.quick
def test_prefetch_replay_hand_computed():
    # E = 4, k = 1, C = 2, one layer, LRU, budget 1. Trace 0 1 2 0 3, predictions 1 1 2 3 3.
    # t0: fetch 1 (free slot) -> {1}; 0 stalls, demand copy -> {0, 1}.
    # t1: 1 predicted and resident, no copy; 1 hits.
    # t2: fetch 2; victims outside {2} score 0, tie -> lower id 0 goes -> {1, 2}; 2 hits (used).
    # t3: fetch 3; victim 1 (tie, lower id) -> {2, 3}; 0 stalls: LRU evicts 3 (never used)
    #     rather than 2 (used at t2) -> {0, 2}.
    # t4: fetch 3; victim 0 (tie, lower id) -> {2, 3}; 3 hits (used).
    # Stalls: t0, t3 -> stall-free 3/5; prefetches 4 (2 used); bytes 2 + 4 = 6.
    trace = np.array([0, 1, 2, 0, 3]).reshape(-1, 1, 1)
    result = replay(trace, 4, 2, make_policy("lru", 1, 4),
                    predictor=scripted([1, 1, 2, 3, 3], 4), prefetch_budget=1)
    assert (result["misses"], result["demand_copies"]) == (2, 2)
    assert result["stall_free_rate"] == pytest.approx(3 / 5) == result["hit_rate"]
    assert (result["prefetches"], result["prefetches_used"], result["bytes_moved"]) == (4, 2, 6)
    # Demand LRU on the same trace misses every access: 0 | 0 1 | 1 2 | 2 0 | 0 3.
    demand = replay(trace, 4, 2, make_policy("lru", 1, 4))
    assert (demand["hits"], demand["bytes_moved"], demand["stall_free_rate"]) == (0, 5, 0.0)


def test_budget_zero_and_full_room_limits():
    # Budget 0 fetches nothing. With C = k = 1 the predicted expert may still replace the
    # resident one (it is outside the predicted set), but never more than one per step.
    trace = np.array([0, 1, 2]).reshape(-1, 1, 1)
    none = replay(trace, 4, 1, make_policy("lru", 1, 4),
                  predictor=scripted([0, 1, 2], 4), prefetch_budget=0)
    assert (none["prefetches"], none["misses"]) == (0, 3)
    exact = replay(trace, 4, 1, make_policy("lru", 1, 4),
                   predictor=scripted([0, 1, 2], 4), prefetch_budget=1)
    assert (exact["prefetches"], exact["misses"], exact["bytes_moved"]) == (3, 0, 3)


def random_trace(seed, num_tokens, num_layers, num_experts, top_k):
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(np.full(num_experts, 0.5), size=num_layers)
    trace = np.empty((num_tokens, num_layers, top_k), dtype=np.int64)
    for t in range(num_tokens):
        for layer in range(num_layers):
            trace[t, layer] = rng.choice(num_experts, top_k, replace=False, p=weights[layer])
    return trace


@settings(deadline=None, max_examples=40)
@given(
    st.integers(0, 2**31 - 1),
    st.integers(3, 8),  # experts
    st.integers(1, 3),  # k
    st.integers(0, 4),  # budget
    st.sampled_from(["previous", "frequency", "crosslayer", "mix", "lags"]),
    st.integers(1, 8),  # predicted set size
    st.sampled_from([0.0, 0.5, 2.0]),  # min_gain
)
@pytest.mark.quick
def test_prefetch_bound_and_capacity_are_never_exceeded(seed, num_experts, top_k, budget, name,
                                                        count, min_gain):
    top_k = min(top_k, num_experts)
    trace = random_trace(seed, 30, 3, num_experts, top_k)
    capacity = int(np.random.default_rng(seed).integers(top_k, num_experts + 1))
    predictor = make_predictor(name, count=count).fit(trace[:15], num_experts)
    seen = []
    original = replay_module.prefetch_step

    def spy(scores, predicted, order, resident, resident_count, cap, bound, min_gain):
        fetched = original(scores, predicted, order, resident, resident_count, cap, bound,
                           min_gain)
        if fetched is not None:
            seen.append(fetched.sum(axis=1).max())
            assert (fetched <= resident).all()  # what was fetched is resident now
            assert (resident.sum(axis=1) <= cap).all()
        return fetched

    replay_module.prefetch_step = spy  # replay() looks the name up in its module at each call
    try:
        result = replay(trace, num_experts, capacity,
                        make_policy("lru", 3, num_experts), chunk=7,
                        predictor=predictor, prefetch_budget=budget,
                        prefetch_min_gain=min_gain)
    finally:
        replay_module.prefetch_step = original
    assert max(seen, default=0) <= budget
    assert sum(result["layer_prefetches"]) == result["prefetches"]
    assert max(result["layer_prefetches"]) <= budget * len(trace)
    assert result["bytes_moved"] == result["misses"] + result["prefetches"]


@pytest.mark.parametrize("policy_name", ["lru", "lfu", "lfru"])
def test_empty_predictor_equals_demand_replay(policy_name):
    trace = random_trace(3, 80, 4, 8, 2)
    demand = replay(trace, 8, 4, make_policy(policy_name, 4, 8))
    # count 0 predicts nothing; "previous" predicts experts that are always still resident
    # (nothing touches a layer's cache between two of its steps but its own prefetch).
    for predictor in [make_predictor("mix", count=0).fit(trace, 8),
                      make_predictor("previous").fit(trace, 8)]:
        result = replay(trace, 8, 4, make_policy(policy_name, 4, 8),
                        predictor=predictor, prefetch_budget=4)
        assert result["prefetches"] == 0
        for key in ["hits", "misses", "bytes_moved", "layer_hit_rate", "stall_free_rate"]:
            assert result[key] == demand[key]
    assert demand["stall_free_rate"] == demand["hit_rate"]


def test_replay_chunking_does_not_change_prefetch_results():
    trace = random_trace(5, 50, 3, 6, 2)
    predictor = make_predictor("mix", context=4).fit(trace, 6)
    runs = [replay(trace, 6, 3, make_policy("lru", 3, 6), chunk=chunk,
                   predictor=predictor, prefetch_budget=2) for chunk in (7, 2048)]
    assert runs[0] == runs[1]


def test_cli_json_has_stall_free_rate():
    code, out, _ = run_cli(["--trace", "olmoe", "--cache", "16", "--policy", "lru", "--json"])
    demand = json.loads(out)
    assert code == 0 and demand["stall_free_rate"] == demand["hit_rate"]
    code, out, _ = run_cli(["--trace", "olmoe", "--cache", "16", "--policy", "lru",
                            "--prefetch", "mix", "--prefetch-budget", "3", "--json"])
    result = json.loads(out)
    assert code == 0
    assert result["prefetch"] == "mix" and result["prefetch_budget"] == 3
    assert result["bytes_moved"] == result["demand_copies"] + result["prefetches"]
    assert result["stall_free_rate"] == pytest.approx(1 - result["misses"] / result["accesses"])
    assert result["prefetches"] <= 3 * result["tokens"] * result["layers"]


def test_cli_gptoss_best_runs_over_its_tuned_policy():
    code, out, _ = run_cli(["--trace", "gptoss", "--cache", "8", "--policy", "lru", "--prefetch",
                            "best", "--datasets", "Polyglot-or-Not_Fact-Completion", "--json"])
    assert code == 0
    result = json.loads(out)
    assert result["tokens"] == 1188 and result["prefetch"] == "best"
    best = PREFETCH_SETTINGS["best"]
    assert result["policy"] == best["policy"] and "not --policy lru" in result["note"]
    assert result["prefetch_min_gain"] == best["min_gain"]
    demand = run_one("gptoss", 8, "lru", ["Polyglot-or-Not_Fact-Completion"])
    assert result["stall_free_rate"] > demand["stall_free_rate"]  # prefetch is worth something


def test_gptoss_crosslayer_uses_the_shipped_table():
    trace = load_trace("gptoss")
    predictor = build_predictor("mix", trace, split_trace(trace))
    # The command recorded in the shipped table when it was fitted (before bench/ became a package).
    assert predictor.provenance["command"] == "python bench/replay.py --fit-table"


def test_shipped_table_is_the_mmlu_fit():
    shipped = load_predictor(CROSSLAYER_TABLE)
    assert shipped.provenance["split"] == "tuning split (datasets starting with 'mmlu')"
    trace = load_trace("gptoss")
    refit = make_predictor("crosslayer").fit(split_trace(trace)["tune_ids"], 32)
    for key, counts in refit.counts.items():
        np.testing.assert_array_equal(shipped.counts[key], counts)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--prefetch", "oracle"],
         "expected one of previous, frequency, crosslayer, mix, lags, best (predictors: "
         "previous, frequency, crosslayer, mix, lags)"),
        (["--prefetch", "mix", "--prefetch-budget", "-1"], "found --prefetch-budget -1"),
        (["--prefetch-budget", "2"], "--prefetch-budget needs --prefetch NAME"),
        (["--prefetch", "mix", "--policy", "belady"], "belady needs the future"),
        (["--prefetch", "mix", "--policy", "static"], "static never changes its slots"),
    ],
)
def test_cli_bad_prefetch_input(argv, expected):
    code, out, err = run_cli(["--trace", "olmoe", "--cache", "16", "--json"] + argv)
    assert code == 2 and out == ""
    assert expected in err


@pytest.mark.quick
def test_predictor_library_errors():
    with pytest.raises(ValueError, match="known predictors: previous, frequency, crosslayer, mix, lags"):
        make_predictor("router")
    with pytest.raises(ValueError, match="not fitted"):
        make_predictor("crosslayer").scores(SMALL)
    with pytest.raises(ValueError, match=r"expected expert ids in \[0, 2\)"):
        make_predictor("previous").fit(SMALL, 2)
    with pytest.raises(ValueError, match="count >= 0"):
        make_predictor("mix", count=-1)
    with pytest.raises(ValueError, match="history"):
        make_predictor("previous").fit(SMALL, 4).scores(SMALL, history=np.zeros((1, 3, 1), int))
    with pytest.raises(TraceError, match="prefetch budget >= 0"):
        replay(SMALL, 4, 1, make_policy("lru", 2, 4),
               predictor=make_predictor("previous").fit(SMALL, 4), prefetch_budget=-2)
