"""Run the replay's command line, `python -m bench.replay`, in a subprocess (tests never import bench scripts)."""

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``python -m bench.replay ARGV``, run from the repository root."""
    completed = subprocess.run([sys.executable, "-m", "bench.replay", *argv], capture_output=True, text=True,
                               timeout=300, cwd=REPO_ROOT)
    return completed.returncode, completed.stdout, completed.stderr
