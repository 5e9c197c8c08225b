"""Expert parallelism inside one process (jmoe.offload.expert_parallel): over 4 CPU devices (and a 2-device mesh)
the tokens and logits equal the one-device model's for a Mixtral-like model (from Hugging Face safetensors and
from jmoe's Orbax format), Qwen2-MoE with a shared expert and a dense layer, and DeepSeek-V3 (latent attention,
grouped router, top-3 of 2 experts per device), in both miss modes and at per-device caches of 0, 1 and all of a
device's experts; each device holds only its share of the experts and keeps its own statistics; the compiled
steps' only collectives are one all-reduce of activations per MoE layer; bad settings are clear errors. The
multi-device runs share one child process (tests/expert_parallel_child.py), since the device count is fixed when
JAX starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import jmoe
from hf_models import write_checkpoint
from jmoe.checkpoint.convert import convert_checkpoint
from jmoe.errors import InputError

# One pytest-xdist worker runs this module (--dist loadgroup): its module fixtures are expensive, and each
# worker that ran some of its tests would build them again.
pytestmark = pytest.mark.xdist_group("expert_parallel")

DEVICES = 4
SMALL = dict(hidden_size=32, num_hidden_layers=2)
CASES = {
    # 8 experts, top-2: 2 per device
    "mixtral": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=24,
                                num_attention_heads=2, num_key_value_heads=1), [
        dict(devices=DEVICES, cache=[0, 1], prefetch=1),
        dict(mesh_devices=2, cache=3, miss_mode="host", policy="lru"),
        # each layer a program of its own (jmoe.decode.chain), each a shard_map over the mesh
        dict(devices=DEVICES, cache=[0, 1], prefetch=1, chained=True),
    ]),
    # shared expert with its gate, a dense layer between the MoE layers
    "qwen2_moe": ("qwen2_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                    shared_expert_intermediate_size=24, intermediate_size=32, mlp_only_layers=[1],
                                    num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2), [
        dict(devices=DEVICES, cache=[1, None], miss_mode="host"),
        dict(devices=DEVICES, cache=[1, None], miss_mode="host", chained=True),
    ]),
    # top-3 when a device owns 2: the grouped router picks over all 8, each device computes its share; experts
    # stored as int8 (values and scales split alike; the one-device reference stores them so too)
    "deepseek_v3": ("deepseek_v3", dict(n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                                        moe_intermediate_size=16, n_shared_experts=1, intermediate_size=32,
                                        first_k_dense_replace=1, num_hidden_layers=3, num_attention_heads=2,
                                        num_key_value_heads=2, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8,
                                        qk_rope_head_dim=4, v_head_dim=8, routed_scaling_factor=2.5), [
        dict(devices=DEVICES, cache=[1, 0], policy="static", expert_dtype="int8"),
    ]),
}
# The Mixtral-like checkpoint converted to jmoe's Orbax format: restored straight into each device's share.
CASES["mixtral_orbax"] = (*CASES["mixtral"][:2], [dict(devices=DEVICES, cache=1)])
ORBAX = {"mixtral_orbax"}
CHILD_TIMEOUT_S = 400


def several_devices_env() -> dict:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(DEVICES), "JMOE_COMPILE_CACHE": "off"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("expert_parallel")
    cases = []
    for i, (name, (model_type, overrides, options)) in enumerate(CASES.items()):
        if name in ORBAX:
            write_checkpoint(root / f"{name}_hf", model_type, seed=i, **overrides)
            convert_checkpoint(root / f"{name}_hf", root / name)
        else:
            write_checkpoint(root / name, model_type, seed=i, **overrides)
        cases.append({"name": name, "path": str(root / name), "options": options})
    child = Path(__file__).with_name("expert_parallel_child.py")
    done = subprocess.run([sys.executable, str(child), json.dumps(cases)], env=several_devices_env(),
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def runs_of(runs, case: str) -> list[dict]:
    of_case = [r for r in runs if r["case"] == case]
    assert len(of_case) == len(CASES[case][2])
    return of_case


@pytest.mark.parametrize("case", list(CASES))
def test_tokens_and_logits_equal_one_device(runs, case):
    for run in runs_of(runs, case):
        assert run["tokens_equal"], run["options"]
        assert run["logits_error"] <= 1e-5, run
        assert run["chained"] == run["options"].get("chained", False)


@pytest.mark.parametrize("case", list(CASES))
def test_each_device_holds_its_share_and_counts_its_accesses(runs, case):
    experts = 8
    for run in runs_of(runs, case):
        options = run["options"]
        devices = options.get("devices") or options["mesh_devices"]
        caches = options["cache"] if isinstance(options["cache"], list) else [options["cache"]] * 2
        for layer, cache in zip(run["shards"], caches):
            assert layer["devices"] == devices and layer["experts_per_shard"] == [experts // devices] * devices
            assert layer["memory_kind"] == ("device" if cache is None else "pinned_host")
        # Every device's manager saw only its own experts' accesses: together, every token's top-k once, in
        # each offloaded layer.
        assert run["stats_devices"] == list(range(devices))
        assert len(run["accesses"]) == sum(c is not None for c in caches)
        assert set(run["accesses"].values()) == {run["routed_accesses"]}


@pytest.mark.parametrize("case", list(CASES))
def test_each_moe_layer_exchanges_one_all_reduce_of_activations(runs, case):
    """Prompt and decode programs: no expert weight crosses between devices, only each MoE layer's output."""
    hidden, moe_layers = 32, 2
    for run in runs_of(runs, case):
        programs = run["collectives"]
        assert {tuple(p["tokens"]) for p in programs} >= {(2, 1)}, programs  # a decode step was compiled
        for program in programs:
            rows = program["tokens"][0] * program["tokens"][1]
            assert program["ops"] == [["all-reduce", f"f32[{rows},{hidden}]"]] * moe_layers, program


@pytest.mark.quick
def test_an_expert_axis_that_does_not_divide_the_experts_is_refused(tmp_path):
    """Through the command line's --devices: refused after reading the headers, before any weight."""
    write_checkpoint(tmp_path / "six", "mixtral", num_local_experts=6, num_experts_per_tok=2, intermediate_size=16,
                     num_attention_heads=2, num_key_value_heads=1)
    done = subprocess.run([sys.executable, "-m", "jmoe.generate", "--model", str(tmp_path / "six"), "--devices",
                           str(DEVICES), "--cache", "1", "--prompt", "w1 w2"], env=several_devices_env(),
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert done.returncode == 2
    assert "4 devices" in done.stderr and "6 experts" in done.stderr and "(1, 2, 3, 6)" in done.stderr
    assert "--devices" in done.stderr


@pytest.mark.parametrize("options, message", [  # options made when the test runs (a Mesh starts JAX)
    (lambda: dict(devices=0), "devices must be a whole number >= 1"),
    (lambda: dict(devices=2, mesh=object()), "either devices=2 or mesh"),
    (lambda: dict(mesh=object()), "mesh must be a jax.sharding.Mesh"),
    (lambda: dict(mesh=jax.make_mesh((1,), ("data",))), r"axes \('data',\)"),
    (lambda: dict(devices=len(jax.local_devices()) + 1), "this process sees"),
    (lambda: dict(devices=2, prefetch_trace=np.zeros((4, 2, 2), np.int32)), "prefetch_trace"),
])
def test_bad_expert_parallel_settings_are_clear_errors(small_mixtral_dir, options, message):
    with pytest.raises(InputError, match=message):
        jmoe.load(small_mixtral_dir, cache=1, progress=False, **options())


def test_cache_statistics_of_a_mesh_name_their_device_in_the_table_and_the_metrics():
    from jmoe.cli.generate import format_stats
    from jmoe.serve.metrics import _cache_metrics

    row = dict(layer=0, cache_slots=1, hits=3, misses=1, hit_rate=0.75, evictions=0, bytes_moved=2**20)
    table = format_stats([{**row, "device": 0}, {**row, "device": 1}]).splitlines()
    assert table[0].split()[:2] == ["device", "layer"] and [line.split()[0] for line in table[1:3]] == ["0", "1"]
    assert format_stats([row]).splitlines()[0].split()[0] == "layer"  # one device: no device column
    hits = _cache_metrics([{**row, "device": 0}, {**row, "device": 1}])[1]
    assert [sample.labels for sample in hits.samples] == [{"layer": "0", "device": "0"}, {"layer": "0", "device": "1"}]
    assert _cache_metrics([row])[1].samples[0].labels == {"layer": "0"}
