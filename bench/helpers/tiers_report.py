"""The Markdown writer of ``python -m bench.replay --tiers-report`` (replay_tiers.md: device slots above a host RAM
tier above the disk, on each trace). The numbers come from ``jmoe.traces.comparison.tier_comparison``; this module
words and tabulates them.
"""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

from bench.helpers.common import measured_commit
from bench.helpers.replay_report import REPORT_CACHES
from jmoe.offload.policies import LFRUPolicy
from jmoe.traces.comparison import tier_comparison
from jmoe.traces.load import DATA_DIR, load_trace
from jmoe.traces.tiers import RELATIONS

TIER_READ_AHEAD = [1, 4]  # read-ahead budgets the tiers report shows (disk reads per layer and step)


def cpu_model() -> str:
    """The CPU model from /proc/cpuinfo (Linux) and the CPUs visible."""
    names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
    return f"{names[0] if names else 'unknown CPU'}, {os.cpu_count()} CPUs visible (/proc/cpuinfo), shared"


def tiers_report(results_dir: Path, traces: list[str], progress=print, data_dir: Path = DATA_DIR) -> Path:
    """``jmoe.traces.comparison.tier_comparison`` on each trace -> replay_tiers.md."""
    began, load = time.perf_counter(), open("/proc/loadavg").read().split()[:3]
    per_token = lambda r, key="disk_reads": r[f"{key}_per_token"]  # noqa: E731
    used = lambda r: (f"{100 * r['read_ahead_used'] / r['read_ahead_reads']:.0f}%"  # noqa: E731
                      if r["read_ahead_reads"] else "none")
    same = lambda pairs: f"{sum(a == b for a, b in pairs)} of {len(pairs)}"  # noqa: E731
    body, reading = [], ["## Reading (computed from the tables)", ""]
    for name in traces:
        caches = REPORT_CACHES[name]
        compared = tier_comparison(load_trace(name, data_dir), caches, TIER_READ_AHEAD, data_dir)
        rows, got, hosts, grid, warmup = (compared[key] for key in ("rows", "by_config", "hosts", "grid", "warmup"))
        first = rows[0]
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
        c, h = caches[len(caches) // 2], hosts[1]
        exc, rel = got[(c, h, "exclusive", 0)], "inclusive" if h >= c else "exclusive"
        line = (f"- {first['model']}: disk reads (exact counts, no read-ahead) of inclusive at H equal the misses of a "
                f"one-level cache of H slots in {same(compared['one_level'])} cells; exclusive at H equals inclusive "
                f"at H + C in {same(compared['twins'])}. At C={c}, H={h}: inclusive {cell(c, h, 'inclusive', 0)}, "
                f"exclusive {per_token(exc):.2f} disk reads per token, for {per_token(exc, 'device_to_host'):.2f} "
                f"device-to-host copies per token (host-to-device: {per_token(exc, 'host_to_device'):.2f})")
        for x in (got[(c, h, rel, r)] for r in TIER_READ_AHEAD):
            line += (f"; {rel}, R={x['read_ahead']}: demand {per_token(x):.2f}, "
                     f"all {per_token(x, 'disk_reads_total'):.2f}")
        reading.append(line + ".")
    lines = ["# Device, host RAM and disk: two-level expert caches replayed on real routing traces", "",
             "- command: `python -m bench.replay --tiers-report` (one run: `python -m bench.replay --trace gptoss "
             "--cache 8 --host-cache 16 --tier exclusive --read-ahead 1 --json`)",
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
