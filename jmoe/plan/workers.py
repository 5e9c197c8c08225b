"""The processes that compile a plan's programs (jmoe.plan.compile_worker) and what each program came to.

One worker compiles all of a plan's programs: it imports JAX and jmoe once and compiles them side by side on
threads. Some XLA:GPU failures abort the process instead of raising (host miss mode's decode in jax 0.10); when
the worker dies with several programs unfinished, which one killed it is unknown, so each of those is compiled
again in a process of its own, side by side: an abort costs only its own program, and the others are reported.
A worker past the timeout is killed, and nothing is left running when this returns or is interrupted.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

COMPILE_TIMEOUT_SECONDS = 3600  # for a worker's programs, and again for the programs compiled one per process
WORKER = [sys.executable, "-m", "jmoe.plan.compile_worker"]  # + the pickled [(job, its directory)]


def compile_in_workers(jobs: dict, workdir: Path) -> dict[str, dict | str]:
    """{key: the worker's result (memory_analysis, cost_analysis, lower_seconds, compile_seconds, hlo_text), or
    why it did not compile} for {key: CompileJob}; each job works in workdir/key."""
    for key in jobs:
        (workdir / key).mkdir()
    ((status, output),) = run_side_by_side([list(jobs)], jobs, workdir)
    results = {key: finished(workdir / key) for key in jobs}
    unfinished = [key for key, result in results.items() if result is None]
    outcomes = {key: (status, output) for key in unfinished}
    if len(unfinished) > 1 and status is not None:  # it died, and the program that killed it is not known
        outcomes = dict(zip(unfinished, run_side_by_side([[key] for key in unfinished], jobs, workdir)))
    for key, (status, output) in outcomes.items():
        results[key] = finished(workdir / key) or failure(status, output)
    return results


def run_side_by_side(groups: list[list[str]], jobs: dict, workdir: Path) -> list[tuple[int | None, str]]:
    """Run a worker per group of job keys, all at once; (exit status, or None if it timed out; its output) each."""
    running = []
    try:
        for group in groups:
            name = "-".join(group)
            with open(workdir / f"{name}.pickle", "wb") as f:
                pickle.dump([(jobs[key], workdir / key) for key in group], f)
            log = open(workdir / f"{name}.txt", "w+")
            process = subprocess.Popen([*WORKER, f.name], stdout=log, stderr=subprocess.STDOUT,
                                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
            running.append((process, log))
        deadline = time.monotonic() + COMPILE_TIMEOUT_SECONDS
        outcomes = []
        for process, log in running:
            try:
                status = process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                status = None
            log.seek(0)
            outcomes.append((status, log.read()))
        return outcomes
    finally:  # timed out, interrupted or failed: no compiler is left running
        for process, log in running:
            if process.poll() is None:
                process.kill()
                process.wait()
            log.close()


def finished(work: Path) -> dict | None:
    """A job's result, with its optimized HLO, if its worker wrote it."""
    if not (work / "result.json").is_file():
        return None
    return {**json.loads((work / "result.json").read_text()), "hlo_text": (work / "hlo.txt").read_text()}


def failure(status: int | None, output: str) -> str:
    how = (f"timed out after {COMPILE_TIMEOUT_SECONDS} s" if status is None
           else f"the compiler process exited with status {status}")
    return f"{how}: {last_error_lines(output)}"


def last_error_lines(output: str, count: int = 6) -> str:
    """The lines that say what went wrong, without the plugin's start-up chatter and stack frames."""
    noise = ("cudart_stub.cc", "absl::InitializeLog", "Invalid stack_frame_id", "    @ ")
    lines = [line for line in output.splitlines() if line.strip() and not any(n in line for n in noise)]
    return " | ".join(lines[-count:]) or "no output"
