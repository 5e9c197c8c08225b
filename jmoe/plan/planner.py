"""`jmoe.plan(path, ...)`: where every byte of a model would live and whether it fits, before anything is loaded.

It reads config.json and the checkpoint headers only (jmoe.plan.headers), makes the placement `jmoe.load`
would make (one device's, under expert parallelism over `devices` GPUs of one host), counts the KV cache,
optionally compiles the decode and prefill programs for a GPU target (jmoe.plan.programs) and checks the result
against the memory available (jmoe.plan.resources, jmoe.plan.budget).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jmoe.arguments import check_backend, positive_finite, whole_number
from jmoe.decode.generation import bucket_batch
from jmoe.errors import InputError, InsufficientMemoryError
from jmoe.offload.engine import steps_run_ahead
from jmoe.offload.options import OffloadOptions
from jmoe.offload.expert_parallel import device_placement
from jmoe.offload.placement import Placement
from jmoe.offload.prefill_chunks import (COMPUTE_FRACTION, LINK_FRACTION, SMALL_CHUNK, host_param_bytes,
                                         prefill_chunk_for)
from jmoe.memory import PINNED_HOST
from jmoe.plan.budget import DEFAULT_CONTEXT, MemoryNeeds, check_fit, gib, memory_needs, on_one_host
from jmoe.plan.depth import REDUCE_FROM_LAYERS
from jmoe.plan.estimate import DeviceSpeeds, DiskReads, Estimate, disk_reads, estimate, speeds_of
from jmoe.plan.headers import CheckpointHeaders, read_headers
from jmoe.plan.hit_rate import fraction, host_hit_rate as plan_host_hit_rate, hit_rate as plan_hit_rate
from jmoe.plan.programs import Program, compile_programs
from jmoe.plan.resources import Resources, ensure_pinned_pool, resources
from jmoe.plan.targets import Target, load_target


@dataclasses.dataclass(frozen=True)
class Plan:
    headers: CheckpointHeaders
    options: OffloadOptions
    placement: Placement
    batch: int  # rows asked for
    rows: int  # rows the programs and KV cache have: the batch padded as generation pads it
    context: int
    target: Target | None
    needs: MemoryNeeds
    available: Resources
    fits: bool
    reasons: tuple[str, ...]  # why it does not fit, each with the numbers and what to change
    notes: tuple[str, ...]
    programs: dict[str, Program]  # "decode" / "prefill", compiled for the target (empty without one)
    estimate: Estimate | None = None  # tokens/s on the target (jmoe.plan.estimate); None without compiled programs
    # Expert parallelism over this many devices of one host: the placement, slots, KV cache and programs are one
    # device's; needs.host_bytes is the host's (every device's pinned share).
    devices: int = 1
    disk: DiskReads | None = None  # the disk tier's reads (host_budget_gb; None: every expert in host memory)

    @property
    def config(self):
        return self.headers.config

    def layer_caches(self) -> list[int | None]:
        """The cache of every MoE layer (None = all its experts resident on the device)."""
        return moe_layer_caches(self.placement, self.config.num_moe_layers)

    def as_dict(self) -> dict:
        cfg, placement = self.config, self.placement
        options = dataclasses.asdict(self.options)
        if not isinstance(options["policy"], str):
            options["policy"] = type(self.options.policy).__name__
        return {
            "model": {"model_type": cfg.family, "layers": cfg.num_layers, "moe_layers": cfg.num_moe_layers,
                      "experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok,
                      "expert_bytes": placement.expert_bytes},
            "checkpoint": self.headers.as_dict(),
            "target": None if self.target is None else {"name": self.target.name,
                                                        "device_kind": self.target.device_kind,
                                                        "device_memory_bytes": self.target.device_memory_bytes},
            "devices": self.devices, "batch": self.batch, "batch_rows": self.rows, "context": self.context,
            "options": options,
            "cache": {"per_moe_layer": self.layer_caches(), "scratch_slots": placement.scratch},
            "groups": [{"group": group, "memory_kind": kind, "tensors": count, "bytes": nbytes}
                       for (group, kind), (count, nbytes) in sorted(placement.group_totals().items())],
            **self.needs.as_dict(),
            "available": self.available.as_dict(),
            "programs": {name: program.as_dict() for name, program in self.programs.items()},
            "fits": self.fits, "reasons": list(self.reasons), "notes": list(self.notes),
            "estimate": None if self.estimate is None else self.estimate.as_dict(),
            **({} if self.disk is None else {"disk": self.disk.as_dict()}),
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.as_dict(), indent=indent)

    def report(self) -> str:
        from jmoe.plan.report import format_plan

        return format_plan(self)


def plan(path: str | Path, cache=None, *, target: str | Path | None = None, batch: int = 1,
         context: int | None = None, host_gb: float | None = None, device_gb: float | None = None,
         compile: bool = True, dtype: str | None = None, backend: str = "auto", hit_rate: float | None = None,
         trace=None, host_link_gbs: float | None = None, extrapolate_layers: bool = False,
         host_hit_rate: float | None = None, disk_gbs: float | None = None, **offload) -> Plan:
    """Plan a model's memory without loading it: see jmoe.plan for the result.

    path: a Hugging Face or jmoe-Orbax checkpoint directory; only config.json and the headers are read.
    cache, dtype, backend and `offload` (policy, offload_params, device_budget_gb, prefetch, miss_mode,
        offload_group_size, offload_num_in_group, offload_prefetch_step, cpu_moe_layers, expert_dtype,
        expert_group_size, side_stream_copies, ...): as jmoe.load.
    target: a GPU to plan for: a shipped target name (jmoe.plan.targets.target_names()) or a target-config
        file; its device memory is the device memory available, and with `compile` the decode and prefill
        programs are compiled for it (needs the gpu-compile extra) and their memory is counted.
        Without a target, this machine's memory is used.
    batch, context: rows and KV-cache tokens planned for (default context: 4096, capped by the model); the
        batch is padded to a power of two as generation pads it.
    host_gb, device_gb: memory available in GiB, instead of what the OS / target / device says.
    hit_rate, trace, host_link_gbs: for the speed estimate (`Plan.estimate`, with a target and compiling): the
        expert-cache hit rate of the offloaded layers, or a routing trace of the model ([tokens, MoE layers, k],
        an int array or a .npy file) replayed with the plan's policy and caches (default: uniform routing,
        cache / experts); the host link's GB/s instead of the target's (PCIe 5.0 x16 for an H100).
    host_hit_rate, disk_gbs: the disk tier (host_budget_gb): the host rows' hit rate (default: replayed from the
        trace with the rows as the caches, else uniform routing, rows / experts) and the GB/s the disk reads
        (default 2.0, assumed); `Plan.disk` says what a decoded token reads from disk, the estimate adds its time.
    extrapolate_layers: a deep model (16+ layers) whose layers repeat is compiled at two shallow depths and its
        programs' sizes, flops, bytes, loops and kernels extrapolated to its depth (jmoe.plan.depth): several times
        faster, exact for everything but temporaries, which are then not counted.
    """
    try:
        options = OffloadOptions(cache, **offload)
    except TypeError as e:
        fields = ", ".join(f.name for f in dataclasses.fields(OffloadOptions))
        raise InputError(f"plan: {e}; the load options are {fields}, dtype, backend") from None
    return plan_with_options(path, options, target=target, batch=batch, context=context, host_gb=host_gb,
                             device_gb=device_gb, compile=compile, dtype=dtype, backend=backend, hit_rate=hit_rate,
                             trace=trace, host_link_gbs=host_link_gbs, extrapolate_layers=extrapolate_layers,
                             host_hit_rate=host_hit_rate, disk_gbs=disk_gbs)


def plan_with_options(path: str | Path, options: OffloadOptions, *, target=None, batch: int = 1, context=None,
                      host_gb=None, device_gb=None, compile: bool = True, dtype=None, backend: str = "auto",
                      hit_rate: float | None = None, trace=None, host_link_gbs: float | None = None,
                      extrapolate_layers: bool = False, host_hit_rate: float | None = None,
                      disk_gbs: float | None = None) -> Plan:
    """`plan` with the offload settings already gathered in an OffloadOptions (the command line uses this)."""
    check_backend(backend)
    if options.mesh is not None:
        raise InputError("plan: a Mesh holds this process's devices, not a target's; plan expert parallelism with "
                         "devices=N (--devices N): N GPUs of one host with every MoE layer's experts split over them")
    devices = options.devices or 1
    host_gb = None if host_gb is None else positive_finite("host_gb", host_gb)
    device_gb = None if device_gb is None else positive_finite("device_gb", device_gb)
    host_link_gbs = None if host_link_gbs is None else positive_finite("host_link_gbs", host_link_gbs)
    disk_gbs = None if disk_gbs is None else positive_finite("disk_gbs (the GB/s the disk reads, --disk-gbs)",
                                                             disk_gbs)
    host_hit_rate = None if host_hit_rate is None else fraction("host_hit_rate", host_hit_rate)
    if options.host_budget_gb is None and (host_hit_rate, disk_gbs) != (None, None):
        raise InputError("host_hit_rate and disk_gbs describe the disk tier, which needs a host budget: give "
                         "host_budget_gb (--host-budget-gb) too, or leave them out")
    headers = read_headers(path, dtype, options.expert_dtype, options.expert_group_size)
    cfg = headers.config
    batch = whole_number("batch", batch, 1, "rows planned for")
    rows = bucket_batch(batch)
    context = checked_context(cfg, context)
    target = None if target is None else load_target(target)
    placement = device_placement(cfg, headers.abstract, options, devices)
    caches = moe_layer_caches(placement, cfg.num_moe_layers)
    if trace is not None and devices > 1:
        raise InputError(f"trace: a routing trace is not replayed per device under expert parallelism yet "
                         f"(devices={devices}); pass hit_rate, or plan without the trace for uniform routing")
    # one device's: its caches over its share of the experts; checked before compiling
    hit = plan_hit_rate(hit_rate, trace, options.policy, caches, cfg.num_experts // devices)
    disk = None
    if placement.host_rows:  # the disk tier (one device only: several are refused with a host budget)
        host_hit = plan_host_hit_rate(host_hit_rate, trace, options.policy, caches, placement.host_rows,
                                      cfg.num_experts, hit[0])
        disk = disk_reads(placement.host_rows, len(placement.offloaded_layers), cfg.num_experts,
                          cfg.num_experts_per_tok, placement.expert_bytes, host_hit, disk_gbs)
    programs = {}
    if target is not None and compile:
        programs = compile_programs(cfg, headers.dtype, options, backend, rows, context, target.config_text,
                                    extrapolate_layers, devices)
    compiled = [p.device_bytes for p in programs.values() if p.device_bytes is not None]
    available = resources(target, host_gb, device_gb)
    needs = on_one_host(memory_needs(cfg, placement, rows, context, headers.dtype, max(compiled) if compiled else None),
                        devices, available)
    reasons, notes = check_fit(needs, available, placement, cfg.num_experts, pool_fixed=False)
    notes += [f"{name} program: not compiled ({p.error}); its temporaries are not counted"
              for name, p in programs.items() if p.error]
    notes += [f"{name} program: compiled with {p.compiled_layers[0]} and {p.compiled_layers[1]} of the "
              f"{cfg.num_layers} decoder layers, its sizes, cost and kernels extrapolated to all of them "
              f"(extrapolate_layers); its temporaries are not counted (they do not scale with depth)"
              for name, p in programs.items() if p.compiled_layers and not p.error]
    if extrapolate_layers and programs and not any(p.compiled_layers for p in programs.values()):
        notes.append(f"extrapolate_layers: the programs were compiled whole, all {cfg.num_layers} decoder layers: "
                     f"a model is extrapolated from {REDUCE_FROM_LAYERS} layers on, and only when its layers "
                     f"repeat (the same placement, cache and group from some layer on)")
    if devices > 1:
        notes.append(f"pinned host: one host holds the {devices} devices and every device's share "
                     f"({devices} x {gib(placement.totals()['host_bytes'])}); device memory, programs and the "
                     f"estimate are one device's")
    if target is None or not compile:
        notes.append("device bytes count weights, slots, KV cache and stream buffers, not the programs' "
                     "temporaries: give a target (and compile) to count those")
    speed = None
    if target is not None:
        speeds, assumptions = speeds_of(target, headers.dtype, host_link_gbs)
        groups = placement.group_totals().items()
        expert_arrays = sum(nbytes for (group, _), (_, nbytes) in groups if group == "experts") + placement.slot_bytes
        resident_experts = sum(nbytes for (group, kind), (_, nbytes) in groups
                               if group == "experts" and kind != PINNED_HOST)
        chunk, how = server_prefill_chunk(placement, headers, context, speeds, devices)
        assumptions.append(how)
        speed = estimate(programs, speeds, caches=caches, num_experts=cfg.num_experts // devices,
                         top_k=cfg.num_experts_per_tok / devices,
                         expert_bytes=placement.expert_bytes, expert_array_bytes=expert_arrays,
                         least_bytes=needs.device_weight_bytes - resident_experts + needs.kv_bytes,
                         host_param_bytes=host_param_bytes(placement), batch=batch, rows=rows, context=context,
                         hit_rate=hit[0], hit_rate_source=hit[1], notes=assumptions, devices=devices, disk=disk,
                         prefill_chunk=chunk, runs_ahead=steps_run_ahead(placement, options))
    if speed is None:
        notes.append("no speed estimate: it needs a target and the programs compiled for it, with their cost "
                     "analysis")
    return Plan(headers, options, placement, batch, rows, context, target, needs, available, not reasons,
                tuple(reasons), tuple(placement.notes) + tuple(notes), programs, speed, devices, disk)


def server_prefill_chunk(placement: Placement, headers: CheckpointHeaders, context: int, speeds: DeviceSpeeds,
                         devices: int) -> tuple[int, str]:
    """Prompt tokens per prefill step as the server cuts a long prompt on the target, and how it chose them (for
    the estimate's assumptions)."""
    chunk = prefill_chunk_for(placement, headers.config, headers.abstract, platform="gpu", context=context,
                              link_bytes_per_s=speeds.host_link_bytes_per_s, peak_flops=speeds.peak_flops,
                              devices=devices)
    if chunk is None:
        small = min(SMALL_CHUNK, context)
        return small, f"prefill chunks of {small} tokens, the server's own: nothing streams"
    return chunk, (f"prefill chunks of {chunk} tokens (jmoe.offload.prefill_chunks: the shortest power of two, at "
                   f"least {SMALL_CHUNK} tokens, whose compute at {COMPUTE_FRACTION:g} of the peak lasts as long as "
                   f"streaming the experts no slot holds at {LINK_FRACTION:g} of the host link, capped at the context)")


def moe_layer_caches(placement: Placement, num_moe_layers: int) -> list[int | None]:
    caches = dict(zip(placement.offloaded_layers, placement.caches))
    return [caches.get(i) for i in range(num_moe_layers)]


def checked_context(cfg, context: int | None) -> int:
    if context is None:
        return min(DEFAULT_CONTEXT, cfg.max_position_embeddings)
    context = whole_number("context", context, 1, "KV-cache tokens planned for")
    if context > cfg.max_position_embeddings:
        raise InputError(f"context={context} is more than the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings}); plan for at most that many tokens")
    return context


def refuse_if_unfit(headers: CheckpointHeaders, placement: Placement, devices: int = 1) -> None:
    """jmoe.load's check before it reads any weight: the plan for this machine (batch 1, default context)
    must fit, else InsufficientMemoryError with the numbers and what to change. Under an expert mesh of
    `devices`, `placement` is one device's: this host holds every device's pinned share (and, on a CPU
    backend, every device's arrays)."""
    cfg = headers.config
    available = resources()
    needs = on_one_host(memory_needs(cfg, placement, 1, checked_context(cfg, None), headers.dtype), devices, available)
    reasons, _ = check_fit(needs, available, placement, cfg.num_experts, pool_fixed=True)
    if reasons:
        raise InsufficientMemoryError(
            f"{headers.directory} does not fit in this machine's memory as placed (planned from the checkpoint "
            f"headers for batch 1 and {checked_context(cfg, None)} tokens of KV cache; no weight was read): "
            + "; ".join(reasons) + ". `python -m jmoe.plan` shows the whole plan; check_memory=False skips "
            "this check")


def raise_pinned_pool_for(path: str | Path, options: OffloadOptions, dtype=None) -> str | None:
    """For the command lines, before JAX starts: raise the pinned-host pool limit to what this placement's
    pinned arrays need, unless the user set it (jmoe.plan.resources.ensure_pinned_pool). Returns what was set."""
    headers = read_headers(path, dtype, options.expert_dtype, options.expert_group_size)
    devices = options.devices or 1  # an expert mesh of N devices pins N devices' shares
    placement = device_placement(headers.config, headers.abstract, options, devices)
    return ensure_pinned_pool(devices * placement.totals()["host_bytes"])
