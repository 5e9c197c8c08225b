#!/usr/bin/env python
"""Replay real MoE routing traces through expert-cache policies and count hits.

    python -m bench.replay --trace gptoss --cache 8 --policy lru --json
    python -m bench.replay --trace gptoss --cache 8 --policy belady --datasets gpqa_diamond,gpqa_main
    python -m bench.replay --report      # writes bench/results/replay.md and replay_*.png
    python -m bench.replay --tune        # LFRU constants on the tuning split -> replay_tuning.md
    python -m bench.replay --trace gptoss --cache 8 --policy lru --prefetch best --json
    python -m bench.replay --prefetch-report   # -> replay_prefetch.md (tuned on mmlu* only)
    python -m bench.replay --fit-table   # refit bench/data/gptoss20b_crosslayer_mmlu.npz on mmlu*
    python -m bench.replay --smoke       # every mode above on a few tokens of each trace, in a temporary directory
    python -m bench.replay --trace gptoss --cache 8 --host-cache 16 --tier exclusive --read-ahead 2 --json
    python -m bench.replay --tiers-report   # device / host RAM / disk tiers -> replay_tiers.md

The simulator, its semantics (hits, stalls, bytes moved, prefetch), the searches and the reports' numbers live in
``jmoe.traces`` (``replay``, ``tiers``, ``tuning``, ``comparison``; traces and splits in ``load``); this script
parses arguments and prints. The reports' Markdown writers are in ``bench/helpers``: ``replay_report.py``
(replay.md, replay_tuning.md), ``prefetch_report.py`` (replay_prefetch.md), ``tiers_report.py``
(replay_tiers.md). Data come from ``bench/data`` only (see its README).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.helpers.common import RESULTS, add_smoke_argument, smoke_run
from bench.helpers.prefetch_report import prefetch_report
from bench.helpers.replay_report import REPORT_CACHES, REPORT_DATE, machine_description, report, tune
from bench.helpers.tiers_report import tiers_report
from jmoe.offload.policies import LFRUPolicy
from jmoe.traces.load import CROSSLAYER_TABLE, TRACE_FILES, TraceError, write_trace_starts
from jmoe.traces.replay import POLICIES, PREFETCH_SETTINGS, run_one
from jmoe.traces.tiers import RELATIONS, TierConfig, run_tiers
from jmoe.traces.tuning import fit_table

# A smoke run's traces: the first SMOKE_SEQUENCES sequences of each GPT-OSS dataset, each cut to SMOKE_TOKENS
# tokens, and the first 2 x SMOKE_TOKENS tokens of the one-prompt traces.
SMOKE_SEQUENCES, SMOKE_TOKENS = 2, 16


def run_tiers_cli(args, datasets) -> int:
    """One two-level replay (--host-cache): disk reads per token, or every count with --json."""
    if args.prefetch is not None:
        raise TraceError("--prefetch (device prefetch) is not simulated with --host-cache; --read-ahead N reads "
                         "ahead from disk with --read-ahead-predictor's predictor")
    config = TierConfig(args.cache, args.host_cache, args.tier or "inclusive", args.read_ahead or 0)
    r = run_tiers(args.trace, [config], args.policy, args.host_policy, args.read_ahead_predictor, datasets,
                  warmup=args.warmup, expert_bytes=args.expert_bytes, decay=args.lfru_decay,
                  recency_weight=args.lfru_recency_weight)[0]
    if args.json:
        print(json.dumps(r))
        return 0
    tok = lambda key: r[key] / r["tokens"]  # noqa: E731
    print(f"{r['model']} ({r['trace']}), {r['evaluated_on']}: {r['tokens']:,} tokens (after {r['warmup']} warm-up), "
          f"cache {r['cache']}/{r['experts']}, host tier {r['host_cache']} ({r['relation']}), policy {r['policy']} "
          f"(host {r['host_policy']}), {r['seconds']} s")
    print(f"device hit rate {100 * r['device_hit_rate']:.2f}%; per token: {tok('host_to_device'):.2f} device misses = "
          f"{tok('host_hits'):.2f} host hits + {tok('disk_reads'):.2f} disk reads; {tok('device_to_host'):.2f} "
          f"device-to-host copies; floor {tok('first_uses'):.2f} first uses")
    if r["read_ahead"]:
        print(f"read-ahead {r['read_ahead']} per layer and step ({r['predictor']}): {r['read_ahead_reads']:,} reads, "
              f"{r['read_ahead_used']:,} used (demand disk reads avoided), {r['read_ahead_wasted']:,} wasted, "
              f"{r['read_ahead_pending']:,} pending; disk reads in all {tok('disk_reads_total'):.2f} per token")
    return 0


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Replay real MoE routing traces (bench/data) through expert-cache policies.")
    parser.add_argument("--trace", default="gptoss", help=f"one of {', '.join(TRACE_FILES)}")
    parser.add_argument("--cache", type=int, default=8, help="slots per layer (k <= C <= E)")
    parser.add_argument("--policy", default="lfru", help=f"one of {', '.join(POLICIES)}")
    parser.add_argument("--datasets", default=None,
                        help="gptoss only: comma-separated dataset names to report on "
                             "(default: the held-out split, datasets not starting with mmlu)")
    parser.add_argument("--lfru-decay", type=float, default=LFRUPolicy.DEFAULT_DECAY)
    parser.add_argument("--lfru-recency-weight", type=float,
                        default=LFRUPolicy.DEFAULT_RECENCY_WEIGHT)
    parser.add_argument("--prefetch", default=None,
                        help=f"prefetch with a predictor: one of {', '.join(PREFETCH_SETTINGS)} "
                             f"(best = the recommended, tuned setting)")
    parser.add_argument("--prefetch-budget", type=int, default=None,
                        help="most experts prefetched per layer and token (default: the "
                             "setting's own)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--stats", action="store_true", help="print per-layer hit rates")
    parser.add_argument("--report", action="store_true",
                        help="write bench/results/replay.md and replay_<trace>.png")
    parser.add_argument("--tune", action="store_true",
                        help="grid-search LFRU constants on GPT-OSS mmlu* -> replay_tuning.md")
    parser.add_argument("--prefetch-report", action="store_true",
                        help="tune prefetch on GPT-OSS mmlu*, report on the rest -> "
                             "replay_prefetch.md")
    parser.add_argument("--fit-table", action="store_true",
                        help=f"refit {CROSSLAYER_TABLE.name} on GPT-OSS mmlu*")
    parser.add_argument("--host-cache", type=int, help="experts per layer in host RAM, the rest on disk "
                        "(default: all in host; a two-level replay, jmoe.traces.tiers)")
    parser.add_argument("--tier", choices=RELATIONS, help="with --host-cache (default inclusive)")
    parser.add_argument("--read-ahead", type=int, help="with --host-cache: most disk reads per layer and step "
                        "issued ahead (default 0)")
    parser.add_argument("--read-ahead-predictor", default="best", help="the prefetch setting whose predictor "
                        f"reads ahead: one of {', '.join(PREFETCH_SETTINGS)}")
    parser.add_argument("--host-policy", help="with --host-cache: the host tier's policy (default: --policy)")
    parser.add_argument("--warmup", type=int, default=0, help="with --host-cache: tokens from the end of the "
                        "tuning split replayed first, uncounted")
    parser.add_argument("--expert-bytes", type=int, help="with --host-cache: one expert's bytes (JSON has bytes)")
    parser.add_argument("--tiers-report", action="store_true", help="the tiers on each trace -> replay_tiers.md")
    parser.add_argument("--tiers-traces", default=",".join(TRACE_FILES), help="--tiers-report's traces")
    parser.add_argument("--results-dir", type=Path, default=RESULTS,
                        help="where --report, --tune and --prefetch-report write (default: "
                             "bench/results)")
    add_smoke_argument(parser)
    return parser.parse_args(argv)


def smoke(args, log) -> int:
    """Every mode on the start of each trace, written to and read from a temporary directory. Tuning there
    chooses other constants than the shipped ones, so the prefetch report skips that check."""
    with smoke_run(args) as directory:
        data_dir = write_trace_starts(directory / "data", SMOKE_SEQUENCES, SMOKE_TOKENS)
        results = directory / "results"
        print(f"wrote {fit_table(REPORT_DATE, path=data_dir / CROSSLAYER_TABLE.name, data_dir=data_dir)}")
        print_result(run_one("gptoss", 8, "lru", prefetch="best", data_dir=data_dir), stats=True)
        print(f"wrote {report(results, log, data_dir)}")
        print(f"wrote {tune(results, log, data_dir)}")
        prefetch = prefetch_report(results, REPORT_DATE, machine_description(), REPORT_CACHES["gptoss"], log,
                                   data_dir, check_tuned=False)
        print(f"wrote {prefetch}")
    return 0


def print_result(result: dict, stats: bool) -> None:
    """One run's result for a reader (``--json`` prints the dict instead)."""
    print(f"{result['model']} ({result['trace']}), {result['evaluated_on']}: "
          f"{result['tokens']:,} tokens, cache {result['cache']}/{result['experts']}, policy {result['policy']}")
    print(f"hit rate {100 * result['hit_rate']:.2f}% ({result['hits']:,} of "
          f"{result['accesses']:,} accesses), {result['bytes_moved']:,} experts moved "
          f"({result['bytes_moved'] / result['tokens']:.2f} per token), {result['seconds']} s")
    if "prefetch" in result:
        print(f"prefetch {result['prefetch']} ({result['predictor']}, budget "
              f"{result['prefetch_budget']}): stall-free {100 * result['stall_free_rate']:.2f}%, "
              f"{result['prefetches']:,} prefetches ({result['prefetches_used']:,} used), "
              f"{result['demand_copies']:,} demand copies")
    if "note" in result:
        print(f"note: {result['note']}")
    if "warning" in result:
        print(f"warning: {result['warning']}")
    if stats:
        for layer, rate in enumerate(result["layer_hit_rate"]):
            print(f"  layer {layer:2d}: {100 * rate:.1f}%")


def main(argv=None) -> int:
    args = parse_args(argv)
    log = lambda message: print(message, file=sys.stderr)  # noqa: E731
    try:
        if args.smoke:
            return smoke(args, log)
        if args.report or args.tune:
            print(f"wrote {(report if args.report else tune)(args.results_dir, progress=log)}")
            return 0
        if args.prefetch_report:
            out = prefetch_report(args.results_dir, REPORT_DATE, machine_description(),
                                  REPORT_CACHES["gptoss"], progress=log)
            print(f"wrote {out}")
            return 0
        if args.fit_table:
            print(f"wrote {fit_table(REPORT_DATE)}")
            return 0
        if args.tiers_report:
            print(f"wrote {tiers_report(args.results_dir, [t for t in args.tiers_traces.split(',') if t], log)}")
            return 0
        if args.prefetch is None and args.prefetch_budget is not None:
            raise TraceError("--prefetch-budget needs --prefetch NAME")
        datasets = [d for d in args.datasets.split(",") if d] if args.datasets else None
        if args.host_cache is not None:
            return run_tiers_cli(args, datasets)
        tier_flags = [f for f, v in [("--tier", args.tier), ("--read-ahead", args.read_ahead),
                                     ("--host-policy", args.host_policy), ("--expert-bytes", args.expert_bytes)]
                      if v is not None] + (["--warmup"] if args.warmup else [])
        if tier_flags:
            raise TraceError(f"{', '.join(tier_flags)} {'needs' if len(tier_flags) == 1 else 'need'} --host-cache H "
                             "(experts per layer in host RAM)")
        result = run_one(args.trace, args.cache, args.policy, datasets,
                         prefetch=args.prefetch, prefetch_budget=args.prefetch_budget,
                         decay=args.lfru_decay, recency_weight=args.lfru_recency_weight)
    except ValueError as err:  # TraceError, or e.g. out-of-range LFRU constants from policies
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not args.stats:
        result.pop("layer_hit_rate")
        result.pop("layer_prefetches", None)
    if args.json:
        print(json.dumps(result))
    else:
        print_result(result, args.stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
