"""The bytes a placement needs where, and whether they fit the memory available, with what to change if not.

`jmoe.plan` and `jmoe.load`'s early check both call `memory_needs` and `check_fit`, so the plan's verdict
and load's refusal follow the same rule.
"""

from __future__ import annotations

import dataclasses
import math

from jmoe.config import ModelConfig
from jmoe.memory import DEVICE
from jmoe.model import kv_bytes_per_token
from jmoe.offload.placement import Placement
from jmoe.plan.resources import PINNED_POOL_ENV, Resources, pinned_pool_gb_for

DEFAULT_CONTEXT = 4096  # tokens of KV cache planned for, as device_budget_gb reserves (capped by the model)


@dataclasses.dataclass(frozen=True)
class MemoryNeeds:
    host_bytes: int  # pinned host memory: offloaded experts and parameters
    device_weight_bytes: int  # parameters on the device
    slot_bytes: int  # expert cache + scratch slots
    fetch_buffer_bytes: int  # layer-group weights in flight
    kv_bytes: int  # the KV cache for batch x context tokens
    stream_bytes: int  # prefill's two expert chunk buffers (one offloaded layer at a time)
    program_bytes: int | None = None  # the largest compiled program's device memory, everything included

    @property
    def estimate_bytes(self) -> int:
        """Device bytes known without compiling: weights, slots, buffers, KV cache; no activations."""
        return (self.device_weight_bytes + self.slot_bytes + self.fetch_buffer_bytes + self.kv_bytes
                + self.stream_bytes)

    @property
    def device_bytes(self) -> int:
        return max(self.estimate_bytes, self.program_bytes or 0)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "device_bytes": self.device_bytes,
                "device_bytes_include_programs": self.program_bytes is not None}


def kv_cache_bytes(cfg: ModelConfig, batch: int, context: int, dtype) -> int:
    """The KV cache of every layer for `batch` rows of `context` tokens (jmoe.model.empty_kv_cache)."""
    return batch * context * kv_bytes_per_token(cfg, dtype)


def memory_needs(cfg: ModelConfig, placement: Placement, batch: int, context: int, dtype,
                 program_bytes: int | None = None) -> MemoryNeeds:
    weights = sum(b for key, b in placement.nbytes.items() if placement.memory_kind[key] == DEVICE)
    return MemoryNeeds(placement.totals()["host_bytes"], weights, placement.slot_bytes, placement.fetch_buffer_bytes,
                       kv_cache_bytes(cfg, batch, context, dtype),
                       placement.stream_bytes if placement.offloaded_layers else 0, program_bytes)


def on_one_host(needs: MemoryNeeds, devices: int, available: Resources) -> MemoryNeeds:
    """The needs of `devices` expert-parallel devices of one host, from one device's: the host's RAM holds every
    device's pinned share; device bytes stay per device where each device has memory of its own, and add up in
    the same RAM on a CPU backend (available.device_bytes None)."""
    if devices == 1:
        return needs
    scaled = (["host_bytes"] if available.device_bytes is not None
              else [f.name for f in dataclasses.fields(needs) if f.name != "program_bytes"])
    return dataclasses.replace(needs, **{field: getattr(needs, field) * devices for field in scaled})


def gib(n: int | float) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_fit(needs: MemoryNeeds, available: Resources, placement: Placement, num_experts: int,
              pool_fixed: bool) -> tuple[list[str], list[str]]:
    """(reasons it does not fit, notes). `pool_fixed`: JAX's GPU backend has started, so the pinned pool
    limit can no longer be raised (jmoe.load); otherwise a default pool that is too small is a note saying
    what to set (the command lines set it themselves)."""
    reasons, notes = [], []
    host, device = needs.host_bytes, needs.device_bytes
    if available.device_bytes is None:  # a CPU backend: device arrays live in host RAM too
        if host + device > available.host_bytes:
            reasons.append(f"host memory: {gib(host + device)} needed ({gib(host)} pinned + {gib(device)} of "
                           f"device arrays, which live in RAM on a CPU backend), {gib(available.host_bytes)} "
                           f"available ({available.host_source}); shorten the context or batch (KV cache "
                           f"{gib(needs.kv_bytes)}), or run on a machine with more memory")
    else:
        if host > available.host_bytes:
            reasons.append(f"host memory: the pinned experts and parameters need {gib(host)}, "
                           f"{gib(available.host_bytes)} available ({available.host_source}); "
                           f"{_less_host_advice(placement, num_experts)}")
        if device > available.device_bytes:
            reasons.append(f"device memory: {gib(device)} needed, {gib(available.device_bytes)} available "
                           f"({available.device_source}); "
                           f"{_less_device_advice(needs, placement, device - available.device_bytes)}")
    if available.pinned_pool_bytes is not None and pinned_pool_gb_for(host) * 2**30 > available.pinned_pool_bytes:
        fix = f"{PINNED_POOL_ENV}={pinned_pool_gb_for(host)}"
        if pool_fixed or available.pinned_pool_set:
            reasons.append(f"pinned host pool: {gib(host)} of pinned arrays exceed the pool JAX on GPU allows "
                           f"({available.pinned_pool_source}); set {fix} before JAX starts (the jmoe command "
                           f"lines do this when it is unset)")
        else:
            notes.append(f"the pinned arrays ({gib(host)}) exceed XLA's default pinned-host pool: the jmoe "
                         f"command lines set {fix} before JAX starts; from Python, set it before the first JAX "
                         f"operation")
    return reasons, notes


def _less_host_advice(placement: Placement, num_experts: int) -> str:
    if not placement.offloaded_layers:
        return "offload fewer parameters with offload_params, or add host memory"
    layer_bytes = num_experts * placement.expert_bytes
    return (f"keep more MoE layers' experts on the device (each resident layer moves {gib(layer_bytes)} off the "
            f"host: a per-layer cache list with None for it, or fewer --cpu-moe-layers), or add host memory")


def _less_device_advice(needs: MemoryNeeds, placement: Placement, over: int) -> str:
    advice = []
    offloaded, caches = placement.offloaded_layers, placement.caches
    if offloaded and len(set(caches)) == 1 and caches[0] > 0:
        smaller = caches[0] - math.ceil(over / (len(offloaded) * placement.expert_bytes))
        if smaller >= 0:
            advice.append(f"a cache of {smaller} instead of {caches[0]}")
    if not offloaded:
        advice.append("offload experts: a cache (--cache N), --cpu-moe-layers N, or --device-budget-gb to "
                      "choose the largest cache that fits")
    advice.append(f"a shorter context or smaller batch (KV cache {gib(needs.kv_bytes)})")
    advice.append("dense weights in host memory (--offload-params, --offload-group-size)")
    return "try " + "; or ".join(advice)
