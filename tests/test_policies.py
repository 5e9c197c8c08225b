"""Cache policies and the shared eviction rule, on hand-made access sequences."""

import numpy as np
import pytest

from jmoe.offload.policies import (
    CachePolicy,
    LFRUPolicy,
    LFUPolicy,
    LRUPolicy,
    StaticPolicy,
    choose_victims,
    eviction_ranking,
    initial_residents,
    make_policy,
    policy_names,
    register_policy,
)

pytestmark = pytest.mark.quick  # the quick tier: all of this module


def counts_row(num_experts, used):
    """One layer's counts: ``used`` maps expert id -> tokens routed to it."""
    row = np.zeros((1, num_experts), dtype=np.int64)
    for expert, n in used.items():
        row[0, expert] = n
    return row


def eviction_order(priority_row, resident_ids, needed_ids=()):
    """The eviction rule written plainly (the oracle): resident experts the step does not need, by
    ascending priority, equal priorities lower id first."""
    ids = sorted(set(map(int, resident_ids)) - set(map(int, needed_ids)), key=lambda e: (priority_row[e], e))
    return np.array(ids, dtype=np.int64)


def feed(policy, steps):
    for used in steps:
        policy.observe(counts_row(policy.num_experts, used))


def test_lru_evicts_least_recently_used_first():
    policy = LRUPolicy(1, 5)
    # step 0: {0, 1}; step 1: {2}; step 2: {0}; step 3: {3}  -> last used [2, 0, 1, 3, never]
    feed(policy, [{0: 1, 1: 1}, {2: 1}, {0: 1}, {3: 1}])
    assert policy.priority().tolist() == [[2, 0, 1, 3, -1]]
    # Everything resident, nothing needed: never-used 4, then 1 (step 0), 2 (step 1), 0, 3.
    assert eviction_order(policy.priority()[0], [0, 1, 2, 3, 4]).tolist() == [4, 1, 2, 0, 3]
    # Expert 1 is needed by the current step: it cannot go, 2 is the first victim.
    assert eviction_order(policy.priority()[0], [0, 1, 2, 3], [1]).tolist() == [2, 0, 3]


def test_lru_ignores_how_many_tokens_used_an_expert():
    policy = LRUPolicy(1, 3)
    feed(policy, [{0: 50}, {1: 1}])  # 0 served 50 tokens, but 1 was used later
    assert eviction_order(policy.priority()[0], [0, 1]).tolist() == [0, 1]


def test_lfu_counts_tokens_and_breaks_ties_by_lower_id():
    policy = LFUPolicy(1, 6)
    # A prefill-like step (counts > 1) then decode steps: totals [3, 2, 5, 1, 0, 0].
    feed(policy, [{0: 3, 1: 1}, {1: 1, 2: 5}, {3: 1}])
    assert policy.priority().tolist() == [[3, 2, 5, 1, 0, 0]]
    # 4 and 5 tie at 0: the lower id (4) goes first; then 3 (1), 1 (2), 0 (3), 2 (5).
    assert eviction_order(policy.priority()[0], range(6)).tolist() == [4, 5, 3, 1, 0, 2]


def test_lfru_hand_computed_priorities_and_victims():
    policy = LFRUPolicy(1, 3, decay=0.5, recency_weight=1.0)
    # step 0: expert 0 serves 4 tokens; steps 1 and 2: expert 1 serves one token each.
    feed(policy, [{0: 4}, {1: 1}, {1: 1}])
    # freq: 0 -> 4 * 0.5 * 0.5 = 1.0; 1 -> 1 * 0.5 + 1 = 1.5; 2 -> 0.
    # recency after step 2: expert 0 last used at step 0 -> 2; expert 1 -> 0.
    # priority = freq / (1 + recency) = [1/3, 1.5, 0]
    assert policy.priority()[0] == pytest.approx([1 / 3, 1.5, 0.0])
    assert eviction_order(policy.priority()[0], [0, 1, 2]).tolist() == [2, 0, 1]


def test_lfru_keeps_a_hot_expert_that_lru_would_evict():
    steps = [{0: 10}, {1: 1}]  # expert 0 was busy, expert 1 was used once, more recently
    lfru = LFRUPolicy(1, 2, decay=0.9, recency_weight=1.0)
    lru = LRUPolicy(1, 2)
    feed(lfru, steps)
    feed(lru, steps)
    # LFRU: freq 0 = 9, recency 1 -> 4.5; freq 1 = 1, recency 0 -> 1: evict 1.
    assert lfru.priority()[0] == pytest.approx([4.5, 1.0])
    assert eviction_order(lfru.priority()[0], [0, 1]).tolist() == [1, 0]
    assert eviction_order(lru.priority()[0], [0, 1]).tolist() == [0, 1]


def test_lfru_rejects_bad_constants():
    with pytest.raises(ValueError, match="decay"):
        LFRUPolicy(2, 4, decay=0.0)
    with pytest.raises(ValueError, match="recency_weight"):
        LFRUPolicy(2, 4, recency_weight=-1.0)


def test_static_pins_most_frequent_and_never_changes():
    policy = StaticPolicy(1, 4, frequency=np.array([[5, 1, 3, 3]]))
    assert policy.admits_misses is False
    # Two slots: expert 0 (5), then 2 and 3 tie at 3 -> the lower id (2) is evicted, 3 stays.
    assert initial_residents(policy.priority(), 2).tolist() == [[True, False, False, True]]
    before = policy.priority().copy()
    feed(policy, [{1: 100}, {1: 100}])
    assert np.array_equal(policy.priority(), before)
    assert initial_residents(policy.priority(), 2).tolist() == [[True, False, False, True]]


def test_static_requires_a_frequency_table_of_the_right_shape():
    with pytest.raises(ValueError, match="frequency="):
        make_policy("static", 2, 4)
    with pytest.raises(ValueError, match=r"\[2, 4\]"):
        make_policy("static", 2, 4, frequency=np.ones((4, 2)))


def test_choose_victims_per_layer_with_needed_and_ties():
    priority = np.array([
        [1.0, 1.0, 0.5, 9.0],  # layer 0
        [3.0, 2.0, 2.0, 1.0],  # layer 1
    ])
    resident = np.array([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=bool)
    needed = np.array([[0, 0, 1, 0], [0, 0, 0, 1]], dtype=bool)
    victims = choose_victims(priority, resident, needed, np.array([2, 1]))
    # Layer 0: 2 is needed; candidates 0 (1.0), 1 (1.0), 3 (9.0) -> evict 0 and 1 (tie, both go).
    # Layer 1: 3 is not resident; candidates 0 (3), 1 (2), 2 (2) -> 1 and 2 tie, lower id 1 goes.
    assert victims.tolist() == [[True, True, False, False], [False, True, False, False]]
    victims = choose_victims(priority, resident, needed, np.array([1, 0]))
    assert victims.tolist() == [[True, False, False, False], [False, False, False, False]]


def test_choose_victims_handles_infinite_priorities():
    priority = np.array([[np.inf, -np.inf, np.inf, 0.0]])
    resident = np.ones((1, 4), dtype=bool)
    needed = np.array([[False, False, False, True]])
    # Candidates 0 (+inf), 1 (-inf), 2 (+inf): evict 1, then 0 (tie with 2, lower id).
    assert choose_victims(priority, resident, needed, 2).tolist() == [[True, True, False, False]]


def test_choose_victims_refuses_when_too_few_evictable():
    resident = np.array([[True, True, False]])
    needed = np.array([[True, False, False]])
    with pytest.raises(ValueError, match="layer 0 must evict 2"):
        choose_victims(np.zeros((1, 3)), resident, needed, np.array([2]))


def test_eviction_ranking_puts_candidates_first_in_rule_order():
    rng = np.random.default_rng(1)
    for _ in range(50):
        priority = rng.integers(0, 3, (2, 7)).astype(float)
        priority[0, rng.integers(0, 7)] = np.inf  # +inf priorities still rank among the candidates
        candidate = rng.random((2, 7)) < 0.6
        ranking = eviction_ranking(priority, candidate)
        for layer in range(2):
            n = candidate[layer].sum()
            assert ranking[layer, :n].tolist() == eviction_order(priority[layer], np.flatnonzero(candidate[layer])).tolist()
            assert sorted(ranking[layer, n:].tolist()) == np.flatnonzero(~candidate[layer]).tolist()


def test_choose_victims_agrees_with_eviction_order():
    rng = np.random.default_rng(0)
    for _ in range(50):
        num_layers, num_experts = 3, 8
        # Few distinct values so ties are common.
        priority = rng.integers(0, 3, (num_layers, num_experts)).astype(float)
        resident = rng.random((num_layers, num_experts)) < 0.7
        needed = resident & (rng.random((num_layers, num_experts)) < 0.3)
        evictable = (resident & ~needed).sum(axis=1)
        num_victims = rng.integers(0, evictable + 1)
        victims = choose_victims(priority, resident, needed, num_victims)
        for layer in range(num_layers):
            order = eviction_order(priority[layer], np.flatnonzero(resident[layer]),
                                   np.flatnonzero(needed[layer]))
            expected = np.zeros(num_experts, dtype=bool)
            expected[order[: num_victims[layer]]] = True
            assert victims[layer].tolist() == expected.tolist()


def test_initial_residents_keeps_top_capacity():
    priority = np.array([[0.0, 2.0, 1.0, 2.0], [4.0, 3.0, 2.0, 1.0]])
    assert initial_residents(priority, 2).tolist() == [
        [False, True, False, True],
        [True, True, False, False],
    ]
    assert initial_residents(priority, 0).sum() == 0
    with pytest.raises(ValueError, match="capacity"):
        initial_residents(priority, 5)


@pytest.mark.parametrize("name", ["lru", "lfu", "lfru", "static"])
def test_priority_shape_and_dtype(name):
    kwargs = {"frequency": np.arange(21).reshape(3, 7)} if name == "static" else {}
    policy = make_policy(name, 3, 7, **kwargs)
    assert policy.name == name
    assert policy.priority().shape == (3, 7)
    policy.observe(np.eye(3, 7, dtype=np.int64))
    assert policy.step == 1
    priority = policy.priority()
    assert priority.shape == (3, 7)
    assert np.issubdtype(priority.dtype, np.floating)
    assert not np.isnan(priority).any()


def test_observe_rejects_wrong_shape():
    policy = make_policy("lru", 3, 7)
    with pytest.raises(ValueError, match=r"expected counts of shape .*\[3, 7\].*found \[7, 3\]"):
        policy.observe(np.zeros((7, 3), dtype=np.int64))


def test_unknown_name_lists_known_policies():
    with pytest.raises(ValueError) as err:
        make_policy("fifo", 2, 4)
    message = str(err.value)
    assert "'fifo'" in message
    for name in ["lfru", "lfu", "lru", "static"]:
        assert name in message
    assert policy_names() == sorted(policy_names())


class MostRecentlyUsedOut(CachePolicy):
    """A research policy: evict the most recently used expert (good for cyclic scans)."""

    name = "mru"

    def __init__(self, num_layers, num_experts):
        super().__init__(num_layers, num_experts)
        self.last_used = np.full(self.shape, -1.0)

    def update(self, counts):
        self.last_used[counts > 0] = self.step

    def priority(self):
        return -self.last_used


def test_custom_subclass_goes_through_make_policy_and_the_eviction_rule():
    policy = make_policy(MostRecentlyUsedOut(2, 3), 2, 3)
    steps = [np.array([[1, 0, 0], [0, 0, 1]]), np.array([[0, 1, 0], [1, 0, 0]])]
    for counts in steps:
        policy.observe(counts)
    # Layer 0: last used [0, 1, never] -> priority [0, -1, 1]: evict 1 (most recent) first.
    # Layer 1: last used [1, never, 0] -> priority [-1, 1, 0]: evict 0 first.
    victims = choose_victims(policy.priority(), np.ones((2, 3), bool), np.zeros((2, 3), bool), 1)
    assert victims.tolist() == [[False, True, False], [True, False, False]]
    with pytest.raises(ValueError, match=r"\[2, 3\]"):
        make_policy(policy, 4, 3)
    # A subclass (the class itself) or a registered name also work.
    assert isinstance(make_policy(MostRecentlyUsedOut, 2, 3), MostRecentlyUsedOut)
    register_policy("mru_test", MostRecentlyUsedOut)
    assert isinstance(make_policy("mru_test", 2, 3), MostRecentlyUsedOut)


def test_subclass_missing_hooks_says_what_to_implement():
    class Half(CachePolicy):
        pass

    with pytest.raises(NotImplementedError, match="update"):
        Half(1, 2).observe(np.zeros((1, 2), dtype=np.int64))


def test_lfru_per_layer_constants_match_separate_policies():
    rng = np.random.default_rng(1)
    steps = [rng.integers(0, 3, (2, 5)) for _ in range(6)]
    both = LFRUPolicy(2, 5, decay=np.array([0.5, 0.9]), recency_weight=np.array([1.0, 0.0]))
    first = LFRUPolicy(1, 5, decay=0.5, recency_weight=1.0)
    second = LFRUPolicy(1, 5, decay=0.9, recency_weight=0.0)
    for counts in steps:
        both.observe(counts)
        first.observe(counts[:1])
        second.observe(counts[1:])
    assert both.priority()[0] == pytest.approx(first.priority()[0])
    assert both.priority()[1] == pytest.approx(second.priority()[0])
    with pytest.raises(ValueError, match=r"shape \[num_layers\] = \[2\], found shape \[3\]"):
        LFRUPolicy(2, 5, decay=np.array([0.5, 0.9, 0.9]))
    with pytest.raises(ValueError, match="decay"):
        LFRUPolicy(2, 5, decay=np.array([0.5, 1.5]))
