"""Trace-forced routing (jmoe.traces.forced_routing): step layout, errors, and the engine's cache statistics
under a forced trace against hand-computed LRU hits and the trace replay (jmoe.traces.replay)."""

import numpy as np
import pytest

import jmoe
from hf_models import write_checkpoint
from jmoe.offload.policies import make_policy
from jmoe.decode.sampling import SamplingParams
from jmoe.traces.forced_routing import TraceError, TraceRouting
from jmoe.traces.replay import replay

# 12 experts, top-2: 4 * k = 8 scratch slots < 12, so the (16-column) prompt step streams its experts and
# leaves the cache empty; every decode step admits its misses. Both layers are MoE layers.
EXPERTS, TOP_K, LAYERS, CACHE = 12, 2, 2, 3
PROMPT = [5, 17, 3, 40]


class Config:
    num_moe_layers, num_experts_per_tok, num_experts = LAYERS, TOP_K, EXPERTS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("trace") / "mixtral"
    write_checkpoint(directory, "mixtral", num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                     num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, intermediate_size=16)
    return directory


def rows_from_layers(*layers):
    """Per-layer lists of (token -> k ids) -> trace rows [tokens, layers, k]."""
    return np.stack([np.asarray(layer, np.int32) for layer in layers], axis=1)


def test_prompt_step_right_aligns_rows_and_decode_steps_take_the_next_row():
    rows = np.arange(6 * LAYERS * TOP_K).reshape(6, LAYERS, TOP_K) % EXPERTS
    routing = TraceRouting(rows, prompt_len=3, config=Config)
    prompt = routing(0, (1, 5))
    assert prompt.shape == (LAYERS, 1, 5, TOP_K) and prompt.dtype == np.int32
    np.testing.assert_array_equal(prompt[:, 0, 2:], rows[:3].transpose(1, 0, 2))  # the 3 prompt tokens
    np.testing.assert_array_equal(prompt[:, 0, :2], rows[[0, 0]].transpose(1, 0, 2))  # padding: valid ids
    for step in (1, 2, 3):
        np.testing.assert_array_equal(routing(step, (1, 1))[:, 0, 0], rows[2 + step])
    assert routing.max_new_tokens == 4


@pytest.mark.parametrize("rows, prompt_len, step, shape, message", [
    (np.zeros((4, LAYERS + 1, TOP_K), np.int32), 2, 0, (1, 16), "MoE layers"),
    (np.full((4, LAYERS, TOP_K), EXPERTS), 2, 0, (1, 16), "expert ids in"),
    (np.zeros((4, LAYERS, TOP_K)), 2, 0, (1, 16), "integer"),
    (np.zeros((4, LAYERS, TOP_K), np.int32), 5, 0, (1, 16), "prompt_len"),
    (np.zeros((4, LAYERS, TOP_K), np.int32), 2, 0, (2, 16), "batch 1"),
    (np.zeros((4, LAYERS, TOP_K), np.int32), 3, 0, (1, 2), "fewer than prompt_len"),
    (np.zeros((4, LAYERS, TOP_K), np.int32), 2, 3, (1, 1), "longer slice"),
])
def test_bad_traces_and_steps_are_refused(rows, prompt_len, step, shape, message):
    with pytest.raises(TraceError, match=message):
        TraceRouting(rows, prompt_len, Config)(step, shape)


def decode_hits(model, rows, policy="lru"):
    """Generate through the whole trace slice; per-layer hits and misses of the decode steps only. Each step is read
    back before the next is dispatched, so the policy works from current tables, as computed by hand and replayed
    (with steps dispatched ahead the manager's tables reach the step after next: tests/test_run_ahead.py)."""
    model.set_policy(policy)
    routing = TraceRouting(rows, len(PROMPT), model.config)
    after_prompt = []
    out = model.generate_detailed(
        [PROMPT], routing.max_new_tokens, SamplingParams(), routing_override=routing, run_ahead=False,
        on_tokens=lambda tokens: after_prompt.append(model.stats()) if not after_prompt else None).tokens
    assert len(out[0]) == routing.max_new_tokens
    first, last = after_prompt[0], model.stats()
    assert all(s["hits"] == 0 for s in first)  # the prompt step starts from an empty cache
    hits = [b["hits"] - a["hits"] for a, b in zip(first, last)]
    misses = [b["misses"] - a["misses"] for a, b in zip(first, last)]
    return hits, misses


@pytest.mark.quick
def test_forced_trace_gives_hand_computed_lru_hits(model_dir):
    model = jmoe.load(model_dir, cache=CACHE, progress=False)
    prompt_rows = np.full((len(PROMPT), LAYERS, TOP_K), [6, 7], np.int32)  # streamed, never cached
    decode = rows_from_layers(
        # cache of 3, LRU, ties to the lower id: {0,1} -> {1,2,3} -> hit 1, {0,1,3} -> {1,4,5} -> {0,2,5}
        [[0, 1], [2, 3], [0, 1], [4, 5], [0, 2]],
        # {0,1} -> hit 0, {0,1,2} -> hit 0, {0,2,3} -> hit 0, {0,1,3} -> {1,4,5}
        [[0, 1], [0, 2], [0, 3], [0, 1], [4, 5]],
    )
    hits, misses = decode_hits(model, np.concatenate([prompt_rows, decode]))
    assert hits == [1, 3]
    assert misses == [9, 7]
    replayed = replay(decode, EXPERTS, CACHE, make_policy("lru", LAYERS, EXPERTS))
    assert [round(r * len(decode) * TOP_K) for r in replayed["layer_hit_rate"]] == hits


def test_forced_random_trace_matches_lru_replay(model_dir):
    rng = np.random.default_rng(0)
    # a skewed distribution so that the cache has something to find
    weights = np.r_[np.full(4, 6.0), np.ones(EXPERTS - 4)]
    rows = np.stack([[rng.choice(EXPERTS, TOP_K, replace=False, p=weights / weights.sum()) for _ in range(LAYERS)]
                     for _ in range(len(PROMPT) + 30)])
    model = jmoe.load(model_dir, cache=CACHE, progress=False)
    hits, misses = decode_hits(model, rows)
    decode = rows[len(PROMPT):]
    replayed = replay(decode, EXPERTS, CACHE, make_policy("lru", LAYERS, EXPERTS))
    assert [round(r * len(decode) * TOP_K) for r in replayed["layer_hit_rate"]] == hits
    assert sum(hits) > 0 and all(h + m == len(decode) * TOP_K for h, m in zip(hits, misses))
