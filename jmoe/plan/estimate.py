"""How fast a plan would run on its target: decode tokens/s (batch 1 and the plan's batch) and prefill tokens/s,
as a [low, high] range with the assumptions that make it.

A step's time is its device time plus the host-to-device copies of the experts it misses:
- device time, from the compiled program's own cost analysis (XLA's flops and bytes accessed,
  compile_worker.cost_analysis) against the target's memory bandwidth and peak, at an achieved fraction of
  each, plus a launch cost per kernel the optimized program launches (jmoe.plan.hlo.kernel_count: a loop's body
  as often as its known trip count; XLA's cost analysis counts a while loop's body once, so a loop's repeats are
  not in its flops and bytes). The analysis counts every operand whole: the stacked expert
  arrays (resident, slots, and the pinned-host ones the step slices) as if every expert were read, and an
  in-place update of a slot buffer as a whole read and write, while the grouped GEMM reads only the experts
  routed to and host arrays cross the link (the copies below), not HBM. So the slow end takes the analysis's
  bytes with the expert arrays replaced by the routed experts (once; any further count of them stays), and
  the fast end the least a step must read: the device's non-expert weights, the KV cache and the routed
  experts;
- copies: experts missed per step x bytes per expert / the host link (PCIe) at an achieved fraction. Misses
  come from a hit rate (given; replayed from a routing trace with the plan's policy and caches; or, without
  either, uniform routing: cache / experts); a batch of B rows needs E (1 - (1 - k/E)^B) distinct experts
  per layer under independent uniform routing. Prefill runs as the serving engine runs a long prompt: in chunks of
  the length jmoe.offload.prefill_chunks chooses from the placement, the link and the target's peak (256 tokens
  where nothing streams), each chunk a step that streams every offloaded expert once.
- disk (the disk tier, host_budget_gb): a step's needed experts that no host row holds are read from the
  checkpoint files: missed as the copies are, at the host rows' hit rate, at a disk's GB/s (given, or assumed).
  Prefill reads every offloaded expert outside the rows once a chunk.
- host: the work between steps (routing back to the host, the cache manager, the generation loop): a time per
  step plus one per offloaded layer, as measured on the lent H100's host.
High = the fast ends with copies hidden behind compute (max); low = the slow ends with none hidden (sum); the host
work adds to both, but for the high end of decode, whose steps are dispatched ahead of it (Model.dispatch_step; not
with a disk tier or history prefetch); the disk reads add to both.

Calibration (bench/results/plan_calibration_h100.md, from bench/results/gpu_check_nvidia_h100_80gb_hbm3.md): with
the nominal link fractions (0.7-0.9) and no host term, every measured decode speed fell below the range (0.37-0.58
of its low end). The measured host work (1.2 ms a step resident, 2.1 ms at 4 offloaded layers) and the link rate
a step's own copies reached (about 16 GB/s of 63, against 53 for a plain copy) put every one inside it.
"""

from __future__ import annotations

import dataclasses

# Achieved fractions of the nominal peaks, [slow, fast]: decode kernels that stream weights reach 60-90% of HBM
# bandwidth; MoE GEMMs 40-80% of the tensor-core peak. Pinned-host copies: a decode step's own copies reached 25%
# of an H100's PCIe 5.0 x16 (measured, see the module docstring), a plain copy 85%.
MEMORY_EFFICIENCY = (0.6, 0.9)
COMPUTE_EFFICIENCY = (0.4, 0.8)
LINK_EFFICIENCY = (0.25, 0.85)
LAUNCH_SECONDS = (5e-6, 1e-6)  # per kernel, [slow, fast]: a launch each, or CUDA graphs
# Host work per step, [slow, fast] seconds: measured 1.23 ms (resident) and 2.13 ms (4 offloaded layers) on the lent
# H100's 16-core Xeon, whose runs varied by 15%; the range spans that and a somewhat faster host.
HOST_SECONDS_PER_STEP = (1.6e-3, 0.9e-3)
HOST_SECONDS_PER_OFFLOADED_LAYER = (0.3e-3, 0.15e-3)
# Collectives between the GPUs of one host (expert parallelism; not measured here): a latency per collective,
# [slow, fast] (NCCL's small all-reduces over NVSwitch take about 10-30 us), and an achieved fraction of the
# interconnect's bandwidth for the bytes; a ring all-reduce sends 2 (N - 1) / N of them, the others (N - 1) / N.
COLLECTIVE_SECONDS = (30e-6, 8e-6)
INTERCONNECT_EFFICIENCY = (0.5, 0.8)
# The disk tier's disk when not given, GB/s: NVMe-class, assumed. The dev machine's disk read 1.36 GB/s sequential,
# Orbax experts as fast, safetensors experts at 28% of it (they transpose): bench/results/disk_reads.md.
DEFAULT_DISK_GBS = 2.0


@dataclasses.dataclass(frozen=True)
class DeviceSpeeds:
    memory_bytes_per_s: float
    peak_flops: float
    host_link_bytes_per_s: float
    interconnect_bytes_per_s: float | None = None  # between the GPUs of one host (None: not known)


@dataclasses.dataclass(frozen=True)
class Estimate:
    decode_tokens_per_s: tuple[float, float]  # [low, high] at the plan's batch
    decode_tokens_per_s_batch1: tuple[float, float]
    prefill_tokens_per_s: tuple[float, float]
    hit_rate: float  # of the offloaded layers' accesses (1.0 when every expert is resident)
    hit_rate_source: str
    inputs: dict  # the numbers the estimate used
    assumptions: tuple[str, ...]

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for key in ("decode_tokens_per_s", "decode_tokens_per_s_batch1", "prefill_tokens_per_s"):
            out[key] = list(out[key])
        out["assumptions"] = list(self.assumptions)
        return out


def device_bytes(bytes_accessed: float, expert_array_bytes: int, routed_experts: float, expert_bytes: int) -> float:
    """HBM bytes of a step: the cost analysis's bytes without the whole expert arrays (counted once each, the
    analysis's way), plus the experts the step's tokens are routed to."""
    return max(bytes_accessed - expert_array_bytes, 0.0) + routed_experts * expert_bytes


def device_seconds(flops: float, hbm_bytes: tuple[float, float], kernels: int,
                   speeds: DeviceSpeeds) -> tuple[float, float]:
    """[slow, fast] seconds of one program on the device, from its [slow, fast] HBM bytes."""
    slow = (hbm_bytes[0] / (speeds.memory_bytes_per_s * MEMORY_EFFICIENCY[0])
            + flops / (speeds.peak_flops * COMPUTE_EFFICIENCY[0]) + kernels * LAUNCH_SECONDS[0])
    fast = max(hbm_bytes[1] / (speeds.memory_bytes_per_s * MEMORY_EFFICIENCY[1]),
               flops / (speeds.peak_flops * COMPUTE_EFFICIENCY[1])) + kernels * LAUNCH_SECONDS[1]
    return slow, fast


def collective_seconds(found: dict, devices: int, speeds: DeviceSpeeds) -> tuple[float, float]:
    """[slow, fast] seconds of a program's collectives ({jmoe.plan.hlo.Collective: count}) over `devices` GPUs.
    They sit on the step's critical path: each MoE layer's output is summed before the next layer starts."""
    if not found:
        return 0.0, 0.0
    bandwidth = speeds.interconnect_bytes_per_s or speeds.host_link_bytes_per_s
    share = (devices - 1) / devices
    sent = sum(count * c.bytes * share * (2 if c.op == "all-reduce" else 1) for c, count in found.items())
    count = sum(found.values())
    return tuple(count * latency + sent / (bandwidth * efficiency)
                 for latency, efficiency in zip(COLLECTIVE_SECONDS, INTERCONNECT_EFFICIENCY))


def link_seconds(nbytes: float, speeds: DeviceSpeeds) -> tuple[float, float]:
    """[slow, fast] seconds to copy `nbytes` from pinned host memory to the device."""
    return nbytes / (speeds.host_link_bytes_per_s * LINK_EFFICIENCY[0]), nbytes / (
        speeds.host_link_bytes_per_s * LINK_EFFICIENCY[1])


def distinct_experts(num_experts: int, top_k: int, rows: int) -> float:
    """Expected distinct experts a layer needs for `rows` tokens routed independently and uniformly."""
    return num_experts * (1 - (1 - top_k / num_experts) ** rows)


def missed_experts(offloaded_layers: int, num_experts: int, top_k: float, hit_rate: float, rows: int) -> float:
    """Experts one decode step of `rows` tokens needs and does not find, over the offloaded layers, at this hit rate."""
    return offloaded_layers * distinct_experts(num_experts, top_k, rows) * (1 - hit_rate)


def decode_copy_bytes(offloaded_caches: list[int], num_experts: int, top_k: int, expert_bytes: int, hit_rate: float,
                      rows: int, host_param_bytes: int = 0) -> float:
    """Bytes one decode step copies to the device: each offloaded layer's missed experts, plus the non-expert
    parameters kept on the host (layer groups copy them in every step)."""
    return missed_experts(len(offloaded_caches), num_experts, top_k, hit_rate, rows) * expert_bytes + host_param_bytes


@dataclasses.dataclass(frozen=True)
class DiskReads:
    """The disk tier (host_budget_gb): what a decoded token (batch 1) reads from the checkpoint files."""
    host_rows: int  # experts per offloaded layer in pinned host rows
    host_hit_rate: float  # of the offloaded layers' accesses: found in a host row (inclusive: device hits too)
    host_hit_rate_source: str
    experts_per_token: float
    bytes_per_token: float
    disk_bytes_per_s: float
    disk_source: str

    @property
    def seconds_per_token(self) -> float:
        return self.bytes_per_token / self.disk_bytes_per_s

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "seconds_per_token": self.seconds_per_token}


def disk_reads(host_rows: int, offloaded_layers: int, num_experts: int, top_k: float, expert_bytes: int,
               host_hit: tuple[float, str], disk_gbs: float | None) -> DiskReads:
    """A decoded token's disk reads: the experts it needs that no host row holds, at the host rows' hit rate."""
    experts = missed_experts(offloaded_layers, num_experts, top_k, host_hit[0], 1)
    if disk_gbs is None:
        disk_gbs, source = DEFAULT_DISK_GBS, ("NVMe-class, assumed, not measured: pass disk_gbs; this project's dev "
                                              "machine read 1.36 GB/s, bench/results/disk_reads.md")
    else:
        source = "as given"
    return DiskReads(host_rows, *host_hit, experts, experts * expert_bytes, disk_gbs * 1e9, source)


def prefill_copy_bytes(offloaded_caches: list[int], num_experts: int, expert_bytes: int,
                       host_param_bytes: int = 0) -> tuple[float, float]:
    """[slow, fast] bytes a prefill chunk streams: every offloaded expert once (fast: those the cache already holds
    are not copied), plus the host-kept non-expert parameters."""
    slow = len(offloaded_caches) * num_experts * expert_bytes
    fast = sum(num_experts - cache for cache in offloaded_caches) * expert_bytes
    return slow + host_param_bytes, fast + host_param_bytes


def host_seconds(offloaded_layers: int) -> tuple[float, float]:
    """[slow, fast] seconds of host work after a step with this many offloaded MoE layers."""
    return tuple(step + offloaded_layers * layer
                 for step, layer in zip(HOST_SECONDS_PER_STEP, HOST_SECONDS_PER_OFFLOADED_LAYER))


def tokens_per_s(tokens: int, device: tuple[float, float], copies: tuple[float, float],
                 host: tuple[float, float] = (0.0, 0.0), disk: float = 0.0,
                 host_beside: bool = False) -> tuple[float, float]:
    """[low, high]: low = slow device time + slow copies, none hidden; high = fast ones, copies hidden; the host
    work between steps adds to both, or with `host_beside` (generate's decode steps run ahead of it,
    Model.dispatch_step) hides behind the fast end's step (the slow end keeps it: no GPU has measured that yet);
    the disk reads add to both: a layer's step waits on its reads (an io_callback inside the step,
    jmoe.offload.host_tier), nothing is computed meanwhile."""
    fast = max(device[1], copies[1], host[1]) if host_beside else max(device[1], copies[1]) + host[1]
    return tokens / (device[0] + copies[0] + host[0] + disk), tokens / (fast + disk)


def speeds_of(target, dtype, host_link_gbs: float | None) -> tuple[DeviceSpeeds, list[str]]:
    """The target's numbers for a program of `dtype`, and the assumptions they carry."""
    notes = []
    if dtype.itemsize <= 2 and target.bf16_flops is not None:
        peak, what = target.bf16_flops, "dense bf16 tensor-core peak"
    else:
        peak, what = target.fp32_flops, "FP32 CUDA-core peak (2 x SMs x FP32 units x clock)"
        if dtype.itemsize <= 2:
            notes.append("the target's bf16 tensor-core peak is unknown (not a shipped target): the FP32 peak is "
                         "used, so compute-bound steps are underestimated")
    if host_link_gbs is not None:
        link, link_what = host_link_gbs * 1e9, f"{host_link_gbs:g} GB/s as given"
    elif target.host_link_bytes_per_s is not None:
        link = target.host_link_bytes_per_s
        link_what = f"{target.host_link}, {link / 1e9:g} GB/s"
    else:
        link, link_what = 31.5e9, "PCIe 4.0 x16, 31.5 GB/s (assumed: the target file names no host link)"
        notes.append("host link assumed PCIe 4.0 x16: pass host_link_gbs for this target")
    notes.insert(0, f"{target.name}: HBM {target.memory_bytes_per_s / 1e9:.0f} GB/s, {what} "
                    f"{peak / 1e12:.1f} TFLOP/s, host link {link_what}")
    return DeviceSpeeds(target.memory_bytes_per_s, peak, link, target.interconnect_bytes_per_s), notes


def estimate(programs: dict, speeds: DeviceSpeeds, *, caches: list[int | None], num_experts: int, top_k: float,
             expert_bytes: int, expert_array_bytes: int, least_bytes: int, host_param_bytes: int, batch: int,
             rows: int, context: int, hit_rate: float, hit_rate_source: str, notes: list[str],
             devices: int = 1, disk: DiskReads | None = None, prefill_chunk: int | None = None,
             runs_ahead: bool = True) -> Estimate | None:
    """The speed estimate from the compiled "decode" and "prefill" programs; None when either has no cost
    analysis. expert_array_bytes: every expert array (resident, host, slots); least_bytes: what a step reads
    besides experts (non-expert device weights + KV cache). Batch 1 takes the batch's decode program's device
    time (the same weights; more KV cache and activations, so batch 1 is underestimated when rows > 1) with
    one row's copies. Under expert parallelism over `devices` GPUs everything is one device's: its programs, its
    share of the experts (num_experts = E / N, top_k = k / N: the routed experts a device holds on average), its
    own host link; the programs' collectives add to the device time. `disk`: the disk tier's reads, whose time
    adds to every step's. `prefill_chunk`: prompt tokens per prefill step of a row (None: the whole prompt in one);
    each chunk streams the offloaded experts, reads the disk and costs the host work once, while the device time is
    the whole prompt program's. `runs_ahead`: decode steps are dispatched ahead of the host's work
    (jmoe.offload.engine.steps_run_ahead: not with a disk tier or history prefetch)."""
    needed = {"decode": programs.get("decode"), "prefill": programs.get("prefill")}
    if any(p is None or not p.cost_analysis for p in needed.values()):
        return None
    offloaded = [c for c in caches if c is not None]
    host = host_seconds(len(offloaded))

    def device(program, tokens):
        cost = program.cost_analysis
        routed = len(caches) * distinct_experts(num_experts, top_k, tokens)
        least = least_bytes + routed * expert_bytes
        # The analysis may count less than a step must read (it counts a whole expert array once, and an
        # extrapolated program's bytes are a fit): the slow end never reads less than the fast one.
        hbm = (max(device_bytes(cost.get("bytes accessed", 0.0), expert_array_bytes, routed, expert_bytes), least),
               least)
        own = device_seconds(cost.get("flops", 0.0), hbm, program.kernels, speeds)
        between = collective_seconds(program.collectives, devices, speeds)
        return own[0] + between[0], own[1] + between[1]

    def disk_seconds(tokens):
        """A decode step's disk reads; a prefill chunk's (tokens None) every expert outside the host rows once."""
        if disk is None:
            return 0.0
        read = (len(offloaded) * (num_experts - disk.host_rows) if tokens is None
                else missed_experts(len(offloaded), num_experts, top_k, disk.host_hit_rate, tokens))
        return read * expert_bytes / disk.disk_bytes_per_s

    def decode_rate(program, tokens):
        copied = decode_copy_bytes(offloaded, num_experts, top_k, expert_bytes, hit_rate, tokens, host_param_bytes)
        return tokens_per_s(tokens, device(program, tokens), link_seconds(copied, speeds), host, disk_seconds(tokens),
                            host_beside=runs_ahead)

    chunk = context if prefill_chunk is None else prefill_chunk
    chunks = -(-context // chunk)
    slow_bytes, fast_bytes = prefill_copy_bytes(offloaded, num_experts, expert_bytes, host_param_bytes)
    prefill = tokens_per_s(rows * context, device(needed["prefill"], rows * context),
                           (link_seconds(chunks * slow_bytes, speeds)[0], link_seconds(chunks * fast_bytes, speeds)[1]),
                           (chunks * host[0], chunks * host[1]), chunks * disk_seconds(None))
    inputs = {"memory_bytes_per_s": speeds.memory_bytes_per_s, "peak_flops": speeds.peak_flops,
              "host_link_bytes_per_s": speeds.host_link_bytes_per_s, "hit_rate": hit_rate,
              "expert_bytes": expert_bytes, "expert_array_bytes": expert_array_bytes, "least_bytes": least_bytes,
              "offloaded_layers": len(offloaded), "prefill_chunk_tokens": chunk, "prefill_chunks": chunks,
              "prefill_stream_bytes_per_chunk": fast_bytes,
              **{f"{name} {key}": value for name, program in needed.items()
                 for key, value in program.cost_analysis.items()},
              **{f"{name} kernels": program.kernels for name, program in needed.items()}}
    assumptions = [*notes, f"hit rate {hit_rate:.3f} ({hit_rate_source})",
                   f"achieved fractions [slow, fast]: HBM {MEMORY_EFFICIENCY}, compute {COMPUTE_EFFICIENCY}, host "
                   f"link {LINK_EFFICIENCY}; {LAUNCH_SECONDS[0] * 1e6:g} / {LAUNCH_SECONDS[1] * 1e6:g} us per kernel",
                   f"host work per step [slow, fast]: {host[0] * 1e3:.2f} / {host[1] * 1e3:.2f} ms (measured on one "
                   f"H100 machine's host; it scales with the host CPU)",
                   "device time: flops from XLA's cost analysis of the compiled programs (a while loop's body "
                   "counted once); HBM bytes, slow: the analysis's, whole expert arrays replaced by the routed "
                   "experts; fast: non-expert device weights + KV cache + routed experts, each read once",
                   "misses are copied (miss mode fetch); a batch's rows route independently and uniformly; "
                   "high = copies hidden behind compute, low = none hidden",
                   f"prefill: a prompt of {context} tokens per row in {chunks} chunk{'s' * (chunks > 1)} of {chunk} "
                   f"tokens, as the server cuts it; each chunk a step that streams every offloaded expert once"]
    if devices > 1:
        link = (f"{speeds.interconnect_bytes_per_s / 1e9:g} GB/s between GPUs" if speeds.interconnect_bytes_per_s
                else "the host link's GB/s between GPUs (the target names no interconnect)")
        assumptions.append(f"expert parallel over {devices} GPUs of one host: one device's programs, experts "
                           f"(routed uniformly over the devices) and host link; each collective of the compiled "
                           f"programs costs {COLLECTIVE_SECONDS[0] * 1e6:g} / {COLLECTIVE_SECONDS[1] * 1e6:g} us "
                           f"plus its bytes at {INTERCONNECT_EFFICIENCY} of {link} (not measured)")
    if disk is not None:
        inputs.update(host_hit_rate=disk.host_hit_rate, disk_bytes_per_s=disk.disk_bytes_per_s)
        assumptions.append(f"disk tier: {disk.bytes_per_token / 1e6:,.3f} MB a decoded token (host hit rate "
                           f"{disk.host_hit_rate:.3f}) at {disk.disk_bytes_per_s / 1e9:g} GB/s ({disk.disk_source}), "
                           f"{disk.seconds_per_token * 1e3:,.3f} ms added to every token's step, none hidden; each "
                           f"prefill chunk reads every offloaded expert outside the host rows once")
    if rows > 1:
        assumptions.append(f"batch 1: the device time of the {rows}-row decode program (a lower estimate)")
    return Estimate(decode_rate(needed["decode"], batch), decode_rate(needed["decode"], 1), prefill, hit_rate,
                    hit_rate_source, inputs, tuple(assumptions))
