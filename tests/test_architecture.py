"""The layout ARCHITECTURE.md promises: imports flow one way, modules stay small, no path hacks."""

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick  # the quick tier: all of this module


ROOT = Path(__file__).resolve().parents[1]
# Layers from the bottom up: a module may import its own layer or lower ones, never higher ones.
LAYERS = {
    "jmoe.errors": 0, "jmoe.memory": 0, "jmoe.jsonfile": 0, "jmoe.arguments": 0, "jmoe.compile_cache": 0,
    "jmoe.collector": 0, "jmoe.kernels": 0, "jmoe.distributed": 0,
    "jmoe.config": 1, "jmoe.config_values": 1, "jmoe.config_rope": 1,
    "jmoe.model": 2,
    "jmoe.checkpoint": 3, "jmoe.offload": 3, "jmoe.decode": 3,
    "jmoe.traces": 4, "jmoe.plan": 4,
    "jmoe.api": 5, "jmoe.eval": 5,
    "jmoe.cli": 6, "jmoe.generate": 6, "jmoe.convert": 6, "jmoe": 6,
}
MAX_LINES = 500


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = ("jmoe", "kernels", *parts[1:]) if parts[0] == "kernels" else parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    """The layer of the longest LAYERS prefix of `module`."""
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return LAYERS[prefix]
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS (and ARCHITECTURE.md)")


def library_files() -> list[Path]:
    return sorted((ROOT / "jmoe").rglob("*.py")) + sorted((ROOT / "kernels").rglob("*.py"))


def absolute_imports(path: Path) -> list[str]:
    """The modules `path` imports by absolute name."""
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("path", library_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_flow_down_the_layers(path):
    if path.name == "__main__.py":  # `python -m jmoe.X` entry points run a command line
        return
    module = module_name(path)
    jmoe_imports = [name for name in absolute_imports(path) if name.split(".")[0] == "jmoe"]
    upward = [name for name in jmoe_imports if layer_of(name) > layer_of(module)]
    assert not upward, f"{module} (layer {layer_of(module)}) imports higher layers: {upward}"


def test_the_library_never_imports_bench_or_tests():
    users = {str(p.relative_to(ROOT)): names for p in library_files()
             if (names := [n for n in absolute_imports(p) if n.split(".")[0] in ("bench", "tests")])}
    assert not users, f"{users}: benchmarks and tests import jmoe, never the other way (move the logic into jmoe)"


def test_modules_stay_small():
    files = library_files() + sorted((ROOT / "bench").rglob("*.py"))
    large = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not large, f"modules over {MAX_LINES} lines: {large}; split them by concern"


def test_no_sys_path_edits_in_bench_or_tests():
    edits = [str(p.relative_to(ROOT)) for folder in ("bench", "tests") for p in (ROOT / folder).rglob("*.py")
             if re.search(r"sys\.path\.(insert|append)", p.read_text())]
    assert not edits, f"sys.path edits in {edits}: bench runs as `python -m bench.NAME`, tests import jmoe"


def test_placement_is_read_through_its_public_accessor():
    users = [str(p.relative_to(ROOT)) for folder in ("jmoe", "bench", "tests") for p in (ROOT / folder).rglob("*.py")
             if "._placement" in p.read_text() and p.name != "test_architecture.py"]
    assert not users, f"{users} read the private _placement: use Model.placement_plan"
