"""Two-level expert cache replay: device slots above a host-RAM tier above the checkpoint on disk.

Issue #31: with a host budget only H experts per MoE layer stay in pinned host RAM; the others
are read from the checkpoint files (by byte range). This module replays routing traces through
both levels so the relation between them is chosen on data.

Semantics (per MoE layer; layers are independent, a token is applied to all of them at once as
in :mod:`jmoe.traces.replay`, whose device level this is exactly):

* Device: C slots, empty at the start, demand-filled: an access to an expert resident before
  the token is a **device hit**; a miss is admitted, evicting the lowest-priority resident expert
  the token does not need (``jmoe.offload.policies.eviction_ranking``, ties: lower id). The device
  level never depends on the host level, so device hits equal ``replay``'s hits for the same
  policy and C, whatever H, relation or read-ahead.
* Host: at most H experts, empty at the start. A device miss whose expert is in the host tier is
  a **host hit** (one host-to-device copy); otherwise it is a **disk read** (demand: the step
  waits for it). Host victims are chosen by the host policy's priority with the same rule.
* Disk: the checkpoint holds every expert at all times, so dropping an expert from the host
  tier costs nothing (no write-back).
* ``inclusive``: every expert in a device slot is also in the host tier (needs H >= C). A disk
  read fills the host tier, then the device (disk -> host -> device). A device eviction leaves
  the host copy, so it moves no bytes. The host tier never evicts an expert that is in a device
  slot; it holds at most H distinct experts, device ones included.
* ``exclusive``: device and host tier are disjoint; together they hold up to C + H distinct
  experts. A host hit moves the expert up (its host slot is freed); a disk read goes to the device
  through a staging buffer, not into the tier. Every device eviction **demotes** its victim into
  the host tier; the tier then drops its lowest-priority experts (the demoted ones included) to
  stay within H. A demoted expert the tier keeps costs a device-to-host copy (``device_to_host``);
  one it drops at once is not copied (the manager knows both choices before it copies).
* Policies: ``policy`` ranks the device, ``host_policy`` (same kinds; None = the device policy's
  ranking) the host tier. Both observe every demand access once per token (the manager sees the
  whole routing either way). Policies that do not admit misses (static) are refused.

Two equalities follow (exact counts; tests/test_replay_tiers.py checks them for lru, lfu, lfru and
belady, and the report on every trace cell): with one ranking for both levels and no read-ahead,
an inclusive tier of H reads from disk exactly what a one-level cache of H slots misses (``replay``
at C = H: the device's experts are always among those H, so the inclusion never binds), and an
exclusive tier of H reads exactly what an inclusive tier of H + C reads (device + tier hold the same
experts once the device is full, and before it is full nothing is dropped).

Read-ahead (``read_ahead`` R > 0, a fitted history predictor from ``replay.build_predictor``):
before each step, the predictor's set for that step (at most ``count`` experts with score >=
``min_score``; it sees only routing before the step, ``predictors.step_before``) is compared with
both levels; up to R predicted experts that are in neither are read from disk into the host tier,
highest score first, into free host slots or over victims: host experts outside the predicted set
and (inclusive) not in a device slot, lowest host-policy priority first. No more are read than
there are free slots plus such victims. The read is issued one step (one layer's compute) ahead,
the lead the predictor is made for; a disk's latency may need a longer lead, so these counts are
what the predictor can know, not what a disk can hide. Counts: ``read_ahead_reads`` = reads
issued; ``read_ahead_used`` = demand disk reads avoided (a device miss found a read-ahead expert
in the host tier, never accessed since its read); ``read_ahead_wasted`` = read-ahead experts
dropped from the host tier before any access (their bytes bought nothing);
``read_ahead_pending`` = still unused at the end. reads = used + wasted + pending.

Counts (over the counted tokens, every layer; per_token = / tokens):
``device_hits + host_hits + disk_reads = accesses``; ``host_to_device`` = device misses (each is
one copy up, from the tier or from the staging buffer); ``device_to_host`` = demotions
kept by the tier (exclusive; 0 inclusive); ``disk_reads_total`` = demand disk reads + read-ahead reads (what the
disk delivers); ``host_evictions`` = experts dropped from the tier; ``first_uses`` = accesses to
a (layer, expert) never accessed before, a floor on ``disk_reads_total`` no policy can beat. With
``expert_bytes``, ``*_bytes`` multiply those by one expert's bytes. ``warmup`` replays that many
leading tokens first without counting them (caches and policies warm; read-ahead experts still
unused then count as plain host contents).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jmoe.offload.policies import CachePolicy, choose_victims
from jmoe.offload.predictors import Predictor, top_experts
from jmoe.traces.load import DATA_DIR, TraceError, check_trace, load_trace, split_trace
from jmoe.traces.replay import (CROSSLAYER_TABLE, POLICIES, build_policy, build_predictor,
                                check_cache, check_prefetch)

RELATIONS = ("inclusive", "exclusive")
_COUNTS = ("disk_reads", "read_ahead_reads", "read_ahead_used", "read_ahead_wasted", "host_evictions",
           "device_to_host")


@dataclass(frozen=True)
class TierConfig:
    """One two-level cache: ``cache`` device slots and ``host_cache`` host experts per layer, their
    ``relation`` (inclusive or exclusive) and the read-ahead budget (disk reads per layer and step)."""

    cache: int
    host_cache: int
    relation: str = "inclusive"
    read_ahead: int = 0


def check_config(config: TierConfig, num_experts: int, top_k: int) -> None:
    check_cache(config.cache, num_experts, top_k)
    if config.relation not in RELATIONS:
        raise TraceError(f"unknown tier relation {config.relation!r} for --tier; expected one of "
                         f"{', '.join(RELATIONS)}")
    if not 0 <= config.host_cache <= num_experts:
        raise TraceError(f"host tier size must be between 0 and E={num_experts} experts per layer; found "
                         f"--host-cache {config.host_cache}")
    if config.relation == "inclusive" and config.host_cache < config.cache:
        raise TraceError(f"an inclusive host tier holds every device expert, so it needs H >= C; found "
                         f"--host-cache {config.host_cache} < --cache {config.cache}: raise H or use "
                         f"--tier exclusive")
    if not isinstance(config.read_ahead, (int, np.integer)) or config.read_ahead < 0:
        raise TraceError(f"expected a read-ahead budget >= 0 (disk reads per layer and step), found "
                         f"--read-ahead {config.read_ahead}")


def _victims(priority: np.ndarray, candidate: np.ndarray, count: np.ndarray) -> np.ndarray:
    """bool like ``candidate`` [..., L, E]: per row the first ``count`` [..., L] candidates in the engine's
    eviction order (``choose_victims`` over the rows that evict; ``priority`` [L, E] is every row's)."""
    rows = (count > 0).reshape(-1)
    num_experts = candidate.shape[-1]
    flat = candidate.reshape(-1, num_experts)
    victims = np.zeros(flat.shape, dtype=bool)
    victims[rows] = choose_victims(np.broadcast_to(priority, candidate.shape).reshape(-1, num_experts)[rows],
                                   flat[rows], np.zeros_like(flat[rows]), count.reshape(-1)[rows])
    return victims.reshape(candidate.shape)


def replay_tiers_grid(expert_ids: np.ndarray, num_experts: int, configs: list[TierConfig],
                      policy: CachePolicy, host_policy: CachePolicy | None = None,
                      predictor: Predictor | None = None, expert_bytes: int | None = None,
                      warmup: int = 0, chunk: int = 2048, check: bool = False) -> list[dict]:
    """Replay ``expert_ids`` [T, L, k] through every two-level cache of ``configs`` at once (one
    pass: the policies' state depends on the routing only, so one fresh ``policy`` and
    ``host_policy`` serve every config); returns one dict of counts per config (module doc).

    ``predictor``: fitted, needed by configs with ``read_ahead > 0``. ``check``: assert the
    relations' invariants after every token (tests)."""
    expert_ids = check_trace(expert_ids, num_experts)
    num_tokens, num_layers, top_k = expert_ids.shape
    if not configs:
        raise TraceError("expected at least one tier configuration")
    for config in configs:
        check_config(config, num_experts, top_k)
    if expert_bytes is not None and (not isinstance(expert_bytes, (int, np.integer)) or expert_bytes <= 0):
        raise TraceError(f"expected a positive expert size in bytes, found --expert-bytes {expert_bytes}")
    if not 0 <= warmup < num_tokens:
        raise TraceError(f"expected 0 <= warm-up tokens < {num_tokens} (the trace's tokens), found {warmup}")
    shared = host_policy is None or host_policy is policy
    for p in (policy,) if shared else (policy, host_policy):
        if not p.admits_misses:
            raise TraceError(f"the tiers replay runs policies that admit misses ({', '.join(POLICIES[:3])}, "
                             f"belady); found {p.name}")
        if p.shape != (num_layers, num_experts):
            raise TraceError(f"policy {p.name!r} is for [layers, experts] = {list(p.shape)}, the trace has "
                             f"{[num_layers, num_experts]}")
    budget = np.array([c.read_ahead for c in configs])
    reading = bool(budget.any())
    if reading:
        if predictor is None:
            raise TraceError("read-ahead needs a fitted predictor (replay.build_predictor)")
        for p in (policy,) if shared else (policy, host_policy):
            check_prefetch(p, 0)
    caches = sorted({c.cache for c in configs})
    cache_of = np.array([caches.index(c.cache) for c in configs])  # config -> device state row
    capacity = np.array(caches)[:, None]  # [nC, 1]
    host_capacity = np.array([c.host_cache for c in configs])[:, None]  # [G, 1]
    inclusive = np.array([c.relation == "inclusive" for c in configs])[:, None, None]
    budget = budget[:, None]
    shape = (len(configs), num_layers, num_experts)
    device = np.zeros((len(caches), num_layers, num_experts), dtype=bool)
    host = np.zeros(shape, dtype=bool)
    ahead = np.zeros(shape, dtype=bool)  # read ahead into the host tier, not accessed since
    seen = np.zeros((num_layers, num_experts), dtype=bool)
    device_misses = np.zeros(len(caches), dtype=np.int64)
    first_uses = 0
    counts = {name: np.zeros(len(configs), dtype=np.int64) for name in _COUNTS}
    layer_rows = np.arange(num_layers)[None, :, None]
    for start in range(0, num_tokens, chunk):
        block = expert_ids[start : start + chunk]
        needed_block = np.zeros((len(block), num_layers, num_experts), dtype=np.uint8)
        needed_block[np.arange(len(block))[:, None, None], layer_rows, block] = 1
        if reading:
            scores = predictor.scores(block, expert_ids[max(0, start - predictor.context) : start])
            predicted_block = top_experts(scores, predictor.count, predictor.min_score)
            # The same set as ids by descending score (top_experts' order), each flagged if predicted.
            top_block = np.argsort(-scores, axis=2, kind="stable")[..., : predictor.count]
            valid_block = np.take_along_axis(predicted_block, top_block, axis=2)
        for i, step_counts in enumerate(needed_block):
            if start + i == warmup:
                device_misses[:] = first_uses = 0
                for value in counts.values():
                    value[:] = 0
                ahead[:] = False
            needed = step_counts.view(bool)
            device_priority = policy.priority()
            host_priority = device_priority if shared else host_policy.priority()
            on_device = device[cache_of]
            if reading:
                _read_ahead(predicted_block[i], top_block[i], valid_block[i], on_device, host, ahead, host_capacity,
                            budget, host_priority, counts)
            # The device level (per distinct C).
            missed = needed & ~device
            n_missed = missed.sum(axis=2)
            device_misses += n_missed.sum(axis=1)
            n_evict = np.maximum(n_missed + device.sum(axis=2) - capacity, 0)
            if n_evict.any():
                demoted = _victims(device_priority, device & ~needed, n_evict)
                device &= ~demoted
            else:
                demoted = np.zeros_like(device)
            device |= needed
            # The host level (per config).
            disk = needed & ~on_device & ~host
            counts["disk_reads"] += disk.sum(axis=(1, 2))
            if reading:
                counts["read_ahead_used"] += (needed & ahead).sum(axis=(1, 2))
                ahead &= ~needed
            host = np.where(inclusive, host | needed, (host & ~needed) | demoted[cache_of])
            n_drop = np.maximum(host.sum(axis=2) - host_capacity, 0)
            if n_drop.any():
                dropped = _victims(host_priority, host & ~device[cache_of], n_drop)
                counts["host_evictions"] += n_drop.sum(axis=1)
                counts["read_ahead_wasted"] += (dropped & ahead).sum(axis=(1, 2))
                ahead &= ~dropped
                host &= ~dropped
            if n_evict.any():  # exclusive: a victim the tier keeps is copied down; one it drops at once is not
                counts["device_to_host"] += (host & demoted[cache_of] & ~inclusive).sum(axis=(1, 2))
            first_uses += int((needed & ~seen).sum())
            seen |= needed
            policy.observe(step_counts)
            if not shared:
                host_policy.observe(step_counts)
            if check:
                _check_invariants(device[cache_of], host, ahead, inclusive, capacity[cache_of], host_capacity)
    tokens = num_tokens - warmup
    results = []
    for g, config in enumerate(configs):
        c = cache_of[g]
        row = {name: int(value[g]) for name, value in counts.items()}
        accesses = tokens * num_layers * top_k
        row.update({
            "tokens": int(tokens), "warmup": int(warmup), "layers": int(num_layers),
            "experts": int(num_experts), "top_k": int(top_k), "cache": config.cache,
            "host_cache": config.host_cache, "relation": config.relation, "read_ahead": int(config.read_ahead),
            "policy": policy.name, "host_policy": (policy if shared else host_policy).name,
            "accesses": accesses, "device_hits": accesses - int(device_misses[c]),
            "host_hits": int(device_misses[c]) - row["disk_reads"],
            "host_to_device": int(device_misses[c]),
            "read_ahead_pending": row["read_ahead_reads"] - row["read_ahead_used"] - row["read_ahead_wasted"],
            "disk_reads_total": row["disk_reads"] + row["read_ahead_reads"],
            "first_uses": first_uses,
        })
        row["device_hit_rate"] = row["device_hits"] / accesses
        for name in ("disk_reads", "disk_reads_total", "host_hits", "host_to_device", "device_to_host",
                     "read_ahead_reads", "first_uses"):
            row[f"{name}_per_token"] = row[name] / tokens
        if expert_bytes is not None:
            row["expert_bytes"] = int(expert_bytes)
            for name in ("disk_reads_total", "host_to_device", "device_to_host"):
                row[f"{name}_bytes"] = row[name] * int(expert_bytes)
        results.append(row)
    return results


def _read_ahead(predicted, top, valid, on_device, host, ahead, host_capacity, budget, priority, counts) -> None:
    """Read predicted experts in neither level from disk into the host tier (module doc), in place.

    predicted: bool [L, E]; top: int [L, n], the predicted ids by descending score where ``valid``
    [L, n]; on_device, host, ahead: bool [G, L, E]; host_capacity, budget: int [G, 1]."""
    layer = np.arange(top.shape[0])[:, None]
    wanted = valid & ~on_device[:, layer, top] & ~host[:, layer, top]  # [G, L, n] by descending score
    rank = np.cumsum(wanted, axis=2)  # 1-based rank among wanted
    free = host_capacity - host.sum(axis=2)
    evictable = host & ~predicted & ~on_device
    n_read = np.minimum(rank[..., -1], np.minimum(budget, free + evictable.sum(axis=2)))
    if not n_read.any():
        return
    n_evict = np.maximum(n_read - free, 0)
    if n_evict.any():
        dropped = _victims(priority, evictable, n_evict)
        counts["host_evictions"] += n_evict.sum(axis=1)
        counts["read_ahead_wasted"] += (dropped & ahead).sum(axis=(1, 2))
        ahead &= ~dropped
        host &= ~dropped
    read = wanted & (rank <= n_read[..., None])
    host[:, layer, top] |= read
    ahead[:, layer, top] |= read
    counts["read_ahead_reads"] += n_read.sum(axis=1)


def _check_invariants(device, host, ahead, inclusive, capacity, host_capacity) -> None:
    assert (device.sum(axis=2) <= capacity).all() and (host.sum(axis=2) <= host_capacity).all()
    both = (device & host).any(axis=(1, 2))
    assert not both[~inclusive[:, 0, 0]].any(), "exclusive: an expert is in both levels"
    assert not (device & ~host)[inclusive[:, 0, 0]].any(), "inclusive: a device expert is not in the host tier"
    assert not (ahead & ~host).any(), "a read-ahead flag outside the host tier"


def tier_grid(caches: list[int], num_experts: int, read_ahead: list[int]) -> list[TierConfig]:
    """A report's grid: H = 25 / 50 / 75% of E at each C in ``caches``, both relations (inclusive only
    where H >= C), without and with each ``read_ahead`` budget, plus inclusive at H + C without
    read-ahead where that fits in E (what exclusive at H is compared with)."""
    hosts = [num_experts // 4, num_experts // 2, 3 * num_experts // 4]
    configs = []
    for c in caches:
        for h in hosts:
            configs += [TierConfig(c, h, relation, r) for relation in RELATIONS for r in [0, *read_ahead]
                        if relation == "exclusive" or h >= c]
            if h + c <= num_experts:
                configs.append(TierConfig(c, h + c))
    return list(dict.fromkeys(configs))


def replay_tiers(expert_ids: np.ndarray, num_experts: int, capacity: int, host_capacity: int,
                 policy: CachePolicy, relation: str = "inclusive", host_policy: CachePolicy | None = None,
                 predictor: Predictor | None = None, read_ahead: int = 0, expert_bytes: int | None = None,
                 warmup: int = 0, check: bool = False) -> dict:
    """One two-level cache (``replay_tiers_grid`` with one config)."""
    config = TierConfig(capacity, host_capacity, relation, read_ahead)
    return replay_tiers_grid(expert_ids, num_experts, [config], policy, host_policy, predictor,
                             expert_bytes, warmup, check=check)[0]


def run_tiers(trace_name: str, configs: list[TierConfig], policy_name: str = "lfru",
              host_policy_name: str | None = None, predictor_setting: str = "best",
              datasets: list[str] | None = None, trace: dict | None = None, warmup: int = 0,
              expert_bytes: int | None = None, data_dir: Path = DATA_DIR, **lfru_kwargs) -> list[dict]:
    """``replay_tiers_grid`` over the report split of one trace (as ``replay.run_one``), preceded by
    the last ``warmup`` tokens of the tuning split, replayed uncounted (for olmoe and kimi: the
    tokens just before). Read-ahead uses ``predictor_setting``'s predictor (fitted on the tuning
    split; its count and min_score, not its budget or policy). Results also say what ran on what."""
    for name in (policy_name, host_policy_name or policy_name):
        if name not in POLICIES or name == "static":
            raise TraceError(f"unknown or unsupported policy {name!r} for the tiers replay; expected one of "
                             f"{', '.join(p for p in POLICIES if p != 'static')}")
    trace = trace if trace is not None else load_trace(trace_name, data_dir)
    split = split_trace(trace, datasets)
    if len(split["eval_ids"]) == 0:
        raise TraceError("the selected sequences hold no tokens; choose other --datasets")
    if not 0 <= warmup <= len(split["tune_ids"]):
        raise TraceError(f"expected 0 <= --warmup <= {len(split['tune_ids'])} (tokens of the tuning split), "
                         f"found {warmup}")
    ids = np.concatenate([split["tune_ids"][len(split["tune_ids"]) - warmup :], split["eval_ids"]])
    split = {**split, "eval_ids": ids}  # Belady's future is the replayed stream
    num_experts = trace["num_experts"]
    policy = build_policy(policy_name, split, num_experts, **lfru_kwargs)
    host_policy = None
    if host_policy_name is not None and host_policy_name != policy_name:
        host_policy = build_policy(host_policy_name, split, num_experts, **lfru_kwargs)
    predictor = None
    if any(c.read_ahead for c in configs):
        predictor = build_predictor(predictor_setting, trace, split, table=Path(data_dir) / CROSSLAYER_TABLE.name)
    began = time.perf_counter()
    results = replay_tiers_grid(ids, num_experts, configs, policy, host_policy, predictor, expert_bytes, warmup)
    seconds = round(time.perf_counter() - began, 2)
    for r in results:
        r.update(trace=trace_name, model=trace["model"], evaluated_on=split["eval_desc"], seconds=seconds)
        if predictor is not None and r["read_ahead"]:
            r.update(read_ahead_predictor=predictor_setting, predictor=repr(predictor))
        lfru = next((p for p in (policy, host_policy) if p is not None and p.name == "lfru"), None)
        if lfru is not None:
            r["lfru"] = {"decay": lfru.decay, "recency_weight": lfru.recency_weight}
    return results
