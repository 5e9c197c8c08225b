"""Benchmarks that cannot rot: every bench module with a command line runs in its smoke mode
(`python -m bench.NAME --smoke`: the real run's code paths at toy sizes, in a temporary directory) and must
exit 0 without touching bench/results. Modules are found by scanning bench/*.py, so a new one is covered the
day it lands, and one without --smoke fails here. Helpers live in subpackages (bench/gpu/, bench/helpers/), so the
top level holds entry points only."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
TIMEOUT_S = 300  # one module; the slowest smoke runs take about a minute on a shared 2-core machine


def has_command_line(path: Path) -> bool:
    return re.search(r"^if __name__ == [\"']__main__[\"']:", path.read_text(), re.MULTILINE) is not None


def bench_modules() -> list[str]:
    """bench/*.py modules with a command line (a `__main__` block)."""
    return sorted(path.stem for path in BENCH.glob("*.py") if has_command_line(path))


def results_snapshot() -> dict[str, tuple[int, bytes]]:
    """Every file under bench/results: (modification time, contents)."""
    return {str(path.relative_to(BENCH)): (path.stat().st_mtime_ns, path.read_bytes())
            for path in sorted((BENCH / "results").rglob("*")) if path.is_file()}


def test_discovery_finds_the_bench_modules():
    modules = bench_modules()
    assert {"decode", "decode_trace", "replay", "kv_cache_mla", "gpu_check"} <= set(modules)
    # The layout says what is what: every top-level module is an entry point, every helper is in a subpackage.
    assert modules == sorted(path.stem for path in BENCH.glob("*.py") if path.stem != "__init__")
    helpers = {str(path.relative_to(BENCH)) for package in BENCH.glob("*/__init__.py") for path in
               package.parent.rglob("*.py")}  # bench/data's script is data tooling, not a package
    assert {"helpers/common.py", "helpers/prefetch_report.py", "gpu/models.py"} <= helpers
    assert not [name for name in helpers if has_command_line(BENCH / name)]


@pytest.mark.parametrize("module", bench_modules())
def test_smoke_run(module):
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
