"""The held-out comparisons behind the replay reports, as numbers (``python -m bench.replay`` words them).

- :func:`policy_grid`: every cache policy at every cache size on one trace (replay.md);
- :func:`setting_quality`: precision and recall of every prefetch setting's predictor;
- :func:`prefetch_grid`: demand policies and every prefetch setting at every cache size, and
  :func:`target_verdict`: whether ``best`` meets ``PREFETCH_TARGET`` (replay_prefetch.md);
- :func:`tier_comparison`: the two-level replay over a report's grid and the equalities its exact counts
  show (replay_tiers.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jmoe.traces.evaluation import precision_recall, predicted_sets
from jmoe.traces.load import DATA_DIR, split_trace
from jmoe.traces.replay import POLICIES, PREFETCH_SETTINGS, build_predictor, run_one
from jmoe.traces.tiers import run_tiers, tier_grid
from jmoe.traces.tuning import PREFETCH_TARGET

TIERS_WARMUP = 2048  # tokens at the end of the tuning split replayed before the tiers grid, uncounted


def policy_grid(trace: dict, caches: list[int], progress=print) -> list[dict]:
    """``run_one`` results of every policy in POLICIES at every cache size, cache-major."""
    rows = []
    for c in caches:
        for policy_name in POLICIES:
            r = run_one(trace["name"], c, policy_name, trace=trace)
            progress(f"{trace['name']} C={c} {policy_name}: hit rate {r['hit_rate']:.4f} "
                     f"({r['seconds']} s)")
            rows.append(r)
    return rows


def setting_quality(trace: dict, split: dict, progress=print) -> dict:
    """{setting: precision_recall of its predictor on ``split["eval_ids"]``} for PREFETCH_SETTINGS."""
    ids = split["eval_ids"].astype(np.int64)
    quality = {}
    for name in PREFETCH_SETTINGS:
        predictor = build_predictor(name, trace, split)
        quality[name] = precision_recall(predicted_sets(predictor, ids), ids)
        progress(f"{name}: precision {quality[name]['precision']:.4f} recall "
                 f"{quality[name]['recall']:.4f}")
    return quality


def prefetch_grid(trace: dict, caches: list[int], progress=print) -> dict:
    """{(cache, name): run_one result} for demand lru, lfru, belady and every prefetch setting
    (over lru, unless the setting names its own policy)."""
    rows = {}
    for c in caches:
        for policy_name in ("lru", "lfru", "belady"):
            rows[(c, policy_name)] = run_one(trace["name"], c, policy_name, trace=trace)
        for name in PREFETCH_SETTINGS:
            rows[(c, name)] = run_one(trace["name"], c, "lru", trace=trace, prefetch=name)
            progress(f"C={c} prefetch {name}: stall-free {rows[(c, name)]['stall_free_rate']:.4f}"
                     f" ({rows[(c, name)]['seconds']} s)")
    return rows


def target_verdict(rows: dict) -> dict:
    """At PREFETCH_TARGET's cache size: ``best``'s result, its bytes as a multiple of demand LRU's
    (``ratio``), whether it meets the target (``met``), and the (stall-free rate, setting) pairs
    of every setting within the target's bytes (``candidates``)."""
    c = PREFETCH_TARGET["cache"]
    hit = rows[(c, "best")]
    lru_bytes = rows[(c, "lru")]["bytes_moved"]
    ratio = hit["bytes_moved"] / lru_bytes
    met = (hit["stall_free_rate"] >= PREFETCH_TARGET["stall_free_rate"]
           and ratio <= PREFETCH_TARGET["bytes_vs_lru"])
    candidates = [(rows[(c, n)]["stall_free_rate"], n) for n in PREFETCH_SETTINGS
                  if rows[(c, n)]["bytes_moved"] <= PREFETCH_TARGET["bytes_vs_lru"] * lru_bytes]
    return {"cache": c, "best": hit, "ratio": ratio, "met": met, "candidates": candidates}


def tier_comparison(trace: dict, caches: list[int], read_ahead: list[int], data_dir: Path = DATA_DIR) -> dict:
    """``run_tiers`` over ``tier_grid(caches, E, read_ahead)`` on one trace after up to TIERS_WARMUP warm-up
    tokens, and the two equalities its exact counts (no read-ahead) should show, as (count, count it should
    equal) pairs: inclusive at H reads from disk what a one-level cache of H slots misses (``one_level``), and
    exclusive at H what inclusive at H + C reads (``twins``).
    Returns {"rows": the results, "by_config": {(C, H, relation, read_ahead): result}, "hosts": exclusive's H
    sizes, "grid": every (C, H), "warmup", "one_level", "twins"}."""
    warmup = min(TIERS_WARMUP, len(split_trace(trace)["tune_ids"]))
    rows = run_tiers(trace["name"], tier_grid(caches, trace["num_experts"], read_ahead), trace=trace,
                     warmup=warmup, data_dir=data_dir)
    by_config = {(r["cache"], r["host_cache"], r["relation"], r["read_ahead"]): r for r in rows}
    hosts = sorted({r["host_cache"] for r in rows if r["relation"] == "exclusive"})
    grid = [(c, h) for c in caches for h in hosts]
    misses = {r["cache"]: r["host_to_device"] for r in rows}  # a one-level cache of C slots
    one_level = [(r["disk_reads"], misses[r["host_cache"]]) for r in rows if r["relation"] == "inclusive"
                 and not r["read_ahead"] and r["host_cache"] in misses]
    twins = [(by_config[(c, h, "exclusive", 0)]["disk_reads"], by_config[(c, h + c, "inclusive", 0)]["disk_reads"])
             for c, h in grid if (c, h + c, "inclusive", 0) in by_config]
    return {"rows": rows, "by_config": by_config, "hosts": hosts, "grid": grid, "warmup": warmup,
            "one_level": one_level, "twins": twins}
