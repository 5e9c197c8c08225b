"""Run bench/replay.py, the replay's command line, as a script (tests never import bench scripts)."""

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
REPLAY_PATH = REPO_ROOT / "bench" / "replay.py"


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``python bench/replay.py ARGV``, run from the repository root."""
    completed = subprocess.run([sys.executable, str(REPLAY_PATH), *argv], capture_output=True, text=True,
                               timeout=300, cwd=REPO_ROOT)
    return completed.returncode, completed.stdout, completed.stderr
