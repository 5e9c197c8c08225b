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

The simulator, its semantics (hits, stalls, bytes moved, prefetch) and the searches live in
``jmoe.traces`` (``replay``, ``tiers``, ``tuning``, ``comparison``; traces and splits in ``load``); this
script parses arguments and writes replay.md and replay_tuning.md (replay_prefetch.md:
``bench/prefetch_report.py``). Data come from ``bench/data`` only (see its README).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from jmoe.offload.policies import LFRUPolicy
from jmoe.traces.comparison import policy_grid
from jmoe.traces.load import CROSSLAYER_TABLE, DATA_DIR, TRACE_FILES, TraceError, load_trace, split_trace
from jmoe.traces.replay import POLICIES, PREFETCH_SETTINGS, run_one
from jmoe.traces.tiers import RELATIONS, TierConfig, run_tiers, tier_grid
from jmoe.traces.tuning import fit_table, tune_lfru
from bench.common import add_smoke_argument, measured_commit, smoke_run
from bench.prefetch_report import prefetch_report

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPORT_CACHES = {"gptoss": [4, 6, 8, 12, 16], "olmoe": [8, 16, 32], "kimi": [16, 32, 64]}
REPORT_DATE = "2026-11-21"
# A smoke run's traces: the first SMOKE_SEQUENCES sequences of each GPT-OSS dataset, each cut to SMOKE_TOKENS
# tokens, and the first 2 x SMOKE_TOKENS tokens of the one-prompt traces.
SMOKE_SEQUENCES, SMOKE_TOKENS = 2, 16


def machine_description() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown (lscpu unavailable)"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    model = fields.get("Model name", "?").strip()
    cpus = fields.get("CPU(s)", "?").strip()
    return f"{model}, {cpus} CPUs visible (lscpu), shared with other jobs"


def plot(rows: list[dict], trace_name: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy_name in POLICIES:
        pts = sorted((r["cache"], r["hit_rate"]) for r in rows if r["policy"] == policy_name)
        style = "--" if policy_name == "belady" else "-"
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], style, marker="o", label=policy_name)
    first = rows[0]
    ax.set_xlabel(f"cache slots per layer (of {first['experts']} experts)")
    ax.set_ylabel("hit rate (%)")
    ax.set_title(f"{first['model']} decode trace: {first['evaluated_on']}", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(rows: list[dict], caches: list[int], key, fmt) -> list[str]:
    lines = ["| policy | " + " | ".join(f"C={c}" for c in caches) + " |",
             "|---|" + "---|" * len(caches)]
    for policy_name in POLICIES:
        cells = []
        for c in caches:
            r = next(r for r in rows if r["policy"] == policy_name and r["cache"] == c)
            cells.append(fmt(key(r)))
        lines.append(f"| {policy_name} | " + " | ".join(cells) + " |")
    return lines


def reading(all_rows: dict) -> list[str]:
    """The 'Reading' section, computed from the numbers so that it stays true when rerun."""

    def rate(trace_name, c, policy_name):
        return next(100 * r["hit_rate"] for r in all_rows[trace_name]
                    if r["cache"] == c and r["policy"] == policy_name)

    lines = ["## Reading", ""]
    g = "gptoss"
    lines.append(
        f"- GPT-OSS held-out, 8 of 32 slots: LRU {rate(g, 8, 'lru'):.1f}%, Belady {rate(g, 8, 'belady'):.1f}%; "
        "the issue quotes about 67% and 78%, so the replay reproduces the reference semantics."
    )
    for trace_name, caches in REPORT_CACHES.items():
        model = all_rows[trace_name][0]["model"]
        parts = []
        for c in caches:
            lru, lfru, opt = (rate(trace_name, c, p) for p in ("lru", "lfru", "belady"))
            closed = f", {100 * (lfru - lru) / (opt - lru):.0f}% of the gap to Belady" if opt > lru else ""
            parts.append(f"C={c}: {lfru - lru:+.1f} points{closed}")
        lines.append(f"- {model}: LFRU against LRU: " + "; ".join(parts) + ".")
    top_k = all_rows[g][0]["top_k"]
    same = {round(rate(g, top_k, p), 6) for p in ("lru", "lfu", "lfru", "belady")}
    if top_k in REPORT_CACHES[g] and len(same) == 1:
        lines.append(
            f"- With C = k = {top_k} every admitting policy, Belady included, scores the same: each token's "
            f"{top_k} experts fill the cache, so there is never a choice to make."
        )
    lfu_below = [
        (t, c) for t, caches in REPORT_CACHES.items() for c in caches
        if rate(t, c, "lfu") < rate(t, c, "lru") - 1e-9
    ]
    lfu_cases = sum(len(c) for c in REPORT_CACHES.values())
    lines.append(
        f"- LFU (counts since the start, no decay) is below LRU in {len(lfu_below)} of {lfu_cases} (trace, C) "
        "cells: it never forgets experts that were popular in earlier sequences."
    )
    static_gap = [rate(g, c, "lru") - rate(g, c, "static") for c in REPORT_CACHES[g]]
    lines.append(
        f"- Static (the experts most used on mmlu*, never adapting) is {min(static_gap):.1f} to "
        f"{max(static_gap):.1f} points below LRU on GPT-OSS held-out. It does not admit misses, so it is "
        "outside the class Belady bounds (on a tiny trace it beats Belady: "
        "`tests/test_replay.py::test_static_is_outside_beladys_class`)."
    )
    return lines


def report(results_dir: Path = RESULTS_DIR, progress=print, data_dir: Path = DATA_DIR) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Expert-cache policies replayed on real routing traces",
        "",
        "- command: `python -m bench.replay --report`",
        f"- date: {REPORT_DATE}",
        f"- machine: {machine_description()} (CPU only: the replay is NumPy bookkeeping)",
        "- data: `bench/data` (provenance in its README); code: `jmoe/traces/replay.py`, policies from "
        "`jmoe/offload/policies.py`",
        f"- LFRU constants: decay={LFRUPolicy.DEFAULT_DECAY}, "
        f"recency_weight={LFRUPolicy.DEFAULT_RECENCY_WEIGHT} (library defaults, tuned on GPT-OSS mmlu* "
        "sequences only: `replay_tuning.md`)",
        "",
        "Semantics: one cache of C slots per layer, empty at the start, warm across sequences in file order; a "
        "token needs its k experts resident at once; a hit is an access to an expert resident before the token; "
        "on a miss the expert is admitted, evicting the lowest-priority resident expert the token does not need "
        "(ties: lower id). Static pins its top-C experts per layer, loads them once (counted in bytes moved) "
        "and streams misses without caching them. Belady evicts the expert used farthest in the future: an "
        "upper bound for demand caching, not a policy one can run.",
        "",
        "Bytes moved are in experts copied host-to-device (one per miss, plus static's initial load), reported "
        "per decode token (all layers together).",
        "",
    ]
    all_rows = {}
    for trace_name, caches in REPORT_CACHES.items():
        rows = all_rows[trace_name] = policy_grid(load_trace(trace_name, data_dir), caches, progress)
        first = rows[0]
        png = results_dir / f"replay_{trace_name}.png"
        plot(rows, trace_name, png)
        lines += [
            f"## {first['model']} ({first['layers']} layers, {first['experts']} experts, top-{first['top_k']})",
            "",
            f"Reported on: {first['evaluated_on']}, {first['tokens']:,} decode tokens, {first['accesses']:,} "
            "(token, layer, expert) accesses.",
            "",
        ]
        if trace_name == "gptoss":
            lines += ["Static's table: expert counts over the mmlu* sequences (tuning split).", ""]
        else:
            lines += [
                "This trace is one prompt, so it has no held-out split of its own. Static's table is the "
                "expert counts of the first half of the tokens; every policy is reported on the second half, "
                "replayed from an empty cache (static starts with its pinned set). LFRU uses the constants "
                "tuned on GPT-OSS mmlu*; nothing was tuned on this trace. With ~150 tokens the numbers are "
                "noisy and the cold start weighs heavily: read them as a sanity check across architectures. "
                f"Static's bytes include loading its pinned set once (C x {first['layers']} experts), spread "
                f"here over only {first['tokens']} tokens.",
                "",
            ]
        lines += ["Hit rate (%):", ""]
        lines += table(rows, caches, lambda r: 100 * r["hit_rate"], lambda v: f"{v:.1f}")
        lines += ["", "Experts moved per decode token (all layers):", ""]
        lines += table(rows, caches, lambda r: r["bytes_moved"] / r["tokens"], lambda v: f"{v:.2f}")
        lines += ["", f"![hit rate vs cache size]({png.name})", ""]
    lines += reading(all_rows)
    out = results_dir / "replay.md"
    out.write_text("\n".join(lines) + "\n")
    return out


def tune(results_dir: Path = RESULTS_DIR, progress=print, data_dir: Path = DATA_DIR) -> Path:
    """``tuning.tune_lfru`` (LFRU constants on GPT-OSS mmlu*) -> replay_tuning.md."""
    tuned = tune_lfru(progress, data_dir=data_dir)
    caches, best = tuned["caches"], tuned["best"]
    lines = [
        "# LFRU constants tuned on the GPT-OSS tuning split",
        "",
        "- command: `python -m bench.replay --tune`",
        f"- date: {REPORT_DATE}; machine: {machine_description()}",
        f"- data: one in {tuned['stride']} mmlu* sequence of `bench/data/gptoss20b_decode_ids.npz` in file "
        f"order ({tuned['tokens']:,} decode tokens); no held-out sequence is used",
        "- objective: mean hit rate over cache sizes " + ", ".join(map(str, caches)) + " of 32",
        "- priority = decayed_freq / (1 + recency_weight * recency), decayed_freq = decay * decayed_freq + "
        "counts each step",
        "",
        "Each row is one (decay, recency_weight); cells are hit rates in %.",
        "",
        "| decay | recency_weight | " + " | ".join(f"C={c} (%)" for c in caches) + " | mean |",
        "|---|---|" + "---|" * (len(caches) + 1),
    ]
    for (decay, weight), rates in tuned["grid"].items():
        mark = " **(best)**" if (decay, weight) == best else ""
        lines.append(f"| {decay} | {weight} | " + " | ".join(f"{100 * r:.2f}" for r in rates)
                     + f" | {100 * np.mean(rates):.2f}{mark} |")
    for name, rates in tuned["baselines"].items():
        lines.append(f"| {name} | - | " + " | ".join(f"{100 * r:.2f}" for r in rates)
                     + f" | {100 * np.mean(rates):.2f} |")
    lines += ["", f"Best: decay={best[0]}, recency_weight={best[1]}."]
    out = results_dir / "replay_tuning.md"
    results_dir.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return out


TIER_READ_AHEAD = [1, 4]  # read-ahead budgets the tiers report shows (disk reads per layer and step)


def cpu_model() -> str:
    """The CPU model from /proc/cpuinfo (Linux) and the CPUs visible."""
    names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
    return f"{names[0] if names else 'unknown CPU'}, {os.cpu_count()} CPUs visible (/proc/cpuinfo), shared"


def tiers_report(results_dir: Path, traces: list[str], progress=print, data_dir: Path = DATA_DIR) -> Path:
    """``jmoe.traces.tiers`` over ``tier_grid`` on each trace -> replay_tiers.md."""
    began, load = time.perf_counter(), open("/proc/loadavg").read().split()[:3]
    per_token = lambda r, key="disk_reads": r[f"{key}_per_token"]  # noqa: E731
    used = lambda r: (f"{100 * r['read_ahead_used'] / r['read_ahead_reads']:.0f}%"  # noqa: E731
                      if r["read_ahead_reads"] else "none")
    same = lambda pairs: f"{sum(a == b for a, b in pairs)} of {len(pairs)}"  # noqa: E731
    body, reading = [], ["## Reading (computed from the tables)", ""]
    for name in traces:
        trace = load_trace(name, data_dir)
        warmup = min(2048, len(split_trace(trace)["tune_ids"]))
        caches = REPORT_CACHES[name]
        rows = run_tiers(name, tier_grid(caches, trace["num_experts"], TIER_READ_AHEAD), trace=trace,
                         warmup=warmup, data_dir=data_dir)
        got = {(r["cache"], r["host_cache"], r["relation"], r["read_ahead"]): r for r in rows}
        first, hosts = rows[0], sorted({r["host_cache"] for r in rows if r["relation"] == "exclusive"})
        grid = [(c, h) for c in caches for h in hosts]
        progress(f"{name}: {len(rows)} configurations in {first['seconds']} s")
        cell = lambda *key: f"{per_token(got[key]):.2f}" if key in got else "–"  # noqa: E731
        body += [f"## {first['model']} ({first['layers']} layers, {first['experts']} experts, top-{first['top_k']})",
                 "", f"Counted: {first['evaluated_on']}, {first['tokens']:,} decode tokens, after {warmup} warm-up "
                 f"tokens (the end of the tuning split, uncounted). Floor (first uses of a (layer, expert)): "
                 f"{per_token(first, 'first_uses'):.3f} per token.",
                 "", "Disk reads per token, demand only (no read-ahead); device misses = host hits + disk reads; "
                 "device-to-host = exclusive's demotions kept by the tier:", "",
                 "| C | H | device misses | inclusive | exclusive | inclusive at H+C | exclusive device-to-host |",
                 "|---|---|---|---|---|---|---|"]
        for c, h in grid:
            ex = got[(c, h, "exclusive", 0)]
            body.append(f"| {c} | {h} | {per_token(ex, 'host_to_device'):.2f} | {cell(c, h, 'inclusive', 0)} | "
                        f"{per_token(ex):.2f} | {cell(c, h + c, 'inclusive', 0)} | "
                        f"{per_token(ex, 'device_to_host'):.2f} |")
        body += ["", "With read-ahead R (disk reads per layer and step, `best`'s predictor): demand disk reads / all "
                 "disk reads (demand + read-ahead) per token, and the share of read-ahead reads used:", "",
                 "| C | H | " + " | ".join(f"{rel} R={r}" for r in TIER_READ_AHEAD for rel in RELATIONS) + " |",
                 "|---|---|" + "---|" * (2 * len(TIER_READ_AHEAD))]
        for c, h in grid:
            cells = [f"{per_token(x):.2f} / {per_token(x, 'disk_reads_total'):.2f} ({used(x)})" if x else "–"
                     for r in TIER_READ_AHEAD for x in (got.get((c, h, rel, r)) for rel in RELATIONS)]
            body.append(f"| {c} | {h} | " + " | ".join(cells) + " |")
        body.append("")
        misses = {r["cache"]: r["host_to_device"] for r in rows}  # a one-level cache of C slots
        one_level = [(r["disk_reads"], misses[r["host_cache"]]) for r in rows if r["relation"] == "inclusive"
                     and not r["read_ahead"] and r["host_cache"] in misses]
        twins = [(got[(c, h, "exclusive", 0)]["disk_reads"], got[(c, h + c, "inclusive", 0)]["disk_reads"])
                 for c, h in grid if (c, h + c, "inclusive", 0) in got]
        c, h = caches[len(caches) // 2], hosts[1]
        exc, rel = got[(c, h, "exclusive", 0)], "inclusive" if h >= c else "exclusive"
        line = (f"- {first['model']}: disk reads (exact counts, no read-ahead) of inclusive at H equal the misses of a "
                f"one-level cache of H slots in {same(one_level)} cells; exclusive at H equals inclusive at H + C in "
                f"{same(twins)}. At C={c}, H={h}: inclusive {cell(c, h, 'inclusive', 0)}, exclusive "
                f"{per_token(exc):.2f} disk reads per token, for {per_token(exc, 'device_to_host'):.2f} device-to-host "
                f"copies per token (host-to-device: {per_token(exc, 'host_to_device'):.2f})")
        for x in (got[(c, h, rel, r)] for r in TIER_READ_AHEAD):
            line += (f"; {rel}, R={x['read_ahead']}: demand {per_token(x):.2f}, "
                     f"all {per_token(x, 'disk_reads_total'):.2f}")
        reading.append(line + ".")
    lines = ["# Device, host RAM and disk: two-level expert caches replayed on real routing traces", "",
             f"- command: `python -m bench.replay --tiers-report` (one run: `python -m bench.replay --trace gptoss "
             f"--cache 8 --host-cache 16 --tier exclusive --read-ahead 1 --json`)",
             f"- date: {datetime.date.today().isoformat()}; commit: {measured_commit()}",
             f"- machine: {cpu_model()}; load average {' '.join(load)} at the start; the whole run took "
             f"{time.perf_counter() - began:.0f} s (CPU only: NumPy bookkeeping)",
             f"- code: `jmoe/traces/tiers.py` (semantics in its docstring); policy LFRU (decay "
             f"{LFRUPolicy.DEFAULT_DECAY}, recency_weight {LFRUPolicy.DEFAULT_RECENCY_WEIGHT}) at both levels, one "
             "ranking; read-ahead with `best`'s predictor (lags, fitted on the tuning split), one step ahead", "",
             "Per layer: C device slots, H experts in pinned host RAM, every expert on disk. Inclusive: the host tier "
             "holds the device's experts too (H >= C). Exclusive: disjoint, C + H distinct experts, each device "
             "eviction demoted into the tier (a device-to-host copy unless the tier drops it at once). Caches start "
             "empty and warm on the warm-up tokens. Counts are experts per decode token, all layers together.", "",
             *body, *reading]
    results_dir.mkdir(parents=True, exist_ok=True)
    (out := results_dir / "replay_tiers.md").write_text("\n".join(lines) + "\n")
    return out


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
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR,
                        help="where --report, --tune and --prefetch-report write (default: "
                             "bench/results)")
    add_smoke_argument(parser)
    return parser.parse_args(argv)


def write_smoke_traces(data_dir: Path) -> Path:
    """`data_dir` holding the start of every vendored trace (SMOKE_SEQUENCES, SMOKE_TOKENS)."""
    data_dir.mkdir(parents=True)
    for name, file in TRACE_FILES.items():
        trace = load_trace(name)
        if name != "gptoss":
            np.save(data_dir / file, trace["expert_ids"][:2 * SMOKE_TOKENS])
            continue
        offsets, names = trace["seq_offsets"], trace["dataset"]
        keep = np.concatenate([np.flatnonzero(names == dataset)[:SMOKE_SEQUENCES] for dataset in np.unique(names)])
        keep.sort()
        rows = [trace["expert_ids"][offsets[i]:min(offsets[i + 1], offsets[i] + SMOKE_TOKENS)] for i in keep]
        np.savez(data_dir / file, expert_ids=np.concatenate(rows), dataset=names[keep],
                 seq_offsets=np.concatenate([[0], np.cumsum([len(r) for r in rows])]))
    return data_dir


def smoke(args, log) -> int:
    """Every mode on the start of each trace, written to and read from a temporary directory. Tuning there
    chooses other constants than the shipped ones, so the prefetch report skips that check."""
    with smoke_run(args) as directory:
        data_dir, results = write_smoke_traces(directory / "data"), directory / "results"
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
