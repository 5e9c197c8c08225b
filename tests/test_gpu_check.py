"""bench.gpu_check's logic on CPU (its small mode). Its smoke run (every section at tiny shapes, within a time budget)
runs here, once, instead of in tests/test_bench_smoke.py: it fails on any failed check (exit status 1), and its
report shows that every kernel and family check passes here and that packages a GPU image may lack are reported as
not run; sections the time budget does not reach are recorded, not skipped."""

import json

import pytest

from smoke_runs import run_smoke

pytestmark = pytest.mark.xdist_group("gpu_check_smoke")  # one worker, so the smoke run below runs once


@pytest.fixture(scope="module")
def smoke_report() -> dict:
    """The JSON report of `python -m bench.gpu_check --smoke` (tests/smoke_runs.py checks its exit, bench/results)."""
    out = run_smoke("gpu_check")
    return json.loads(out[out.index("{"):])


def test_smoke_run_starts_every_section(smoke_report):
    assert set(smoke_report["sections"]) == {"environment", "kernels", "families", "offload", "bandwidth", "decode"}
    assert smoke_report["summary"]["failed"] == 0 and smoke_report["summary"]["sections_not_run"] == []
    assert smoke_report["summary"]["passed"] > 0


def test_every_kernel_backend_in_every_format_matches_reference_on_cpu(smoke_report):
    from jmoe.kernels.dispatch import BACKENDS
    from jmoe.kernels.quantized import FORMATS

    from bench.gpu import decode_attention, norm, projection
    from bench.gpu.bookkeeping import PLAN_CASES, ROUTING_CASES

    checks = smoke_report["sections"]["kernels"]["checks"]
    # The decode step's bookkeeping, attention, norm and projection kernels against XLA's computations, each case run
    # and passed (interpreted here).
    step_kernels = [c for c in checks
                    if c["name"].startswith(("choose_experts kernel", "fetch_plan kernel", "attend_one_token kernel",
                                             "attend_latent_one_token kernel", "rms_norm kernel",
                                             "projected_rows kernel"))]
    cases = (len(ROUTING_CASES) + len(PLAN_CASES) + len(decode_attention.CASES) + len(decode_attention.LATENT_CASES)
             + len(norm.CASES) + len(projection.CASES))
    assert len(step_kernels) == cases and all(c["passed"] for c in step_kernels)
    checks = [c for c in checks if c not in step_kernels]
    assert len(checks) == (len(BACKENDS) - 1) * (len(FORMATS) + 1)  # every backend but reference, bf16 + formats
    not_run = [c for c in checks if c["passed"] is None]
    assert {c["name"].split(" / ")[0] for c in not_run} == {"triton"}  # GPU-only, said so
    # ... and, on a GPU too, plain float weights only (quantized experts go to the Pallas kernel)
    assert all(("GPU-only" if c["name"].split(" / ")[1] == "bf16" else "by design") in c["detail"] for c in not_run)
    assert all(c["passed"] for c in checks if c not in not_run), [c for c in checks if c["passed"] is False]
    assert smoke_report["sections"]["environment"]["measurements"]["backend"] == "cpu"


def test_small_families_match_the_cpu_reference(smoke_report):
    from bench.gpu.numerics import SMALL_FAMILIES

    checks = smoke_report["sections"]["families"]["checks"]
    assert [c["name"] for c in checks] == list(SMALL_FAMILIES) and all(c["passed"] for c in checks), checks


def test_small_configs_parse_as_transformers_complete_ones():
    """A small run writes its models' configs without transformers (bench.gpu.models.model_config): jmoe must read them
    as it reads the complete configs a full run writes."""
    from bench.gpu.models import FAMILY_CASES, hf_config, model_config, speed_models
    from bench.gpu.numerics import SMALL_FAMILIES
    from jmoe.config import parse_config

    cases = [(family, FAMILY_CASES[family]) for family in SMALL_FAMILIES]
    cases += [(spec["model_type"], {k: v for k, v in spec.items() if k != "model_type"})
              for spec in speed_models(small=True).values()]
    for model_type, overrides in cases:
        complete = parse_config(hf_config(model_type, **overrides))
        assert parse_config(model_config(model_type, True, **overrides)) == complete, model_type


def test_sections_past_the_budget_are_recorded_as_not_run(capsys):
    from bench.gpu_check import main

    assert main(["--smoke", "--budget-s", "0"]) == 0  # in this process: a budget of 0 runs nothing
    out = capsys.readouterr().out
    result = json.loads(out[out.index("{"):])
    assert set(result["sections"]) == {"environment", "kernels", "families", "offload", "bandwidth", "decode"}
    assert all(s["status"] == "not run: out of time" for s in result["sections"].values())
    assert result["summary"]["sections_not_run"] == list(result["sections"])


def test_excluded_items_are_recorded_as_not_run_without_running():
    from bench.gpu.results import Budget, SectionResult

    ran = []
    result = SectionResult()
    for name in ("cache 0, miss fetch", "cache 0, miss host"):
        result.attempt(name, Budget(60, excluded=("miss host",)), lambda name=name: ran.append(name) or (True, ""))
    assert ran == ["cache 0, miss fetch"]
    assert result.checks[1] == {"name": "cache 0, miss host", "passed": None,
                                "detail": "not run: excluded (--exclude 'miss host')"}


def test_family_argmax_check_forgives_near_ties_only():
    import numpy as np

    from bench.gpu.numerics import argmax_agrees

    reference = np.array([[1.0, 0.9999, 0.0], [0.0, 2.0, 1.0]])
    swapped_near_tie = reference + np.array([[-2e-4, 2e-4, 0.0], [0.0, 0.0, 0.0]])
    assert argmax_agrees(swapped_near_tie, reference) == (True, 1)
    clear_flip = reference + np.array([[0.0, 0.0, 0.0], [0.0, -0.6, 0.6]])  # a margin of 1 is no tie
    assert argmax_agrees(clear_flip, reference) == (False, 1)


def test_profile_summary_measures_copy_kernel_overlap_on_device_streams():
    from bench.gpu.profile import device_summary

    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7(Kernel)"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "Stream #8(MemcpyH2D)"}}]
    spans = [(1, 7, "fusion_kernel", 0, 100), (1, 8, "MemcpyH2D", 50, 100),  # half of this copy under the kernel
             (1, 8, "MemcpyH2D", 300, 50), (2, 3, "host work", 0, 1000)]  # host events are not device time
    events = meta + [{"ph": "X", "pid": p, "tid": t, "name": n, "ts": ts, "dur": d} for p, t, n, ts, d in spans]
    summary = device_summary(events, steps=2)
    assert summary["device events"] == 3
    assert summary["copy busy us/step"] == 75 and summary["kernel busy us/step"] == 50
    assert summary["copy time overlapping kernels"] == 50 / 150
    assert summary["stream Stream #8(MemcpyH2D) busy us/step"] == 75
    assert summary["top device events"][0] == "75.0 us/step x1.0 MemcpyH2D"
    assert device_summary(events[4:], steps=1)["device events"] == 0  # no process names: no device streams
