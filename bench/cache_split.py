"""Per-layer caches against one cache for every layer, at the same number of device slots, on the vendored
routing traces: should a device budget give layers different caches?

For each trace and policy, the replay (jmoe.traces.replay, the engine's eviction rule) gives every layer's hit
rate at every cache size from k to E, on the tuning split and on the held-out split (layers' caches are
independent, so any per-layer allocation's hit rate is read off these curves exactly). For each uniform
cache C, the split of L x C slots that maximises the tuning split's hit rate (exact dynamic programme,
every layer >= k) is then scored on the held-out split, next to uniform C and to the held-out optimum (the
same programme run on the held-out curves: the most any split could gain).

    python -m bench.cache_split [--traces gptoss,olmoe,kimi] [--policies lru,lfru]
    python -m bench.cache_split --smoke    # every trace, lfru, the first 32 tokens of each split, no result file
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from bench.helpers.common import add_smoke_argument, smoke_run, write_result
from bench.helpers.replay_report import REPORT_CACHES
from jmoe.traces.load import load_trace, split_trace
from jmoe.traces.replay import build_policy, replay

SMOKE_TOKENS = 32  # tokens of each split a smoke run replays


def layer_curves(ids: np.ndarray, num_experts: int, policy_name: str, split: dict, log) -> np.ndarray:
    """float [L, E + 1]: hit rate of each layer at each cache size (NaN below k)."""
    num_layers, top_k = ids.shape[1], ids.shape[2]
    curves = np.full((num_layers, num_experts + 1), np.nan)
    for capacity in range(top_k, num_experts + 1):
        policy = build_policy(policy_name, {**split, "eval_ids": ids}, num_experts)
        curves[:, capacity] = replay(ids, num_experts, capacity, policy)["layer_hit_rate"]
    log(f"  curves for {len(ids)} tokens done")
    return curves


def best_split(curves: np.ndarray, total: int, smallest: int) -> np.ndarray:
    """int [L]: per-layer caches >= smallest summing to `total` that maximise the summed hit rate."""
    num_layers, width = curves.shape
    sizes = np.arange(smallest, width)
    value = np.full(total + 1, -np.inf)
    value[0] = 0.0
    choice = np.zeros((num_layers, total + 1), np.int64)
    for layer in range(num_layers):
        new = np.full(total + 1, -np.inf)
        for size in sizes:
            candidate = np.full(total + 1, -np.inf)
            candidate[size:] = value[:total + 1 - size] + curves[layer, size]
            better = candidate > new
            new[better], choice[layer, better] = candidate[better], size
        value = new
    caches, left = np.zeros(num_layers, np.int64), total
    for layer in reversed(range(num_layers)):
        caches[layer] = choice[layer, left]
        left -= caches[layer]
    return caches


def mean_hit(curves: np.ndarray, caches: np.ndarray) -> float:
    return float(np.mean(curves[np.arange(len(caches)), caches]))


def run(traces: list[str], policies: list[str], log, tokens: int | None = None) -> str:
    """The table; `tokens`: replay only the first tokens of each split (a smoke run)."""
    lines = ["| trace | policy | uniform C | held-out hit %, uniform | held-out hit %, split chosen on tuning | "
             "gain (points) | held-out optimum split (upper bound) | chosen caches per layer |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for name in traces:
        trace = load_trace(name)
        split = split_trace(trace)
        num_experts = trace["num_experts"]
        top_k = split["eval_ids"].shape[2]
        for policy in policies:
            log(f"{name} {policy}")
            tune = layer_curves(split["tune_ids"][:tokens], num_experts, policy, split, log)
            held_out = layer_curves(split["eval_ids"][:tokens], num_experts, policy, split, log)
            for cache in REPORT_CACHES[name]:
                if cache < top_k:
                    continue
                total = cache * tune.shape[0]
                uniform = np.full(tune.shape[0], cache)
                chosen = best_split(tune, total, top_k)
                oracle = best_split(held_out, total, top_k)
                base, ours = mean_hit(held_out, uniform), mean_hit(held_out, chosen)
                lines.append(f"| {name} | {policy} | {cache} | {100 * base:.2f} | {100 * ours:.2f} | "
                             f"{100 * (ours - base):+.2f} | {100 * mean_hit(held_out, oracle):.2f} | "
                             f"{' '.join(map(str, chosen))} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default="gptoss,olmoe,kimi")
    parser.add_argument("--policies", default="lru,lfru")
    add_smoke_argument(parser)
    args = parser.parse_args()
    with smoke_run(args):
        if args.smoke:
            args.policies = "lfru"
        report(args, SMOKE_TOKENS if args.smoke else None)
    return 0


def report(args, tokens: int | None) -> None:
    began = time.perf_counter()

    def log(message):
        print(f"[{time.perf_counter() - began:6.0f} s] {message}", file=sys.stderr, flush=True)

    load_before = open("/proc/loadavg").read().split()[:3]
    table = run(args.traces.split(","), args.policies.split(","), log, tokens)
    load_after = open("/proc/loadavg").read().split()[:3]
    body = (f"Conditions: load average {' '.join(load_before)} before, {' '.join(load_after)} after; "
            f"{time.perf_counter() - began:.0f} s. Splits as in replay.md (GPT-OSS: tuning = mmlu* sequences, "
            f"held out = the rest; OLMoE, Kimi: first half / second half of one prompt). Same total slots in "
            f"every row of a uniform C: L x C.\n\n{table}\n")
    print(write_result("cache_split.md", "Per-layer cache splits against a uniform cache (replay)", body))


if __name__ == "__main__":
    sys.exit(main())
