"""Serving under load: jmoe's OpenAI server against `transformers serve` (its continuous batching) on one
checkpoint, with a bounded load generator on 127.0.0.1.

  JAX_PLATFORMS=cpu python -m bench.serve [--cache 4] [--concurrency 1,2,4,8,16] [--requests 48] [--rounds 2]
                                          [--constrained-share 0,0.5]   # those shares of jmoe's requests JSON-
                                                                        # constrained, alternated on one server
  JAX_PLATFORMS=cpu python -m bench.serve --smoke   # toy sizes, both servers, no result file (the default model's
                                                    # first two layers, transformers' KV cache sized to the requests)

A fixed request set (from --seed): prompts cut from the Python standard library's own sources (what the default
model was trained on; 16-192 tokens) and max_tokens 16-128, greedy, streamed. For each concurrency level, N
client threads take the requests in order until none are left; each server runs in its own process, the
engines alternate over --rounds, and every figure is the median over rounds. Reported per engine and level:
aggregate generated tokens/s, time to first token p50/p99, inter-token latency p50/p99; for jmoe also the
expert-cache hit rate, host-to-device bytes per generated token (its /metrics) and the share of the decode bound
(the bytes its decode steps had to read, at this machine's measured read bandwidth). Then a soak: --soak
more requests at concurrency 8 through the last round's jmoe server, its resident memory after the first 50
and at the end. With several --constrained-share values, each jmoe server runs every level once per share, the
shares alternating, so constrained and free loads meet the same server, compiled programs and machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import NamedTuple

import httpx
import numpy as np

from bench.compare_cpu import load_average, load_warning, quiet_start_load
from bench.decode import WeightReads, weight_reads
from bench.helpers.common import (DEFAULT_MODEL, add_smoke_argument, default_model, read_bandwidth_gbs, smoke_run,
                                  write_result)
from bench.helpers.servers import Server, complete, jmoe_command, metric_delta, transformers_command

ENGINES = ("jmoe", "transformers")
# --constrained-share: those requests answer in this schema (response_format json_schema), through the grammar engine.
CONSTRAINED_FORMAT = {"type": "json_schema", "json_schema": {"name": "snippet", "strict": True, "schema": {
    "type": "object", "additionalProperties": False, "required": ["code", "notes"],
    "properties": {"code": {"type": "string"}, "notes": {"type": "array", "items": {"type": "string"}}}}}}
SMOKE_KV_PAGES = 4  # transformers serve's pages of 256 tokens in a smoke run: a page per request and to spare
SOURCE_MODULES = ("argparse", "json/decoder", "textwrap", "shlex", "string", "csv", "difflib", "fractions")


# ---- the workload ----------------------------------------------------------------------------------------

def workload(model_dir: Path, count: int, seed: int, prompt_range=(16, 192), output_range=(16, 128)) -> list:
    """`count` (prompt text, max_tokens) pairs: prompts of prompt_range tokens cut at random places from
    standard-library sources, output lengths uniform in output_range."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    ids = [tokenizer.encode((stdlib / f"{name}.py").read_text()).ids for name in SOURCE_MODULES]
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        source = rng.choice(ids)
        length = rng.randint(*prompt_range)
        start = rng.randrange(len(source) - length)
        requests.append((tokenizer.decode(source[start:start + length]), rng.randint(*output_range)))
    return requests


# ---- the servers -----------------------------------------------------------------------------------------

def start_server(engine: str, args, log_path: Path) -> Server:
    """A fresh server of `engine` on the benchmark's checkpoint: jmoe with every program compiled first (steady
    state: no program compiles behind the measured load), transformers with its continuous batching."""
    name = "default" if engine == "jmoe" else str(args.model)
    if engine == "jmoe":
        command = lambda port: jmoe_command(port, args.model, name, args.max_batch, args.context,  # noqa: E731
                                            args.cache, ("--no-compile-cache", "--compile-all-first"))
    else:  # a smoke run's few short requests: a page of the KV cache each and to spare
        command = lambda port: transformers_command(  # noqa: E731
            port, args.model, *((SMOKE_KV_PAGES, args.max_batch * args.context) if args.smoke else ()))
    return Server(engine, command, log_path, name)


def run_level(server: Server, requests: list, concurrency: int) -> dict:
    """`requests` through `concurrency` client threads; aggregate throughput and latency percentiles."""
    pending = list(reversed(requests))
    results, errors = [], []
    lock = threading.Lock()

    clients = [httpx.Client() for _ in range(concurrency)]

    def client(http: httpx.Client):
        while True:
            with lock:
                if not pending:
                    return
                prompt, max_tokens, *constrained = pending.pop()
            try:
                extra = {"response_format": CONSTRAINED_FORMAT} if constrained and constrained[0] else None
                outcome = complete(http, server, prompt, max_tokens, extra_body=extra)
            except Exception as error:  # reported after the level: a failed request invalidates it
                errors.append(error)
                return
            with lock:
                results.append(outcome)

    began = time.monotonic()
    threads = [threading.Thread(target=client, args=(http,)) for http in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.monotonic() - began
    for http in clients:
        http.close()
    if errors:
        raise RuntimeError(f"{server.engine} at concurrency {concurrency}: {errors[0]}")
    ttft = [r["ttft"] for r in results]
    gaps = [g for r in results for g in r["gaps"]]
    tokens = sum(r["tokens"] for r in results)
    # Cached tokens the decode steps' attention reads: the first token comes from the prefill, the i-th after it
    # attends to the prompt and the i tokens before it.
    kv_reads = (sum((r["tokens"] - 1) * r["prompt_tokens"] + r["tokens"] * (r["tokens"] - 1) // 2 for r in results)
                if all(r["prompt_tokens"] is not None for r in results) else None)
    return {"tokens_per_s": tokens / wall, "wall": wall, "tokens": tokens, "requests": len(results),
            "kv_reads": kv_reads,
            "ttft_p50": np.percentile(ttft, 50), "ttft_p99": np.percentile(ttft, 99),
            "itl_p50": np.percentile(gaps, 50) if gaps else float("nan"),
            "itl_p99": np.percentile(gaps, 99) if gaps else float("nan")}


def expert_traffic(before: dict, after: dict, tokens: int) -> tuple[float | None, float | None]:
    """Hit rate and host-to-device bytes per generated token between two jmoe /metrics readings."""
    hits = metric_delta(before, after, "jmoe:expert_cache_hits_total")
    misses = metric_delta(before, after, "jmoe:expert_cache_misses_total")
    moved_name = "jmoe:expert_cache_host_to_device_bytes_total"
    hit_rate = hits / (hits + misses) if hits + misses else None
    return hit_rate, (metric_delta(before, after, moved_name) / tokens if moved_name in after else None)


class DecodeReads(NamedTuple):
    """What bounds a level's decode: the model's weight reads, its cached bytes per token and the measured
    read bandwidth."""

    weights: WeightReads
    kv_per_token: int
    bandwidth_gbs: float


def decode_reads(model_dir: Path, smoke: bool) -> DecodeReads:
    """The model's byte counts (loaded here once, then dropped) and this machine's streaming read bandwidth."""
    import jmoe
    from jmoe.model.transformer import kv_bytes_per_token

    model = jmoe.load(model_dir, progress=False)
    return DecodeReads(weight_reads(model), kv_bytes_per_token(model.config, model.kv_dtype),
                       read_bandwidth_gbs(smoke))


def step_times(level: dict, before: dict, after: dict) -> dict[str, float]:
    """Where the level's wall time went in jmoe's engine: its decode and prefill steps' shares, and its decode steps'
    count, mean time and mean rows (tokens they generated; a request's first token comes from its prefill)."""
    decode = metric_delta(before, after, 'jmoe:step_seconds_sum{kind="decode"}')
    steps = metric_delta(before, after, 'jmoe:step_seconds_count{kind="decode"}')
    prefill = metric_delta(before, after, 'jmoe:step_seconds_sum{kind="prefill"}')
    return {"decode_share": decode / level["wall"], "prefill_share": prefill / level["wall"], "decode_steps": steps,
            "decode_ms": 1e3 * decode / steps if steps else float("nan"),
            "decode_rows": (level["tokens"] - level["requests"]) / steps if steps else float("nan")}


def decode_bound(reads: DecodeReads, level: dict, before: dict, after: dict) -> float | None:
    """Generated tokens/s if the level's decode steps (step_times' count and rows) had only to read their bytes once
    at the measured bandwidth: per step the dense weights and each MoE layer's distinct experts (the server's
    counts), plus the cached tokens every row attends to. Prefill is left out, so the bound is generous."""
    layer_steps = metric_delta(before, after, "jmoe:decode_distinct_experts_count")
    if not layer_steps or level["kv_reads"] is None:
        return None
    distinct = metric_delta(before, after, "jmoe:decode_distinct_experts_sum") / layer_steps
    step_bytes = reads.weights.step(level["decode_rows"], distinct)
    nbytes = level["decode_steps"] * step_bytes + level["kv_reads"] * reads.kv_per_token
    return level["tokens"] / (nbytes / (reads.bandwidth_gbs * 1e9))


# ---- the run ---------------------------------------------------------------------------------------------

def measure(engine: str, args, requests: dict[float, list], log_dir: Path, reads: DecodeReads,
            soak_requests: list | None = None) -> dict:
    """Every concurrency level through one fresh server of `engine`, once per constrained share of `requests`
    (share -> request list; the shares alternate within each level); then, given `soak_requests`, those at 8
    clients through the same server, with its resident memory after the first 50 (or a tenth) and at the end."""
    server = start_server(engine, args, log_dir / f"{engine}_{time.monotonic_ns()}.log")
    try:
        ready = server.wait_ready(args.start_timeout)
        levels = {}
        for concurrency in args.concurrency:
            for share, share_requests in requests.items():
                before = server.metrics() if engine == "jmoe" else {}
                level = run_level(server, share_requests, concurrency)
                if engine == "jmoe":
                    after = server.metrics()
                    level["hit_rate"], level["bytes_per_token"] = expert_traffic(before, after, level["tokens"])
                    level.update(step_times(level, before, after))
                    level["bound"] = decode_bound(reads, level, before, after)
                levels[concurrency, share] = level
        soaked = None
        if soak_requests:
            first = max(1, min(50, len(soak_requests) // 10))
            run_level(server, soak_requests[:first], 8)
            rss_first = server.rss_bytes()
            run_level(server, soak_requests[first:], 8)
            soaked = {"first": first, "total": len(soak_requests), "rss_first": rss_first,
                      "rss_last": server.rss_bytes()}
        return {"ready_s": ready, "levels": levels, "soak": soaked}
    finally:
        server.stop()


def fmt(value, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and np.isnan(value)) else format(value, spec)


def report(args, runs: dict, soaked: dict | None, start_load: float, conditions: str, reads: DecodeReads) -> str:
    median = lambda engine, level, key: statistics.median(r["levels"][level][key] for r in runs[engine])  # noqa: E731
    shares = args.constrained_share
    share_column = shares != [0.0]
    lines = [load_warning(start_load) + conditions, "",
             f"Model `{args.model}`, float32, greedy, streamed completions; jmoe `--cache {args.cache}` "
             f"`--max-batch {args.max_batch}`; {args.requests} requests per level (seed {args.seed}); medians of "
             f"{args.rounds} rounds, engines alternated."
             + (f" A share of the requests (every request i with i * share crossing a whole number) answers in a JSON "
                f"schema (response_format json_schema: an object of a code string and a list of note strings); "
                f"shares {', '.join(f'{x:g}' for x in shares)} alternate on each server." if share_column else ""), "",
             "| engine | clients | " + ("constrained | " if share_column else "") + "tokens/s | vs 1 client | "
             "TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) | hit rate | bytes/token | "
             "decode bound (tokens/s) | share of bound |",
             "|---|---|" + ("---|" if share_column else "") + "---|---|---|---|---|---|---|---|---|---|"]
    bounds = {}
    for engine in runs:
        for level in runs[engine][0]["levels"]:
            c, share = level
            single = median(engine, (args.concurrency[0], share), "tokens_per_s")
            hit = bytes_per = bound = fraction = None
            if engine == "jmoe" and runs[engine][0]["levels"][level].get("hit_rate") is not None:
                hit = median(engine, level, "hit_rate")
                bytes_per = median(engine, level, "bytes_per_token")
            if engine == "jmoe" and runs[engine][0]["levels"][level].get("bound") is not None:
                bound = bounds[level] = median(engine, level, "bound")
                fraction = median(engine, level, "tokens_per_s") / bound
            lines.append(f"| {engine} | {c} | " + (f"{share:g} | " if share_column else "")
                         + f"{median(engine, level, 'tokens_per_s'):.1f} | "
                         f"{median(engine, level, 'tokens_per_s') / single:.2f}x | "
                         f"{1e3 * median(engine, level, 'ttft_p50'):.0f} | {1e3 * median(engine, level, 'ttft_p99'):.0f} | "
                         f"{1e3 * median(engine, level, 'itl_p50'):.1f} | {1e3 * median(engine, level, 'itl_p99'):.1f} | "
                         f"{fmt(hit, '.3f')} | {fmt(bytes_per, ',.0f')} | {fmt(bound, ',.0f')} | "
                         f"{fmt(fraction, '.1%')} |")
    if bounds:
        first = args.concurrency[0]
        lines += ["", f"Decode bound: generated tokens over the time to read, once, what the level's decode steps "
                      f"needed (per step the dense weights, {reads.weights.fixed / 1e6:.2f} MB, and each MoE layer's "
                      f"distinct experts as the server counted them, {reads.weights.per_expert / 1e6:.2f} MB each; "
                      f"every row's cached tokens, {reads.kv_per_token / 1e3:.1f} kB each) at this machine's "
                      f"{reads.bandwidth_gbs:.1f} GB/s streaming read bandwidth "
                      f"(bench.helpers.common.read_bandwidth_gbs); prefill is left out. The bound's own ratio to "
                      f"{first} client{'' if first == 1 else 's'}: "
                      + ", ".join(f"{bounds[c, shares[0]] / bounds[first, shares[0]]:.2f}x at {c}"
                                  for c in args.concurrency if (c, shares[0]) in bounds) + "."]
    if "jmoe" in runs:
        lines += ["", "Where jmoe's wall time went (its /metrics step sums; the rest: between steps, handing tokens to "
                      "the HTTP side, waiting for requests):", "",
                  "| clients | " + ("constrained | " if share_column else "") + "decode steps | ms per decode step | "
                  "rows per decode step | prefill steps | rest |",
                  "|---|" + ("---|" if share_column else "") + "---|---|---|---|---|"]
        for level in runs["jmoe"][0]["levels"]:
            decode, prefill = median("jmoe", level, "decode_share"), median("jmoe", level, "prefill_share")
            lines.append(f"| {level[0]} | " + (f"{level[1]:g} | " if share_column else "")
                         + f"{decode:.0%} | {median('jmoe', level, 'decode_ms'):.2f} | "
                         f"{median('jmoe', level, 'decode_rows'):.2f} | {prefill:.0%} | {1 - decode - prefill:.0%} |")
    if "jmoe" in runs and len(shares) > 1:
        base = shares[0]
        lines += ["", f"Constrained against share {base:g}, same server, medians over rounds (tokens/s; generated "
                      f"tokens, which differ where a schema ends an answer before max_tokens):", "",
                  "| clients | constrained | tokens/s ratio | tokens generated |", "|---|---|---|---|"]
        lines += [f"| {c} | {share:g} | {median('jmoe', (c, share), 'tokens_per_s') / median('jmoe', (c, base), 'tokens_per_s'):.2f}x "
                  f"| {median('jmoe', (c, share), 'tokens'):.0f} vs {median('jmoe', (c, base), 'tokens'):.0f} |"
                  for c in args.concurrency for share in shares[1:]]
    readiness = "; ".join(f"{engine} " + ", ".join(f"{r['ready_s']:.1f}" for r in runs[engine]) + " s"
                          for engine in runs)
    lines += ["", f"Ready, from starting the server to its first answered completion (jmoe: every program compiled, "
                  f"with the compile cache as each round found it), round by round: {readiness}."]
    if len(runs) == 2:
        lines += ["", "| clients | jmoe / transformers tokens/s |", "|---|---|"]
        lines += [f"| {c} | {median('jmoe', (c, 0.0), 'tokens_per_s') / median('transformers', (c, 0.0), 'tokens_per_s'):.2f}x |"
                  for c in args.concurrency]
    if soaked:
        change = soaked["rss_last"] / soaked["rss_first"] - 1
        lines += ["", f"Soak: {soaked['total']} more requests at 8 clients through the last jmoe server: resident memory "
                      f"{soaked['rss_first'] / 2**20:.1f} MiB after {soaked['first']}, {soaked['rss_last'] / 2**20:.1f} "
                      f"MiB at the end ({100 * change:+.1f}%)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="(a smoke run: the default model's first "
                        "layers, bench.helpers.common.default_model)")
    parser.add_argument("--cache", type=int, default=4, help="jmoe: experts per MoE layer on the device")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 2, 4, 8, 16])
    parser.add_argument("--requests", type=int, default=48, help="requests per concurrency level")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--engines", type=lambda s: s.split(","), default=list(ENGINES))
    parser.add_argument("--soak", type=int, default=500, help="requests in the jmoe soak (0 = none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/jmoe_bench_serve"))
    parser.add_argument("--out", default="serve_cpu.md")
    parser.add_argument("--allow-load", action="store_true", help="write the report even if the machine is busy")
    parser.add_argument("--constrained-share", type=lambda s: [float(x) for x in s.split(",")], default=[0.0],
                        help="shares of the requests constrained to a JSON schema, comma-separated (jmoe only; several "
                             "alternate on each server)")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    unknown = set(args.engines) - set(ENGINES)
    if unknown:
        parser.error(f"--engines: unknown {sorted(unknown)}; choose from {', '.join(ENGINES)}")
    if not all(0 <= x <= 1 for x in args.constrained_share) or len(set(args.constrained_share)) < len(
            args.constrained_share) or (args.constrained_share != [0.0] and args.engines != ["jmoe"]):
        parser.error(f"--constrained-share must be distinct shares in [0, 1], with --engines jmoe; found "
                     f"{args.constrained_share} with --engines {','.join(args.engines)}")
    with smoke_run(args):
        if args.smoke:
            args.max_batch, args.context, args.concurrency, args.requests, args.rounds, args.soak = 2, 64, [1, 2], 4, 1, 6
            args.model = default_model(args)
        start_load = quiet_start_load("bench.serve", args.allow_load or args.smoke)
        args.workdir.mkdir(parents=True, exist_ok=True)
        prompt_range, output_range = ((8, 24), (4, 8)) if args.smoke else ((16, 192), (16, 128))
        plain = workload(args.model, args.requests, args.seed, prompt_range, output_range)
        requests = {share: [(*r, int((i + 1) * share) > int(i * share)) for i, r in enumerate(plain)]
                    for share in args.constrained_share}
        reads = decode_reads(args.model, args.smoke)
        began = time.monotonic()
        runs = {engine: [] for engine in args.engines}
        soak_requests = workload(args.model, args.soak, args.seed + 1, prompt_range, output_range) if args.soak else None
        for round_index in range(args.rounds):
            for engine in args.engines:
                print(f"round {round_index + 1}: {engine}", file=sys.stderr, flush=True)
                last_jmoe = engine == "jmoe" and round_index == args.rounds - 1
                runs[engine].append(measure(engine, args, requests, args.workdir, reads,
                                            soak_requests if last_jmoe else None))
        soaked = runs["jmoe"][-1]["soak"] if "jmoe" in runs else None
        conditions = (f"Load average {start_load:.2f} at the start, {load_average():.2f} at the end; whole run "
                      f"{time.monotonic() - began:.0f} s.")
        path = write_result(args.out, "Serving under load: jmoe against transformers serve", report(
            args, runs, soaked, start_load, conditions, reads))
        print(path.read_text())


if __name__ == "__main__":
    main()
