"""A bench module's smoke run as the suite runs it: `python -m bench.NAME --smoke` in its own process on JAX's CPU
backend, which must exit 0 without touching bench/results. tests/test_bench_smoke.py runs every module's;
tests/test_gpu_check.py runs bench.gpu_check's and reads its report too."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
TIMEOUT_S = 300  # one module; the slowest smoke runs take about a minute on a shared 2-core machine


def results_snapshot() -> dict[str, tuple[int, bytes]]:
    """Every file under bench/results: (modification time, contents)."""
    return {str(path.relative_to(BENCH)): (path.stat().st_mtime_ns, path.read_bytes())
            for path in sorted((BENCH / "results").rglob("*")) if path.is_file()}


def run_smoke(module: str) -> str:
    """`python -m bench.MODULE --smoke`'s standard output, after checking its exit status and bench/results."""
    before = results_snapshot()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    try:
        done = subprocess.run([sys.executable, "-m", f"bench.{module}", "--smoke"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"python -m bench.{module} --smoke ran past {TIMEOUT_S} s")
    assert done.returncode == 0, (f"python -m bench.{module} --smoke exited {done.returncode}:\n"
                                  f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    after = results_snapshot()
    changed = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
    assert not changed, f"python -m bench.{module} --smoke changed bench/results: {changed}"
    return done.stdout
