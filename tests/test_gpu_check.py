"""bench.gpu_check's logic on CPU (its small mode): the kernel checks pass here, packages a GPU image may lack are
reported as not run, and sections the time budget does not reach are recorded, not skipped. The whole small run
(families, offload, bandwidth, decode) is tests/test_bench_smoke.py's `--smoke` run, which fails on any failed
check (exit status 1)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_gpu_check(*args) -> dict:
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--smoke", *args], cwd=ROOT,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout[done.stdout.index("{"):])


def test_every_kernel_backend_in_every_format_matches_reference_on_cpu():
    from jmoe.kernels.dispatch import BACKENDS
    from jmoe.kernels.quantized import FORMATS

    result = run_gpu_check("--sections", "environment,kernels", "--budget-s", "1000")
    checks = result["sections"]["kernels"]["checks"]
    assert len(checks) == (len(BACKENDS) - 1) * (len(FORMATS) + 1)  # every backend but reference, bf16 + formats
    not_run = [c for c in checks if c["passed"] is None]
    assert {c["name"].split(" / ")[0] for c in not_run} == {"triton"}  # GPU-only, said so
    # ... and, on a GPU too, plain float weights only (quantized experts go to the Pallas kernel)
    assert all(("GPU-only" if c["name"].split(" / ")[1] == "bf16" else "by design") in c["detail"] for c in not_run)
    assert all(c["passed"] for c in checks if c not in not_run), [c for c in checks if c["passed"] is False]
    assert result["sections"]["environment"]["measurements"]["backend"] == "cpu"
    assert result["summary"]["failed"] == 0 and result["summary"]["sections_not_run"] == []


def test_sections_past_the_budget_are_recorded_as_not_run():
    result = run_gpu_check("--budget-s", "0")
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
