"""Trace replay (jmoe.traces, CLI bench/replay.py): hand-computed hit counts, Belady optimality, CLI, errors."""

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jmoe.errors import JmoeError
from jmoe.offload.policies import CachePolicy, LFRUPolicy, StaticPolicy, make_policy
from jmoe.traces.belady import BeladyOracle
from jmoe.traces.load import TRACE_FILES, TraceError, frequency_table, load_trace, split_trace, write_trace_starts
from jmoe.traces.replay import replay
from replay_cli import REPO_ROOT, run_cli


def one_layer(sequence):
    """A k=1, one-layer trace [T, 1, 1] from a list of expert ids."""
    return np.array(sequence, dtype=np.int64).reshape(-1, 1, 1)


def run(trace, num_experts, capacity, policy):
    if policy == "belady":
        policy = BeladyOracle(trace, num_experts)
    elif isinstance(policy, str):
        policy = make_policy(policy, trace.shape[1], num_experts)
    return replay(trace, num_experts, capacity, policy)


# E = 4, k = 1, C = 2. Expert 0 is hot, 1 and 2 alternate around it.
HOT_SEQUENCE = [0, 0, 0, 1, 2, 0, 1, 2, 0]


@pytest.mark.quick
def test_lru_hand_computed():
    # t0 0 miss {0}; t1, t2 hits; t3 1 miss {0,1}; t4 2 miss, LRU victim 0 (last t2) -> {1,2};
    # t5 0 miss, victim 1 (t3) -> {2,0}; t6 1 miss, victim 2 (t4) -> {0,1};
    # t7 2 miss, victim 0 (t5) -> {1,2}; t8 0 miss. Hits: t1, t2 = 2.
    result = run(one_layer(HOT_SEQUENCE), 4, 2, "lru")
    assert (result["hits"], result["accesses"], result["bytes_moved"]) == (2, 9, 7)
    assert result["hit_rate"] == pytest.approx(2 / 9)


@pytest.mark.quick
def test_lfu_hand_computed():
    # t0 miss {0}; t1, t2 hits (count 0 = 3); t3 1 miss {0,1}; t4 2 miss, victim 1 (1 < 3)
    # -> {0,2}; t5 hit (0 = 4); t6 1 miss, victim 2 (1 < 4) -> {0,1}; t7 2 miss, victim 1
    # (2 < 4) -> {0,2}; t8 hit. Hits: t1, t2, t5, t8 = 4.
    result = run(one_layer(HOT_SEQUENCE), 4, 2, "lfu")
    assert (result["hits"], result["bytes_moved"]) == (4, 5)


@pytest.mark.quick
def test_lfru_hand_computed():
    # decay 0.5, recency_weight 1. priority = freq / (1 + recency) at the time of the miss.
    # t0 miss {0}: f0 = 1. t1 hit: f0 = 1.5. t2 hit: f0 = 1.75 (last use t2).
    # t3 1 miss, free slot -> {0,1}: f0 = .875, f1 = 1 (last t3).
    # t4 2 miss: 0 -> .875 / (1 + 1) = .4375, 1 -> 1 / 1 = 1: victim 0 -> {1,2}.
    #    f0 = .4375, f1 = .5, f2 = 1 (last t4).
    # t5 0 miss: 1 -> .5 / 2 = .25, 2 -> 1: victim 1 -> {2,0}. f0 = 1.21875, f1 = .25, f2 = .5.
    # t6 1 miss: 2 -> .5 / 2 = .25, 0 -> 1.21875: victim 2 -> {0,1}. f0 = .609, f1 = 1.125.
    # t7 2 miss: 0 -> .609 / 2 = .305, 1 -> 1.125: victim 0 -> {1,2}. t8 0 miss. Hits = 2.
    policy = LFRUPolicy(1, 4, decay=0.5, recency_weight=1.0)
    assert run(one_layer(HOT_SEQUENCE), 4, 2, policy)["hits"] == 2
    # With slow decay and no recency term it behaves like LFU here: 4 hits.
    policy = LFRUPolicy(1, 4, decay=0.99, recency_weight=0.0)
    assert run(one_layer(HOT_SEQUENCE), 4, 2, policy)["hits"] == 4


@pytest.mark.quick
def test_belady_hand_computed():
    # t0 miss {0}; t1, t2 hits; t3 1 miss {0,1}; t4 2 miss: next use 0 -> t5, 1 -> t6:
    # victim 1 -> {0,2}; t5 hit; t6 1 miss: next 0 -> t8, 2 -> t7: victim 0 -> {2,1};
    # t7 hit; t8 0 miss. Hits: t1, t2, t5, t7 = 4.
    assert run(one_layer(HOT_SEQUENCE), 4, 2, "belady")["hits"] == 4


def test_belady_evicts_never_used_again_first_then_lower_id():
    # C = 2: t0 0, t1 1 fill; t2 2 miss: neither 0 nor 1 is used again -> victim 0 (lower id)
    # -> {1,2}; t3 1 hit; t4 0 miss: 2 never used again -> victim 2 -> {1,0}; t5 1 hit.
    result = run(one_layer([0, 1, 2, 1, 0, 1]), 4, 2, "belady")
    assert result["hits"] == 2


def test_static_pinned_set_and_bytes_moved():
    # frequency [1, 5, 3, 0], C = 2 -> pinned {1, 2}; hits are the accesses to 1 or 2:
    # t3, t4, t6, t7 = 4; the 5 misses are streamed; bytes = 2 (initial load) + 5 = 7.
    policy = StaticPolicy(1, 4, frequency=np.array([[1, 5, 3, 0]]))
    result = run(one_layer(HOT_SEQUENCE), 4, 2, policy)
    assert (result["hits"], result["bytes_moved"], result["initial_load"]) == (4, 7, 2)


def test_lru_two_layers_k2_never_evicts_a_needed_expert():
    # E = 4, k = 2, C = 3, two layers replayed independently.
    # Layer 0: {0,1}, {2,3}, {0,2}. t0 fill {0,1}. t1 needs 2, 3 (both miss), one free slot:
    #   evict one of 0, 1 (both last used t0) -> lower id 0 -> {1,2,3}. t2 needs 0 (miss), 2
    #   (hit): evict among 1 (t0) and 3 (t1) -> 1 -> {0,2,3}. Hits: 1.
    # Layer 1: {3,2}, {3,1}, {0,1}. t0 fill {2,3}; t1 3 hit, 1 fills the free slot;
    #   t2 1 hit, 0 miss: evict among 2 (t0), 3 (t1) -> 2. Hits: 2.
    trace = np.array([
        [[0, 1], [3, 2]],
        [[2, 3], [3, 1]],
        [[0, 2], [0, 1]],
    ])
    result = run(trace, 4, 3, "lru")
    assert result["hits"] == 3
    assert result["accesses"] == 12
    assert result["bytes_moved"] == 9
    assert result["layer_hit_rate"] == pytest.approx([1 / 6, 2 / 6])


def optimal_hits(sequence_sets, capacity):
    """Brute force: the most hits any demand cache of ``capacity`` slots can get on one layer,
    where each step's experts must all be resident at once."""
    best = {frozenset(): 0}
    for needed in sequence_sets:
        needed = frozenset(needed)
        following = {}
        for state, hits in best.items():
            gained = hits + len(needed & state)
            optional = sorted(state - needed)
            room = capacity - len(needed)
            for size in range(0, min(room, len(optional)) + 1):
                for kept in itertools.combinations(optional, size):
                    nxt = needed | frozenset(kept)
                    if following.get(nxt, -1) < gained:
                        following[nxt] = gained
        best = following
    return max(best.values())


small_traces = st.integers(3, 6).flatmap(
    lambda num_experts: st.integers(1, 2).flatmap(
        lambda top_k: st.tuples(
            st.just(num_experts),
            st.just(top_k),
            st.integers(top_k, num_experts),
            st.lists(
                st.lists(
                    st.permutations(range(num_experts)).map(lambda p: list(p[:top_k])),
                    min_size=1, max_size=1,
                ),
                min_size=1, max_size=10,
            ),
        )
    )
)


@settings(deadline=None, max_examples=60)
@given(small_traces)
@pytest.mark.quick
def test_belady_matches_brute_force_optimum(case):
    num_experts, top_k, capacity, rows = case
    trace = np.array(rows, dtype=np.int64)  # [T, 1, k]
    assert run(trace, num_experts, capacity, "belady")["hits"] == optimal_hits(
        [row[0] for row in rows], capacity
    )


@settings(deadline=None, max_examples=30)
@given(
    st.integers(0, 2**31 - 1),
    st.integers(4, 8),  # experts
    st.integers(1, 3),  # k
    st.integers(20, 80),  # tokens
)
def test_belady_is_never_beaten(seed, num_experts, top_k, num_tokens):
    rng = np.random.default_rng(seed)
    num_layers = 3
    # Skewed popularity so that policies actually differ.
    weights = rng.dirichlet(np.full(num_experts, 0.5), size=num_layers)
    trace = np.empty((num_tokens, num_layers, top_k), dtype=np.int64)
    for layer in range(num_layers):
        for t in range(num_tokens):
            trace[t, layer] = rng.choice(num_experts, top_k, replace=False, p=weights[layer])
    capacity = int(rng.integers(top_k, num_experts + 1))
    belady = run(trace, num_experts, capacity, "belady")["hits"]
    for policy in ["lru", "lfu", "lfru", RandomPriority(num_layers, num_experts, seed)]:
        assert run(trace, num_experts, capacity, policy)["hits"] <= belady


class RandomPriority(CachePolicy):
    """Admits every miss, evicts at random: any admitting policy must lose to Belady."""

    name = "random"

    def __init__(self, num_layers, num_experts, seed):
        super().__init__(num_layers, num_experts)
        self.rng = np.random.default_rng(seed)

    def update(self, counts):
        pass

    def priority(self):
        return self.rng.random(self.shape)


def test_static_is_outside_beladys_class():
    # Belady is optimal among caches that admit every miss. Static does not: it starts with its
    # pinned set and streams misses through scratch without evicting, so it can beat Belady.
    # E = 2, k = 1, C = 1, trace 0 1 0 1 0 1: Belady must admit each miss, which evicts the
    # other expert, so every access misses -> 0 hits. Static pins expert 0 (frequency 4 > 3)
    # from the start and streams the 1s -> the three accesses to 0 hit.
    trace = one_layer([0, 1, 0, 1, 0, 1])
    assert run(trace, 2, 1, "belady")["hits"] == 0
    static = StaticPolicy(1, 2, frequency=np.array([[4, 3]]))
    assert run(trace, 2, 1, static)["hits"] == 3


def test_full_cache_hits_everything_after_first_use():
    trace = np.array([[[0, 1]], [[2, 3]], [[1, 2]], [[3, 0]]])  # E = 4, k = 2
    for policy in ["lru", "lfu", "lfru", "belady"]:
        result = run(trace, 4, 4, policy)
        assert result["hits"] == 4  # only the first use of each expert misses
        assert result["bytes_moved"] == 4


def test_frequency_table_counts_per_layer():
    trace = np.array([[[0, 1], [2, 3]], [[0, 2], [2, 1]]])
    assert frequency_table(trace, 4).tolist() == [[2, 1, 1, 0], [0, 1, 2, 1]]


def test_gptoss_split_keeps_tuning_and_reporting_apart():
    trace = load_trace("gptoss")
    split = split_trace(trace)
    assert len(split["eval_ids"]) == 62993  # gpqa_*, sorry_bench, tulu3, Polyglot
    assert len(split["tune_ids"]) == 152445  # mmlu*
    assert not split["overlap"]
    chosen = split_trace(trace, ["Polyglot-or-Not_Fact-Completion"])
    assert len(chosen["eval_ids"]) == 1188


def test_trace_starts_are_the_first_tokens_of_every_trace(tmp_path):
    data_dir = write_trace_starts(tmp_path / "data", sequences=2, tokens=16)
    for name in TRACE_FILES:
        full, start = load_trace(name), load_trace(name, data_dir)
        if name != "gptoss":
            np.testing.assert_array_equal(start["expert_ids"], full["expert_ids"][:32])
            continue
        for dataset in set(full["dataset"]):  # its first two sequences, in file order, each cut to 16 tokens
            kept, originals = np.flatnonzero(start["dataset"] == dataset), np.flatnonzero(full["dataset"] == dataset)
            assert len(kept) == min(2, len(originals))
            for i, j in zip(kept, originals):
                first_tokens = full["expert_ids"][full["seq_offsets"][j]:full["seq_offsets"][j + 1]][:16]
                np.testing.assert_array_equal(start["expert_ids"][start["seq_offsets"][i]:start["seq_offsets"][i + 1]],
                                              first_tokens)


def test_cli_json_on_olmoe_matches_the_core():
    code, out, _ = run_cli(["--trace", "olmoe", "--cache", "16", "--policy", "lru", "--json"])
    assert code == 0
    result = json.loads(out)
    for key in ["hit_rate", "accesses", "hits", "bytes_moved", "trace", "cache", "policy", "tokens"]:
        assert key in result
    assert (result["trace"], result["cache"], result["policy"]) == ("olmoe", 16, "lru")
    full = np.load(REPO_ROOT / "bench" / "data" / "olmoe_1b7b_decode_299.npy")
    second_half = full[len(full) // 2 :]
    direct = run(second_half, 64, 16, "lru")
    assert result["tokens"] == len(second_half) == 150
    assert result["accesses"] == 150 * 16 * 8
    assert result["hits"] == direct["hits"]
    assert result["bytes_moved"] == result["accesses"] - result["hits"]


def test_cli_subprocess_gptoss_datasets():
    code, out, err = run_cli(["--trace", "gptoss", "--cache", "8", "--policy", "belady", "--datasets",
                              "tulu3_persona_if,Polyglot-or-Not_Fact-Completion", "--json"])
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["tokens"] == 1470 + 1188
    assert result["accesses"] == result["tokens"] * 24 * 4
    assert 0.0 < result["hit_rate"] < 1.0


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--trace", "olmoe", "--cache", "0"], "found --cache 0"),
        (["--trace", "olmoe", "--cache", "65"], "E=64"),
        (["--trace", "olmoe", "--cache", "4"], "k=8"),
        (["--trace", "olmoe", "--policy", "fifo"], "expected one of lru, lfu, lfru, static, belady"),
        (["--trace", "mixtral"], "expected one of gptoss, olmoe, kimi"),
        (["--trace", "gptoss", "--datasets", "gpqa_nope"], "available: Polyglot-or-Not"),
        (["--trace", "kimi", "--datasets", "gpqa_main"], "gptoss only"),
        (["--trace", "olmoe", "--cache", "8", "--lfru-decay", "1.5"], "decay"),
    ],
)
def test_cli_bad_input_is_a_clear_error(argv, expected):
    code, out, err = run_cli(argv + ["--json"])
    assert code == 2
    assert out == ""
    assert expected in err


@pytest.mark.quick
def test_replay_core_rejects_bad_traces_and_caches():
    assert issubclass(TraceError, JmoeError)  # part of jmoe's error hierarchy
    policy = make_policy("lru", 1, 4)
    with pytest.raises(TraceError, match="between k=2"):
        replay(np.array([[[0, 1]]]), 4, 1, policy)
    with pytest.raises(TraceError, match=r"\[0, 4\)"):
        replay(np.array([[[0, 4]]]), 4, 2, policy)
    with pytest.raises(TraceError, match="distinct"):
        replay(np.array([[[1, 1]]]), 4, 2, policy)
    with pytest.raises(TraceError, match="policy 'lru' is for"):
        replay(np.zeros((1, 2, 1), dtype=np.int64), 4, 2, policy)
