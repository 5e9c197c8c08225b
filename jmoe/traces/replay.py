"""Replay routing traces through an expert cache, with or without prefetch, and count hits.

Semantics (fixed, so that numbers are comparable):
  * one cache of C slots per MoE layer, empty at the start, kept warm across sequences taken in
    file order;
  * a token needs all its k experts resident at once: an access to an expert that was resident
    before the token is a hit, any other access a miss;
  * on a miss the policy's cache admits the expert, evicting, if no slot is free, the resident
    expert of lowest priority among those the token does not need (ties: lower expert id first;
    ``jmoe.offload.policies.choose_victims``, the engine's own rule);
  * a policy with ``admits_misses = False`` (static) starts with its pinned set loaded and serves
    misses from scratch without evicting;
  * bytes_moved counts experts copied to the device: one per miss (admitted or streamed), plus
    the initial load of a static cache.
The policies are the engine's (lru, lfu, lfru, static from ``jmoe.offload.policies``) plus
``belady``, the offline optimum (:class:`jmoe.traces.belady.BeladyOracle`): evict the expert
whose next use is farthest in the future (never used again first).

Prefetch (a predictor from ``jmoe.offload.predictors``, a setting of ``PREFETCH_SETTINGS``):
  * steps run in order (token t, layer 0 .. L-1, then token t + 1); while one step computes,
    the copies for the next step are issued: for layer l + 1 of the same token while layer l
    computes, and for layer 0 of token t + 1 between tokens. The predictor sees only routing
    already chosen (everything before the step, see ``predictors.step_before``), never the
    step's own experts; tables it learns come from the tuning split only;
  * before layer l of token t starts, the predictor's set for that step (at most ``count``
    experts with score >= ``min_score``) is compared with the layer's cache: up to B
    (``--prefetch-budget``, per layer and token; asserted) predicted, not-resident experts are
    copied in, highest score first, into free slots or over victims. Victims are resident
    experts outside the predicted set, lowest predictor score first (ties: lower id); no more
    experts are fetched than there are free slots plus such victims, and a copy over a victim
    is made only if its score beats the victim's by at least the setting's ``min_gain``;
  * then the layer starts: an access whose expert is not resident is a stall (it waits for a
    demand copy); stalls are admitted as above (policy eviction among experts the step does
    not need). ``stall_free_rate`` = accesses resident when their layer starts /
    accesses; ``hits``/``hit_rate`` count the same thing, so without prefetch
    ``stall_free_rate == hit_rate``;
  * the policy observes demand accesses only, once per token (a prefetched expert that is
    never used keeps its old priority, so demand misses evict it early);
  * ``bytes_moved`` counts every copy: demand copies (= stalls) + prefetches, in experts;
    ``prefetches_used`` counts prefetched experts the step they were fetched for then used;
  * only online policies that admit misses run with prefetch (belady needs the future, static
    never changes its slots). A setting may name its own policy (``best`` runs over lfru,
    tuned with it; the result then says so in ``note``); ``x LRU`` comparisons are always
    against demand LRU. Layers' caches are independent, so the replay applies a token's
    prefetches and accesses to all layers at once; this equals the step-by-step order above.

Data: see :mod:`jmoe.traces.load` (splits: tables and constants come from the tuning split,
results are reported on the rest).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from jmoe.offload.history_prefetch import BEST
from jmoe.offload.policies import CachePolicy, choose_victims, initial_residents, make_policy
from jmoe.offload.predictors import (
    Predictor,
    load_predictor,
    make_predictor,
    predictor_names,
    top_experts,
)
from jmoe.traces.belady import BeladyOracle
from jmoe.traces.load import (
    CROSSLAYER_TABLE,
    DATA_DIR,
    TraceError,
    check_trace,
    frequency_table,
    load_trace,
    split_trace,
)

POLICIES = ["lru", "lfu", "lfru", "static", "belady"]
# Prefetch settings by name: predictor, size of its predicted set (count), score threshold,
# budget (experts per layer and token), min_gain (a fetch's score over its victim's) and policy
# (the cache policy under prefetch; None = --policy). "best" was tuned on GPT-OSS mmlu* only
# (bench/results/replay_prefetch.md, "Tuning"); the others are untuned references.
PREFETCH_SETTINGS = {
    "previous": {"predictor": "previous", "count": 8, "min_score": 0.5, "budget": 2},
    "frequency": {"predictor": "frequency", "count": 8, "min_score": -np.inf, "budget": 2},
    "crosslayer": {"predictor": "crosslayer", "count": 8, "min_score": -np.inf, "budget": 2},
    "mix": {"predictor": "mix", "count": 8, "min_score": -np.inf, "budget": 2},
    "lags": {"predictor": "lags", "count": 8, "min_score": -np.inf, "budget": 2},
    "best": {"predictor": "lags", **BEST, "policy": "lfru"},  # the engine runs it too (prefetch_trace)
}


def check_cache(capacity: int, num_experts: int, top_k: int) -> None:
    if not top_k <= capacity <= num_experts:
        raise TraceError(
            f"cache size must be between k={top_k} (every token needs its {top_k} experts "
            f"resident at once) and E={num_experts} (experts per layer); found --cache "
            f"{capacity}: pass a value in [{top_k}, {num_experts}]"
        )


def check_prefetch(policy: CachePolicy, prefetch_budget: int) -> None:
    if policy.name == "belady" or not policy.admits_misses:
        raise TraceError(
            f"prefetch runs with an online policy that admits misses (lru, lfu, lfru); found "
            f"--policy {policy.name}: belady needs the future and static never changes its slots"
        )
    if not isinstance(prefetch_budget, (int, np.integer)) or prefetch_budget < 0:
        raise TraceError(
            f"expected a prefetch budget >= 0 (experts per layer and token), found "
            f"--prefetch-budget {prefetch_budget}"
        )


def replay(
    expert_ids: np.ndarray,
    num_experts: int,
    capacity: int,
    policy: CachePolicy,
    chunk: int = 2048,
    predictor: Predictor | None = None,
    prefetch_budget: int = 0,
    prefetch_min_gain: float = 0.0,
) -> dict:
    """Run one policy over a trace ``expert_ids`` [T, L, k]; returns counts (see module doc).

    The policy must be fresh (its clock is advanced once per token). With a fitted
    ``predictor``, up to ``prefetch_budget`` predicted experts per layer and token are copied in
    before the layer starts, each only if its score beats its victim's by ``prefetch_min_gain``
    (module doc, "Prefetch").
    """
    expert_ids = check_trace(expert_ids, num_experts)
    num_tokens, num_layers, top_k = expert_ids.shape
    check_cache(capacity, num_experts, top_k)
    if policy.shape != (num_layers, num_experts):
        raise TraceError(
            f"policy {policy.name!r} is for [layers, experts] = {list(policy.shape)}, "
            f"the trace has {[num_layers, num_experts]}"
        )
    if predictor is not None:
        check_prefetch(policy, prefetch_budget)
    prefetches_per_layer = np.zeros(num_layers, dtype=np.int64)
    prefetches_used = 0
    if policy.admits_misses:
        resident = np.zeros((num_layers, num_experts), dtype=bool)
        bytes_moved = 0
    else:
        resident = initial_residents(policy.priority(), capacity)
        bytes_moved = int(resident.sum())  # the pinned set has to be copied in once
    preload = bytes_moved
    resident_count = resident.sum(axis=1)
    misses_per_layer = np.zeros(num_layers, dtype=np.int64)
    layer_rows = np.arange(num_layers)[None, :, None]
    for start in range(0, num_tokens, chunk):
        block = expert_ids[start : start + chunk]
        needed_block = np.zeros((len(block), num_layers, num_experts), dtype=np.uint8)
        needed_block[np.arange(len(block))[:, None, None], layer_rows, block] = 1
        if predictor is not None:
            history = expert_ids[max(0, start - predictor.context) : start]
            scores = predictor.scores(block, history)
            predicted_block = top_experts(scores, predictor.count, predictor.min_score)
            # Experts in descending score order (ties: lower id), per (token, layer).
            order_block = np.argsort(-scores, axis=2, kind="stable")
        for i, counts in enumerate(needed_block):
            needed = counts.view(bool)
            if predictor is not None:
                fetched = prefetch_step(scores[i], predicted_block[i], order_block[i],
                                        resident, resident_count, capacity, prefetch_budget,
                                        prefetch_min_gain)
                if fetched is not None:
                    n_fetched = fetched.sum(axis=1)
                    assert (n_fetched <= prefetch_budget).all(), "prefetch bound exceeded"
                    prefetches_per_layer += n_fetched
                    prefetches_used += int((fetched & needed).sum())
                    resident_count = resident.sum(axis=1)
            missed = needed & ~resident
            n_missed = missed.sum(axis=1)
            misses_per_layer += n_missed
            if policy.admits_misses and n_missed.any():
                n_evict = n_missed - (capacity - resident_count)
                np.maximum(n_evict, 0, out=n_evict)
                if n_evict.any():
                    resident &= ~choose_victims(policy.priority(), resident, needed, n_evict)
                resident |= needed
                resident_count = resident.sum(axis=1)
            policy.observe(counts)
    accesses_per_layer = num_tokens * top_k
    misses = int(misses_per_layer.sum())
    accesses = num_tokens * num_layers * top_k
    prefetches = int(prefetches_per_layer.sum())
    result = {
        "tokens": int(num_tokens),
        "layers": int(num_layers),
        "experts": int(num_experts),
        "top_k": int(top_k),
        "cache": int(capacity),
        "policy": policy.name,
        "accesses": int(accesses),
        "hits": accesses - misses,
        "misses": misses,
        "hit_rate": (accesses - misses) / accesses,
        "stall_free_rate": (accesses - misses) / accesses,
        "bytes_moved": bytes_moved + misses + prefetches,
        "initial_load": preload,
        "layer_hit_rate": [1.0 - m / accesses_per_layer for m in misses_per_layer.tolist()],
    }
    if predictor is not None:
        result.update({
            "prefetch": predictor.name,
            "prefetch_budget": int(prefetch_budget),
            "prefetch_min_gain": float(prefetch_min_gain),
            "prefetches": prefetches,
            "prefetches_used": prefetches_used,
            "demand_copies": misses,
            "layer_prefetches": prefetches_per_layer.tolist(),
        })
    return result


def prefetch_step(scores: np.ndarray, predicted: np.ndarray, order: np.ndarray,
                  resident: np.ndarray, resident_count: np.ndarray, capacity: int,
                  budget: int, min_gain: float = 0.0) -> np.ndarray | None:
    """Copy predicted experts into every layer's cache before the layer starts (in place).

    scores: float [L, E], the predictor's scores for the coming step; predicted: bool [L, E],
    its predicted set; order: int [L, E], experts by descending score. Per layer, the
    not-resident predicted experts of highest score are fetched, at most ``budget``. Free slots
    are filled first; then the i-th further fetch replaces the i-th lowest-scored resident
    expert outside the predicted set (ties: lower id; ``choose_victims``), and is made only if
    its score exceeds that victim's by at least ``min_gain`` (a swap between near-equal guesses
    costs a copy and wins little). Returns bool [L, E] of the fetched experts, or None.
    """
    wanted = predicted & ~resident
    free = capacity - resident_count[:, None]
    evictable = resident & ~predicted
    wanted_by_score = np.take_along_axis(wanted, order, axis=1)
    rank = np.cumsum(wanted_by_score, axis=1)  # 1-based rank among wanted, by descending score
    room = rank <= free + evictable.sum(axis=1, keepdims=True)
    victim_scores = np.sort(np.where(evictable, scores, np.inf), axis=1)  # lowest first
    victim = np.take_along_axis(victim_scores, np.clip(rank - free - 1, 0, None), axis=1)
    gain = np.where(rank <= free, np.inf, np.take_along_axis(scores, order, axis=1) - victim)
    # Candidates' scores fall and victims' rise with rank, so the passing fetches are a prefix.
    n_fetch = (wanted_by_score & (rank <= budget) & room & (gain >= min_gain)).sum(axis=1)
    if not n_fetch.any():
        return None
    take = wanted_by_score & (rank <= n_fetch[:, None])
    fetched = np.zeros_like(wanted)
    np.put_along_axis(fetched, order, take, axis=1)
    n_evict = np.maximum(n_fetch - free[:, 0], 0)
    if n_evict.any():
        resident &= ~choose_victims(scores, resident, predicted, n_evict)
    resident |= fetched
    return fetched


def build_policy(name: str, split: dict, num_experts: int, **lfru_kwargs) -> CachePolicy:
    """A fresh policy for replaying ``split["eval_ids"]``."""
    num_layers = split["eval_ids"].shape[1]
    if name == "belady":
        return BeladyOracle(split["eval_ids"], num_experts)
    if name == "static":
        return make_policy("static", num_layers, num_experts,
                           frequency=frequency_table(split["tune_ids"], num_experts))
    if name == "lfru":
        return make_policy("lfru", num_layers, num_experts, **lfru_kwargs)
    try:
        return make_policy(name, num_layers, num_experts)
    except ValueError as err:
        raise TraceError(f"{err}; for --policy use one of {', '.join(POLICIES)}") from None


def build_predictor(setting: str, trace: dict, split: dict, table: Path = CROSSLAYER_TABLE,
                    **overrides) -> Predictor:
    """A fitted predictor for the prefetch ``setting`` (a key of PREFETCH_SETTINGS).

    Tables come from the tuning split only: for gptoss crosslayer and mix the shipped mmlu*
    ``table``, otherwise a fit on ``split["tune_ids"]``. ``overrides`` replace constructor
    arguments (count, min_score, recency_weight, ...).
    """
    if setting not in PREFETCH_SETTINGS:
        raise TraceError(
            f"unknown prefetch setting {setting!r} for --prefetch; expected one of "
            f"{', '.join(PREFETCH_SETTINGS)}"
        )
    spec = PREFETCH_SETTINGS[setting]
    kwargs = {"count": spec["count"], "min_score": spec["min_score"], **overrides}
    if trace["name"] == "gptoss" and spec["predictor"] in ("crosslayer", "mix"):
        predictor = load_predictor(table, spec["predictor"], **kwargs)
        if predictor.provenance.get("split") != split["tune_desc"]:
            raise TraceError(
                f"{table} was fitted on {predictor.provenance.get('split')!r}, "
                f"expected {split['tune_desc']!r}: rerun python -m bench.replay --fit-table"
            )
        return predictor
    return make_predictor(spec["predictor"], **kwargs).fit(split["tune_ids"], trace["num_experts"])


def run_one(trace_name: str, capacity: int, policy_name: str, datasets: list[str] | None = None,
            trace: dict | None = None, prefetch: str | None = None,
            prefetch_budget: int | None = None, data_dir: Path = DATA_DIR,
            **lfru_kwargs) -> dict:
    """Replay the report split of one trace (loaded from ``data_dir`` unless ``trace`` is given)
    with one policy and, optionally, one prefetch setting; returns ``replay``'s counts plus what
    was run on what (trace, model, evaluated_on, seconds, ...)."""
    if policy_name not in POLICIES:
        raise TraceError(
            f"unknown policy {policy_name!r} for --policy; expected one of {', '.join(POLICIES)}"
        )
    if prefetch is not None and prefetch not in PREFETCH_SETTINGS:
        raise TraceError(
            f"unknown prefetch setting {prefetch!r} for --prefetch; expected one of "
            f"{', '.join(PREFETCH_SETTINGS)} (predictors: {', '.join(predictor_names())})"
        )
    requested_policy = policy_name
    if prefetch is not None and PREFETCH_SETTINGS[prefetch].get("policy"):
        policy_name = PREFETCH_SETTINGS[prefetch]["policy"]  # tuned together with the predictor
    trace = trace if trace is not None else load_trace(trace_name, data_dir)
    split = split_trace(trace, datasets)
    num_experts = trace["num_experts"]
    check_cache(capacity, num_experts, split["eval_ids"].shape[2])
    if len(split["eval_ids"]) == 0:
        raise TraceError("the selected sequences hold no tokens; choose other --datasets")
    policy = build_policy(policy_name, split, num_experts, **lfru_kwargs)
    predictor = None
    if prefetch is not None:
        if prefetch_budget is None:
            prefetch_budget = PREFETCH_SETTINGS[prefetch]["budget"]
        check_prefetch(policy, prefetch_budget)
        predictor = build_predictor(prefetch, trace, split,
                                    table=Path(data_dir) / CROSSLAYER_TABLE.name)
    began = time.perf_counter()
    min_gain = PREFETCH_SETTINGS[prefetch].get("min_gain", 0.0) if prefetch else 0.0
    result = replay(split["eval_ids"], num_experts, capacity, policy, predictor=predictor,
                    prefetch_budget=prefetch_budget or 0, prefetch_min_gain=min_gain)
    if predictor is not None:
        result["prefetch"] = prefetch
        result["predictor"] = repr(predictor)
    if policy_name != requested_policy:
        result["note"] = (f"prefetch setting {prefetch!r} runs over its own cache policy "
                          f"{policy_name} (tuned with it), not --policy {requested_policy}")
    result["seconds"] = round(time.perf_counter() - began, 2)
    result["trace"] = trace_name
    result["model"] = trace["model"]
    result["evaluated_on"] = split["eval_desc"]
    if policy_name == "static":
        result["static_table_from"] = split["tune_desc"]
        if split["overlap"]:
            result["warning"] = ("the static table comes from sequences that are also being "
                                 "reported on: this number is not a held-out result")
    if policy_name == "lfru":
        result["lfru"] = {"decay": policy.decay, "recency_weight": policy.recency_weight}
    return result
