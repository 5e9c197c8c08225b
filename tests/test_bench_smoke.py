"""Benchmarks that cannot rot: every bench module with a command line runs in its smoke mode
(`python -m bench.NAME --smoke`: the real run's code paths at toy sizes, in a temporary directory) and must
exit 0 without touching bench/results (tests/smoke_runs.py). Modules are found by scanning bench/*.py, so a new one is
covered the day it lands, and one without --smoke fails here. Helpers live in subpackages (bench/gpu/, bench/helpers/),
so the top level holds entry points only."""

import re
from pathlib import Path

import pytest

from smoke_runs import BENCH, ROOT, run_smoke

# Smoke runs that another test module runs instead (once, reading their report as well): module -> that test module.
SMOKE_RUN_ELSEWHERE = {"gpu_check": "test_gpu_check"}
# The quick tier runs the cheapest smoke run: discovery, the subprocess, and the bench/results check.
QUICK_SMOKE_RUNS = {"kv_cache_mla"}


def has_command_line(path: Path) -> bool:
    return re.search(r"^if __name__ == [\"']__main__[\"']:", path.read_text(), re.MULTILINE) is not None


def bench_modules() -> list[str]:
    """bench/*.py modules with a command line (a `__main__` block)."""
    return sorted(path.stem for path in BENCH.glob("*.py") if has_command_line(path))


@pytest.mark.quick
def test_discovery_finds_the_bench_modules():
    modules = bench_modules()
    assert {"decode", "decode_trace", "replay", "kv_cache_mla", "gpu_check"} <= set(modules)
    # The layout says what is what: every top-level module is an entry point, every helper is in a subpackage.
    assert modules == sorted(path.stem for path in BENCH.glob("*.py") if path.stem != "__init__")
    helpers = {str(path.relative_to(BENCH)) for package in BENCH.glob("*/__init__.py") for path in
               package.parent.rglob("*.py")}  # bench/data's script is data tooling, not a package
    assert {"helpers/common.py", "helpers/prefetch_report.py", "gpu/models.py"} <= helpers
    assert not [name for name in helpers if has_command_line(BENCH / name)]


def test_smoke_runs_left_to_other_modules_are_run_there():
    for module, test_module in SMOKE_RUN_ELSEWHERE.items():
        assert module in bench_modules()
        assert f'run_smoke("{module}")' in (ROOT / "tests" / f"{test_module}.py").read_text(), (
            f"tests/{test_module}.py no longer runs bench.{module}'s smoke run: run it here again")


@pytest.mark.parametrize("module", [pytest.param(module, marks=[pytest.mark.quick] if module in QUICK_SMOKE_RUNS else [])
                                    for module in bench_modules() if module not in SMOKE_RUN_ELSEWHERE])
def test_smoke_run(module):
    run_smoke(module)
