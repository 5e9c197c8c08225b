"""Constants chosen on the GPT-OSS tuning split (mmlu* sequences) only: LFRU's decay and
recency weight, the ``lags`` predictor's weights and the ``best`` prefetch setting, and the
shipped cross-layer predictor table.

Each search returns its numbers; ``python -m bench.replay`` writes them as Markdown
(``--tune`` -> replay_tuning.md, ``--prefetch-report`` -> replay_prefetch.md) or saves the table
(``--fit-table``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from jmoe.offload.policies import LFRUPolicy, make_policy
from jmoe.offload.predictors import MultiLagPredictor, Predictor, make_predictor
from jmoe.traces.evaluation import precision_recall, predicted_sets
from jmoe.traces.load import (
    CROSSLAYER_TABLE,
    DATA_DIR,
    TRACE_FILES,
    TraceError,
    load_trace,
    sequence_rows,
    split_trace,
    tuning_sample,
)
from jmoe.traces.replay import PREFETCH_SETTINGS, replay

# What the "best" prefetch setting is tuned for (issue 7): the stall-free rate at C=8 of 32,
# with at most 1.5x the bytes demand LRU moves.
PREFETCH_TARGET = {"cache": 8, "stall_free_rate": 0.85, "bytes_vs_lru": 1.5}


def tune_lfru(progress=print, decays=(0.5, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999),
              recency_weights=(0.0, 0.25, 1.0, 4.0), caches=(6, 8, 12, 16), stride: int = 4,
              data_dir: Path = DATA_DIR) -> dict:
    """Grid-search LFRU's constants on GPT-OSS mmlu* sequences only (one in ``stride``, in
    file order, to keep the search in minutes).

    All grid points run in one replay: the trace's layers are tiled once per grid point and
    LFRU gets per-layer constants, so each tiled copy of a layer is an independent cache.
    Returns {"grid": {(decay, recency_weight): hit rate per cache}, "baselines": {"lru", "lfu":
    hit rate per cache}, "best": (decay, recency_weight) of the highest mean, "tokens",
    "caches", "stride"}.
    """
    trace = load_trace("gptoss", data_dir)
    ids = trace["expert_ids"][sequence_rows(trace, tuning_sample(trace, stride)[0])]
    num_layers, num_experts = ids.shape[1], trace["num_experts"]
    grid = [(d, w) for d in decays for w in recency_weights]
    tiled = np.tile(ids, (1, len(grid), 1))
    decay_rows = np.repeat([d for d, _ in grid], num_layers)
    weight_rows = np.repeat([w for _, w in grid], num_layers)
    rates = np.zeros((len(grid), len(caches)))
    for j, c in enumerate(caches):
        policy = LFRUPolicy(tiled.shape[1], num_experts, decay=decay_rows, recency_weight=weight_rows)
        layer_rates = np.array(replay(tiled, num_experts, c, policy)["layer_hit_rate"])
        rates[:, j] = layer_rates.reshape(len(grid), num_layers).mean(axis=1)
        progress(f"C={c}: best {100 * rates[:, j].max():.2f}% at {grid[int(rates[:, j].argmax())]}")
    results = {g: rates[i].tolist() for i, g in enumerate(grid)}
    baselines = {}
    for name in ["lru", "lfu"]:
        baselines[name] = [replay(ids, num_experts, c, make_policy(name, num_layers, num_experts))
                           ["hit_rate"] for c in caches]
    best = max(results, key=lambda k: np.mean(results[k]))
    return {"grid": results, "baselines": baselines, "best": best, "tokens": len(ids),
            "caches": tuple(caches), "stride": stride}


def tune_prefetch(progress=print, stride: int = 8, data_dir: Path = DATA_DIR) -> dict:
    """Choose the lags predictor's weights and "best"'s policy, threshold, gain and budget on
    GPT-OSS mmlu*.

    The predictor's tables are fitted on the mmlu* sequences not in the tuning sample (all but
    one in ``stride``); replays run on the sample (one in ``stride`` mmlu* sequences, file
    order). No held-out sequence is read. Weights: highest recall of the top 8. Policy,
    threshold, gain and budget: highest stall-free rate at the target's cache size with bytes
    moved <= the target's multiple of demand LRU's bytes on the same sample.
    """
    trace = load_trace("gptoss", data_dir)
    sample, rest = tuning_sample(trace, stride)
    ids = trace["expert_ids"][sequence_rows(trace, sample)].astype(np.int64)
    fit_ids = trace["expert_ids"][sequence_rows(trace, rest)].astype(np.int64)
    num_layers, num_experts, capacity = ids.shape[1], trace["num_experts"], PREFETCH_TARGET["cache"]
    fitted = make_predictor("lags").fit(fit_ids, num_experts)  # every lag the grid uses

    def lags(**kwargs) -> Predictor:
        return make_predictor("lags", **kwargs).copy_tables_from(fitted)

    weights = []
    for step_weights in ((1.0,), (0.7, 0.5, 0.3), (1.0, 0.5, 0.3)):
        for token_weight in (0.0, 0.3):
            for recency_weight, recency_decay in ((0.5, 0.95), (1.0, 0.9)):
                row = {"step_weights": step_weights, "token_weight": token_weight,
                       "recency_weight": recency_weight, "recency_decay": recency_decay}
                row["recall"] = precision_recall(predicted_sets(lags(**row), ids), ids)["recall"]
                weights.append(row)
                progress(f"lags {row}")
    chosen_weights = max(weights, key=lambda r: r["recall"])
    predictor_kwargs = {k: v for k, v in chosen_weights.items() if k != "recall"}
    lru = replay(ids, num_experts, capacity, make_policy("lru", num_layers, num_experts))
    grid = []
    for policy_name in ("lru", "lfru"):
        for min_score in (-np.inf, 0.0, 0.5):
            for min_gain in (0.0, 2.0, 3.0):
                r = replay(ids, num_experts, capacity,
                           make_policy(policy_name, num_layers, num_experts),
                           predictor=lags(min_score=min_score, **predictor_kwargs),
                           prefetch_budget=4, prefetch_min_gain=min_gain)
                row = {"policy": policy_name, "min_score": min_score, "min_gain": min_gain,
                       "budget": 4, "stall_free_rate": r["stall_free_rate"],
                       "bytes_vs_lru": r["bytes_moved"] / lru["bytes_moved"]}
                grid.append(row)
                progress(f"tune C={capacity} {row}")
    within = [r for r in grid if r["bytes_vs_lru"] <= PREFETCH_TARGET["bytes_vs_lru"]]
    chosen = max(within or grid, key=lambda r: r["stall_free_rate"])
    return {"tokens": len(ids), "fit_tokens": len(fit_ids), "stride": stride, "lru": lru,
            "weights": weights, "chosen_weights": chosen_weights, "grid": grid,
            "chosen": chosen}


def check_best_setting(tuned: dict) -> None:
    """Raise unless ``tune_prefetch``'s choice is what PREFETCH_SETTINGS["best"] and
    MultiLagPredictor's defaults hold (so that the shipped constants are the tuned ones)."""
    best = PREFETCH_SETTINGS["best"]
    chosen = tuned["chosen"]
    keys = ("policy", "min_score", "min_gain", "budget")
    defaults = {"step_weights": MultiLagPredictor.DEFAULT_STEP_WEIGHTS,
                "token_weight": MultiLagPredictor.DEFAULT_TOKEN_WEIGHT,
                "recency_weight": MultiLagPredictor.DEFAULT_RECENCY_WEIGHT,
                "recency_decay": MultiLagPredictor.DEFAULT_RECENCY_DECAY}
    chosen_weights = {k: v for k, v in tuned["chosen_weights"].items() if k != "recall"}
    if [chosen[k] for k in keys] != [best[k] for k in keys] or chosen_weights != defaults:
        raise TraceError(
            f"tuning chose {chosen} and {chosen_weights}, but PREFETCH_SETTINGS['best'] is "
            f"{best} and MultiLagPredictor's defaults are {defaults}: update them, then rerun "
            f"--prefetch-report"
        )


def fit_table(date: str, path: Path = CROSSLAYER_TABLE, data_dir: Path = DATA_DIR,
              command: str = "python -m bench.replay --fit-table") -> Path:
    """Fit the cross-layer table on the GPT-OSS mmlu* sequences and save it with provenance
    (the trace file's hash, the split, ``command`` and ``date``)."""
    trace = load_trace("gptoss", data_dir)
    split = split_trace(trace)
    source = Path(data_dir) / TRACE_FILES["gptoss"]
    predictor = make_predictor("crosslayer").fit(split["tune_ids"], trace["num_experts"])
    return predictor.save(
        path,
        source=f"bench/data/{source.name} (sha256 {hashlib.sha256(source.read_bytes()).hexdigest()})",
        split=split["tune_desc"],
        tokens=str(len(split["tune_ids"])),
        order="sequences concatenated in file order, as the replay reads them",
        command=command,
        date=date,
    )
