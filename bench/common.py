"""Shared benchmark helpers: random HF checkpoints, machine description, bandwidth, result files."""

from __future__ import annotations

import datetime
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> str:
    """Cores, CPU name with family/model/stepping (virtual machines often report only "AMD EPYC", and two such
    guests measured 2.7x apart), OS."""
    try:
        fields = dict(line.split(":", 1) for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True).stdout.splitlines() if ":" in line)
        fields = {key.strip(): value.strip() for key, value in fields.items()}
        model = fields["Model name"]
        if "CPU family" in fields:
            model += (f" (family {fields['CPU family']} model {fields.get('Model', '?')} "
                      f"stepping {fields.get('Stepping', '?')})")
    except (KeyError, FileNotFoundError):
        model = platform.processor() or "unknown CPU"
    import os

    return f"{os.cpu_count()}-core {model}, {platform.system()} {platform.release()}"


def write_random_checkpoint(directory: Path, model_type: str, seed: int = 0, **overrides) -> Path:
    """A random-weight HF checkpoint written by transformers, so jmoe and transformers load the same files."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (directory / "config.json").is_file():
        return directory
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **overrides)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def median_seconds(fn, repeats: int = 5) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def read_bandwidth_gbs(megabytes: int = 1024) -> float:
    """Streaming read bandwidth of this machine as JAX sees it (a jitted sum over a large array)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((megabytes * 2**20 // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    seconds = median_seconds(lambda: total(x).block_until_ready())
    return x.nbytes / seconds / 1e9


def command_line() -> str:
    """How this benchmark was started: `python -m bench.NAME ARGS` (bench scripts run as modules)."""
    return f"python -m bench.{Path(sys.argv[0]).stem} {' '.join(sys.argv[1:])}".rstrip()


def write_result(name: str, title: str, body: str) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / name
    header = (f"# {title}\n\n- Date: {datetime.date.today().isoformat()}\n- Machine: {machine()}\n"
              f"- Command: `{command_line()}`\n\n")
    path.write_text(header + body)
    return path


def run_parts(args, parts: dict) -> tuple[list[str], str]:
    """Run the report sections `parts` {name: fn(args, log)} chosen by `args.part` ("all" or a name), with
    timestamped progress on stderr; returns the sections and a line on load average and run time."""
    began = time.perf_counter()

    def log(message):
        print(f"[{time.perf_counter() - began:6.0f} s] {message}", file=sys.stderr, flush=True)

    load_before = open("/proc/loadavg").read().split()[:3]
    sections = [fn(args, log) for name, fn in parts.items() if args.part in ("all", name)]
    load_after = open("/proc/loadavg").read().split()[:3]
    conditions = (f"load average {' '.join(load_before)} before, {' '.join(load_after)} after; whole run "
                  f"{time.perf_counter() - began:.0f} s")
    return sections, conditions
