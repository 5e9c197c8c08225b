"""Per-layer caches and --cpu-moe-layers: layers may keep different numbers of experts on the device, and
offloading still changes timing, never results."""

import numpy as np
import pytest

import jmoe
from hf_models import VOCAB

PROMPTS = [list(np.random.RandomState(1).randint(0, VOCAB, 11)), list(np.random.RandomState(2).randint(0, VOCAB, 4))]
LOGIT_IDS = np.random.RandomState(3).randint(0, VOCAB, (2, 9))


@pytest.fixture(scope="module")
def olmoe(hf_checkpoints):
    directory = hf_checkpoints["olmoe_e8k4_clip"][0]
    model = jmoe.load(directory, progress=False)
    return directory, np.asarray(model.logits(LOGIT_IDS)), model.generate(PROMPTS, max_new_tokens=8)


# (load options, expected cache slots of each MoE layer, None = resident)
LAYOUTS = [
    (dict(cache=[0, None]), [0, None]),
    (dict(cache=[None, 5]), [None, 5]),
    (dict(cache=[3, 1], policy="lru", prefetch=2), [3, 1]),
    (dict(cache=[1, 6], policy="static"), [1, 6]),
    (dict(cpu_moe_layers=1), [0, None]),
    (dict(cpu_moe_layers=1, miss_mode="host"), [0, None]),
    (dict(cpu_moe_layers=1, cache=2), [0, 2]),
]


@pytest.mark.parametrize("options,slots", LAYOUTS, ids=[str(o) for o, _ in LAYOUTS])
def test_per_layer_caches_match_resident_and_show_in_stats_and_placement(olmoe, options, slots):
    directory, ref_logits, ref_tokens = olmoe
    model = jmoe.load(directory, progress=False, **options)
    np.testing.assert_allclose(np.asarray(model.logits(LOGIT_IDS)), ref_logits, atol=1e-5, rtol=0)
    assert model.generate(PROMPTS, max_new_tokens=8) == ref_tokens
    offloaded = [i for i, s in enumerate(slots) if s is not None]
    assert model.placement_plan.offloaded_layers == tuple(offloaded)
    assert model.placement_plan.caches == tuple(slots[i] for i in offloaded)
    stats = model.stats()
    assert [s["layer"] for s in stats] == offloaded
    assert [s["cache_slots"] for s in stats] == [slots[i] for i in offloaded]
    fed = LOGIT_IDS.size + sum(len(p) for p in PROMPTS) + 7 * len(PROMPTS)  # logits, prompts, fed-back tokens
    assert all(s["hits"] + s["misses"] == fed * model.config.num_experts_per_tok for s in stats)
    placement = model.placement()
    for layer, cache in enumerate(slots):
        kind = placement[f"layers.{layer}.mlp.experts.w_down"]["memory_kind"]
        assert kind == ("device" if cache is None else "pinned_host"), (layer, kind)
    summary = model.placement_plan.summary()
    assert "expert slots" in summary
    if len(set(model.placement_plan.caches)) > 1:
        assert "(MoE layer 0)" in summary


@pytest.mark.quick
def test_layer_without_cache_never_hits_while_its_neighbour_caches(olmoe):
    directory = olmoe[0]
    model = jmoe.load(directory, cache=[0, 8 - 1], policy="lru", progress=False)
    model.generate(PROMPTS[0], max_new_tokens=12)
    no_cache, big_cache = model.stats()
    assert no_cache["hits"] == 0 and no_cache["evictions"] == 0
    assert big_cache["hits"] > 0


@pytest.mark.quick
def test_static_policy_installs_each_layers_own_number_of_experts(olmoe):
    from jmoe.offload.policies import StaticPolicy

    directory = olmoe[0]
    frequency = np.arange(16, dtype=float).reshape(2, 8)  # higher id = more used
    model = jmoe.load(directory, cache=[2, 5], policy=StaticPolicy(2, 8, frequency), progress=False)
    installed = [sorted(np.asarray(e).tolist()) for e in model.engine.state.expert_in_slot]
    assert installed == [[6, 7], [3, 4, 5, 6, 7]]


@pytest.mark.quick
def test_per_layer_cache_and_cpu_moe_layers_bad_input(olmoe):
    directory = olmoe[0]
    with pytest.raises(jmoe.InputError, match="cache lists 3 values, but the model has 2 MoE layers"):
        jmoe.load(directory, cache=[1, 2, 3], progress=False)
    with pytest.raises(jmoe.InputError, match=r"cache\[1\] must be a whole number >= 0"):
        jmoe.load(directory, cache=[1, -2], progress=False)
    with pytest.raises(jmoe.InputError, match="either a per-layer cache list .* or cpu_moe_layers"):
        jmoe.load(directory, cache=[1, 2], cpu_moe_layers=1, progress=False)
    with pytest.raises(jmoe.InputError, match="cpu_moe_layers=3 is more than the model's 2 MoE layers"):
        jmoe.load(directory, cpu_moe_layers=3, progress=False)
    with pytest.raises(jmoe.InputError, match="either cache .* or device_budget_gb"):
        jmoe.load(directory, cache=[1, 2], device_budget_gb=1.0, progress=False)


def test_cli_per_layer_cache_and_cpu_moe_layers_flags():
    from jmoe.cli.common import offload_options
    from jmoe.cli.generate import build_parser

    args = build_parser().parse_args(["--cache", "0,all,3"])
    assert offload_options(args).cache == (0, None, 3)
    args = build_parser().parse_args(["--cpu-moe-layers", "2", "--cache", "4"])
    options = offload_options(args)
    assert options.layer_caches(3) == (0, 0, 4)


def test_device_budget_chooses_the_cache_of_the_layers_cpu_moe_layers_leaves(olmoe):
    directory, ref_logits, ref_tokens = olmoe
    base = jmoe.plan(directory, cache=0).placement
    dense = base.totals()["device_bytes"] - base.slot_bytes
    kv = 2 * 2 * 4096 * 4 * 8 * 4  # k and v, layers, budget tokens, kv heads, head_dim, float32
    slots_and_stream = base.scratch * base.expert_bytes + base.stream_bytes  # shared scratch, prefill's chunks
    budget = dense + kv + slots_and_stream + 3 * base.expert_bytes + base.expert_bytes // 2  # one layer: 3 slots
    model = jmoe.load(directory, cpu_moe_layers=1, device_budget_gb=budget / 2**30, progress=False)
    assert model.placement_plan.offloaded_layers == (0, 1) and model.placement_plan.caches == (0, 3)
    np.testing.assert_allclose(np.asarray(model.logits(LOGIT_IDS)), ref_logits, atol=1e-5, rtol=0)
    assert model.generate(PROMPTS, max_new_tokens=8) == ref_tokens
