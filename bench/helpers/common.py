"""Shared benchmark helpers: random HF checkpoints, machine description, bandwidth, result files, smoke runs."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parents[1] / "results"
DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "checkpoints" / "default"
# The shipped model's decoder layers a smoke run keeps: each layer compiles code of its own (4 -> 2 layers: a resident
# and an offloaded generation of the default model 14 -> 8 s of CPU, 2-core Zen 3).
SMOKE_DEFAULT_LAYERS = 2
_results_dir = RESULTS  # where write_result writes: a smoke run points it at its temporary directory
# The sizes of a smoke run's random checkpoints: every width small, two layers. A spec keeps its other keys
# (family, number of experts, top-k, vocabulary), so a smoke run has the real run's routing shapes.
SMOKE_SIZES = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, q_lora_rank=32, kv_lora_rank=16,
                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


def add_smoke_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true",
                        help="the same code paths at the smallest sizes, in a temporary work directory, writing "
                             "no result under bench/results (tests/test_bench_smoke.py runs it)")


@contextlib.contextmanager
def smoke_run(args: argparse.Namespace):
    """Around a benchmark's run. With `args.smoke`: yields a fresh temporary directory (removed afterwards), set
    as `args.workdir`, where write_result then writes instead of bench/results, with the environment of
    smoke_environment (it takes effect where JAX has not started its CPU backend and PyTorch is not imported yet, as
    at a module's start).
    Otherwise yields None and changes nothing."""
    global _results_dir
    if not args.smoke:
        yield None
        return
    # In the environment, so that child processes (bench/compare_cpu.py's workers, servers) run the same way.
    saved = {key: os.environ.get(key) for key in ("XLA_FLAGS", "OMP_NUM_THREADS")}
    os.environ.update(smoke_environment(saved["XLA_FLAGS"]))
    from jmoe.collector import freeze_loaded

    freeze_loaded()  # what the benchmark imported, out of the garbage collector's walks (jmoe.collector)
    with tempfile.TemporaryDirectory(prefix="jmoe_smoke_") as directory:
        args.workdir = Path(directory)
        _results_dir = args.workdir / "results"
        try:
            yield args.workdir
        finally:
            _results_dir = RESULTS
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key)
                else:
                    os.environ[key] = value


def smoke_environment(xla_flags: str | None) -> dict[str, str]:
    """A smoke run's environment variables, given XLA_FLAGS as it was: XLA:CPU told to optimize less
    (jmoe.compile_cache.FAST_COMPILE_XLA_FLAGS: compiling is most of a smoke run), and PyTorch on one thread: on a
    busy machine (the suite's other worker) its two threads spin-wait for each other, and a toy transformers generate
    took 18 s of CPU instead of 5 (a DeepSeek-shaped one of bench.decode_trace, 2-core Zen 3, load 6)."""
    from jmoe.compile_cache import with_fast_compile  # here: it imports JAX, which some smoke processes never need

    return {"XLA_FLAGS": with_fast_compile(xla_flags), "OMP_NUM_THREADS": "1"}


def default_model(args: argparse.Namespace) -> Path:
    """The shipped model (checkpoints/default); in a smoke run its first SMOKE_DEFAULT_LAYERS layers (its widths,
    routers and tokenizer), written once into the run's work directory."""
    if not args.smoke:
        return DEFAULT_MODEL
    directory = args.workdir / "default_model"
    if not (directory / "config.json").is_file():
        write_first_layers(DEFAULT_MODEL, directory, SMOKE_DEFAULT_LAYERS)
    return directory


def write_first_layers(source: Path, directory: Path, layers: int) -> None:
    """A copy of the Hugging Face checkpoint `source` (one model.safetensors) with its first `layers` decoder layers."""
    from safetensors.numpy import load_file, save_file

    directory.mkdir(parents=True)
    for path in source.iterdir():
        if path.name not in ("model.safetensors", "config.json"):
            shutil.copy(path, directory)
    kept = {name: tensor for name, tensor in load_file(source / "model.safetensors").items()
            if (layer := re.match(r"model\.layers\.(\d+)\.", name)) is None or int(layer[1]) < layers}
    save_file(kept, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}, indent=2))


def smoke_spec(spec: dict, **overrides) -> dict:
    """A transformers config spec at smoke size: each of its size keys from SMOKE_SIZES (as many key-value heads
    as query heads where the spec has that, as MLA needs), then `overrides`."""
    sizes = {key: value for key, value in SMOKE_SIZES.items() if key in spec}
    if spec.get("num_key_value_heads") == spec.get("num_attention_heads"):
        sizes["num_key_value_heads"] = sizes["num_attention_heads"]
    return {**spec, **sizes, **overrides}


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


def write_smoke_checkpoint(directory: Path, model_type: str, seed: int = 0, **overrides) -> Path:
    """write_random_checkpoint's checkpoint for a smoke run, without transformers and PyTorch (importing them was half
    of bench.scale's smoke run): float32 random tensors from NumPy under the names and shapes of jmoe's layout table,
    norms of ones. The transformers writer stays covered by the smoke runs that compare against transformers.
    (bench.gpu.models.write_checkpoint also writes without transformers, but draws jmoe.random_model's initialisation
    for the GPU checks whose tolerances assume it: that starts JAX, ~3.7 s of CPU for a toy Mixtral.)"""
    from safetensors.numpy import save_file

    from jmoe.checkpoint.hf_layout import expected_tensors
    from jmoe.config import parse_config

    if (directory / "config.json").is_file():
        return directory
    config = {**overrides, "model_type": model_type, "dtype": "float32", "torch_dtype": "float32"}
    rng = np.random.default_rng(seed)
    tensors = {name: np.ones(target.hf_shape, np.float32) if "norm" in name
               else rng.standard_normal(target.hf_shape, np.float32) * 0.02
               for name, target in expected_tensors(parse_config(config)).items()}
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def per_expert_copies(experts):
    """One array per expert, copies of the stacked leaves of `experts` (a jmoe.kernels.ExpertWeights): the layout
    of jmoe.kernels.per_expert_views at any expert size (views are made from MIN_EXPERT_BYTES per expert on)."""
    import jax

    return tuple(jax.tree.map(lambda a: a[e:e + 1], experts.stacked()) for e in range(experts.num_experts))


def one_expert_bytes(experts) -> int:
    """Bytes of one expert of `experts`: a pytree whose leaves have the expert axis first (stacked ExpertWeights)."""
    import jax

    return sum(leaf.nbytes // leaf.shape[0] for leaf in jax.tree.leaves(experts))


def error_text(error: BaseException, limit: int = 600) -> str:
    """An exception as a report's one line: its type and message, cut at `limit` characters."""
    return f"{type(error).__name__}: {error}"[:limit]


def median_seconds(fn, repeats: int = 5) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def read_bandwidth_gbs(smoke: bool = False) -> float:
    """Streaming read bandwidth of this machine as JAX sees it (a jitted sum over 1 GiB; 16 MiB in a smoke run)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones(((16 if smoke else 1024) * 2**20 // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    seconds = median_seconds(lambda: total(x).block_until_ready())
    return x.nbytes / seconds / 1e9


def command_line() -> str:
    """How this benchmark was started: `python -m bench.NAME ARGS` (bench scripts run as modules)."""
    return f"python -m bench.{Path(sys.argv[0]).stem} {' '.join(sys.argv[1:])}".rstrip()


def measured_commit() -> str:
    """The commit of the checkout a benchmark runs in, and whether tracked files (results aside) differ from it."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=RESULTS.parent, capture_output=True, text=True, check=True).stdout
    try:
        head, status = git("rev-parse", "--short", "HEAD").strip(), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    # Results written by an earlier run of the same session are not changes to the code measured.
    changed = [line for line in status.splitlines() if not line[3:].startswith("bench/results/")]
    return head + (" with uncommitted changes" if changed else "")


def write_result(name: str, title: str, body: str) -> Path:
    """bench/results/NAME (in a smoke run, NAME in its temporary directory): a header (date, machine, the commit
    measured, command), then `body`."""
    _results_dir.mkdir(exist_ok=True)
    path = _results_dir / name
    header = (f"# {title}\n\n- Date: {datetime.date.today().isoformat()}\n- Machine: {machine()}\n"
              f"- Commit: {measured_commit()}\n- Command: `{command_line()}`\n\n")
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
