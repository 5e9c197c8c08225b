"""Placement: which parameters live on the device and which in pinned host memory, and how many slots.

Rules, in order:
- a MoE layer whose cache is < the number of experts has its experts offloaded: `cache` is one number for
  every MoE layer (the default use) or one per MoE layer (None = resident), and `cpu_moe_layers` = N gives
  the first N MoE layers a cache of 0 (all their experts stay on the host, as llama.cpp's --n-cpu-moe);
- `offload_params` patterns offload more: a plain pattern matches whole segments of the dotted parameter
  path (`w_down`, `mlp.experts`, `attn`), a `re:` pattern is a regular expression searched in it
  (`re:layers\\.(1[0-9])\\..*experts`). Expert tensors of a layer move as a unit (they share slots);
  any other matched parameter stays in pinned host memory and is copied in at every step;
- `device_budget_gb` picks the largest cache, the same for every layer it chooses for, that fits next to
  the device-resident weights, the KV cache and the scratch slots (per-layer caches from a budget did not
  beat a uniform split on the replay traces: bench/results/cache_split.md);
- `layer_groups` (jmoe.offload.layer_groups) limits offloading to N of every G decoder layers: the
  patterns then match only those layers' parameters (no pattern: all their non-expert weights), and their
  non-expert weights are fetched K layers ahead inside the step instead of all at its start.
A pattern that matches nothing and a budget that cannot hold the dense weights are errors.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from jmoe.config import ModelConfig
from jmoe.errors import InputError
from jmoe.memory import DEVICE, PINNED_HOST
from jmoe.model import kv_bytes_per_token
from jmoe.model.params import ParamPath, param_key
from jmoe.offload.host_tier import STAGED_PER_LAYER
from jmoe.offload.layer_groups import LayerGroups, prefetch_buffer_bytes
from jmoe.offload.options import OffloadOptions
BUDGET_KV_TOKENS = 4096  # KV cache reserved by device_budget_gb: one sequence of this many tokens


def is_expert_param(path: ParamPath) -> bool:
    return "experts" in path


def moe_position(cfg: ModelConfig, path: ParamPath) -> int:
    """Index among the MoE layers of the layer an expert parameter belongs to."""
    return cfg.moe_layer_indices.index(path[1])


def param_group(path: ParamPath) -> str:
    if path[0] == "embed":
        return "embedding"
    if path[0] == "lm_head":
        return "lm head"
    for segment, group in (("experts", "experts"), ("router", "router"), ("shared_expert", "shared expert"),
                           ("shared_expert_gate", "shared expert"), ("attn", "attention"), ("mlp", "dense mlp")):
        if segment in path:
            return "norms" if segment == "attn" and "norm" in str(path[-2]) else group
    return "norms"


def pattern_matches(pattern: str, key: str) -> bool:
    if pattern.startswith("re:"):
        return re.search(pattern[3:], key) is not None
    wanted = pattern.split(".")
    segments = key.split(".")
    return any(segments[i:i + len(wanted)] == wanted for i in range(len(segments) - len(wanted) + 1))


@dataclasses.dataclass(frozen=True)
class Placement:
    memory_kind: dict[str, str]  # param key -> "device" | "pinned_host"
    nbytes: dict[str, int]  # param key -> bytes
    groups: dict[str, str]  # param key -> group name
    offloaded_layers: tuple[int, ...]  # MoE-layer positions whose experts live on the host
    caches: tuple[int, ...]  # cache slots of each offloaded layer (aligned with offloaded_layers)
    scratch: int  # scratch slots, shared by the offloaded layers
    expert_bytes: int  # bytes of one expert (gate_up + down)
    notes: tuple[str, ...] = ()
    layer_groups: LayerGroups | None = None
    fetched_keys: dict[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # layer -> keys fetched ahead
    fetch_buffer_bytes: int = 0  # device memory the fetched layer weights can take at once
    kv_bytes_per_token: int = 0  # KV cache per token of one sequence, all layers (MLA: the compressed latent)
    # The disk tier: experts per offloaded layer in pinned host rows (jmoe.offload.host_tier), the rest on disk
    # only; 0 = every expert in host memory. The offloaded experts' nbytes count these rows.
    host_rows: int = 0

    def memory_kind_of(self, path: ParamPath) -> str:
        return self.memory_kind[param_key(path)]

    @property
    def layer_expert_bytes(self) -> int:
        """One expert of every offloaded layer together: what a host row per layer takes (the disk tier's unit)."""
        return len(self.offloaded_layers) * self.expert_bytes

    @property
    def slot_bytes(self) -> int:
        return (sum(self.caches) + self.scratch) * self.expert_bytes

    @property
    def stream_bytes(self) -> int:
        """Device memory prefill's two chunk buffers take on top, one offloaded layer at a time."""
        return 2 * self.scratch * self.expert_bytes

    def describe_caches(self) -> str:
        """'4 cache' when every offloaded layer has the same, else the cache of each MoE layer."""
        if len(set(self.caches)) == 1:
            return f"{self.caches[0]} cache"
        return "cache " + ", ".join(f"{c} (MoE layer {i})" for i, c in zip(self.offloaded_layers, self.caches))

    def totals(self) -> dict[str, int]:
        device = sum(b for k, b in self.nbytes.items() if self.memory_kind[k] == DEVICE) + self.slot_bytes
        device += self.fetch_buffer_bytes
        host = sum(b for k, b in self.nbytes.items() if self.memory_kind[k] == PINNED_HOST)
        return {"device_bytes": device, "host_bytes": host}

    def as_dict(self) -> dict[str, dict]:
        """Per parameter: memory kind and bytes (JSON-serialisable)."""
        return {k: {"memory_kind": self.memory_kind[k], "bytes": self.nbytes[k]} for k in self.memory_kind}

    def group_totals(self) -> dict[tuple[str, str], list[int]]:
        """(group, memory kind) -> [tensors, bytes]."""
        rows: dict[tuple[str, str], list[int]] = {}
        for key, kind in self.memory_kind.items():
            row = rows.setdefault((self.groups[key], kind), [0, 0])
            row[0] += 1
            row[1] += self.nbytes[key]
        return rows

    def summary(self) -> str:
        lines = [f"{'group':<16}{'memory kind':<14}{'tensors':>8}{'MB':>12}"]
        for (group, kind), (count, nbytes) in sorted(self.group_totals().items()):
            lines.append(f"{group:<16}{kind:<14}{count:>8}{nbytes / 2**20:>12.2f}")
        if self.offloaded_layers:
            lines.append(f"{'expert slots':<16}{DEVICE:<14}{len(self.offloaded_layers):>8}"
                         f"{self.slot_bytes / 2**20:>12.2f}   ({self.describe_caches()} per layer, "
                         f"{len(self.offloaded_layers)} offloaded MoE layers, + {self.scratch} scratch slots they "
                         f"share; prefill streams through up to {self.stream_bytes / 2**20:.2f} MB more, one "
                         f"layer at a time)")
        if self.fetched_keys:
            lines.append(f"{'layer prefetch':<16}{DEVICE:<14}{len(self.fetched_keys):>8}"
                         f"{self.fetch_buffer_bytes / 2**20:>12.2f}   ({self.layer_groups.describe()}: "
                         f"layers {', '.join(map(str, sorted(self.fetched_keys)))})")
        totals = self.totals()
        lines.append(f"KV cache: {self.kv_bytes_per_token:,} bytes per token of each sequence, all layers")
        lines.append(f"total on device {totals['device_bytes'] / 2**20:.2f} MB, in pinned host memory "
                     f"{totals['host_bytes'] / 2**20:.2f} MB")
        lines.extend(self.notes)
        return "\n".join(lines)


def plan_placement(cfg: ModelConfig, abstract: dict[ParamPath, object],
                   options: OffloadOptions = OffloadOptions()) -> Placement:
    """Decide every parameter's memory kind and the slot counts. `abstract` maps paths to shape/dtype."""
    device_budget_gb, layer_groups = options.device_budget_gb, options.layer_groups
    offload_params = options.offload_params
    keys = {path: param_key(path) for path in abstract}
    kv_per_token = kv_bytes_per_token(cfg, abstract[("embed",)].dtype)  # the cache takes the activations' dtype
    nbytes = {keys[p]: int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for p, a in abstract.items()}
    host_keys: set[str] = set()
    offloaded: set[int] = set()
    notes: list[str] = []
    candidates = list(abstract)
    if layer_groups is not None:
        candidates = [p for p in abstract if p[0] == "layers" and layer_groups.offloaded(p[1])]
    for pattern, matched in select_params(offload_params, candidates, keys, layer_groups):
        if not matched:
            example = ", ".join(keys[p] for p in candidates[:6])
            where = (f"no parameter of the grouped layers ({layer_groups.describe()})" if layer_groups
                     else "no parameter")
            raise InputError(f"offload_params pattern {pattern!r} matches {where}; parameter names look "
                             f"like: {example}, ... (plain patterns match whole dotted segments, 're:' "
                             f"patterns are regular expressions)")
        for path in matched:
            if is_expert_param(path):
                offloaded.add(moe_position(cfg, path))
            else:
                host_keys.add(keys[path])
    fetched_keys: dict[int, tuple[str, ...]] = {}
    if layer_groups is not None:  # grouped layers' non-expert weights are fetched ahead inside the step
        for path in abstract:
            if keys[path] in host_keys:
                fetched_keys[path[1]] = fetched_keys.get(path[1], ()) + (keys[path],)
    fetch_buffer = prefetch_buffer_bytes(
        layer_groups, {layer: sum(nbytes[k] for k in ks) for layer, ks in fetched_keys.items()}, cfg.num_layers
    ) if fetched_keys else 0
    # Per MoE layer: its cache, or None while undecided (resident unless a pattern or the budget offloads it).
    caches = list(options.layer_caches(cfg.num_moe_layers))
    if device_budget_gb is None and any(caches[i] is None for i in offloaded):
        notes.append("offload_params matched expert weights of layers without a cache: cache = 0 there (every "
                     "needed expert is copied in at each step)")
        for i in offloaded:
            caches[i] = 0 if caches[i] is None else caches[i]
    expert_paths = [p for p in abstract if is_expert_param(p)]
    expert_bytes = sum(nbytes[keys[p]] for p in expert_paths) // max(1, cfg.num_moe_layers * cfg.num_experts)
    # Scratch slots, shared by every offloaded layer (layers run one after another), in units of top_k.
    scratch = min(cfg.num_experts, options.scratch_rows * cfg.num_experts_per_tok)

    if device_budget_gb is not None:
        budget = int(device_budget_gb * 2**30)
        dense = sum(b for k, b in nbytes.items()
                    if k not in host_keys and not is_expert_param(tuple(k.split("."))))
        kv = BUDGET_KV_TOKENS * kv_per_token
        chosen = [i for i, c in enumerate(caches) if c is None]  # the layers whose cache the budget chooses
        per_slot = len(chosen) * expert_bytes
        scratch_bytes = scratch * expert_bytes
        fixed = sum(c for c in caches if c is not None) * expert_bytes  # cpu_moe_layers: 0
        stream = 2 * scratch * expert_bytes  # prefill's two chunk buffers, one layer at a time
        floor = dense + fetch_buffer + kv + scratch_bytes + fixed + stream
        if budget < floor:
            raise InputError(f"device_budget_gb={device_budget_gb} ({budget / 2**30:.3f} GB) cannot hold the "
                             f"dense weights ({dense / 2**30:.3f} GB) + KV cache for {BUDGET_KV_TOKENS} tokens "
                             f"({kv / 2**30:.3f} GB) + layer prefetch buffers ({fetch_buffer / 2**30:.3f} GB) + scratch "
                             f"slots ({scratch_bytes / 2**30:.3f} GB) + prefill stream buffers "
                             f"({stream / 2**30:.3f} GB) = "
                             f"{floor / 2**30:.3f} GB; raise the budget or offload more with offload_params")
        cache = int(min(cfg.num_experts, (budget - floor) // per_slot)) if per_slot else cfg.num_experts
        for i in chosen:
            caches[i] = cache
        notes.append(f"device_budget_gb={device_budget_gb}: chose cache={cache} of {cfg.num_experts} experts per "
                     f"layer (dense {dense / 2**30:.3f} GB + KV {kv / 2**30:.3f} GB + slots)")
        if chosen and cache >= cfg.num_experts:
            offloaded.difference_update(chosen)
            notes.append("the budget holds every expert: nothing is offloaded" if len(chosen) == len(caches)
                         else "the budget holds every expert of the layers it chose for")

    # A layer is offloaded when its cache is below E, or when a pattern put its experts on the host.
    offloaded.update(i for i, c in enumerate(caches) if c is not None and c < cfg.num_experts)
    offloaded_layers = tuple(sorted(offloaded))
    memory_kind = {}
    for path in abstract:
        key = keys[path]
        on_host = key in host_keys or (is_expert_param(path) and moe_position(cfg, path) in offloaded)
        memory_kind[key] = PINNED_HOST if on_host else DEVICE
    staged, ahead = STAGED_PER_LAYER, options.read_ahead
    host_rows = tiered_rows(cfg, options.host_budget_gb, len(offloaded_layers), expert_bytes, staged, ahead)
    if host_rows:
        for path in abstract:
            if is_expert_param(path) and moe_position(cfg, path) in offloaded:
                per_expert = nbytes[keys[path]] // cfg.num_experts
                # The read-ahead's experts (one layer's) counted as a share of every offloaded layer's parameter.
                nbytes[keys[path]] = per_expert * (host_rows + staged) + per_expert * ahead // len(offloaded_layers)
        notes.append(f"host_budget_gb={options.host_budget_gb}: {host_rows} of {cfg.num_experts} experts per "
                     f"offloaded layer in pinned host rows and {staged} staged (read for admission)"
                     + (f", {ahead} of the next layer read ahead" if ahead else "")
                     + ", the others read from the checkpoint files when needed")
        largest_cache = max(min(caches[i], cfg.num_experts) for i in offloaded_layers)
        if host_rows < 2 * largest_cache:
            # The host rows include the device's experts: at H = C every device miss is a disk read
            # (bench/results/replay_tiers.md: inclusive at H reads from disk what a one-level cache of H misses).
            notes.append(f"warning: {host_rows} host rows per layer is under twice the device cache ({largest_cache}): "
                         f"the rows also hold the device's experts, so nearly every device miss reads the disk; "
                         f"raise host_budget_gb to at least "
                         f"{2 * largest_cache * len(offloaded_layers) * expert_bytes / 1e9:.3f} GB or lower the cache")
    return Placement(memory_kind, nbytes, {keys[p]: param_group(p) for p in abstract}, offloaded_layers,
                     tuple(min(caches[i], cfg.num_experts) for i in offloaded_layers),
                     scratch if offloaded_layers else 0, expert_bytes, tuple(notes), layer_groups, fetched_keys,
                     fetch_buffer, kv_per_token, host_rows)


def tiered_rows(cfg: ModelConfig, host_budget_gb: float | None, layers: int, expert_bytes: int,
                staged: int, ahead: int = 0) -> int:
    """Experts per offloaded layer that `host_budget_gb` holds in pinned host rows next to `staged` experts per
    layer (jmoe.offload.host_tier: a step's read kept for admission) and `ahead` experts read ahead (one layer's);
    0 when there is no budget, nothing offloaded, or the budget holds every expert (no disk tier)."""
    if host_budget_gb is None or not layers:
        return 0
    held = int((host_budget_gb * 1e9 - ahead * expert_bytes) // (layers * expert_bytes))
    if held >= cfg.num_experts:
        return 0
    if held < 1 + staged:
        needed = ((1 + staged) * layers + ahead) * expert_bytes / 1e9
        raise InputError(f"host_budget_gb={host_budget_gb} holds {max(held, 0)} experts of each of the {layers} "
                         f"offloaded MoE layers ({expert_bytes / 1e9:.4f} GB each) beside the {ahead} read ahead; "
                         f"the disk tier needs one host row and {staged} staged (read for admission) per layer: "
                         f"give at least {needed:.4f} GB" + (" or read fewer ahead" if ahead else ""))
    return held - staged


def select_params(patterns: list[str] | None, candidates: list[ParamPath], keys: dict[ParamPath, str],
                  layer_groups: LayerGroups | None) -> list[tuple[str, list[ParamPath]]]:
    """(pattern, the candidate parameters it matches) for each pattern; with layer groups and no pattern,
    every non-expert weight of the grouped layers."""
    if not patterns and layer_groups is not None:
        return [("(all non-expert weights)", [p for p in candidates if not is_expert_param(p)])]
    return [(pattern, [p for p in candidates if pattern_matches(pattern, keys[p])]) for pattern in patterns or []]
