"""The expert-cache hit rate a plan's speed estimate assumes: given by the user, replayed from a routing trace
of the model with the plan's policy and per-layer caches (jmoe.traces.replay, the engine's eviction rule), or,
without either, what uniform routing gives (a cache of c of E experts holds a needed expert with chance c/E).
The disk tier's host rows (host_budget_gb) get theirs the same way, the rows as the caches."""

from __future__ import annotations

import numpy as np

from jmoe.errors import InputError
from jmoe.offload.history_prefetch import routing_trace_array
from jmoe.offload.policies import CachePolicy, make_policy
from jmoe.traces.load import TraceError, check_trace, frequency_table
from jmoe.traces.replay import replay


def load_routing_trace(trace, num_moe_layers: int, num_experts: int) -> np.ndarray:
    """An int array [tokens, MoE layers, k] of this model's routing, or a .npy file of one, checked."""
    try:
        trace = check_trace(routing_trace_array(trace, "trace"), num_experts)
    except TraceError as e:
        raise InputError(f"trace: {e}") from None
    if trace.shape[1] != num_moe_layers:
        raise InputError(f"trace: it has {trace.shape[1]} MoE layers, the model {num_moe_layers}; record the "
                         f"trace from this model")
    return trace


def replayed_hit_rate(trace: np.ndarray, policy: str, caches: list[int | None], num_experts: int) -> float:
    """The hit rate over the offloaded layers' accesses when `trace` [tokens, MoE layers, k] is replayed through
    each layer's cache (None = resident, not counted) with a fresh `policy` (a name); a cache smaller than
    top-k, which the replay cannot hold a token's experts in, counts as all misses."""
    top_k = trace.shape[2]
    hits = accesses = 0
    for cache in sorted({c for c in caches if c is not None}):
        layers = [i for i, c in enumerate(caches) if c == cache]
        part = trace[:, layers, :]
        accesses += part.size
        if cache >= top_k:
            hits += replay(part, num_experts, cache, fresh_policy(policy, part, num_experts))["hits"]
    return hits / accesses if accesses else 1.0


def fresh_policy(policy: str, trace: np.ndarray, num_experts: int) -> CachePolicy:
    if not isinstance(policy, str):
        raise InputError("trace: replaying needs the cache policy by name (lru, lfu, lfru, static), found a "
                         f"{type(policy).__name__} object")
    if policy == "static":  # its pinned set: the trace's most used experts
        return make_policy("static", trace.shape[1], num_experts, frequency=frequency_table(trace, num_experts))
    return make_policy(policy, trace.shape[1], num_experts)


def uniform_hit_rate(caches: list[int | None], num_experts: int) -> float:
    offloaded = [c for c in caches if c is not None]
    return float(np.mean([c / num_experts for c in offloaded])) if offloaded else 1.0


def fraction(name: str, value: float) -> float:
    """`value` as a float in [0, 1] (a hit rate), else InputError naming `name`."""
    if not 0.0 <= value <= 1.0:
        raise InputError(f"{name} must be in [0, 1] (the share of the offloaded layers' expert accesses that hit), "
                         f"found {value}; pass a fraction such as 0.8, or leave it out for the default")
    return float(value)


def hit_rate(given: float | None, trace, policy, caches: list[int | None], num_experts: int,
             name: str = "hit_rate", capacity: str = "cache") -> tuple[float, str]:
    """(hit rate, where it comes from) of caches of these capacities (`name`, `capacity`: what the messages call
    the given rate and the capacity)."""
    if given is not None and trace is not None:
        raise InputError(f"give {name} or a routing trace to replay, not both")
    if given is not None:
        return fraction(name, given), "given"
    if not any(c is not None for c in caches):
        return 1.0, "every expert resident"
    if trace is not None:
        trace = load_routing_trace(trace, len(caches), num_experts)
        return replayed_hit_rate(trace, policy, caches, num_experts), (
            f"replayed from a routing trace of {trace.shape[0]} tokens, policy {policy}")
    return uniform_hit_rate(caches, num_experts), f"uniform routing ({capacity} / experts); pass a trace or {name}"


def host_hit_rate(given: float | None, trace, policy, caches: list[int | None], host_rows: int, num_experts: int,
                  device_hit_rate: float) -> tuple[float, str]:
    """(hit rate, source) of the disk tier's host rows. The tiers are inclusive, so the replay's two-level tier reads
    from disk exactly what a one-level cache of `host_rows` misses (jmoe.traces.tiers,
    bench/results/replay_tiers.md): `hit_rate` with the rows as every offloaded layer's cache. The engine admits
    at most one read per layer and step (jmoe.offload.host_tier), so for it this is an estimate. A device hit is a
    host hit, so it is never below the device's."""
    rate, source = hit_rate(given, trace, policy, [None if c is None else host_rows for c in caches], num_experts,
                            "host_hit_rate", "host rows")
    if rate >= device_hit_rate:
        return rate, source
    if given is not None:
        raise InputError(f"host_hit_rate ({given}) is below the device hit rate ({device_hit_rate:.3f}): the host "
                         f"rows hold every expert of the device slots, so a device hit is a host hit; pass "
                         f"host_hit_rate >= {device_hit_rate:.3f}")
    return device_hit_rate, (f"the device hit rate: {source} gives {rate:.3f}, less, and every device hit is a "
                             f"host hit (inclusive tiers)")
