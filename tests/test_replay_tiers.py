"""Two-level replay (jmoe.traces.tiers, CLI bench/replay.py --host-cache): hand-computed counts, the
relations' invariants, read-ahead, the device level against jmoe.traces.replay, the CLI and its report."""

import json
import re

import numpy as np
import pytest

from jmoe.offload.policies import make_policy
from jmoe.offload.predictors import Predictor, make_predictor
from jmoe.traces.belady import BeladyOracle
from jmoe.traces.comparison import tier_comparison
from jmoe.traces.load import TraceError, load_trace
from jmoe.traces.replay import replay
from jmoe.traces.tiers import TierConfig, replay_tiers, replay_tiers_grid, tier_grid
from replay_cli import run_cli

# One layer, k = 1, E = 4: three experts used in a loop.
LOOP = np.array([0, 1, 2, 0, 1, 2, 0]).reshape(-1, 1, 1)


def lru(trace, num_experts):
    return make_policy("lru", trace.shape[1], num_experts)


def random_trace(seed, tokens=300, layers=3, num_experts=8, top_k=2):
    """Skewed routing (a few hot experts per layer), k distinct ids per (token, layer)."""
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(np.full(num_experts, 0.5), size=layers)
    return np.stack([np.stack([rng.choice(num_experts, top_k, replace=False, p=weights[l]) for l in range(layers)])
                     for _ in range(tokens)])


class Oracle(Predictor):
    """Knows each step's experts (reads the step itself): the perfect predictor."""

    name = "oracle"

    def scores(self, expert_ids, history=None):
        ids = self._ready(expert_ids)
        out = np.zeros(ids.shape[:2] + (self.num_experts,), dtype=np.float32)
        np.put_along_axis(out, ids, 1.0, axis=2)
        return out


class Constant(Predictor):
    """Always predicts the same expert."""

    name = "constant"

    def __init__(self, expert):
        super().__init__(count=1, min_score=0.5)
        self.expert = expert

    def scores(self, expert_ids, history=None):
        ids = self._ready(expert_ids)
        out = np.zeros(ids.shape[:2] + (self.num_experts,), dtype=np.float32)
        out[..., self.expert] = 1.0
        return out


@pytest.mark.quick
def test_loop_inclusive_thrashes_where_exclusive_holds_it():
    # Inclusive C=1, H=2: the tier holds the device's expert plus one other; LRU drops the one the loop
    # needs next, so all 7 accesses are disk reads.
    inc = replay_tiers(LOOP, 4, 1, 2, lru(LOOP, 4), "inclusive")
    assert (inc["device_hits"], inc["host_hits"], inc["disk_reads"], inc["device_to_host"]) == (0, 0, 7, 0)
    # Exclusive C=1, H=2 holds all three: t0..t2 disk (t1, t2 demote 0, 1); t3..t6 host hits, each demoting
    # the previous expert, which the tier keeps: 6 device-to-host copies.
    exc = replay_tiers(LOOP, 4, 1, 2, lru(LOOP, 4), "exclusive")
    assert (exc["device_hits"], exc["host_hits"], exc["disk_reads"], exc["device_to_host"]) == (0, 4, 3, 6)
    assert exc["host_to_device"] == 7 and exc["first_uses"] == 3
    # Inclusive with H = C + 2 = 3 matches exclusive's disk reads, with no copy down.
    inc3 = replay_tiers(LOOP, 4, 1, 3, lru(LOOP, 4), "inclusive")
    assert (inc3["disk_reads"], inc3["device_to_host"]) == (3, 0)


def test_exclusive_with_no_host_tier_drops_victims_without_copies():
    result = replay_tiers(LOOP, 4, 1, 0, lru(LOOP, 4), "exclusive")
    assert (result["disk_reads"], result["device_to_host"], result["host_evictions"]) == (7, 0, 6)


@pytest.mark.parametrize("seed", range(3))
def test_device_level_is_the_single_level_replay(seed):
    trace = random_trace(seed)
    configs = [TierConfig(c, h, rel, r) for c in (2, 4, 6) for h in (6, 8) for rel in ("inclusive", "exclusive")
               for r in (0, 2)]
    predictor = make_predictor("previous", count=3, min_score=0.5).fit(trace, 8)
    results = replay_tiers_grid(trace, 8, configs, make_policy("lfru", 3, 8), predictor=predictor, check=True)
    for config, result in zip(configs, results):
        single = replay(trace, 8, config.cache, make_policy("lfru", 3, 8))
        assert result["device_hits"] == single["hits"]  # whatever H, relation and read-ahead
        assert result["device_hits"] + result["host_hits"] + result["disk_reads"] == result["accesses"]
        assert result["read_ahead_reads"] == (result["read_ahead_used"] + result["read_ahead_wasted"]
                                              + result["read_ahead_pending"])
        assert result["disk_reads_total"] >= result["first_uses"]
        if config.relation == "inclusive":
            assert result["device_to_host"] == 0


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.quick
def test_whole_host_tier_reads_each_expert_once(seed):
    trace = random_trace(seed)
    distinct = sum(len(np.unique(trace[:, l])) for l in range(trace.shape[1]))
    for relation, host in (("inclusive", 8), ("exclusive", 8 - 3)):  # H = E, and C + H = E
        result = replay_tiers(trace, 8, 3, host, make_policy("lfru", 3, 8), relation, check=True)
        assert result["disk_reads"] == result["first_uses"] == distinct
        assert result["host_evictions"] == 0


@pytest.mark.parametrize("seed", range(3))
def test_inclusive_with_host_equal_to_device_reads_every_device_miss_from_disk(seed):
    trace = random_trace(seed)
    result = replay_tiers(trace, 8, 4, 4, make_policy("lru", 3, 8), "inclusive", check=True)
    assert result["host_hits"] == 0
    assert result["disk_reads"] == result["host_to_device"] == result["accesses"] - result["device_hits"]
    assert result["device_hits"] < result["accesses"]  # there were misses to count


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfru", "belady"])
def test_exclusive_at_h_equals_inclusive_at_h_plus_c_equals_one_level_at_h_plus_c(policy):
    # With one ranking for both levels, device + tier hold the same experts either way once the device is
    # full (and, without read-ahead, before too): the disk reads are equal. And an inclusive tier of H reads
    # what a one-level cache of H slots misses (the device's experts are always among those H: inclusion).
    trace = random_trace(7, tokens=400)
    make = (lambda: BeladyOracle(trace, 8)) if policy == "belady" else (lambda: make_policy(policy, 3, 8))
    for c, h in ((2, 2), (3, 2), (2, 5)):
        exc = replay_tiers(trace, 8, c, h, make(), "exclusive")
        inc = replay_tiers(trace, 8, c, h + c, make(), "inclusive")
        assert exc["disk_reads"] == inc["disk_reads"] == replay(trace, 8, h + c, make())["misses"]
        assert exc["device_to_host"] > 0 and inc["device_to_host"] == 0
        smaller = replay_tiers(trace, 8, c, max(h, c), make(), "inclusive")
        assert smaller["disk_reads"] > exc["disk_reads"]


def test_a_separate_host_policy_ranks_the_tier():
    # Device LRU, tier LFU, inclusive C=1, H=2 on 0 0 0 1 2 0: at t4 the tier must drop 0 or 1; LRU would drop
    # 0 (older), LFU keeps 0 (used 3 times) and drops 1, so t5 is a host hit instead of a disk read.
    trace = np.array([0, 0, 0, 1, 2, 0]).reshape(-1, 1, 1)
    same = replay_tiers(trace, 4, 1, 2, lru(trace, 4), "inclusive")
    own = replay_tiers(trace, 4, 1, 2, lru(trace, 4), "inclusive", host_policy=make_policy("lfu", 1, 4))
    assert (same["disk_reads"], same["host_hits"]) == (4, 0)
    assert (own["disk_reads"], own["host_hits"], own["host_policy"]) == (3, 1, "lfu")


@pytest.mark.parametrize("relation, host", [("inclusive", 6), ("exclusive", 2)])
@pytest.mark.quick
def test_perfect_read_ahead_removes_demand_disk_reads(relation, host):
    # Room for the k = 2 predicted experts beyond the device's C = 4 (inclusive H = C + k; exclusive H = k).
    trace = random_trace(3)
    predictor = Oracle(count=2, min_score=0.5).fit(trace, 8)
    result = replay_tiers(trace, 8, 4, host, make_policy("lru", 3, 8), relation, predictor=predictor,
                          read_ahead=2, check=True)
    without = replay_tiers(trace, 8, 4, host, make_policy("lru", 3, 8), relation)
    assert result["disk_reads"] == 0 and without["disk_reads"] > 0
    assert result["read_ahead_wasted"] == result["read_ahead_pending"] == 0
    assert result["read_ahead_used"] == result["read_ahead_reads"] > 0
    assert result["host_hits"] == result["host_to_device"]  # every device miss served from RAM
    # A budget of one read per step leaves the second expert of some steps to a demand read.
    one = replay_tiers(trace, 8, 4, host, make_policy("lru", 3, 8), relation, predictor=predictor, read_ahead=1)
    assert 0 < one["disk_reads"] < without["disk_reads"]


def test_wasted_read_ahead_hand_computed():
    # Exclusive C=1, H=1, LRU; the predictor always names expert 3, never used. t0: 3 read ahead into the
    # free host slot; 0 from disk. t1: 3 already there; 1 from disk, 0 demoted: the tier holds {3, 0} and
    # drops 3 (never used, LRU -1 < 0's t0): one wasted read, 0 kept (one copy down).
    trace = np.array([0, 1]).reshape(-1, 1, 1)
    result = replay_tiers(trace, 4, 1, 1, lru(trace, 4), "exclusive", predictor=Constant(3).fit(trace, 4),
                          read_ahead=1)
    assert {key: result[key] for key in ("disk_reads", "read_ahead_reads", "read_ahead_used", "read_ahead_wasted",
                                         "read_ahead_pending", "disk_reads_total", "device_to_host")} == {
        "disk_reads": 2, "read_ahead_reads": 1, "read_ahead_used": 0, "read_ahead_wasted": 1,
        "read_ahead_pending": 0, "disk_reads_total": 3, "device_to_host": 1}


def test_inclusive_read_ahead_never_evicts_a_device_expert():
    # Inclusive H = C: once the device is full the tier is the device's experts, so read-ahead has no room.
    trace = random_trace(4)
    result = replay_tiers(trace, 8, 4, 4, make_policy("lru", 3, 8), "inclusive",
                          predictor=Oracle(count=2, min_score=0.5).fit(trace, 8), read_ahead=2, warmup=20,
                          check=True)
    assert result["read_ahead_reads"] == 0


def test_warmup_is_replayed_but_not_counted():
    trace = random_trace(5)
    cold = replay_tiers(trace[100:], 8, 3, 4, make_policy("lru", 3, 8), "exclusive")
    warm = replay_tiers(trace, 8, 3, 4, make_policy("lru", 3, 8), "exclusive", warmup=100)
    assert warm["tokens"] == cold["tokens"] == 200
    assert warm["first_uses"] < cold["first_uses"] and warm["disk_reads"] < cold["disk_reads"]


@pytest.mark.quick
def test_bad_configurations_are_refused():
    trace = random_trace(0, tokens=10)
    with pytest.raises(TraceError, match="H >= C"):
        replay_tiers(trace, 8, 4, 3, make_policy("lru", 3, 8), "inclusive")
    with pytest.raises(TraceError, match="relation"):
        replay_tiers(trace, 8, 4, 4, make_policy("lru", 3, 8), "both")
    with pytest.raises(TraceError, match="predictor"):
        replay_tiers(trace, 8, 4, 4, make_policy("lru", 3, 8), read_ahead=1)
    with pytest.raises(TraceError, match="admit misses"):
        replay_tiers(trace, 8, 4, 4, make_policy("static", 3, 8, frequency=np.ones((3, 8))))
    with pytest.raises(TraceError, match="host tier size"):
        replay_tiers(trace, 8, 4, 9, make_policy("lru", 3, 8), "exclusive")


def test_report_grid_covers_both_relations_and_the_h_plus_c_comparison():
    configs = tier_grid([4, 8], 32, [1])
    assert TierConfig(8, 8, "inclusive") in configs and TierConfig(8, 8, "exclusive", 1) in configs
    assert TierConfig(16, 8, "inclusive") not in configs  # C = 16 is not in the grid
    assert TierConfig(8, 16 + 8, "inclusive") in configs  # inclusive at H + C for exclusive at H = 16
    assert all(c.host_cache >= c.cache for c in configs if c.relation == "inclusive")
    assert len(configs) == len(set(configs))


def test_tier_comparison_finds_both_equalities_on_a_real_trace():
    compared = tier_comparison(load_trace("olmoe"), [8, 16], [1])
    assert compared["hosts"] == [16, 32, 48] and compared["warmup"] == 149  # olmoe's whole tuning half
    assert set(compared["grid"]) == {(c, h) for c in [8, 16] for h in [16, 32, 48]}
    assert len(compared["by_config"]) == len(compared["rows"])
    for pairs in (compared["one_level"], compared["twins"]):  # exact counts, cell by cell
        assert pairs and all(count == expected for count, expected in pairs)


def test_cli_two_levels_json_and_errors():
    code, out, err = run_cli(["--trace", "olmoe", "--cache", "16", "--host-cache", "32", "--tier", "exclusive",
                              "--read-ahead", "2", "--expert-bytes", "1000", "--json"])
    assert code == 0, err
    result = json.loads(out)
    assert (result["relation"], result["host_cache"], result["read_ahead"]) == ("exclusive", 32, 2)
    assert result["device_hits"] + result["host_hits"] + result["disk_reads"] == result["accesses"]
    assert result["disk_reads_total_bytes"] == 1000 * result["disk_reads_total"]
    code, _, err = run_cli(["--trace", "olmoe", "--read-ahead", "2"])
    assert code == 2 and "--read-ahead needs --host-cache" in err
    code, _, err = run_cli(["--trace", "olmoe", "--cache", "16", "--host-cache", "8"])
    assert code == 2 and "H >= C" in err


def test_cli_tiers_report(tmp_path):
    code, out, err = run_cli(["--tiers-report", "--tiers-traces", "olmoe", "--results-dir", str(tmp_path)])
    assert code == 0, err
    text = (tmp_path / "replay_tiers.md").read_text()
    assert "OLMoE-1B-7B-0924" in text and "| 16 | 32 |" in text and "machine:" in text
    counts = re.findall(r"in (\d+) of (\d+)", text)  # the two equalities, cell by cell
    assert len(counts) == 2 and all(a == b != "0" for a, b in counts)
