"""The held-out comparisons behind the replay reports, as numbers (``bench/replay.py`` writes them).

- :func:`policy_grid`: every cache policy at every cache size on one trace (replay.md);
- :func:`setting_quality`: precision and recall of every prefetch setting's predictor;
- :func:`prefetch_grid`: demand policies and every prefetch setting at every cache size, and
  :func:`target_verdict`: whether ``best`` meets ``PREFETCH_TARGET`` (replay_prefetch.md).
"""

from __future__ import annotations

import numpy as np

from jmoe.traces.evaluation import precision_recall, predicted_sets
from jmoe.traces.replay import POLICIES, PREFETCH_SETTINGS, build_predictor, run_one
from jmoe.traces.tuning import PREFETCH_TARGET


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
