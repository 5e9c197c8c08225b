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
    assert all("GPU-only" in c["detail"] for c in not_run)
    assert all(c["passed"] for c in checks if c not in not_run), [c for c in checks if c["passed"] is False]
    assert result["sections"]["environment"]["measurements"]["backend"] == "cpu"
    assert result["summary"]["failed"] == 0 and result["summary"]["sections_not_run"] == []


def test_sections_past_the_budget_are_recorded_as_not_run():
    result = run_gpu_check("--budget-s", "0")
    assert set(result["sections"]) == {"environment", "kernels", "families", "offload", "bandwidth", "decode"}
    assert all(s["status"] == "not run: out of time" for s in result["sections"].values())
    assert result["summary"]["sections_not_run"] == list(result["sections"])
