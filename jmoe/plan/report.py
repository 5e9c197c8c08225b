"""A plan as a readable table (`Plan.report()`, `python -m jmoe.plan` without --json)."""

from __future__ import annotations

from jmoe.plan.budget import gib


def format_plan(plan) -> str:
    cfg, placement, needs, available = plan.config, plan.placement, plan.needs, plan.available
    target = "this machine" if plan.target is None else f"{plan.target.name} ({plan.target.device_kind})"
    if plan.devices > 1:
        target += f" x {plan.devices}, the experts split over them (bytes per device; pinned host for the host)"
    caches = plan.layer_caches()
    own = "" if plan.devices == 1 else " (each GPU's own)"
    if len(set(caches)) == 1:
        cache = ("all experts resident" if caches[0] is None
                 else f"{caches[0]} of {cfg.num_experts // plan.devices} experts{own}")
        cache += " in every MoE layer"
    else:
        cache = ", ".join("resident" if c is None else str(c) for c in caches) + " (per MoE layer)"
    lines = [
        f"{plan.headers.directory}: {cfg.family}, {cfg.num_layers} layers ({cfg.num_moe_layers} MoE), "
        f"{cfg.num_experts} experts, top-{cfg.num_experts_per_tok}, {plan.headers.dtype.name}",
        f"plan for {target}: batch {plan.batch}"
        + (f" (padded to {plan.rows} rows)" if plan.rows != plan.batch else "")
        + f", context {plan.context} tokens; device cache {cache}"
        + (f" + {placement.scratch} scratch slots" if placement.offloaded_layers else ""),
        "",
        f"{'group':<16}{'memory kind':<14}{'tensors':>8}{'GiB':>11}",
    ]
    for (group, kind), (count, nbytes) in sorted(placement.group_totals().items()):
        lines.append(f"{group:<16}{kind:<14}{count:>8}{nbytes / 2**30:>11.3f}")
    lines.append("")
    rows = [("pinned host", needs.host_bytes), ("device weights", needs.device_weight_bytes),
            ("expert slots", needs.slot_bytes), ("layer prefetch", needs.fetch_buffer_bytes),
            ("KV cache", needs.kv_bytes), ("prefill stream", needs.stream_bytes)]
    for name, program in plan.programs.items():
        if program.memory_analysis is not None:
            rows.append((f"{name} program", program.device_bytes))
    lines += [f"{name:<30}{nbytes / 2**30:>11.3f} GiB" for name, nbytes in rows if nbytes]
    what = "largest compiled program" if needs.program_bytes is not None else "weights + slots + KV + buffers"
    lines.append(f"{'device total':<30}{needs.device_bytes / 2**30:>11.3f} GiB   ({what})")
    lines.append("")
    device = ("shares host RAM" if available.device_bytes is None
              else f"{gib(available.device_bytes)} ({available.device_source})")
    lines.append(f"available: host {gib(available.host_bytes)} ({available.host_source}); device {device}")
    if available.pinned_pool_bytes is not None:
        lines.append(f"pinned host pool: {gib(available.pinned_pool_bytes)} ({available.pinned_pool_source})")
    lines += format_collectives(plan)
    lines.append("FITS" if plan.fits else "DOES NOT FIT")
    lines += [f"- {reason}" for reason in plan.reasons]
    lines += format_disk(plan)
    lines += format_estimate(plan)
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


def format_estimate(plan) -> list[str]:
    speed = plan.estimate
    if speed is None:
        return []

    def span(pair):
        return f"{pair[0]:,.1f} - {pair[1]:,.1f}"

    lines = ["", f"speed estimate on {plan.target.name} (tokens/s, low - high):",
             f"  decode, batch 1{'':<12}{span(speed.decode_tokens_per_s_batch1)}"]
    if plan.batch > 1:
        lines.append(f"  decode, batch {plan.batch:<12}{span(speed.decode_tokens_per_s)}")
    lines.append(f"  prefill, {plan.context}-token prompt{'':<2}{span(speed.prefill_tokens_per_s)}")
    lines.append(f"  prefill, {plan.context}-token prompt: {prefill_streaming(speed.inputs)}")
    lines += [f"  assumes: {line}" for line in speed.assumptions]
    return lines


def prefill_streaming(inputs: dict) -> str:
    """'1 chunk of 4096 tokens, experts streamed once, 45.1 GB': how the server cuts the prompt and what streams."""
    chunks, chunk = inputs["prefill_chunks"], inputs["prefill_chunk_tokens"]
    cut = f"{chunks} chunk{'s' * (chunks > 1)} of {chunk} tokens"
    streamed = chunks * inputs["prefill_stream_bytes_per_chunk"]
    if not streamed:
        return f"{cut}, nothing streamed"
    what = "experts" if inputs["offloaded_layers"] else "host-kept weights"
    times = "once" if chunks == 1 else f"{chunks} times"
    return f"{cut}, {what} streamed {times}, {streamed / 1e9:,.1f} GB"


def format_disk(plan) -> list[str]:
    """The disk tier (host_budget_gb): what a decoded token reads from the checkpoint files, and how long."""
    disk = plan.disk
    if disk is None:
        return []
    return ["", f"disk tier: {disk.host_rows} of {plan.config.num_experts} experts per offloaded layer in pinned host "
                f"rows, the others read from the checkpoint files when a step needs them",
            f"  host hit rate {disk.host_hit_rate:.3f} ({disk.host_hit_rate_source})",
            f"  disk reads per decoded token (batch 1): {disk.experts_per_token:,.2f} experts, "
            f"{disk.bytes_per_token / 1e6:,.3f} MB",
            f"  disk {disk.disk_bytes_per_s / 1e9:g} GB/s ({disk.disk_source}): "
            f"{disk.seconds_per_token * 1e3:,.3f} ms a token"]


def format_collectives(plan) -> list[str]:
    """What crosses between the devices in each compiled program (expert parallelism only)."""
    lines = []
    for name, program in plan.programs.items():
        for c, count in program.collectives.items():
            lines.append(f"{name} program: {count} x {c.op} of {', '.join(c.shapes)} ({c.bytes:,} bytes each)")
    return lines + [""] if lines else []
