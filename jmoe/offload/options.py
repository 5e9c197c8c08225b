"""Offload options: everything `jmoe.load` and the command lines accept about where weights live and how
the expert cache behaves, checked once, in one place, before anything is read or allocated."""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

from jmoe.arguments import checked_expert_dtype, positive_finite, whole_number
from jmoe.errors import InputError
from jmoe.offload.layer_groups import LayerGroups, layer_groups_from
from jmoe.offload.policies import CachePolicy, policy_factory

MISS_MODES = ("fetch", "host", "direct")
# Miss modes that compute a missed expert where its weights lie, in pinned host memory ("host": the host computes
# it; "direct": the device reads it there), and admit it into the cache by the manager's plan for the next step.
COMPUTED_WHERE_THEY_LIE = ("host", "direct")


def checked_cache(cache):
    """`cache` as None, an int >= 0, or a tuple of (int >= 0 | None) per MoE layer."""
    meaning = "experts kept on the device per MoE layer"
    if cache is None or not isinstance(cache, (list, tuple)):
        return None if cache is None else whole_number("cache", cache, 0, meaning)
    if not cache:
        raise InputError("cache is an empty list; give one value per MoE layer, a single number, or None")
    return tuple(None if c is None else whole_number(f"cache[{i}]", c, 0, meaning + ", or None = all")
                 for i, c in enumerate(cache))


@dataclasses.dataclass(frozen=True)
class OffloadOptions:
    """See `jmoe.load` for the meaning of each field."""

    # Experts kept on the device per MoE layer: one number for every layer, or one entry per MoE layer
    # (None = that layer's experts all resident); None = every expert resident.
    cache: int | Sequence[int | None] | None = None
    policy: str | CachePolicy = "lfru"
    offload_params: tuple[str, ...] = ()
    device_budget_gb: float | None = None
    prefetch: int = 0
    miss_mode: str = "fetch"
    offload_group_size: int = 0
    offload_num_in_group: int = 1
    offload_prefetch_step: int = 1
    cpu_moe_layers: int = 0  # the first N MoE layers keep no expert on the device (cache 0)
    # A routing trace of the model (.npy path or int array [tokens, MoE layers, k]): prefetch with the
    # history predictor fitted on it (jmoe.offload.history_prefetch); None = off.
    prefetch_trace: object = None
    # How routed experts are stored, in host memory, slots and copies: None = as the checkpoint stores them
    # (the other parameters' dtype; a converted checkpoint's own format), or jmoe.arguments.EXPERT_DTYPES;
    # int4's rows per scale (None = 64).
    expert_dtype: str | None = None
    expert_group_size: int | None = None
    # Expert parallelism (jmoe.offload.expert_parallel): split every MoE layer's experts over this process's
    # first `devices` devices, or over `mesh` (a jax.sharding.Mesh with one axis, "expert"); None = one device.
    devices: int | None = None
    mesh: object = None
    # The disk tier (jmoe.offload.host_tier): pinned host memory for the offloaded layers' experts, in GB; the
    # experts beyond it stay in the checkpoint files. None = every expert in host memory.
    host_budget_gb: float | None = None
    # The disk tier's read-ahead: experts per offloaded layer whose reads start before the token that may need
    # them, chosen by the history predictor fitted on `prefetch_trace`; 0 = off.
    read_ahead: int = 0
    # Decode rows whose missed experts all copy into the scratch slots the offloaded layers share: scratch_rows x
    # top_k slots (at most the experts per layer). A step that misses more computes the rest on the host. Fewer
    # rows hold less memory (a disk tier's budget decoding one row needs 1) and stream prefill in smaller chunks.
    scratch_rows: int = 8
    # The disk tier's reads past the page cache (O_DIRECT): True, False, or None = when the page cache has room for
    # under a quarter of the experts on disk only (jmoe.checkpoint.read_buffers.direct_reads_pay).
    direct_reads: bool | None = None
    # On a GPU, the copies made ahead of need (prefetch, prefetch_trace, the planned admissions of miss modes host and
    # direct) as asynchronous calls on a second stream, beside the kernels XLA schedules between their start and done.
    side_stream_copies: bool = False

    def __post_init__(self):
        object.__setattr__(self, "cache", checked_cache(self.cache))
        object.__setattr__(self, "cpu_moe_layers", whole_number("cpu_moe_layers", self.cpu_moe_layers, 0,
                                                                "MoE layers, counted from the first, whose "
                                                                "experts all stay in host memory"))
        if self.cpu_moe_layers and isinstance(self.cache, tuple):
            raise InputError(f"give either a per-layer cache list ({list(self.cache)}) or cpu_moe_layers "
                             f"({self.cpu_moe_layers}), not both: write 0 for the first layers in the list instead")
        if self.device_budget_gb is not None:
            budget = positive_finite("device_budget_gb (GB)", self.device_budget_gb)
            object.__setattr__(self, "device_budget_gb", budget)
            if self.cache is not None:
                raise InputError(f"give either cache ({self.cache}) or device_budget_gb ({budget}), not both: "
                                 f"the budget chooses the cache")
        patterns = self.offload_params
        if isinstance(patterns, str):
            patterns = (patterns,)
        if patterns is None:
            patterns = ()
        if not all(isinstance(p, str) and p for p in patterns):
            raise InputError(f"offload_params must be a list of non-empty name patterns, found {patterns!r}")
        for pattern in patterns:
            if pattern.startswith("re:"):
                try:
                    re.compile(pattern[3:])
                except re.error as e:
                    raise InputError(f"offload_params pattern {pattern!r} is not a valid regular expression "
                                     f"({e}); fix it or use a plain dotted pattern such as 'w_down'") from None
        object.__setattr__(self, "offload_params", tuple(patterns))
        object.__setattr__(self, "prefetch", whole_number("prefetch", self.prefetch, 0,
                                                                     "experts per layer copied ahead, 0 = off"))
        if self.prefetch_trace is not None:
            if self.prefetch:
                raise InputError(f"give either prefetch={self.prefetch} (router guess) or prefetch_trace (history "
                                 f"predictor), not both")
            if self.policy == "static":
                raise InputError("prefetch_trace needs a cache policy that admits misses (lru, lfu, lfru); "
                                 "static never changes its slots")
        if self.miss_mode not in MISS_MODES:
            raise InputError(f"miss_mode must be one of {', '.join(MISS_MODES)}, found {self.miss_mode!r}")
        if isinstance(self.policy, str):
            try:
                policy_factory(self.policy)
            except ValueError as e:
                raise InputError(str(e)) from None
        elif not isinstance(self.policy, CachePolicy):
            raise InputError(f"policy must be a policy name or a jmoe.offload.policies.CachePolicy, found "
                             f"{type(self.policy).__name__}")
        if self.devices is not None:
            object.__setattr__(self, "devices", whole_number("devices", self.devices, 1,
                                                             "devices the experts are split over"))
            if self.mesh is not None:
                raise InputError(f"give either devices={self.devices} or mesh, not both: the mesh names its devices")
        if self.prefetch_trace is not None and (self.mesh is not None or (self.devices or 1) > 1):
            raise InputError("prefetch_trace (history prefetch) does not run over several devices yet; use "
                             "prefetch=N (the router's guess) there, or one device")
        if self.host_budget_gb is not None:
            object.__setattr__(self, "host_budget_gb", positive_finite("host_budget_gb (GB)", self.host_budget_gb))
            unsupported = [name for name, used in ((f"miss_mode={self.miss_mode!r}", self.miss_mode != "fetch"),
                                                   ("prefetch", self.prefetch),
                                                   ("devices/mesh", self.mesh is not None or (self.devices or 1) > 1),
                                                   ("policy='static'", self.policy == "static"))
                           if used]
            if unsupported:
                raise InputError(f"host_budget_gb (the disk tier) does not work with {', '.join(unsupported)} yet; "
                                 f"leave those out, or host_budget_gb")
        object.__setattr__(self, "read_ahead", whole_number("read_ahead", self.read_ahead, 0,
                                                            "experts of the next layer read ahead from disk, 0 = off"))
        if self.host_budget_gb is not None and (self.read_ahead > 0) != (self.prefetch_trace is not None):
            raise InputError(f"with host_budget_gb, read_ahead (found {self.read_ahead}) and prefetch_trace (found "
                             f"{'a trace' if self.prefetch_trace is not None else 'none'}) go together: the "
                             f"predictor fitted on the trace chooses the experts read ahead from disk")
        if not (self.direct_reads is None or isinstance(self.direct_reads, bool)):
            raise InputError(f"direct_reads must be True, False or None (decide from the page cache's room), found "
                             f"{self.direct_reads!r}")
        if self.host_budget_gb is None and self.direct_reads is not None:
            raise InputError(f"direct_reads={self.direct_reads} decides how the disk tier reads experts: it needs "
                             f"host_budget_gb; leave it at None otherwise")
        if self.host_budget_gb is None and self.read_ahead:
            raise InputError(f"read_ahead={self.read_ahead} reads experts ahead from disk: it needs host_budget_gb "
                             f"(the disk tier) and prefetch_trace; leave it at 0 otherwise")
        object.__setattr__(self, "scratch_rows", whole_number("scratch_rows", self.scratch_rows, 1,
                                                              "decode rows whose missed experts all copy into the "
                                                              "scratch slots"))
        if not isinstance(self.side_stream_copies, bool):
            raise InputError(f"side_stream_copies is True or False, found {self.side_stream_copies!r}")
        copies_ahead = (self.prefetch or self.miss_mode in COMPUTED_WHERE_THEY_LIE
                        or (self.prefetch_trace is not None and self.host_budget_gb is None))
        if self.side_stream_copies and not copies_ahead:
            raise InputError("side_stream_copies=True puts the copies made ahead of need on a second stream, and these "
                             "settings make none: turn on prefetch, prefetch_trace (without host_budget_gb) or "
                             "miss_mode 'host' / 'direct', or leave side_stream_copies off")
        self.layer_groups  # checks the group settings
        checked_expert_dtype(self.expert_dtype)
        if self.expert_group_size is not None:
            whole_number("expert_group_size", self.expert_group_size, 2, "rows of an int4 weight sharing a scale")

    def layer_caches(self, num_moe_layers: int) -> tuple[int | None, ...]:
        """The cache of every MoE layer (None = all its experts resident), before a device budget chooses
        one: `cache` spread over the layers, the first `cpu_moe_layers` at 0."""
        if isinstance(self.cache, tuple):
            if len(self.cache) != num_moe_layers:
                raise InputError(f"cache lists {len(self.cache)} values, but the model has {num_moe_layers} MoE "
                                 f"layers; give one value per MoE layer (None = all experts of that layer resident)")
            return self.cache
        if self.cpu_moe_layers > num_moe_layers:
            raise InputError(f"cpu_moe_layers={self.cpu_moe_layers} is more than the model's {num_moe_layers} MoE "
                             f"layers; give at most {num_moe_layers}")
        return (0,) * self.cpu_moe_layers + (self.cache,) * (num_moe_layers - self.cpu_moe_layers)

    @property
    def layer_groups(self) -> LayerGroups | None:
        return layer_groups_from(self.offload_group_size, self.offload_num_in_group, self.offload_prefetch_step)
