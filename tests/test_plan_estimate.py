"""jmoe.plan's speed estimate: its arithmetic against hand-computed cases, the hit rate it replays from a routing
trace against the replay's own, and the estimate reaching as_dict(), report() and the command line."""

import numpy as np
import pytest

import jmoe
from jmoe.errors import InputError
from jmoe.offload.policies import make_policy
from jmoe.plan import estimate as est
from jmoe.plan import planner
from jmoe.plan.hit_rate import replayed_hit_rate
from jmoe.plan.programs import Program
from jmoe.traces.replay import replay

SPEEDS = est.DeviceSpeeds(memory_bytes_per_s=1e12, peak_flops=1e14, host_link_bytes_per_s=1e10)


def test_device_seconds_slow_adds_memory_compute_and_launches_fast_takes_the_larger():
    slow, fast = est.device_seconds(flops=1e12, hbm_bytes=(6e9, 3e9), kernels=100, speeds=SPEEDS)
    # slow: 6e9 / (1e12 x 0.6) + 1e12 / (1e14 x 0.4) + 100 x 5 us; fast: max(3e9 / 0.9e12, 1e12 / 0.8e14) + 100 x 1 us
    assert slow == pytest.approx(0.01 + 0.025 + 0.0005)
    assert fast == pytest.approx(0.0125 + 0.0001)


def test_copies_experts_and_tokens_per_second():
    assert est.link_seconds(1e9, SPEEDS) == pytest.approx((1 / 2.5, 1 / 8.5))
    assert est.distinct_experts(8, 2, 1) == pytest.approx(2.0)
    assert est.distinct_experts(8, 2, 2) == pytest.approx(3.5)  # 8 x (1 - (6/8)^2)
    # 3 offloaded layers x 2 experts x 0.75 missed x 1000 bytes + 500 host-kept bytes
    assert est.decode_copy_bytes([2, 2, 2], 8, 2, 1000, 0.25, 1, 500) == pytest.approx(5000)
    assert est.prefill_copy_bytes([2, 4], 8, 1000) == (16000, 10000)
    assert est.tokens_per_s(4, (0.5, 0.2), (0.3, 0.4)) == pytest.approx((5.0, 10.0))
    assert est.tokens_per_s(4, (0.5, 0.2), (0.3, 0.4), host=(0.2, 0.1)) == pytest.approx((4.0, 8.0))
    # Steps dispatched ahead: the host's work hides behind the fast end's step, unless it is the longer.
    assert est.tokens_per_s(4, (0.5, 0.2), (0.3, 0.4), host=(0.2, 0.1), host_beside=True) == pytest.approx((4.0, 10.0))
    assert est.tokens_per_s(4, (0.5, 0.2), (0.3, 0.4), host=(0.2, 0.8), host_beside=True) == pytest.approx((4.0, 5.0))
    # 1.6 / 0.9 ms a step plus 0.3 / 0.15 ms per offloaded layer
    assert est.host_seconds(0) == pytest.approx((1.6e-3, 0.9e-3))
    assert est.host_seconds(4) == pytest.approx((2.8e-3, 1.5e-3))


def test_collectives_cost_a_latency_each_and_their_bytes_over_the_interconnect():
    from jmoe.plan.hlo import Collective

    speeds = est.DeviceSpeeds(1e12, 1e14, 1e10, interconnect_bytes_per_s=1e11)
    found = {Collective("all-reduce", ("f32[1,1000]",), 4000): 3, Collective("all-to-all", ("bf16[500]",), 1000): 1}
    # 4 devices: an all-reduce sends 2 x 3/4 of its bytes, the others 3/4: 3 x 6000 + 750 = 18750 bytes;
    # 4 collectives x 30 / 8 us, plus the bytes at 0.5 / 0.8 of 1e11 B/s
    slow, fast = est.collective_seconds(found, 4, speeds)
    assert slow == pytest.approx(4 * 30e-6 + 18750 / 0.5e11)
    assert fast == pytest.approx(4 * 8e-6 + 18750 / 0.8e11)
    assert est.collective_seconds({}, 1, speeds) == (0.0, 0.0)
    # a target without an interconnect: the host link's bandwidth
    assert est.collective_seconds(found, 4, SPEEDS)[0] == pytest.approx(4 * 30e-6 + 18750 / 0.5e10)


def fake_programs(decode_bytes=9e8, prefill_bytes=1.8e9, flops=0.0):
    return {name: Program(name, (1, t), cost_analysis={"flops": flops, "bytes accessed": b}, hlo_text="")
            for name, t, b in (("decode", 1, decode_bytes), ("prefill", 100, prefill_bytes))}


def test_device_bytes_replace_whole_expert_arrays_by_the_routed_experts():
    # 9e8 counted, of which 3e8 are expert arrays; 4 routed experts of 1e7 bytes
    assert est.device_bytes(9e8, 3e8, 4, 10**7) == pytest.approx(6.4e8)
    assert est.device_bytes(1e8, 3e8, 0, 10**7) == 0.0


def test_estimate_by_hand():
    def speed_at(hit_rate):
        return est.estimate(fake_programs(), SPEEDS, caches=[None, 4], num_experts=8, top_k=2, expert_bytes=10**7,
                            expert_array_bytes=3 * 10**8, least_bytes=10**8, host_param_bytes=0, batch=1, rows=1,
                            context=100, hit_rate=hit_rate, hit_rate_source="given", notes=[])

    speed = speed_at(0.5)
    slow_host, fast_host = 1.9e-3, 1.05e-3  # 1.6 / 0.9 ms a step + 0.3 / 0.15 ms for the one offloaded layer
    # decode: HBM 9e8 - 3e8 + 2 layers x 2 routed x 1e7 = 6.4e8 B -> 6.4e8 / 0.6e12 s slow, / 0.9e12 fast;
    # copies: 1 offloaded layer x 2 x 0.5 missed x 1e7 B -> 1e7 / 0.25e10 s slow, 1e7 / 0.85e10 fast (the larger)
    # the fast end's steps run ahead of the host's work, which hides behind the copies
    assert speed.decode_tokens_per_s == pytest.approx((1 / (6.4e8 / 0.6e12 + 1e7 / 0.25e10 + slow_host),
                                                       1 / (1e7 / 0.85e10)))
    assert speed.decode_tokens_per_s_batch1 == speed.decode_tokens_per_s
    # prefill of 100 tokens: every expert routed (8 x (1 - 0.75^100) = 8 per layer): HBM 1.5e9 + 1.6e8 B; streams
    # 8 experts slow (8e7 B / 0.25e10), the 4 uncached fast (4e7 B / 0.85e10, more than 1.66e9 / 0.9e12)
    assert speed.prefill_tokens_per_s == pytest.approx((100 / (1.66e9 / 0.6e12 + 8e7 / 0.25e10 + slow_host),
                                                        100 / (4e7 / 0.85e10 + fast_host)))
    low, high = speed.as_dict()["decode_tokens_per_s"]
    assert low < high
    # the prompt in chunks of 40 tokens, as the server cuts it: 3 steps, each streaming the experts and costing
    # the host work once, over the one program's device time
    chunked = est.estimate(fake_programs(), SPEEDS, caches=[None, 4], num_experts=8, top_k=2, expert_bytes=10**7,
                           expert_array_bytes=3 * 10**8, least_bytes=10**8, host_param_bytes=0, batch=1, rows=1,
                           context=100, hit_rate=0.5, hit_rate_source="given", notes=[], prefill_chunk=40)
    assert chunked.prefill_tokens_per_s == pytest.approx(
        (100 / (1.66e9 / 0.6e12 + 3 * (8e7 / 0.25e10 + slow_host)), 100 / (3 * (4e7 / 0.85e10 + fast_host))))
    assert (chunked.inputs["prefill_chunks"], chunked.inputs["prefill_chunk_tokens"]) == (3, 40)
    assert speed.inputs["prefill_chunks"] == 1 and "in 3 chunks of 40 tokens" in chunked.assumptions[-1]
    # every access a hit: no copies; fast HBM = 1e8 least + 4 routed x 1e7 = 1.4e8 B at 0.9e12 B/s
    assert speed_at(1.0).decode_tokens_per_s == pytest.approx((1 / (6.4e8 / 0.6e12 + slow_host), 1 / fast_host))
    # an analysis that counts less than a step must read (1e8 counted, 3e8 of it expert arrays): the slow end
    # reads the least too, so it stays the slow end
    undercounted = est.estimate(fake_programs(decode_bytes=1e8), SPEEDS, caches=[None, 4], num_experts=8, top_k=2,
                                expert_bytes=10**7, expert_array_bytes=3 * 10**8, least_bytes=10**8,
                                host_param_bytes=0, batch=1, rows=1, context=100, hit_rate=1.0,
                                hit_rate_source="given", notes=[])
    assert undercounted.decode_tokens_per_s == pytest.approx((1 / (1.4e8 / 0.6e12 + slow_host), 1 / fast_host))
    assert est.estimate({"decode": Program("decode", (1, 1))}, SPEEDS, caches=[4], num_experts=8, top_k=2,
                        expert_bytes=1, expert_array_bytes=0, least_bytes=0, host_param_bytes=0, batch=1, rows=1,
                        context=1,
                        hit_rate=1.0, hit_rate_source="", notes=[]) is None  # nothing compiled: no estimate


def random_trace(tokens=300, layers=2, experts=4, top_k=2, seed=0):
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((tokens, layers, experts)) ** np.arange(1, experts + 1), axis=2)[:, :, :top_k]


@pytest.mark.quick
@pytest.mark.parametrize("policy", ["lru", "lfru"])
def test_hit_rate_replayed_from_a_trace_equals_the_replay(policy):
    trace = random_trace(layers=3, experts=8, top_k=2)
    expected = replay(trace, 8, 4, make_policy(policy, 3, 8))["hit_rate"]
    assert replayed_hit_rate(trace, policy, [4, 4, 4], 8) == pytest.approx(expected)
    # per-layer caches: each group of layers replays with its own cache; a resident layer is not counted
    parts = [replay(trace[:, [0], :], 8, 3, make_policy(policy, 1, 8))["hits"],
             replay(trace[:, [2], :], 8, 6, make_policy(policy, 1, 8))["hits"]]
    assert replayed_hit_rate(trace, policy, [3, None, 6], 8) == pytest.approx(sum(parts) / (2 * trace[:, 0].size))


@pytest.fixture
def no_compile_but_costs(monkeypatch):
    """Plans whose "compiled" programs are fakes with a known cost analysis (compiled ones, with XLA's cost analysis:
    test_plan_gpu_compile)."""
    monkeypatch.setattr(planner, "compile_programs", lambda *args: fake_programs())


@pytest.mark.quick
def test_plan_estimate_from_a_trace_reaches_as_dict_report_and_cli(small_mixtral_dir, tmp_path, no_compile_but_costs,
                                                                   capsys):
    from jmoe.cli.plan import main

    trace_file = tmp_path / "trace.npy"
    np.save(trace_file, random_trace())
    plan = jmoe.plan(small_mixtral_dir, cache=2, target="h100", trace=trace_file, policy="lru")
    estimate = plan.as_dict()["estimate"]
    assert estimate["hit_rate"] == pytest.approx(replay(random_trace(), 4, 2, make_policy("lru", 2, 4))["hit_rate"])
    for key in ("decode_tokens_per_s", "decode_tokens_per_s_batch1", "prefill_tokens_per_s"):
        low, high = estimate[key]
        assert 0 < low < high
    assert any("PCIe 5.0 x16" in line for line in estimate["assumptions"])
    assert "speed estimate on h100" in plan.report() and "decode, batch 1" in plan.report()
    main([str(small_mixtral_dir), "--target", "h100", "--cache", "2", "--hit-rate", "0.5", "--host-link-gbs", "25"])
    out = capsys.readouterr().out
    assert "hit rate 0.500 (given)" in out and "25 GB/s as given" in out


@pytest.fixture(scope="module")
def mixtral_8x7b(tmp_path_factory):
    """Mixtral-8x7B's published shape in bf16: config.json and a header-only safetensors file, no weights."""
    from bench.plan import MODELS, write_header_only_checkpoint

    return write_header_only_checkpoint(tmp_path_factory.mktemp("mixtral-8x7b"), MODELS["mixtral-8x7b"])


def test_a_long_prompt_streams_the_experts_once_a_chunk_of_the_servers_length(mixtral_8x7b, no_compile_but_costs):
    """Mixtral-8x7B at cache 4 of 8 on an H100 streams 45.1 GB a prefill chunk, 0.9 s at 0.8 of PCIe 5.0 x16:
    27.8k tokens' compute at 0.8 of the bf16 peak, so a 4096-token prompt is one chunk and streams them once, not
    16 times (256-token chunks). A link 16 times as fast makes 2048-token chunks (jmoe.offload.prefill_chunks)."""
    def prefill(context, **options):
        plan = jmoe.plan(mixtral_8x7b, cache=4, target="h100", context=context, **options)
        inputs = plan.estimate.inputs
        return inputs["prefill_chunks"], inputs["prefill_chunk_tokens"], plan

    chunks, chunk, plan = prefill(4096)
    assert (chunks, chunk) == (1, 4096)
    assert plan.estimate.inputs["prefill_stream_bytes_per_chunk"] == 32 * 4 * plan.placement.expert_bytes
    report = plan.report()
    assert "  prefill, 4096-token prompt: 1 chunk of 4096 tokens, experts streamed once, 45.1 GB" in report
    assert "prefill chunks of 4096 tokens (jmoe.offload.prefill_chunks: the shortest power of two" in report
    assert prefill(1024)[:2] == (1, 1024) and prefill(32768)[:2] == (1, 32768)
    assert prefill(4096, host_link_gbs=16)[:2] == (1, 4096)  # a slower link: a longer chunk, still the context
    chunks, chunk, fast_link = prefill(32768, host_link_gbs=16 * 63)
    assert (chunks, chunk) == (16, 2048)
    assert "32768-token prompt: 16 chunks of 2048 tokens, experts streamed 16 times, 721.6 GB" in fast_link.report()
    # every weight on the device: nothing streams, and the prompt is cut into the server's own 256-token chunks
    resident = jmoe.plan(mixtral_8x7b, target="h100", context=4096)
    assert "prefill, 4096-token prompt: 16 chunks of 256 tokens, nothing streamed" in resident.report()


def test_plan_estimate_inputs_are_checked(small_mixtral_dir, no_compile_but_costs):
    with pytest.raises(InputError, match="3 MoE layers, the model 2"):
        jmoe.plan(small_mixtral_dir, cache=2, target="h100", trace=random_trace(layers=3))
    with pytest.raises(InputError, match="not both"):
        jmoe.plan(small_mixtral_dir, cache=2, target="h100", trace=random_trace(), hit_rate=0.5)
    with pytest.raises(InputError, match=r"hit_rate must be in \[0, 1\]"):
        jmoe.plan(small_mixtral_dir, cache=2, target="h100", hit_rate=1.5)
    assert jmoe.plan(small_mixtral_dir, target="h100").estimate.hit_rate == 1.0  # every expert resident
    assert jmoe.plan(small_mixtral_dir, target="h100", compile=False).estimate is None


def test_calibration_reads_the_settings_a_gpu_check_run_measured(tmp_path):
    import json
    from pathlib import Path

    from bench.plan_calibration import measured_settings

    results = json.loads((Path(__file__).resolve().parents[1] / "bench/results/gpu_check_nvidia_h100_80gb_hbm3.json")
                         .read_text())
    settings = measured_settings(results)
    assert [(s["model"], s["cache"]) for s in settings] == [("mixtral", None), ("mixtral", 4), ("mixtral", 2),
                                                            ("deepseek_v3", None), ("deepseek_v3", 32),
                                                            ("deepseek_v3", 6)]
    assert settings[1]["tokens_per_s"] == pytest.approx(94.47, abs=0.01)
    assert settings[1]["mb_per_token"] == pytest.approx(129.4, abs=0.1) and settings[0]["mb_per_token"] == 0.0
    with pytest.raises(SystemExit, match="full gpu_check run"):
        measured_settings({**results, "mode": "small"})


def test_calibration_reads_the_resident_and_fetch_settings_of_a_decode_bound_run():
    """bench.gpu_decode_bound's JSON: the default variant's and the big shape's resident and fetch rows without
    prefetch (what jmoe.plan estimates), each with its measured hit rate; the big shape's placement a device budget."""
    from bench.gpu_decode_bound import BIG
    from bench.plan_calibration import decode_bound_settings, settings_of

    def row(model, miss_mode, **more):
        return {"model": model, "miss_mode": miss_mode, "tokens_per_s": 10.0, **more}

    results = {"settings": [], "variants": {
        "default": {"rows": [row("mixtral", "resident", cache=None), row("mixtral", "fetch", cache=2, hit_rate=0.5),
                             row("mixtral", "direct", cache=2, hit_rate=0.5),
                             row("mixtral", "fetch", cache=2, prefetch=2, hit_rate=0.6)]},
        BIG: {"rows": [row(BIG, "resident", cache=None),
                       row(BIG, "fetch", cache=41, device_budget_gb=24.0, hit_rate=0.4)]},
        "latency-hiding scheduler": {"rows": [row("mixtral", "fetch", cache=2, hit_rate=0.5)]}}}
    settings = settings_of(results)
    assert settings == decode_bound_settings(results)
    assert [(s["model"], s["cache"], s["device_budget_gb"], s["hit_rate"]) for s in settings] == [
        ("mixtral", None, None, None), ("mixtral", 2, None, 0.5), (BIG, None, None, None), (BIG, None, 24.0, 0.4)]
    with pytest.raises(SystemExit, match="gpu_decode_bound's JSON"):
        decode_bound_settings({"mode": "full"})


# ---- the disk tier (host_budget_gb): what a decoded token reads from disk, and its time in the estimate ----

def test_disk_reads_per_token_by_hand():
    # 2 offloaded layers x 2 distinct experts a token x (1 - 0.25) missed by the host rows = 3 experts of 1000 bytes
    reads = est.disk_reads(3, 2, 8, 2, 1000, (0.25, "given"), 1.5)
    assert (reads.experts_per_token, reads.bytes_per_token) == pytest.approx((3.0, 3000.0))
    assert reads.disk_bytes_per_s == 1.5e9 and reads.seconds_per_token == pytest.approx(3000 / 1.5e9)
    assert reads.as_dict()["seconds_per_token"] == reads.seconds_per_token and reads.disk_source == "as given"
    every_hit = est.disk_reads(3, 2, 8, 2, 1000, (1.0, "given"), None)
    assert every_hit.experts_per_token == 0.0 and every_hit.seconds_per_token == 0.0
    assert every_hit.disk_bytes_per_s == est.DEFAULT_DISK_GBS * 1e9 and "assumed" in every_hit.disk_source


@pytest.mark.parametrize("batch", [1, 2])
def test_the_disk_time_adds_to_every_decode_step_and_prefill_reads_what_no_host_row_holds(batch):
    def speed(disk):
        return est.estimate(fake_programs(), SPEEDS, caches=[None, 4], num_experts=8, top_k=2, expert_bytes=10**7,
                            expert_array_bytes=3 * 10**8, least_bytes=10**8, host_param_bytes=0, batch=batch,
                            rows=batch, context=100, hit_rate=0.5, hit_rate_source="given", notes=[], disk=disk,
                            runs_ahead=disk is None)  # as the planner says: the disk tier's steps wait

    disk = est.disk_reads(6, 1, 8, 2, 10**7, (0.75, "given"), 0.5)
    without, with_disk = speed(None), speed(disk)
    # one offloaded layer: 8 x (1 - (6/8)^batch) distinct experts a step, a quarter of them read, 1e7 B at 0.5 GB/s
    step = 8 * (1 - 0.75 ** batch) * 0.25 * 1e7 / 0.5e9
    for low_or_high in (0, 1):
        # Without a disk tier the fast end's steps run ahead of the host's work (1.05 ms, hidden behind the copies);
        # with one they wait for it again.
        shown = (0.0, 1.05e-3)[low_or_high]
        assert (batch / with_disk.decode_tokens_per_s[low_or_high]
                == pytest.approx(batch / without.decode_tokens_per_s[low_or_high] + step + shown))
        # prefill reads the 8 - 6 experts outside the host rows once
        assert (100 * batch / with_disk.prefill_tokens_per_s[low_or_high]
                == pytest.approx(100 * batch / without.prefill_tokens_per_s[low_or_high] + 2 * 1e7 / 0.5e9))
    assert with_disk.decode_tokens_per_s_batch1[0] == pytest.approx(
        1 / (1 / without.decode_tokens_per_s_batch1[0] + disk.seconds_per_token))
    assert any(line.startswith("disk tier: 5.000 MB a decoded token") for line in with_disk.assumptions)
    assert not any("disk" in line for line in without.assumptions) and "disk_bytes_per_s" not in without.inputs


@pytest.fixture(scope="module")
def olmoe_dir(hf_checkpoints):
    return hf_checkpoints["olmoe_e8k4_clip"][0]  # 2 MoE layers, 8 experts, top-4


def host_budget_for(directory, cache, rows):
    """A host budget (GB) whose placement keeps `rows` host rows per offloaded layer (and whatever else the
    placement counts in the budget per layer)."""
    probe = jmoe.plan(directory, cache=cache)
    layer_experts = probe.placement.layer_expert_bytes
    for held in range(rows, probe.config.num_experts):
        budget = (held + 0.5) * layer_experts / 1e9
        try:
            if jmoe.plan(directory, cache=cache, host_budget_gb=budget).placement.host_rows == rows:
                return budget
        except InputError:  # too small for the disk tier's other experts
            pass
    raise AssertionError(f"no host budget keeps {rows} host rows")


def test_host_hit_rate_from_a_trace_equals_a_one_level_replay_at_the_host_rows(olmoe_dir):
    from jmoe.traces.tiers import replay_tiers

    trace = random_trace(layers=2, experts=8, top_k=4)
    budget = host_budget_for(olmoe_dir, 4, 6)
    plan = jmoe.plan(olmoe_dir, cache=4, host_budget_gb=budget, trace=trace, policy="lru")
    one_level = replay(trace, 8, 6, make_policy("lru", 2, 8))
    assert plan.disk.host_hit_rate == pytest.approx(one_level["hit_rate"])
    assert plan.disk.host_hit_rate_source.startswith("replayed from a routing trace of 300 tokens")
    # the two-level replay (device 4 slots, inclusive host tier of 6) reads from disk what that cache misses
    tiers = replay_tiers(trace, 8, 4, 6, make_policy("lru", 2, 8))
    assert 1 - plan.disk.host_hit_rate == pytest.approx(tiers["disk_reads"] / tiers["accesses"])
    # a decoded token reads 2 layers x top-4 x the host misses, each expert's bytes
    assert plan.disk.experts_per_token == pytest.approx(2 * 4 * (1 - one_level["hit_rate"]))
    assert plan.disk.bytes_per_token == pytest.approx(plan.disk.experts_per_token * plan.placement.expert_bytes)


def test_host_hit_rate_defaults_to_uniform_routing_and_never_below_the_device_hit_rate(olmoe_dir):
    budget = host_budget_for(olmoe_dir, 2, 4)
    uniform = jmoe.plan(olmoe_dir, cache=2, host_budget_gb=budget, hit_rate=0.25)
    assert uniform.disk.host_hit_rate == 0.5 and uniform.disk.host_hit_rate_source.startswith(
        "uniform routing (host rows / experts)")
    # a device hit is a host hit (inclusive tiers): a device hit rate above the uniform host rows' is taken
    above = jmoe.plan(olmoe_dir, cache=2, host_budget_gb=budget, hit_rate=0.9)
    assert above.disk.host_hit_rate == 0.9 and "every device hit is a host hit" in above.disk.host_hit_rate_source
    assert jmoe.plan(olmoe_dir, cache=2, host_budget_gb=budget, host_hit_rate=1.0).disk.bytes_per_token == 0


def test_a_host_budget_lowers_the_plans_decode_rate_by_the_disk_time(olmoe_dir, monkeypatch):
    # programs whose cost analysis counts nothing: both ends read the least a step must, the same with and without
    # the host budget (whose host rows change the expert arrays' bytes)
    monkeypatch.setattr(planner, "compile_programs", lambda *args: fake_programs(0.0, 0.0))
    budget = host_budget_for(olmoe_dir, 2, 4)
    without = jmoe.plan(olmoe_dir, cache=2, target="h100", hit_rate=0.25)
    tiered = jmoe.plan(olmoe_dir, cache=2, target="h100", hit_rate=0.25, host_budget_gb=budget, host_hit_rate=0.5,
                       disk_gbs=0.001)
    # 2 offloaded layers x top-4 x (1 - 0.5) = 4 experts a token, at 1 MB/s
    assert tiered.disk.seconds_per_token == pytest.approx(4 * tiered.placement.expert_bytes / 1e6)
    assert 1 / tiered.estimate.decode_tokens_per_s[0] == pytest.approx(
        1 / without.estimate.decode_tokens_per_s[0] + tiered.disk.seconds_per_token)
    # the fast end: without the tier the host's work hid behind the step (run ahead); with it, it adds again
    assert 1 / tiered.estimate.decode_tokens_per_s[1] > (1 / without.estimate.decode_tokens_per_s[1]
                                                         + tiered.disk.seconds_per_token)
    assert tiered.estimate.inputs["disk_bytes_per_s"] == 1e6 and tiered.estimate.inputs["host_hit_rate"] == 0.5


def test_disk_lines_appear_only_with_a_host_budget(olmoe_dir, capsys):
    from jmoe.cli.plan import main

    budget = host_budget_for(olmoe_dir, 2, 4)
    plain = jmoe.plan(olmoe_dir, cache=2)
    assert plain.disk is None and "disk" not in plain.as_dict() and "disk" not in plain.report()
    tiered = jmoe.plan(olmoe_dir, cache=2, host_budget_gb=budget, disk_gbs=1.5)
    report, data = tiered.report(), tiered.as_dict()["disk"]
    for line in ("disk tier: 4 of 8 experts per offloaded layer in pinned host rows",
                 "  host hit rate 0.500 (uniform routing (host rows / experts)",
                 "  disk reads per decoded token (batch 1): 4.00 experts, ", "  disk 1.5 GB/s (as given): "):
        assert line in report
    assert data["host_rows"] == 4 and data["experts_per_token"] == 4.0 and data["disk_bytes_per_s"] == 1.5e9
    assert main([str(olmoe_dir), "--cache", "2", "--host-budget-gb", str(budget), "--host-hit-rate", "1",
                 "--json"]) == 0
    disk = __import__("json").loads(capsys.readouterr().out)["disk"]
    assert disk["experts_per_token"] == 0.0 and disk["host_hit_rate_source"] == "given"
    assert "assumed" in disk["disk_source"]


def test_disk_tier_inputs_are_checked(olmoe_dir, capsys):
    from jmoe.cli.plan import main

    budget = host_budget_for(olmoe_dir, 2, 4)
    tiered = dict(cache=2, host_budget_gb=budget)
    with pytest.raises(InputError, match=r"host_hit_rate must be in \[0, 1\] .*found 1.5; pass a fraction"):
        jmoe.plan(olmoe_dir, host_hit_rate=1.5, **tiered)
    with pytest.raises(InputError, match=r"disk_gbs .*--disk-gbs.* must be a finite number > 0, found 0"):
        jmoe.plan(olmoe_dir, disk_gbs=0, **tiered)
    with pytest.raises(InputError, match="needs a host budget: give host_budget_gb"):
        jmoe.plan(olmoe_dir, cache=2, disk_gbs=2.0)
    with pytest.raises(InputError, match="give host_hit_rate or a routing trace to replay, not both"):
        jmoe.plan(olmoe_dir, host_hit_rate=0.5, trace=random_trace(experts=8, top_k=4), **tiered)
    with pytest.raises(InputError, match=r"host_hit_rate \(0.5\) is below the device hit rate \(0.800\)"):
        jmoe.plan(olmoe_dir, hit_rate=0.8, host_hit_rate=0.5, **tiered)
    for flag, value in (("--disk-gbs", "-1"), ("--host-hit-rate", "2")):
        assert main([str(olmoe_dir), "--cache", "2", "--host-budget-gb", str(budget), flag, value]) == 2
        assert f"error: {flag[2:].replace('-', '_')}" in capsys.readouterr().err
