"""jmoe against transformers on CPU, measured the fair way: every engine in its own fresh process (PyTorch's
and XLA's thread pools disturb each other), alternated over several rounds, medians over every sample, the
load average recorded before and after each process.

  JAX_PLATFORMS=cpu python -m bench.compare_cpu [--phases decode,prefill] [--rounds 3] [--repeats 5]
  JAX_PLATFORMS=cpu python -m bench.compare_cpu --checkpoint checkpoints/default   # another checkpoint
  JAX_PLATFORMS=cpu python -m bench.compare_cpu --smoke   # toy checkpoint, one round, no result file

decode: batch 1, float32, greedy, the 215M Mixtral-shaped random checkpoint of bench.decode, or --checkpoint's (all
experts resident): milliseconds per decode step after a 32-token prompt, next to the read-bandwidth bound.
prefill: one prompt of --prompt-len random tokens (batch 1, float32): prompt tokens per second, jmoe
resident and with --offload-cache experts per layer on the device (the rest streamed from host memory).
The checkpoint is written once by transformers under --workdir, so both engines read the same file.

A smoke run: the checkpoint at smoke size, one round of one repeat, 4 new tokens, a 16-token prompt, and one
process per engine instead of one per configuration (each process starts JAX or PyTorch anew, most of a smoke
run's time): one for the bandwidth and every jmoe configuration, one for every transformers configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np

from bench.decode import PROMPT, compare_models, weight_reads
from bench.helpers.common import (add_smoke_argument, read_bandwidth_gbs, smoke_run, write_random_checkpoint,
                                  write_result)

MAX_QUIET_LOAD = 1.0  # 1-minute load average above which a run is not a result


def prompt_ids(length: int, vocab_size: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(0).integers(0, vocab_size, length)]


# ---- one measurement, in a child process -----------------------------------------------------------------

def jmoe_worker(args) -> dict:
    import jmoe
    from jmoe.decode.sampling import SamplingParams

    options = {} if args.cache is None else {"cache": args.cache}
    model = jmoe.load(args.dir, backend=args.backend, progress=False, **options)
    if args.phase == "decode":
        run = lambda: model.generate_detailed([PROMPT], args.tokens, SamplingParams())  # noqa: E731
        run()  # compiles the prompt and decode steps of this KV-cache length
        samples = [(r.decode_seconds / r.decode_steps) for r in (run() for _ in range(args.repeats))]
        return {"seconds": samples, "bytes_per_token": weight_reads(model).step()}
    prompt = prompt_ids(args.prompt_len, model.config.vocab_size)
    run = lambda: model.generate_detailed([prompt], 1, SamplingParams()).prefill_seconds  # noqa: E731
    run()
    return {"seconds": [run() for _ in range(args.repeats)]}


def transformers_worker(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.float32).eval()
    meta = {"threads": torch.get_num_threads(), "torch": torch.__version__,
            "implementation": f"experts {model.get_experts_implementation()['']}, attention "
                              f"{model.config._attn_implementation}"}
    with torch.inference_mode():
        if args.phase == "prefill":
            ids = torch.tensor([prompt_ids(args.prompt_len, model.config.vocab_size)])

            def once():  # logits of the last position only, as generate (and jmoe's prompt step) computes
                start = time.perf_counter()
                model(ids, use_cache=True, logits_to_keep=1).logits.argmax(-1)
                return time.perf_counter() - start

            once()  # warm-up

            return {"seconds": [once() for _ in range(args.repeats)], **meta}

        def decode_steps():
            # The same work as jmoe's decode steps: one token per forward against the KV cache, greedy.
            out = model(torch.tensor([PROMPT]), use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            start = time.perf_counter()
            for _ in range(args.tokens - 1):
                out = model(token, past_key_values=cache, use_cache=True)
                cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            return (time.perf_counter() - start) / (args.tokens - 1)

        decode_steps()
        return {"seconds": [decode_steps() for _ in range(args.repeats)], **meta}


def measurement(args) -> dict:
    if args.engine == "bandwidth":
        return {"gbs": read_bandwidth_gbs(args.smoke)}
    return (jmoe_worker if args.engine == "jmoe" else transformers_worker)(args)


def worker(args) -> None:
    if args.group:  # a smoke run: several configurations of one engine in this process, one after another
        print(json.dumps({"results": [measurement(argparse.Namespace(**{**vars(args), **spec}))
                                      for spec in json.loads(args.group)]}))
    else:
        print(json.dumps(measurement(args)))


# ---- the run: alternate the engines' processes -------------------------------------------------------------

def load_average() -> float:
    return float(open("/proc/loadavg").read().split()[0])


def quiet_start_load(tool: str, allow_load: bool) -> float:
    """The 1-minute load average as a run begins; above MAX_QUIET_LOAD the run stops unless `allow_load`."""
    start_load = load_average()
    if start_load > MAX_QUIET_LOAD and not allow_load:
        raise SystemExit(f"{tool}: the 1-minute load average is {start_load:.2f}, above {MAX_QUIET_LOAD}: wait for "
                         "a quiet machine, or pass --allow-load to write a report marked as taken under load")
    return start_load


def load_warning(start_load: float) -> str:
    """What heads a report begun under load (nothing on a quiet machine)."""
    return "" if start_load <= MAX_QUIET_LOAD else (
        f"**Taken under load (1-minute load average {start_load:.2f} when it began): not a result.**\n\n")


def baseline_workspace(python: str) -> tuple[Path, dict]:
    """Where and how a baseline jmoe (another jmoe installed, not editable, in `python`'s environment) runs
    this script: a directory holding only a copy of bench/ (so that no jmoe source tree shadows the
    installed one), with this environment's packages (jax, torch, ...) on PYTHONPATH."""
    workspace = Path(tempfile.mkdtemp(prefix="jmoe_baseline_"))
    shutil.copytree(Path(__file__).resolve().parent, workspace / "bench", ignore=shutil.ignore_patterns("results"))
    return workspace, {"PYTHONPATH": sysconfig.get_paths()["purelib"]}


def run_child(spec: dict, args, group: list[dict] | None = None) -> dict:
    """One child process measuring `spec`, or (a smoke run) every configuration of `group` in turn."""
    python, cwd, env = sys.executable, None, {}
    if spec.get("baseline"):
        python, (cwd, env) = args.baseline_python, args.baseline_workspace
    command = [python, "-m", "bench.compare_cpu", "worker", "--engine", spec["engine"], "--dir", str(args.dir),
               "--repeats", str(args.repeats), "--tokens", str(args.tokens), "--prompt-len", str(args.prompt_len)]
    for key in ("phase", "backend", "cache"):
        if spec.get(key) is not None:
            command += [f"--{key}", str(spec[key])]
    if group:
        command += ["--group", json.dumps([{key: spec.get(key, vars(args)[key]) for key in GROUP_KEYS}
                                           for spec in group])]
    if args.smoke:
        command.append("--smoke")
    before = load_average()
    try:
        done = subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=args.child_timeout,
                              env={**os.environ, "JAX_PLATFORMS": "cpu", **env})
    except subprocess.TimeoutExpired:
        raise SystemExit(f"compare_cpu: {spec['label']} ran past {args.child_timeout} s: {' '.join(command)}")
    if done.returncode:
        raise SystemExit(f"compare_cpu: {spec['label']} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {**result, "load": (before, load_average())}


GROUP_KEYS = ("engine", "phase", "backend", "cache")  # what a worker of a smoke run's group takes from each spec


def grouped_children(specs: list[dict], args) -> dict[str, dict]:
    """A smoke run's measurements by label: one process per engine (JAX's for the bandwidth and the jmoe
    configurations, transformers', and the baseline jmoe's when there is one)."""
    groups: dict[tuple, list[dict]] = {}
    for spec in specs:
        groups.setdefault((spec["engine"] == "transformers", bool(spec.get("baseline"))), []).append(spec)
    results = {}
    for group in groups.values():
        outcome = run_child({**group[0], "label": f"{group[0]['label']} and the rest of its process"}, args, group)
        results.update({spec["label"]: {**result, "load": outcome["load"]}
                        for spec, result in zip(group, outcome["results"])})
    return results


def configurations(args) -> list[dict]:
    import jmoe

    experts = jmoe.load_config(args.dir).num_experts
    specs = []
    if "decode" in args.phases:
        specs += [{"label": f"jmoe decode ({backend})", "engine": "jmoe", "phase": "decode", "backend": backend}
                  for backend in args.backends]
        specs += [{"label": f"jmoe decode (auto), cache {cache} of {experts}",
                   "engine": "jmoe", "phase": "decode", "backend": "auto", "cache": cache}
                  for cache in args.decode_caches]
        specs.append({"label": "transformers decode", "engine": "transformers", "phase": "decode"})
    if "prefill" in args.phases:
        specs += [{"label": "jmoe prefill, resident", "engine": "jmoe", "phase": "prefill", "backend": "auto"},
                  {"label": f"jmoe prefill, cache {args.offload_cache} of {experts}",
                   "engine": "jmoe", "phase": "prefill", "backend": "auto", "cache": args.offload_cache},
                  {"label": "transformers prefill", "engine": "transformers", "phase": "prefill"}]
    if args.baseline_python:  # every jmoe configuration again, with the baseline jmoe
        specs += [{**spec, "label": f"{spec['label']} [{args.baseline_name}]", "baseline": True}
                  for spec in specs if spec["engine"] == "jmoe"]
    return specs


def report(specs, samples, start_load, loads, bandwidth, args, wall) -> str:
    def seconds(label):
        return [s for run in samples[label] for s in run["seconds"]]

    def measured(phase):
        """(label, all samples, median) of every configuration of `phase`, in the order run."""
        for spec in specs:
            if spec["phase"] == phase:
                values = seconds(spec["label"])
                yield spec["label"], values, statistics.median(values)

    lines = []
    if "decode" in args.phases:
        hf = statistics.median(seconds("transformers decode"))
        lines += ["## Decode (batch 1, float32; every expert resident unless a cache is named)", "",
                  "| engine | ms per step (median) | min - max | tok/s | vs transformers | share of bound |",
                  "|---|---|---|---|---|---|"]
        for label, values, median in measured("decode"):
            per_token = samples[label][0].get("bytes_per_token")
            share = f"{per_token / (bandwidth * 1e9) / median:.0%}" if per_token else "-"
            lines.append(f"| {label} | {median * 1e3:.2f} | {min(values) * 1e3:.2f} - {max(values) * 1e3:.2f} | "
                         f"{1 / median:.1f} | {hf / median:.2f}x | {share} |")
        per_token = next(s[0]["bytes_per_token"] for label, s in samples.items() if "bytes_per_token" in s[0])
        lines += ["", f"Bound: {per_token / 1e6:.1f} MB of weights per token (dense matrices, top-k experts per "
                  f"layer, one embedding row) at the measured {bandwidth:.1f} GB/s streaming read bandwidth "
                  f"(a jitted sum over 1 GiB, its own process) = {per_token / bandwidth / 1e6:.2f} ms per token; "
                  "share of bound = bound / measured step.", ""]
    if "prefill" in args.phases:
        hf = statistics.median(seconds("transformers prefill"))
        resident = statistics.median(seconds("jmoe prefill, resident"))
        lines += [f"## Prefill ({args.prompt_len}-token prompt, batch 1, float32)", "",
                  "| engine | seconds (median) | min - max | prompt tok/s | vs transformers | vs jmoe resident |",
                  "|---|---|---|---|---|---|"]
        for label, values, median in measured("prefill"):
            lines.append(f"| {label} | {median:.3f} | {min(values):.3f} - {max(values):.3f} | "
                         f"{args.prompt_len / median:.0f} | {hf / median:.2f}x | {resident / median:.2f}x |")
        lines.append("")
    threads = next((s[0]["threads"] for s in samples.values() if "threads" in s[0]), "?")
    implementation = next((s[0]["implementation"] for s in samples.values() if "implementation" in s[0]), "?")
    torch_version = next((s[0]["torch"] for s in samples.values() if "torch" in s[0]), "?")
    checkpoint = f"`{args.checkpoint}`" if args.checkpoint else "bench.decode's 215M Mixtral-shaped random one"
    method = (f"Checkpoint: {checkpoint}.\n\nMethod: {args.rounds} rounds; in each, every configuration runs once in "
              f"a fresh process, in the order listed; each process warms up (compiles) and then times {args.repeats} "
              f"runs; medians are over all {args.rounds * args.repeats} samples of a configuration. jmoe decode: the "
              f"decode steps of `generate_detailed` after the 32-token prompt, {args.tokens} new tokens (compilation "
              f"excluded); transformers decode: a loop of one-token forwards with its KV cache and greedy argmax (its "
              f"best case: none of generate's per-step bookkeeping), "
              f"{args.tokens - 1} steps. Prefill: jmoe's prompt step (`prefill_seconds`, includes picking the "
              f"first token); transformers: one forward over the prompt with use_cache=True and logits_to_keep=1, "
              f"then the argmax. jax {version('jax')} (XLA:CPU), transformers {version('transformers')} "
              f"({implementation}), PyTorch {torch_version} with {threads} threads. "
              f"1-minute load average {start_load:.2f} when the run began; around each process "
              f"{min(loads):.2f} - {max(loads):.2f}, the run's own processes included (each keeps both cores "
              f"busy); whole run {wall:.0f} s.")
    return load_warning(start_load) + method + "\n\n" + "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", default="run", choices=["run", "worker"])
    parser.add_argument("--phases", default="decode,prefill", type=lambda s: s.split(","))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64, help="decode: new tokens per run")
    parser.add_argument("--prompt-len", type=int, default=512, help="prefill: prompt tokens")
    parser.add_argument("--offload-cache", type=int, default=4,
                        help="prefill: experts per layer on the device in the offloaded run")
    parser.add_argument("--backends", default="auto", type=lambda s: s.split(","), help="jmoe kernels for decode")
    parser.add_argument("--decode-caches", default=[], type=lambda s: [int(c) for c in s.split(",")],
                        help="decode also offloaded with these experts per layer on the device (own routing)")
    parser.add_argument("--checkpoint", type=Path, help="a Hugging Face checkpoint directory to compare on "
                        "(default: bench.decode's 215M Mixtral-shaped random one, written under --workdir)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/jmoe_bench"))
    parser.add_argument("--out", default="compare_cpu.md")
    parser.add_argument("--allow-load", action="store_true", help="write the report even if the machine is busy")
    parser.add_argument("--baseline-python", help="also run every jmoe configuration with the jmoe installed "
                        "(not editable) in this interpreter's environment, e.g. an earlier commit")
    parser.add_argument("--baseline-name", default="baseline", help="how the report names the baseline jmoe")
    parser.add_argument("--child-timeout", type=int, default=1800, help="seconds before a measurement counts as hung")
    # worker-only arguments
    parser.add_argument("--engine", choices=["jmoe", "transformers", "bandwidth"])
    parser.add_argument("--phase", choices=["decode", "prefill"])
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--cache", type=int, default=None)
    parser.add_argument("--dir", type=Path)
    parser.add_argument("--group", help="a smoke run: a JSON list of configurations to measure in turn")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    if args.mode == "worker":
        return worker(args)
    with smoke_run(args):
        if args.smoke:
            args.rounds, args.repeats, args.tokens, args.prompt_len = 1, 1, 4, 16
        compare(args)


def compare(args) -> None:
    """Every configuration in its own process, alternated over the rounds; the report."""
    start_load = quiet_start_load("compare_cpu", args.allow_load or args.smoke)
    args.workdir.mkdir(parents=True, exist_ok=True)
    # absolute: a baseline jmoe's children run in a directory of their own
    args.dir = args.checkpoint.resolve() if args.checkpoint else write_random_checkpoint(
        args.workdir / "compare_mixtral", **compare_models(args.smoke)["mixtral"])
    began = time.perf_counter()
    if args.baseline_python:
        args.baseline_workspace = baseline_workspace(args.baseline_python)
    specs = configurations(args)
    samples = {spec["label"]: [] for spec in specs}
    loads = []
    bandwidth_spec = {"label": "bandwidth", "engine": "bandwidth"}
    if args.smoke:  # one round, its measurements taken here
        smoke_results = grouped_children([bandwidth_spec, *specs], args)
        bandwidth = smoke_results["bandwidth"]["gbs"]
    else:
        smoke_results, bandwidth = None, run_child(bandwidth_spec, args)["gbs"]
    for round_index in range(args.rounds):
        for spec in specs:
            result = smoke_results[spec["label"]] if smoke_results else run_child(spec, args)
            samples[spec["label"]].append(result)
            loads += list(result["load"])
            print(f"round {round_index + 1}: {spec['label']}: median {statistics.median(result['seconds']):.4f} s, "
                  f"load {result['load'][0]:.2f} -> {result['load'][1]:.2f}", file=sys.stderr, flush=True)
    body = report(specs, samples, start_load, loads, bandwidth, args, time.perf_counter() - began)
    print(write_result(args.out, "jmoe vs transformers on CPU (separate processes, alternated)", body))


if __name__ == "__main__":
    main()
