"""Prometheus metrics of a serving engine, and one log line per finished request.

`Metrics` is the engine's observer (`step`, `grammar` and `finished` are called on the engine's thread) and owns its own
CollectorRegistry, so two servers in one process never share counters. What the engine and the model already
count (running and waiting requests, compiled programs, the expert cache's per-layer statistics) is read at
scrape time. Every name starts with `jmoe:`.
"""

from __future__ import annotations

import logging

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

logger = logging.getLogger("jmoe.serve")

GRAMMAR_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
EXPERT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Metrics:
    """Counters and histograms fed by the engine; set `engine` once it exists for the values read at scrape."""

    def __init__(self):
        self.engine = None
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("jmoe:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.reused_prompt_tokens = Counter("jmoe:prompt_tokens_reused", "Prompt tokens of finished requests whose "
                                            "keys and values a row already held (prefix reuse)", registry=r)
        self.computed_prompt_tokens = Counter("jmoe:prompt_tokens_computed", "Prompt tokens of finished requests "
                                              "that were prefilled", registry=r)
        self.generated_tokens = Counter("jmoe:generation_tokens", "Tokens generated for finished requests",
                                        registry=r)
        self.finished_requests = Counter("jmoe:requests_finished", "Finished requests by finish reason",
                                         ["finish_reason"], registry=r)
        self.ttft = Histogram("jmoe:time_to_first_token_seconds", "From submission to the first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("jmoe:inter_token_latency_seconds", "Between consecutive tokens of one request",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.step_seconds = Histogram("jmoe:step_seconds", "Engine step time by kind (prefill, decode)", ["kind"],
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.distinct_experts = Histogram("jmoe:decode_distinct_experts",
                                          "Distinct experts one MoE layer reads in one decode step (one "
                                          "observation per MoE layer and step)", buckets=EXPERT_BUCKETS, registry=r)
        self.constrained_requests = Counter("jmoe:constrained_requests", "Finished requests whose output a grammar "
                                            "constrained, by kind (json_schema, json_object, regex, choice, grammar, "
                                            "tool_calls)", ["kind"], registry=r)
        self.grammar_seconds = Histogram("jmoe:grammar_mask_seconds", "Host time computing the grammars' token masks "
                                         "of one step (all its constrained rows)", buckets=GRAMMAR_BUCKETS,
                                         registry=r)
        r.register(_EngineCollector(self))

    # ---- the observer interface (engine thread) -------------------------------------------------------
    def step(self, kind: str, seconds: float, rows: int, routing: np.ndarray) -> None:
        """routing: the step's expert ids, int [L_moe, entries, T, k], -1 = none."""
        self.step_seconds.labels(kind).observe(seconds)
        if kind == "decode":
            for layer in routing.reshape(routing.shape[0], -1):
                self.distinct_experts.observe(np.unique(layer[layer >= 0]).size)

    def grammar(self, seconds: float, rows: int) -> None:
        """A step's grammar masks took `seconds` on the host for `rows` constrained rows."""
        self.grammar_seconds.observe(seconds)

    def finished(self, request) -> None:
        self.prompt_tokens.inc(request.prompt_tokens)
        self.reused_prompt_tokens.inc(request.cached_tokens)
        self.computed_prompt_tokens.inc(request.prefilled - request.cached_tokens)
        self.generated_tokens.inc(request.completion_tokens)
        self.finished_requests.labels(request.finish_reason).inc()
        ttft = None if request.first_token_at is None else request.first_token_at - request.submitted
        if ttft is not None:
            self.ttft.observe(ttft)
        for gap in np.diff(request.token_times):
            self.itl.observe(gap)
        end = request.token_times[-1] if request.token_times else request.submitted
        constraint = request.params.constraint
        grammar = ""
        if constraint is not None:
            self.constrained_requests.labels(constraint.kind).inc()
            grammar = f", constrained ({constraint.kind}): grammar {request.grammar_seconds * 1000:.1f} ms"
        logger.info("request %s finished (%s): prompt %d tokens (%d reused), completion %d tokens, ttft %s, total "
                    "%.3f s%s", request.id, request.finish_reason, request.prompt_tokens, request.cached_tokens,
                    request.completion_tokens,
                    "-" if ttft is None else f"{ttft:.3f} s", end - request.submitted, grammar)

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges and counters read from the engine and its model at scrape time."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        engine = self.metrics.engine
        if engine is None:
            return
        yield _gauge("jmoe:num_requests_running", "Requests holding a batch row", engine.running())
        yield _gauge("jmoe:num_requests_waiting", "Requests waiting for a batch row", engine.waiting())
        yield _gauge("jmoe:compiled_programs", "Programs the engine has compiled (all of them by warm-up)",
                     engine.compiled_programs)
        yield from _cache_metrics(engine.model.stats())


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation)
    family.add_metric([], value)
    return family


def _cache_metrics(stats: list[dict]):
    """Per offloaded MoE layer (and device, under an expert mesh): hit rate, hits and misses, host-to-device bytes
    and evictions (nothing when every expert is resident)."""
    labels = ["layer", "device"] if any("device" in s for s in stats) else ["layer"]
    hit_rate = GaugeMetricFamily("jmoe:expert_cache_hit_rate", "Expert cache hits / lookups per MoE layer",
                                 labels=labels)
    hits = CounterMetricFamily("jmoe:expert_cache_hits", "Expert lookups served from a device slot per MoE layer",
                               labels=labels)
    misses = CounterMetricFamily("jmoe:expert_cache_misses", "Expert lookups not in a device slot per MoE layer",
                                 labels=labels)
    moved = CounterMetricFamily("jmoe:expert_cache_host_to_device_bytes", "Expert bytes copied to the device per "
                                "MoE layer", labels=labels)
    evictions = CounterMetricFamily("jmoe:expert_cache_evictions", "Experts evicted from device slots per MoE layer",
                                    labels=labels)
    for s in stats:
        layer = [str(s[label]) for label in labels]
        if s["hit_rate"] is not None:
            hit_rate.add_metric(layer, s["hit_rate"])
        hits.add_metric(layer, s["hits"])
        misses.add_metric(layer, s["misses"])
        moved.add_metric(layer, s["bytes_moved"])
        evictions.add_metric(layer, s["evictions"])
    return [hit_rate, hits, misses, moved, evictions]
