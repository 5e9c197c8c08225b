"""Import scripts from bench/ (a folder of scripts, not a package) in tests, once per session."""

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench_module(name: str):
    """bench/<name>.py as a module, registered as jmoe_bench_<name> so every test shares one copy."""
    key = f"jmoe_bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]
