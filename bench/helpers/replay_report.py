"""The Markdown writers of ``python -m bench.replay --report`` (replay.md and replay_<trace>.png: every policy at
every cache size on each trace) and ``--tune`` (replay_tuning.md: LFRU's constants). The numbers come from
``jmoe.traces`` (``comparison.policy_grid``, ``tuning.tune_lfru``); this module words, tabulates and plots them.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np

from bench.helpers.common import RESULTS
from jmoe.offload.policies import LFRUPolicy
from jmoe.traces.comparison import policy_grid
from jmoe.traces.load import DATA_DIR, load_trace
from jmoe.traces.replay import POLICIES
from jmoe.traces.tuning import tune_lfru

REPORT_CACHES = {"gptoss": [4, 6, 8, 12, 16], "olmoe": [8, 16, 32], "kimi": [16, 32, 64]}
REPORT_DATE = "2026-11-21"


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


def report(results_dir: Path = RESULTS, progress=print, data_dir: Path = DATA_DIR) -> Path:
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


def tune(results_dir: Path = RESULTS, progress=print, data_dir: Path = DATA_DIR) -> Path:
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
