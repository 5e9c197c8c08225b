"""jmoe.plan: memory from headers alone, equal to what jmoe.load places, load's early refusal, and how the processes
that compile a plan's programs fail."""

import json
import shutil
import struct
import sys
import time

import jax
import numpy as np
import pytest

import jmoe
from jmoe.plan import resources

OLMOE = "olmoe_e8k4_clip"
# Placements that put bytes in different places: experts offloaded, per-layer caches, patterns, layer groups.
OPTION_SETS = [dict(), dict(cache=2), dict(cpu_moe_layers=1), dict(cache=[1, None], offload_params=["attn"]),
               dict(cache=3, offload_group_size=2, offload_num_in_group=1)]


def header_only_copy(src, dst):
    """A copy of a checkpoint whose tensor data is gone: safetensors files cut after their header, Orbax
    array data files deleted."""
    shutil.copytree(src, dst)
    for path in dst.rglob("*.safetensors"):
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
        with open(path, "r+b") as f:
            f.truncate(8 + header_len)
    for data_dir in [d for d in dst.rglob("d") if d.is_dir()]:
        shutil.rmtree(data_dir)
    return dst


def without_directory(plan):
    out = plan.as_dict()
    out["checkpoint"].pop("directory")
    return out


@pytest.fixture(scope="module")
def olmoe_dir(hf_checkpoints):
    return hf_checkpoints[OLMOE][0]


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory):
    from hf_models import FAMILY_CASES, write_checkpoint

    model_type, overrides = FAMILY_CASES["qwen2_moe_shared_dense"]
    directory = tmp_path_factory.mktemp("sharded") / "m"
    write_checkpoint(directory, model_type, seed=7, max_shard_size="40KB", **overrides)
    assert (directory / "model.safetensors.index.json").is_file()
    return directory


@pytest.fixture(scope="module")
def orbax_dir(olmoe_dir, tmp_path_factory):
    from jmoe.checkpoint.convert import convert_checkpoint

    return convert_checkpoint(olmoe_dir, tmp_path_factory.mktemp("orbax") / "m", progress=False)


@pytest.mark.parametrize("which", ["single file", "shards", "orbax"])
def test_plan_on_a_header_only_copy_equals_the_plan_on_the_full_checkpoint(which, olmoe_dir, sharded_dir, orbax_dir,
                                                                          tmp_path):
    source = {"single file": olmoe_dir, "shards": sharded_dir, "orbax": orbax_dir}[which]
    copy = header_only_copy(source, tmp_path / "headers")
    data_bytes = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
    assert sum(p.stat().st_size for p in copy.rglob("*") if p.is_file()) < data_bytes / 2
    for options in (dict(cache=2), dict(cache=1, offload_params=["w_down"])):
        full = jmoe.plan(source, host_gb=8, device_gb=4, **options)
        headers_only = jmoe.plan(copy, host_gb=8, device_gb=4, **options)
        assert without_directory(headers_only) == without_directory(full)
        assert full.needs.host_bytes > 0 and full.fits


@pytest.mark.quick
@pytest.mark.parametrize("options", OPTION_SETS, ids=[str(o) for o in OPTION_SETS])
def test_plan_totals_equal_the_placement_load_makes(olmoe_dir, options):
    plan = jmoe.plan(olmoe_dir, **options)
    model = jmoe.load(olmoe_dir, progress=False, **options)
    arrays = jax.tree.leaves(model.params) + jax.tree.leaves(model.engine.state)
    host = sum(a.nbytes for a in arrays if a.sharding.memory_kind == "pinned_host")
    device = sum(a.nbytes for a in jax.tree.leaves(model.params) if a.sharding.memory_kind == "device")
    state = model.engine.state
    slots = sum(a.nbytes for a in jax.tree.leaves((getattr(state, "buffers", ()), getattr(state, "scratch", ()))))
    assert plan.needs.host_bytes == host
    assert plan.needs.device_weight_bytes == device
    assert plan.needs.slot_bytes == slots
    assert plan.needs.device_bytes >= device + slots + plan.needs.kv_bytes
    assert plan.placement.as_dict() == model.placement()
    assert plan.layer_caches() == [dict(zip(model.placement_plan.offloaded_layers,
                                            model.placement_plan.caches)).get(i) for i in range(2)]


@pytest.mark.quick
def test_plan_json_and_report_say_where_bytes_live_and_what_is_available(olmoe_dir):
    plan = jmoe.plan(olmoe_dir, cache=[0, 3], batch=2, context=64, host_gb=1, device_gb=1)
    data = json.loads(plan.to_json())
    assert data["model"] == {"model_type": "olmoe", "layers": 2, "moe_layers": 2, "experts": 8, "top_k": 4,
                             "expert_bytes": plan.placement.expert_bytes}
    assert data["cache"] == {"per_moe_layer": [0, 3], "scratch_slots": 8}
    assert data["kv_bytes"] == 2 * 2 * 2 * 64 * 4 * 8 * 4  # k and v, layers, batch, tokens, kv heads, head dim, f32
    groups = {(g["group"], g["memory_kind"]): g["bytes"] for g in data["groups"]}
    assert groups[("experts", "pinned_host")] == data["host_bytes"]
    assert data["available"]["host_bytes"] == 2**30 and data["available"]["device_bytes"] == 2**30
    assert data["fits"] is True and data["reasons"] == []
    assert data["programs"] == {} and not data["device_bytes_include_programs"]
    report = plan.report()
    for text in ("olmoe", "pinned_host", "KV cache", "FITS", "0, 3 (per MoE layer)"):
        assert text in report


def test_too_small_host_or_device_does_not_fit_and_says_why(olmoe_dir):
    host_short = jmoe.plan(olmoe_dir, cache=2, host_gb=1e-5, device_gb=4)
    assert not host_short.fits
    (reason,) = host_short.reasons
    assert reason.startswith("host memory: the pinned experts and parameters need") and "resident layer" in reason
    device_short = jmoe.plan(olmoe_dir, cache=4, host_gb=4, device_gb=1e-4)
    assert not device_short.fits
    (reason,) = device_short.reasons
    assert reason.startswith("device memory:") and "KV cache" in reason
    needs = device_short.needs
    just_enough = jmoe.plan(olmoe_dir, cache=4, host_gb=4, device_gb=needs.device_bytes / 2**30)
    assert just_enough.fits
    assert not jmoe.plan(olmoe_dir, cache=4, host_gb=4, device_gb=(needs.device_bytes - 1) / 2**30).fits


def test_on_a_cpu_backend_device_arrays_count_against_host_memory(olmoe_dir, monkeypatch):
    plan = jmoe.plan(olmoe_dir, cache=2)
    assert plan.available.device_bytes is None and plan.available.pinned_pool_bytes is None
    total = plan.needs.host_bytes + plan.needs.device_bytes
    assert jmoe.plan(olmoe_dir, cache=2, host_gb=total / 2**30).fits
    short = jmoe.plan(olmoe_dir, cache=2, host_gb=(total - 1) / 2**30)
    assert not short.fits and "live in RAM on a CPU backend" in short.reasons[0]


def test_pinned_pool_limit_set_too_low_is_a_reason_unset_it_is_a_note(olmoe_dir, monkeypatch):
    monkeypatch.setenv(resources.PINNED_POOL_ENV, "0")
    explicit = jmoe.plan(olmoe_dir, cache=2, target="h100", compile=False, host_gb=4)
    assert not explicit.fits and f"set {resources.PINNED_POOL_ENV}=1 before JAX starts" in explicit.reasons[0]
    monkeypatch.delenv(resources.PINNED_POOL_ENV)
    monkeypatch.setattr(resources, "DEFAULT_PINNED_POOL_GB", 0)
    default = jmoe.plan(olmoe_dir, cache=2, target="h100", compile=False, host_gb=4)
    assert default.fits and any(f"set {resources.PINNED_POOL_ENV}=1" in note for note in default.notes)
    assert default.available.device_bytes == int(default.target.device_memory_bytes * 0.75)


def test_command_lines_raise_the_pinned_pool_only_when_needed_and_unset(monkeypatch):
    monkeypatch.delenv(resources.PINNED_POOL_ENV, raising=False)
    assert resources.ensure_pinned_pool(10 * 2**30) is None
    assert resources.PINNED_POOL_ENV not in __import__("os").environ
    assert resources.ensure_pinned_pool(100 * 2**30) == f"{resources.PINNED_POOL_ENV}=105"
    assert resources.pinned_pool() == (105 * 2**30, f"{resources.PINNED_POOL_ENV}=105")
    assert resources.ensure_pinned_pool(500 * 2**30) is None  # the user's (here: the earlier) setting stays


@pytest.fixture
def small_host(monkeypatch):
    """This machine, as far as jmoe.load's check sees it, with 1 KiB of RAM."""
    monkeypatch.setattr(resources, "host_available_bytes", lambda: 1024)


@pytest.mark.parametrize("which", ["safetensors", "orbax"])
def test_load_refuses_before_reading_any_tensor_data(which, olmoe_dir, orbax_dir, tmp_path, small_host, monkeypatch):
    import jmoe.checkpoint.loading as loading
    import jmoe.checkpoint.orbax_store as orbax_store

    def no_reading(*args, **kwargs):
        raise AssertionError("tensor data was read before the memory check refused")

    monkeypatch.setattr(loading, "read_tensor", no_reading)
    monkeypatch.setattr(orbax_store.orbax(), "load", no_reading)
    copy = header_only_copy(olmoe_dir if which == "safetensors" else orbax_dir, tmp_path / "headers")
    for directory in (olmoe_dir if which == "safetensors" else orbax_dir, copy):
        with pytest.raises(jmoe.InsufficientMemoryError, match=r"host memory: .* needed .* available .*; shorten "
                                                                r"the context .*check_memory=False skips"):
            jmoe.load(directory, cache=2, progress=False)
    # The same limit makes the plan say no, and without the check the full checkpoint loads.
    assert not jmoe.plan(olmoe_dir, cache=2).fits
    monkeypatch.undo()
    monkeypatch.setattr(resources, "host_available_bytes", lambda: 1024)
    model = jmoe.load(olmoe_dir, cache=2, progress=False, check_memory=False)
    assert model.generate([1, 2, 3], max_new_tokens=2)


def test_plan_bad_input(olmoe_dir, tmp_path):
    with pytest.raises(jmoe.InputError, match="context=999 is more than the model's max_position_embeddings"):
        jmoe.plan(olmoe_dir, context=999)
    with pytest.raises(jmoe.InputError, match="batch must be a whole number >= 1"):
        jmoe.plan(olmoe_dir, batch=0)
    with pytest.raises(jmoe.InputError, match="target 'b200' is neither a shipped target .*h100"):
        jmoe.plan(olmoe_dir, target="b200")
    bad_target = tmp_path / "t.textproto"
    bad_target.write_text('platform_name: "CUDA"\n')
    with pytest.raises(jmoe.InputError, match="not a usable GPU target config"):
        jmoe.plan(olmoe_dir, target=bad_target)
    with pytest.raises(jmoe.InputError, match="unexpected keyword argument 'cach'.* the load options are cache"):
        jmoe.plan(olmoe_dir, cach=2)
    with pytest.raises(jmoe.InputError, match="host_gb must be a finite number > 0"):
        jmoe.plan(olmoe_dir, host_gb=-1)
    with pytest.raises(jmoe.InputError, match="cache lists 1 values"):
        jmoe.plan(olmoe_dir, cache=[1])
    with pytest.raises(jmoe.InputError, match=r"a Mesh holds this process's devices.*devices=N"):
        jmoe.plan(olmoe_dir, cache=2, mesh=object())
    with pytest.raises(jmoe.InputError, match=r"expected a device count that divides 8 \(1, 2, 4, 8\), found 3"):
        jmoe.plan(olmoe_dir, cache=2, devices=3)
    with pytest.raises(jmoe.InputError, match="not replayed per device under expert parallelism"):
        jmoe.plan(olmoe_dir, cache=2, devices=2, trace=np.zeros((4, 2, 4), np.int32))


def test_load_check_counts_every_device_of_an_expert_mesh(olmoe_dir, monkeypatch):
    """Under an expert mesh the placement is one device's; this host holds every device's share."""
    from jmoe.offload.options import OffloadOptions
    from jmoe.offload.placement import plan_placement
    from jmoe.plan.budget import memory_needs
    from jmoe.plan.headers import read_headers
    from jmoe.plan.planner import checked_context, refuse_if_unfit

    headers = read_headers(olmoe_dir, None, None, None)
    placement = plan_placement(headers.config, headers.abstract, OffloadOptions(2))
    needs = memory_needs(headers.config, placement, 1, checked_context(headers.config, None), headers.dtype)
    monkeypatch.setattr(resources, "host_available_bytes", lambda: int(1.5 * (needs.host_bytes + needs.device_bytes)))
    refuse_if_unfit(headers, placement)  # one device's share fits
    with pytest.raises(jmoe.InsufficientMemoryError, match="host memory"):
        refuse_if_unfit(headers, placement, devices=2)


def test_expert_parallel_plan_is_one_devices_share_and_the_hosts_whole(olmoe_dir):
    """Without a target: two devices each hold half the experts and slots; the host pins both halves."""
    one, two = jmoe.plan(olmoe_dir, cache=2), jmoe.plan(olmoe_dir, cache=2, devices=2)
    assert two.devices == 2 and two.as_dict()["devices"] == 2
    assert two.placement.expert_bytes == one.placement.expert_bytes
    assert two.placement.totals()["host_bytes"] * 2 == one.placement.totals()["host_bytes"]
    # the host of both devices pins what one device would; on this CPU the devices' arrays share its RAM too
    assert two.needs.host_bytes == one.needs.host_bytes
    assert two.needs.kv_bytes == 2 * one.needs.kv_bytes  # the KV cache is replicated
    assert any("one host holds the 2 devices" in note for note in two.notes)
    on_h100 = jmoe.plan(olmoe_dir, cache=2, devices=2, target="h100", compile=False)
    assert on_h100.needs.kv_bytes == one.needs.kv_bytes  # each GPU has memory of its own
    # cache 2 per device and layer, and scratch slots for its own experts: fewer slot bytes than one device's
    assert on_h100.needs.slot_bytes == two.placement.slot_bytes < one.placement.slot_bytes
    assert two.needs.slot_bytes == 2 * two.placement.slot_bytes
    assert on_h100.needs.host_bytes == one.needs.host_bytes


def test_cli_prints_the_plan_and_exits_1_when_it_does_not_fit(olmoe_dir, capsys):
    from jmoe.cli.plan import main

    assert main([str(olmoe_dir), "--cache", "2", "--host-gb", "4", "--device-gb", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] and data["cache"]["per_moe_layer"] == [2, 2]
    assert main([str(olmoe_dir), "--cpu-moe-layers", "1", "--device-gb", "1e-5", "--host-gb", "4"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "device memory:" in out
    assert main([str(olmoe_dir), "--target", "nope"]) == 2
    assert "error: target 'nope'" in capsys.readouterr().err


def test_without_the_plugin_a_target_plan_says_how_to_compile(olmoe_dir, monkeypatch):
    import jmoe.plan.programs as programs

    monkeypatch.setattr(programs, "plugin_available", lambda: False)
    plan = jmoe.plan(olmoe_dir, cache=2, target="rtx4090", host_gb=4)
    assert all(p.error == programs.PLUGIN_HINT for p in plan.programs.values())
    assert any("gpu-compile" in note for note in plan.notes)
    assert plan.fits and plan.needs.device_bytes == plan.needs.estimate_bytes
    assert plan.target.device_kind == "NVIDIA GeForce RTX 4090"


# A stand-in for jmoe.plan.compile_worker: a job "ok" writes its result, "dies" aborts the process as XLA:GPU's
# compiler can, "hangs" never finishes.
FAKE_WORKER = """
import json, os, pickle, sys, time
for job, work in pickle.load(open(sys.argv[1], "rb")):
    if job == "dies":
        os.abort()
    if job == "hangs":
        time.sleep(60)
    (work / "hlo.txt").write_text("HloModule")
    (work / "result.json").write_text(json.dumps({"job": work.name}))
"""


@pytest.fixture
def fake_workers(monkeypatch):
    from jmoe.plan import workers

    monkeypatch.setattr(workers, "WORKER", [sys.executable, "-c", FAKE_WORKER])
    return workers


@pytest.mark.quick
def test_one_worker_compiles_a_plans_programs_and_a_death_costs_only_the_program_that_caused_it(fake_workers,
                                                                                                tmp_path):
    for case in ("three", "two"):
        (tmp_path / case).mkdir()
    results = fake_workers.compile_in_workers({"a": "ok", "b": "dies", "c": "ok"}, tmp_path / "three")
    assert [results["a"], results["c"]] == [{"job": key, "hlo_text": "HloModule"} for key in "ac"]
    assert results["b"].startswith("the compiler process exited with status -6")
    # b and c were unfinished when the worker died: each was compiled again alone, a was not
    assert sorted(p.name for p in (tmp_path / "three").glob("*.pickle")) == ["a-b-c.pickle", "b.pickle", "c.pickle"]
    # one program unfinished: it is the one that killed the worker, and it is not compiled again
    results = fake_workers.compile_in_workers({"a": "ok", "b": "dies"}, tmp_path / "two")
    assert results["a"]["job"] == "a" and "status -6" in results["b"]
    assert [p.name for p in (tmp_path / "two").glob("*.pickle")] == ["a-b.pickle"]


def test_a_worker_past_the_timeout_is_killed_and_its_unfinished_programs_time_out(fake_workers, monkeypatch, tmp_path):
    monkeypatch.setattr(fake_workers, "COMPILE_TIMEOUT_SECONDS", 1)
    start = time.monotonic()
    results = fake_workers.compile_in_workers({"a": "ok", "b": "hangs", "c": "ok"}, tmp_path)
    assert time.monotonic() - start < 30
    assert results["a"]["job"] == "a"
    assert results["b"] == results["c"] == "timed out after 1 s: no output"


def test_command_lines_raise_the_pinned_pool_from_the_plan_before_loading(olmoe_dir, monkeypatch, capsys):
    from jmoe.cli.common import load_for_cli
    from jmoe.offload.options import OffloadOptions

    monkeypatch.delenv(resources.PINNED_POOL_ENV, raising=False)
    monkeypatch.setattr(resources, "DEFAULT_PINNED_POOL_GB", 0)  # as if the experts needed more than 64 GiB
    model = load_for_cli(olmoe_dir, OffloadOptions(cache=2))
    assert __import__("os").environ[resources.PINNED_POOL_ENV] == "1"
    assert f"set {resources.PINNED_POOL_ENV}=1 for the pinned experts" in capsys.readouterr().err
    assert model.placement_plan.caches == (2, 2)


@pytest.mark.parametrize("target", [None, "h100"])
def test_a_host_budget_fits_where_every_expert_would_not(olmoe_dir, target):
    """The disk tier pins only the host rows: host memory that cannot hold every offloaded expert holds them."""
    every_expert = jmoe.plan(olmoe_dir, cache=2, target=target, compile=False)
    placement = every_expert.placement
    budget = 4.5 * placement.layer_expert_bytes / 1e9  # 4 of 8 experts a layer
    # room for 3/4 of the pinned experts (and on this CPU backend, the device arrays, which live in RAM too)
    on_device = 0 if target else every_expert.needs.device_bytes
    host_gb = (0.75 * every_expert.needs.host_bytes + on_device) / 2**30
    short = jmoe.plan(olmoe_dir, cache=2, target=target, compile=False, host_gb=host_gb)
    assert not short.fits and short.reasons[0].startswith("host memory")
    tiered = jmoe.plan(olmoe_dir, cache=2, target=target, compile=False, host_gb=host_gb, host_budget_gb=budget)
    rows = tiered.placement.host_rows
    assert 0 < rows < 8 and tiered.needs.host_bytes < every_expert.needs.host_bytes
    assert tiered.fits and tiered.reasons == ()
    report = tiered.report()
    assert "FITS" in report and "DOES NOT FIT" not in report and f"disk tier: {rows} of 8" in report


def test_the_memory_cgroup_limit_and_use_are_read_from_v1_and_v2_and_bound_the_page_cache_room(tmp_path, monkeypatch):
    proc = tmp_path / "cgroup"
    root = tmp_path / "fs"
    v1 = root / "memory" / "box" / "job"
    v1.mkdir(parents=True)
    proc.write_text("4:cpu,memory:/box/job\n0::/\n")
    (v1 / "memory.stat").write_text("rss 5\nhierarchical_memory_limit 6000000000\ntotal_rss 2000000000\n")
    assert resources.cgroup_memory(proc, root) == (6_000_000_000, 2_000_000_000)
    (v1 / "memory.stat").write_text("hierarchical_memory_limit 9223372036854771712\ntotal_rss 1\n")
    assert resources.cgroup_memory(proc, root) is None  # v1's "no limit"
    # v2: the tightest limit of the group and its ancestors, the group's own anonymous memory
    v2 = root / "slice" / "unit"
    v2.mkdir(parents=True)
    proc.write_text("0::/slice/unit\n")
    (root / "slice" / "memory.max").write_text("5000000000\n")
    (v2 / "memory.max").write_text("max\n")
    (v2 / "memory.stat").write_text("anon 1000\nfile 7\n")
    assert resources.cgroup_memory(proc, root) == (5_000_000_000, 1000)
    (root / "slice" / "memory.max").write_text("max\n")
    assert resources.cgroup_memory(proc, root) is None
    assert resources.cgroup_memory(tmp_path / "missing", root) is None

    monkeypatch.setattr(resources, "host_available_bytes", lambda: 20 * 10**9)
    monkeypatch.setattr(resources, "cgroup_memory", lambda: None)
    assert resources.page_cache_room(4 * 10**9) == (16 * 10**9, "MemAvailable of this machine")
    monkeypatch.setattr(resources, "cgroup_memory", lambda: (6 * 10**9, 10**9))
    room, bound = resources.page_cache_room(4 * 10**9)
    assert room == 10**9 and bound == "its memory cgroup's limit of 6.00 GB, 1.00 GB of it in use"
    assert resources.page_cache_room(8 * 10**9)[0] == 0
