"""The offload engine's invariants: offloading changes timing, never results."""

import functools

import jax
import numpy as np
import pytest

import jmoe
from jmoe.decode.sampling import SamplingParams
from hf_models import VOCAB
from jmoe.offload.resident import ResidentEngine
from jmoe.offload.policies import policy_names

FAMILY_REPRESENTATIVES = ["mixtral_e4k2_gqa2", "qwen2_moe_shared_dense", "qwen3_moe_headdim_tied",
                          "olmoe_e8k4_clip", "deepseek_v3_qlora_groups",
                          "gpt_oss_e4k2_window"]  # glm4_moe: tests/test_families.py
POLICIES = policy_names()
PROMPTS = [list(np.random.RandomState(1).randint(0, VOCAB, 11)), list(np.random.RandomState(2).randint(0, VOCAB, 4))]
LOGIT_IDS = np.random.RandomState(3).randint(0, VOCAB, (2, 9))


def cache_sizes(name, cfg):
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    if name == FAMILY_REPRESENTATIVES[0]:  # every boundary once: nothing cached, fewer than k, k, half, all but one, all
        return sorted({0, 1, k, e // 2, e - 1, e})
    # The cache logic is family-independent; the other families meet pure streaming and a half-full cache.
    return [0, e // 2]


@pytest.fixture(scope="module")
def resident(hf_checkpoints):
    """resident(name) -> (config, logits, tokens) of the resident model, computed on first use (each xdist worker
    runs only some of the families)."""

    @functools.cache
    def results(name):
        model = jmoe.load(hf_checkpoints[name][0], progress=False)
        return model.config, np.asarray(model.logits(LOGIT_IDS)), model.generate(PROMPTS, max_new_tokens=10)

    return results


@pytest.mark.parametrize("name", FAMILY_REPRESENTATIVES)
def test_every_cache_size_and_policy_matches_resident(name, hf_checkpoints, resident):
    cfg, ref_logits, ref_tokens = resident(name)
    # Every cache size, each with the next policy in turn (which experts a policy keeps only changes timing; the
    # policies' own choices are tested in test_policies.py), so every policy meets several cache sizes.
    for i, cache in enumerate(cache_sizes(name, cfg)):
        model = jmoe.load(hf_checkpoints[name][0], cache=cache, progress=False)
        if cache == cfg.num_experts:  # everything fits: the resident path, no manager
            assert isinstance(model.engine, ResidentEngine) and model.stats() == []
            continue
        for policy in (POLICIES[i % len(POLICIES)], POLICIES[(i + 1) % len(POLICIES)]):
            model.set_policy(policy)  # an empty cache: prompts stream through scratch, decode steps fill it
            np.testing.assert_allclose(np.asarray(model.logits(LOGIT_IDS)), ref_logits, atol=1e-5, rtol=0,
                                       err_msg=f"cache={cache} policy={policy}")
            assert model.generate(PROMPTS, max_new_tokens=10) == ref_tokens, f"cache={cache} policy={policy}"


@pytest.fixture(scope="module")
def olmoe_dir(hf_checkpoints):
    return hf_checkpoints["olmoe_e8k4_clip"][0]


def test_offloaded_experts_live_in_pinned_host_and_device_bytes_match_summary(olmoe_dir):
    model = jmoe.load(olmoe_dir, cache=2, progress=False)
    placement = model.placement()
    module = model.module()
    for block in module.moe_blocks():
        for weights in (block.experts.w_gate_up[...], block.experts.w_down[...]):
            assert weights.sharding.memory_kind == "pinned_host"
    assert placement["layers.0.mlp.experts.w_down"]["memory_kind"] == "pinned_host"
    assert placement["layers.0.attn.q.kernel"]["memory_kind"] == "device"
    device_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(model.params) if leaf.sharding.memory_kind == "device")
    device_bytes += sum(leaf.nbytes for leaf in jax.tree.leaves((model.engine.state.buffers,
                                                                 model.engine.state.scratch)))
    assert device_bytes == model.placement_plan.totals()["device_bytes"]


def test_prefill_routing_to_every_expert_with_cache_top_k_is_exact(olmoe_dir):
    base = jmoe.load(olmoe_dir, progress=False)
    prompt = list(np.random.RandomState(5).randint(0, VOCAB, 120))
    ref_logits, routing = base.logits_and_routing([prompt])
    assert all(len(np.unique(layer)) == base.config.num_experts for layer in routing), "prompt must touch all experts"
    model = jmoe.load(olmoe_dir, cache=base.config.num_experts_per_tok, progress=False)
    np.testing.assert_allclose(np.asarray(model.logits([prompt])), np.asarray(ref_logits), atol=1e-5, rtol=0)
    assert model.generate(prompt, max_new_tokens=6) == base.generate(prompt, max_new_tokens=6)


def test_no_recompilation_and_no_device_to_host_transfer_over_100_churning_steps(olmoe_dir):
    model = jmoe.load(olmoe_dir, cache=1, policy="lru", progress=False)
    # Warm: compiles the prompt and decode programs for these shapes (other sampling parameters).
    model.generate(PROMPTS[0], max_new_tokens=100, temperature=0.5, top_k=3)
    compiled = model.compiled_programs
    with jax.transfer_guard_device_to_host("disallow"):
        tokens = model.generate(PROMPTS[0], max_new_tokens=100, temperature=1.0, top_p=0.9, seed=3)
    assert len(tokens[0]) == 100
    assert model.compiled_programs == compiled  # other sampling parameters, same programs
    stats = model.stats()
    assert sum(s["evictions"] for s in stats) > 50, "the cache should churn"


@pytest.mark.quick
def test_statistics_add_up(olmoe_dir):
    model = jmoe.load(olmoe_dir, cache=3, progress=False)
    out = model.generate(PROMPTS, max_new_tokens=7)
    fed = sum(len(p) for p in PROMPTS) + sum(len(t) - 1 for t in out)  # prompt tokens + fed-back tokens
    k = model.config.num_experts_per_tok
    for layer in model.stats():
        assert layer["hits"] + layer["misses"] == fed * k
        assert layer["bytes_moved"] % model.placement_plan.expert_bytes == 0
    import json

    json.dumps(model.stats())


def test_static_policy_pins_and_never_evicts(olmoe_dir):
    model = jmoe.load(olmoe_dir, cache=3, policy="static", progress=False)
    model.generate(PROMPTS[0], max_new_tokens=12)
    stats = model.stats()
    assert all(s["evictions"] == 0 for s in stats)
    assert all(s["hits"] > 0 for s in stats)
    assert (np.asarray(model.engine.state.expert_in_slot) >= 0).all()


def test_offload_params_by_segment_and_regex(olmoe_dir):
    base = jmoe.load(olmoe_dir, progress=False)
    ref = np.asarray(base.logits(LOGIT_IDS))
    by_segment = jmoe.load(olmoe_dir, offload_params=["w_down", "attn"], progress=False)
    kinds = by_segment.placement()
    assert kinds["layers.1.mlp.experts.w_gate_up"]["memory_kind"] == "pinned_host"  # experts move as a unit
    assert kinds["layers.0.attn.o.kernel"]["memory_kind"] == "pinned_host"
    assert kinds["layers.0.mlp.router.kernel"]["memory_kind"] == "device"
    np.testing.assert_allclose(np.asarray(by_segment.logits(LOGIT_IDS)), ref, atol=1e-5, rtol=0)
    by_regex = jmoe.load(olmoe_dir, cache=2, offload_params=[r"re:layers\.1\..*experts"], progress=False)
    kinds = by_regex.placement()
    assert kinds["layers.1.mlp.experts.w_down"]["memory_kind"] == "pinned_host"
    np.testing.assert_allclose(np.asarray(by_regex.logits(LOGIT_IDS)), ref, atol=1e-5, rtol=0)
    assert by_regex.generate(PROMPTS, max_new_tokens=6) == base.generate(PROMPTS, max_new_tokens=6)


@pytest.mark.quick
def test_device_budget_picks_largest_fitting_cache(olmoe_dir):
    from jmoe.offload.placement import BUDGET_KV_TOKENS

    base = jmoe.load(olmoe_dir, cache=0, progress=False).placement_plan
    dense = base.totals()["device_bytes"] - base.slot_bytes
    kv = 2 * 2 * BUDGET_KV_TOKENS * 4 * 8 * 4  # layers, tokens, kv heads, head_dim, float32
    per_slot = 2 * base.expert_bytes  # one cache slot in each of the two layers
    shared = base.scratch * base.expert_bytes + base.stream_bytes  # scratch slots, prefill's chunk buffers
    budget = dense + kv + shared + 3 * per_slot + per_slot // 2
    model = jmoe.load(olmoe_dir, device_budget_gb=budget / 2**30, progress=False)
    assert model.placement_plan.caches == (3, 3)


@pytest.mark.quick
def test_bad_input(olmoe_dir):
    with pytest.raises(jmoe.InputError, match="cache must be a whole number >= 0"):
        jmoe.load(olmoe_dir, cache=-1)
    with pytest.raises(ValueError, match="unknown cache policy 'fifo'.*lfru"):
        jmoe.load(olmoe_dir, cache=2, policy="fifo")
    with pytest.raises(jmoe.InputError, match="pattern 'w9' matches no parameter"):
        jmoe.load(olmoe_dir, offload_params=["w9"])
    with pytest.raises(jmoe.InputError, match="device_budget_gb=1e-06 .* cannot hold the dense weights"):
        jmoe.load(olmoe_dir, device_budget_gb=1e-6)


def test_cli_cache_flags_and_stats_table(hf_checkpoints, tmp_path, capsys):
    from hf_models import write_word_tokenizer
    from jmoe.generate import main

    import shutil

    model_dir = tmp_path / "m"
    shutil.copytree(hf_checkpoints["olmoe_e8k4_clip"][0], model_dir)
    write_word_tokenizer(model_dir)
    assert main(["--model", str(model_dir), "--prompt", "w1 w2 w3", "--max-new-tokens", "4", "--cache", "2",
                 "--policy", "lru", "--stats"]) == 0
    out = capsys.readouterr()
    assert "hit rate" in out.out and "total hit rate" in out.out
    assert "pinned_host" in out.err  # the placement summary
    assert main(["--model", str(model_dir), "--prompt", "w1", "--cache", "2", "--policy", "nope"]) == 2
    assert "unknown cache policy 'nope'" in capsys.readouterr().err


def test_orbax_checkpoint_restores_into_placement(olmoe_dir, tmp_path):
    from jmoe.checkpoint.convert import convert_checkpoint

    out = convert_checkpoint(olmoe_dir, tmp_path / "orbax", progress=False)
    model = jmoe.load(out, cache=2, progress=False)
    assert model.module().moe_blocks()[0].experts.w_down[...].sharding.memory_kind == "pinned_host"
    ref = jmoe.load(olmoe_dir, progress=False)
    np.testing.assert_allclose(np.asarray(model.logits(LOGIT_IDS)), np.asarray(ref.logits(LOGIT_IDS)), atol=1e-5,
                               rtol=0)


def first_four_experts(moe_layers: int):
    """A routing override that sends every token of every MoE layer to experts 0-3."""
    return lambda step, shape: np.broadcast_to(np.array([0, 1, 2, 3], np.int32), (moe_layers, *shape, 4))


@pytest.mark.quick
def test_forced_routing_drives_the_cache(olmoe_dir):
    """Trace-forced routing (a benchmark option): the engine sees exactly the forced experts."""
    model = jmoe.load(olmoe_dir, cache=2, progress=False)
    forced = first_four_experts(model.config.num_moe_layers)
    model.set_policy("lru")
    prompt = PROMPTS[1]
    out = model.generate_detailed([prompt], 6, SamplingParams(), routing_override=forced).tokens[0]
    for layer in model.stats():
        # The prompt streams all four experts and leaves the cache empty; the first decode step misses all
        # four and admits two into the two slots; every later step hits those two and takes the other two
        # through scratch (their only possible victims are experts the step needs).
        assert layer["misses"] == 4 * len(prompt) + 4 + 2 * (len(out) - 2)
        assert layer["hits"] == 2 * (len(out) - 2)


def test_router_prefetch_keeps_results_and_respects_its_bound(olmoe_dir, resident):
    """Prefetch copies at most `prefetch` experts per layer ahead of need and never changes results."""
    _, ref_logits, ref_tokens = resident("olmoe_e8k4_clip")
    model = jmoe.load(olmoe_dir, cache=3, policy="lru", prefetch=2, progress=False)
    np.testing.assert_allclose(np.asarray(model.logits(LOGIT_IDS)), ref_logits, atol=1e-5, rtol=0)
    assert model.generate(PROMPTS, max_new_tokens=10) == ref_tokens
    before = model.stats()
    k, expert_bytes = model.config.num_experts_per_tok, model.placement_plan.expert_bytes
    steps = 9
    model.generate(PROMPTS[1], max_new_tokens=steps + 1)
    first, second = [
        {key: after[key] - prior[key] for key in ("hits", "misses", "bytes_moved")}
        for prior, after in zip(before, model.stats())]
    # The prompt step streams (no prefetch); each decode step copies at most k demand misses, plus at
    # most 2 prefetched experts into the second layer.
    prompt_copies = model.config.num_experts
    assert first["bytes_moved"] <= (prompt_copies + steps * k) * expert_bytes
    assert second["bytes_moved"] <= (prompt_copies + steps * (k + 2)) * expert_bytes
    with pytest.raises(jmoe.InputError, match="prefetch must be a whole number >= 0"):
        jmoe.load(olmoe_dir, cache=3, prefetch=-1)


@pytest.mark.cpu_hlo
def test_decode_leaves_out_scratch_where_the_cache_admits_every_miss(olmoe_dir):
    """A policy that admits misses offers every slot as a victim, so where the slots outnumber the experts a step
    routes to (4 >= 1 x top-4) the decode step has no scratch path: one copy loop a layer, not two. A static
    policy's misses go to scratch (its victim order is empty, [L, 0]): a step of its own, compiled the first time
    set_policy switches to it, and not again when it switches back."""
    from jmoe.plan.hlo import control_flow

    model = jmoe.load(olmoe_dir, cache=4, progress=False)
    expected = model.generate([PROMPTS[1]], max_new_tokens=4)
    first = model.compiled_programs
    for policy in ("static", "lru"):
        model.set_policy(policy)
        assert model.generate([PROMPTS[1]], max_new_tokens=4) == expected, policy
        assert model.compiled_programs == 2 * first, policy
    decodes = [step["hlo"] for step in model.compiled_steps() if step["tokens"][1] == 1]
    layers = len(model.engine.layers)
    assert sorted(control_flow(hlo).data_dependent_loops for hlo in decodes) == [layers, 2 * layers]


def test_static_policy_instance_is_installed_before_the_first_step(olmoe_dir):
    from jmoe.offload.policies import StaticPolicy

    cfg = jmoe.load_config(olmoe_dir)
    frequency = np.zeros((cfg.num_moe_layers, cfg.num_experts))
    frequency[:, [1, 4, 6]] = 1.0
    model = jmoe.load(olmoe_dir, cache=3, policy=StaticPolicy(cfg.num_moe_layers, cfg.num_experts, frequency),
                      progress=False)
    np.testing.assert_array_equal(np.asarray(model.engine.state.expert_in_slot), [[1, 4, 6]] * cfg.num_moe_layers)
    model.set_policy(StaticPolicy(cfg.num_moe_layers, cfg.num_experts, frequency[:, ::-1]))
    np.testing.assert_array_equal(np.asarray(model.engine.state.expert_in_slot), [[1, 3, 6]] * cfg.num_moe_layers)
    model.generate(PROMPTS[0], max_new_tokens=5)
    assert all(s["evictions"] == 0 and s["hits"] > 0 for s in model.stats())


def test_offload_arguments_are_checked_even_when_everything_is_resident(olmoe_dir):
    with pytest.raises(ValueError, match="unknown cache policy 'fifo'"):
        jmoe.load(olmoe_dir, policy="fifo", progress=False)
    with pytest.raises(jmoe.InputError, match="prefetch must be a whole number >= 0"):
        jmoe.load(olmoe_dir, prefetch=-1, progress=False)
    with pytest.raises(jmoe.InputError, match="side_stream_copies is True or False, found 'yes'"):
        jmoe.load(olmoe_dir, side_stream_copies="yes", progress=False)
    with pytest.raises(jmoe.InputError, match="these settings make none: turn on prefetch"):
        jmoe.load(olmoe_dir, cache=2, side_stream_copies=True, progress=False)


def test_the_command_lines_take_side_stream_copies():
    from jmoe.cli.common import offload_options
    from jmoe.cli.generate import build_parser

    assert offload_options(build_parser().parse_args(["--prefetch", "1", "--side-stream-copies"])).side_stream_copies
    assert not offload_options(build_parser().parse_args(["--miss-mode", "direct"])).side_stream_copies
    with pytest.raises(jmoe.InputError, match="these settings make none"):
        offload_options(build_parser().parse_args(["--side-stream-copies"]))


# Host compute differs between families only in the expert FFN: plain SwiGLU (Mixtral), biases and clamped
# SwiGLU (GPT-OSS), and top-4 (OLMoE); routers and shared experts run on the device as in fetch mode.
@pytest.mark.parametrize("name", ["mixtral_e4k2_gqa2", "gpt_oss_e4k2_window", "olmoe_e8k4_clip"])
def test_host_miss_mode_and_prefetch_match_resident(name, hf_checkpoints, resident):
    """Miss mode "host" (missed experts computed where their weights live), alone and with prefetch."""
    cfg, ref_logits, ref_tokens = resident(name)
    k = cfg.num_experts_per_tok
    for cache, prefetch in ((0, 0), (k, k)):  # no cache at all; a cache of k filled ahead by prefetch
        model = jmoe.load(hf_checkpoints[name][0], cache=cache, miss_mode="host", prefetch=prefetch, progress=False)
        np.testing.assert_allclose(np.asarray(model.logits(LOGIT_IDS)), ref_logits, atol=1e-5, rtol=0,
                                   err_msg=f"cache={cache} prefetch={prefetch}")
        assert model.generate(PROMPTS, max_new_tokens=10) == ref_tokens, f"cache={cache} prefetch={prefetch}"


def test_direct_miss_mode_matches_resident_and_admits_its_misses(hf_checkpoints, resident):
    """Miss mode "direct" (the device reads missed experts in host memory; on this CPU the host computes them, as
    "host" does), alone and with prefetch, its copies ahead of need on a second stream (on a GPU); the manager admits
    the misses for later steps (hits at decode)."""
    name = "mixtral_e4k2_gqa2"
    cfg, ref_logits, ref_tokens = resident(name)
    k = cfg.num_experts_per_tok
    for cache, prefetch in ((1, 0), (k, k)):
        model = jmoe.load(hf_checkpoints[name][0], cache=cache, miss_mode="direct", prefetch=prefetch,
                          side_stream_copies=bool(prefetch), progress=False)
        np.testing.assert_allclose(np.asarray(model.logits(LOGIT_IDS)), ref_logits, atol=1e-5, rtol=0)
        assert model.generate(PROMPTS, max_new_tokens=10) == ref_tokens, f"cache={cache} prefetch={prefetch}"
        assert all(layer["hits"] > 0 for layer in model.stats())


def test_the_direct_kernel_computes_the_missed_experts_only():
    """What miss mode "direct" runs on a GPU (there over the pinned-host experts; here over device arrays, with
    the Pallas kernel interpreted): the grouped GEMM for the choices of missed experts, the others reading
    nothing, against the reference kernel on those choices alone; with cached experts beside them, every choice
    from where it lies (a one-row step: in the same two kernels, one source after another)."""
    from jmoe.kernels import ExpertKernel, ExpertWeights, moe_ffn
    from jmoe.offload.where_they_lie import missed_experts_by_kernel

    rng = np.random.default_rng(0)
    experts, d, f = 4, 16, 16
    w_gate_up, w_down = (rng.standard_normal(shape, np.float32) * 0.1 for shape in ((experts, d, 2 * f),
                                                                                      (experts, f, d)))
    x = rng.standard_normal((3, d), np.float32)
    ids = np.array([[0, 2], [3, -1], [2, 1]], np.int32)
    weights = rng.random((3, 2), np.float32)
    missing = np.array([False, True, True, False])
    host = ExpertWeights(w_gate_up, w_down)
    kernel = ExpertKernel("pallas", "swiglu")
    y = missed_experts_by_kernel(missing, x, ids, weights, host, None, kernel)
    missed = np.where((ids >= 0) & missing[np.maximum(ids, 0)], ids, -1)
    expected = moe_ffn(x, missed, weights, w_gate_up, w_down, backend="reference", out_dtype=np.float32)
    assert np.abs(np.asarray(expected)).max() > 0
    np.testing.assert_allclose(np.asarray(y), np.asarray(expected), atol=1e-5, rtol=0)
    # The experts not missing, 3 and 0, cached in slots 0 and 1 (copies of theirs): every choice computed.
    slots = ExpertWeights(w_gate_up[[3, 0]], w_down[[3, 0]])
    slot_ids = np.array([[1, -1], [0, -1], [-1, -1]], np.int32)
    for rows in (1, 3):  # one kernel reading two sources; two calls
        y = missed_experts_by_kernel(missing, x[:rows], ids[:rows], weights[:rows], host,
                                     (slot_ids[:rows], slots), kernel)
        expected = moe_ffn(x[:rows], ids[:rows], weights[:rows], w_gate_up, w_down, backend="reference",
                           out_dtype=np.float32)
        np.testing.assert_allclose(np.asarray(y), np.asarray(expected), atol=1e-5, rtol=0, err_msg=f"{rows} rows")
    # An expert width Triton cannot tile (40: blocks of 8) is a clear error, not XLA's kernel failing on host arrays.
    narrow = ExpertWeights(w_gate_up[:, :, :80], w_down[:, :8].repeat(5, axis=1))
    with pytest.raises(jmoe.InputError, match=r'miss_mode="direct" .* divisible by 16 .*; found hidden size 16, '
                                              r'expert width 40, .* Use miss_mode="host" or "fetch"'):
        missed_experts_by_kernel(missing, x, ids, weights, narrow, None, kernel)


def test_host_miss_mode_moves_no_expert_weights_at_decode_without_cache(olmoe_dir):
    """With no cache slots, "fetch" copies every needed expert at each decode step; "host" copies none."""
    moved = {}
    for mode in ("fetch", "host"):
        model = jmoe.load(olmoe_dir, cache=0, miss_mode=mode, progress=False)
        model.generate(PROMPTS[1], max_new_tokens=1)  # the prompt step alone (it streams in both modes)
        prompt_bytes = sum(s["bytes_moved"] for s in model.stats())
        # A step of several tokens is a prefill whatever the model's size: it streams its experts in.
        assert prompt_bytes >= model.config.num_moe_layers * model.placement_plan.expert_bytes, mode
        model.set_policy("lfru")
        model.generate(PROMPTS[1], max_new_tokens=6)
        moved[mode] = sum(s["bytes_moved"] for s in model.stats()) - prompt_bytes
    assert moved["host"] == 0
    assert moved["fetch"] >= 5 * model.config.num_moe_layers * model.placement_plan.expert_bytes


def test_host_miss_mode_admits_misses_into_the_cache_for_later_steps(olmoe_dir):
    """A decode step in host mode computes its misses on the host and reads only slots filled before it;
    the manager then admits one missed expert per layer, copied as the next step starts."""
    model = jmoe.load(olmoe_dir, cache=2, policy="lru", miss_mode="host", progress=False)
    forced = first_four_experts(model.config.num_moe_layers)

    prompt = PROMPTS[1]
    out = model.generate_detailed([prompt], 6, SamplingParams(), routing_override=forced, run_ahead=False).tokens[0]
    assert len(out) == 6  # the prompt step, then five decode steps
    for layer in model.stats():
        # The prompt streams; decode steps then hit 1, 2, 2, 2, 2 of the four experts: one admission (of a
        # miss of the step before, the prompt included) as each step starts, until both slots are full. (Steps
        # dispatched ahead: tests/test_run_ahead.py.)
        assert layer["hits"] == 1 + 2 + 2 + 2 + 2
        assert layer["misses"] == 4 * len(prompt) + 3 + 2 + 2 + 2 + 2
    reference = jmoe.load(olmoe_dir, progress=False)
    assert model.generate(PROMPTS[0], max_new_tokens=12) == reference.generate(PROMPTS[0], max_new_tokens=12)
    with pytest.raises(jmoe.InputError, match="miss_mode must be one of fetch, host, direct, found 'cpu'"):
        jmoe.load(olmoe_dir, cache=3, miss_mode="cpu", progress=False)


@pytest.mark.quick
def test_host_miss_mode_copies_only_planned_admissions(olmoe_dir):
    """Host mode plans one admission per layer and step; once the cache holds every expert the steps use, the
    plans admit nothing and the steps copy nothing (before issue 33 each step copied one expert regardless)."""
    model = jmoe.load(olmoe_dir, cache=4, policy="lru", miss_mode="host", progress=False)
    forced, expert_bytes = first_four_experts(model.config.num_moe_layers), model.placement_plan.expert_bytes

    prompt = PROMPTS[1]
    out = model.generate_detailed([prompt], 9, SamplingParams(), routing_override=forced, run_ahead=False).tokens[0]
    assert len(out) == 9  # the prompt step, then eight decode steps
    for layer in model.stats():
        # The prompt streams the four experts; the first four decode steps each admit one; the last four hit all.
        assert layer["hits"] == 1 + 2 + 3 + 4 * 5
        assert layer["bytes_moved"] == (4 + 4) * expert_bytes
