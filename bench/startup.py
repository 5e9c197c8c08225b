"""Start-up time: how long `python -m jmoe.serve` takes to answer its first completion, cold (an empty compilation
cache) and warm (restarted with the cache the cold start left), answering once the programs of small requests exist
(the default) against compiling every program first (`--compile-all-first`); and `python -m jmoe.generate`'s wall
time for a few tokens, cold and warm.

  JAX_PLATFORMS=cpu python -m bench.startup [--model DIR | --shape mixtral-215m] [--cache 4] [--rounds 2]
                                            [--max-batch 8] [--context N] [--variants ready-first,all-first]
  JAX_PLATFORMS=cpu python -m bench.startup --smoke   # the default model's first layers, a small context, one
                                                      # round, cold starts of the default server and generate

Each start is its own process, the variants alternate over --rounds, and every figure is the median over rounds.
Reported per variant: seconds to /ready answering 200, to the first completion answered, and (from /ready's body
when it answered) how many of the server's programs were compiled by then, of how many; the server's log says what
it compiled when (`compiled 12 of 84 programs, about 40 s left`). `--shape mixtral-215m`: bench.decode's random
215M Mixtral (8 layers, 16 experts, hidden 512), written once into --workdir; without a tokenizer, its prompt is
token ids and generate is left out.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.compare_cpu import load_average, load_warning, quiet_start_load
from bench.decode import COMPARE_MODELS
from bench.helpers.common import (DEFAULT_MODEL, add_smoke_argument, default_model, smoke_run, smoke_spec,
                                  write_random_checkpoint, write_result)
from bench.helpers.servers import free_port

SERVER_VARIANTS = {"ready-first": [], "all-first": ["--compile-all-first"]}


def start_server(args, variant: str, cache: Path, log: Path) -> dict:
    """One server start: seconds to /ready 200 and to its first completion (4 tokens), and /ready's body then."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "jmoe.serve", "--model", str(args.model), "--port", str(port),
               "--max-batch", str(args.max_batch), "--compile-cache", str(cache), "--served-model-name", "default",
               *(["--context", str(args.context)] if args.context else []),
               *(["--cache", str(args.cache)] if args.cache is not None else []), *SERVER_VARIANTS[variant]]
    began = time.monotonic()
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}; see {log}")
            try:
                response = httpx.get(url + "/ready", timeout=5)
                if response.status_code == 200:
                    ready, body = time.monotonic() - began, response.json()
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - began > args.start_timeout:
                raise RuntimeError(f"not ready after {args.start_timeout} s; see {log}")
            time.sleep(0.2)
        prompt = "def f(x):" if has_tokenizer(args.model) else list(range(100, 108))
        answer = httpx.post(url + "/v1/completions", json={"model": "default", "prompt": prompt, "max_tokens": 4,
                                                           "temperature": 0}, timeout=args.start_timeout)
        answer.raise_for_status()
        return {"ready": ready, "first": time.monotonic() - began, "compiled": body.get("compiled_programs"),
                "programs": body.get("programs")}
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def has_tokenizer(model: Path) -> bool:
    return (model / "tokenizer.json").is_file()


def run_generate(args, cache: Path) -> float:
    """Wall seconds of `python -m jmoe.generate` for 8 tokens with this compilation cache."""
    began = time.monotonic()
    subprocess.run([sys.executable, "-m", "jmoe.generate", "--model", str(args.model), "--prompt", "def f(x):",
                    "--max-new-tokens", "8", "--json", "--compile-cache", str(cache),
                    *(["--cache", str(args.cache)] if args.cache is not None else [])], check=True,
                   capture_output=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return time.monotonic() - began


def measure_round(args, round_index: int) -> dict:
    """Every variant once, cold then warm, each with a compilation cache of its own (a smoke run: the default
    variant and generate, cold only)."""
    results = {}
    starts = ("cold",) if args.smoke else ("cold", "warm")
    for variant in args.variants:
        cache = args.workdir / f"cache_{round_index}_{variant}"
        shutil.rmtree(cache, ignore_errors=True)
        for start in starts:
            print(f"round {round_index + 1}: server, {variant}, {start}", file=sys.stderr, flush=True)
            log = args.workdir / f"server_{round_index}_{variant}_{start}.log"
            results[f"server, {variant}", start] = start_server(args, variant, cache, log)
    if not has_tokenizer(args.model):
        return results
    cache = args.workdir / f"cache_{round_index}_generate"
    shutil.rmtree(cache, ignore_errors=True)
    for start in starts:
        print(f"round {round_index + 1}: generate, {start}", file=sys.stderr, flush=True)
        results["generate, 8 tokens", start] = {"first": run_generate(args, cache)}
    return results


def report(args, rounds: list[dict], start_load: float, conditions: str) -> str:
    median = lambda key, field: statistics.median(r[key][field] for r in rounds)  # noqa: E731
    lines = [load_warning(start_load) + conditions, "",
             f"Model `{args.model}`, `--max-batch {args.max_batch}`"
             + (f" `--context {args.context}`" if args.context else "")
             + (f" `--cache {args.cache}`" if args.cache is not None else "") + ", otherwise the server's defaults "
             f"(offload settings, context); medians of {args.rounds} rounds. Cold: an empty compilation cache; "
             f"warm: the same start again with the cache the cold one left.", "",
             "| what | start | to /ready (s) | to first answer (s) | programs compiled at ready |",
             "|---|---|---|---|---|"]
    for key in rounds[0]:
        what, start = key
        ready = f"{median(key, 'ready'):.1f}" if "ready" in rounds[0][key] else "-"
        compiled = (f"{rounds[0][key]['compiled']} of {rounds[0][key]['programs']}"
                    if rounds[0][key].get("programs") else "-")
        lines.append(f"| {what} | {start} | {ready} | {median(key, 'first'):.1f} | {compiled} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="(a smoke run: the default model's first "
                        "layers, bench.helpers.common.default_model)")
    parser.add_argument("--shape", choices=["mixtral-215m"], default=None,
                        help="a random checkpoint of this shape instead of --model (written into --workdir)")
    parser.add_argument("--cache", type=int, default=None, help="experts per MoE layer on the device (default: all)")
    parser.add_argument("--variants", type=lambda s: s.split(","), default=list(SERVER_VARIANTS),
                        help=f"server variants, comma-separated, of {', '.join(SERVER_VARIANTS)}")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=None, help="(default: the server's, 4096 or the model's "
                        "max_position_embeddings if smaller)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--start-timeout", type=float, default=1200)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/jmoe_bench_startup"))
    parser.add_argument("--out", default="startup_cpu.md")
    parser.add_argument("--allow-load", action="store_true", help="write the report even if the machine is busy")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    if set(args.variants) - set(SERVER_VARIANTS):
        parser.error(f"--variants: unknown {sorted(set(args.variants) - set(SERVER_VARIANTS))}; choose from "
                     f"{', '.join(SERVER_VARIANTS)}")
    with smoke_run(args):
        if args.smoke:
            args.max_batch, args.context, args.rounds, args.variants = 2, 64, 1, args.variants[:1]
            args.model = default_model(args)
        start_load = quiet_start_load("bench.startup", args.allow_load or args.smoke)
        args.workdir.mkdir(parents=True, exist_ok=True)
        if args.shape is not None:
            spec = smoke_spec(COMPARE_MODELS["mixtral"]) if args.smoke else COMPARE_MODELS["mixtral"]
            args.model = write_random_checkpoint(args.workdir / args.shape, **spec)
        began = time.monotonic()
        rounds = [measure_round(args, i) for i in range(args.rounds)]
        conditions = (f"Load average {start_load:.2f} at the start, {load_average():.2f} at the end; whole run "
                      f"{time.monotonic() - began:.0f} s.")
        path = write_result(args.out, "Start-up: the server's first answer and generate, cold and warm",
                            report(args, rounds, start_load, conditions))
        print(path.read_text())


if __name__ == "__main__":
    main()
