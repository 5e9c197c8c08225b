"""bench.gpu_check's measuring sections: host-to-device bandwidth three ways, and decode tokens/s of a model of a
few GB (bf16, Mixtral- and DeepSeek-shaped) resident and at several caches, with the device memory each load
holds against jmoe.plan's prediction and a check that offloaded experts live in pinned host memory."""

from __future__ import annotations

import gc
import math
from pathlib import Path

import numpy as np

from bench.decode import PROMPT, jmoe_decode
from bench.disk_reads import convert_once
from bench.gpu.models import SPEED_DTYPE, speed_config, speed_models, write_checkpoint
from bench.gpu.profile import step_split, step_timer, traced_steps
from bench.gpu.results import Budget, SectionResult, format_value
from bench.helpers.common import median_seconds, one_expert_bytes

PLAIN_COPY_BYTES = 1 << 30  # the link's peak: one plain 1 GiB copy (16 MiB in small mode)
COPIED_EXPERTS = 8  # experts per timed in-program copy: enough bytes that launch overhead does not dominate


def speed_checkpoint(workdir: Path, name: str, small: bool) -> Path:
    directory = workdir / "speed" / (name + ("_small" if small else ""))  # a reused workdir keeps both apart
    return write_checkpoint(directory, speed_config(name, small), SPEED_DTYPE, seed=2)


def host_experts(model):
    """The first offloaded MoE layer's experts, in pinned host memory."""
    return model.module().moe_blocks()[0].experts.weights()


def expert_copy_kernel(host, ids, destinations, expert_bytes: int) -> dict[int, tuple[float, object]]:
    """{elements a program moves: (GB/s, the slots filled)} of jmoe.kernels.expert_copy copying experts ids[j] of
    `host` into device slot destinations[j] (interpreted where no GPU runs it)."""
    import functools

    import jax
    from jmoe.kernels.expert_copy import CHUNK, copy_experts
    from jmoe.offload.slots import empty_slots

    on_gpu = jax.default_backend() == "gpu"
    count = ids.shape[0]
    out = {}
    for chunk in (CHUNK // 4, CHUNK, CHUNK * 4):  # elements a program moves: its default, a quarter, four times
        copy = jax.jit(functools.partial(copy_experts, on_gpu=on_gpu, chunk=chunk), donate_argnums=0)
        slots = [empty_slots(host, count)]

        def run():  # the slots donated and handed back, as a step's are
            slots[0] = jax.block_until_ready(copy(slots[0], host, ids, destinations))

        seconds = median_seconds(run, repeats=10)
        out[chunk] = count * expert_bytes / seconds / 1e9, slots[0]
    return out


def bandwidth(workdir: Path, small: bool, budget: Budget, log) -> SectionResult:
    import jax
    import jax.numpy as jnp
    import jmoe
    from jmoe.memory import DEVICE, PINNED_HOST, sharding_for
    from jmoe.offload.slots import copy_by_loop, device_copy, empty_slots

    result = SectionResult()
    model = jmoe.load(speed_checkpoint(workdir, "mixtral", small), cache=0, progress=False, check_finite=False)
    host = host_experts(model).stacked()
    count = min(COPIED_EXPERTS, host.num_experts)
    expert_bytes = one_expert_bytes(host)

    @jax.jit
    def copy_unrolled(host):  # what a step did per missed expert: slice the host array, device_put the slice
        return [device_copy(host, np.int32(e)) for e in range(count)]

    seconds = median_seconds(lambda: jax.block_until_ready(copy_unrolled(host)), repeats=10)
    result.measurements["in-program expert copies, GB/s"] = count * expert_bytes / seconds / 1e9

    @jax.jit
    def copy_listed(host, ids, destinations):  # a step's miss loop (a CPU's copies): a trip count the device computed
        return copy_by_loop(empty_slots(host, count), host, ids, destinations)

    ids = jax.device_put(np.arange(count, dtype=np.int32)[::-1].copy(), sharding_for(DEVICE))
    destinations = jax.device_put(np.arange(count, dtype=np.int32), sharding_for(DEVICE))
    seconds = median_seconds(lambda: jax.block_until_ready(copy_listed(host, ids, destinations)), repeats=10)
    result.measurements["in-program copies in a data-dependent loop, GB/s"] = count * expert_bytes / seconds / 1e9
    looped = copy_listed(host, ids, destinations)
    for chunk, (gbs, copied) in expert_copy_kernel(host, ids, destinations, expert_bytes).items():
        result.measurements[f"expert-copy kernel, {chunk} elements a program, GB/s"] = gbs
        same = all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(copied), jax.tree.leaves(looped)))
        result.check(f"expert-copy kernel ({chunk}) copies what the loop copies", same,
                     "the slots it filled equal the data-dependent loop's, bit for bit")
    # The same bytes as pinned-host arrays of their own, moved by jax.device_put outside any program.
    # (sliced in NumPy: an eager op on a pinned-host array would run as host compute, or fail, on a GPU)
    pieces = jax.device_put([np.asarray(jax.device_get(leaf))[:count] for leaf in jax.tree.leaves(host)],
                            sharding_for(PINNED_HOST))
    seconds = median_seconds(lambda: jax.block_until_ready(jax.device_put(pieces, sharding_for(DEVICE))), repeats=10)
    result.measurements["jax.device_put of the same bytes, GB/s"] = count * expert_bytes / seconds / 1e9
    plain_bytes = plain_copy_bytes(small)
    result.measurements[f"plain {plain_bytes >> 20} MiB pinned-host copy, GB/s"] = plain_copy_gbs(small)
    result.notes.append(f"{count} experts of {expert_bytes / 2**20:.1f} MiB (bf16 Mixtral-shaped model, first MoE "
                        f"layer) per timed copy; medians of 10 (plain copy: 5) after a warm-up; the in-program "
                        f"copies once with constant expert indices, unrolled, once as a step's miss loop did them "
                        f"(indices and trip count computed on the device), and by the kernel every step's copies "
                        f"now take on a GPU (jmoe.kernels.expert_copy: one launch, the entries computed on the "
                        f"device, no host round trip), with programs of its default chunk, a quarter and four times")
    log("bandwidth done")
    return result


def plain_copy_bytes(small: bool) -> int:
    return PLAIN_COPY_BYTES // (64 if small else 1)


def plain_copy_gbs(small: bool) -> float:
    """The link's peak: GB/s of jax.device_put of one plain pinned-host array to the device (median of 5)."""
    import jax
    from jmoe.memory import DEVICE, PINNED_HOST, sharding_for

    size = plain_copy_bytes(small)
    plain = jax.device_put(np.ones(size // 4, np.float32), sharding_for(PINNED_HOST))
    return size / median_seconds(lambda: jax.block_until_ready(jax.device_put(plain, sharding_for(DEVICE))), 5) / 1e9


def device_bytes_in_use() -> int | None:
    import jax

    stats = jax.devices()[0].memory_stats()
    return None if not stats or "bytes_in_use" not in stats else int(stats["bytes_in_use"])


def caches_for(num_experts: int, top_k: int, small: bool) -> list[int | None]:
    """Resident, then half the experts, then top-k: the cache range a user of a smaller GPU would pick from
    (small mode: resident and top-k, the same code paths)."""
    return [None, top_k] if small else [None, *sorted({max(top_k, num_experts // 2), top_k}, reverse=True)]


MISS_MODES_TIMED = (("host", "on the host"), ("direct", "read in place"))  # miss_mode, its label


def speed_settings(directory: Path, name: str, first: bool, small: bool) -> list[tuple[str, Path, dict]]:
    """(label, checkpoint, jmoe.load options) of one model: its caches (caches_for), its smallest cache in the miss
    modes that compute misses where they lie (MISS_MODES_TIMED), then for the first model the
    smallest cache with the disk tier holding half the experts in host rows, read from its Orbax conversion (experts
    stored as held: a read applies no orientation; on a Zen 4 core a 39 MB expert took 20-27 ms from Orbax and
    65-82 ms from safetensors, bench/results/disk_tier_orbax.md): what the in-step reads cost on the device."""
    import jmoe
    from jmoe.offload.host_tier import host_budget_gb_holding

    num_experts, top_k = _experts_and_top_k(directory)
    caches = caches_for(num_experts, top_k, small)
    settings = [(f"{name}, {'resident' if c is None else f'cache {c}'}", directory, {"cache": c}) for c in caches]
    # Issue #54's ways of serving the smallest cache's misses without demand copies, beside fetch's.
    settings += [(f"{name}, cache {top_k}, misses {where}", directory, {"cache": top_k, "miss_mode": mode})
                 for mode, where in MISS_MODES_TIMED]
    if first:  # its conversion is made when the setting's turn comes (decode_speed): it may run out of time
        placement = jmoe.plan(directory, cache=top_k, compile=False).placement  # the conversion's, too
        rows = num_experts // 2
        budget_gb = host_budget_gb_holding(rows, placement.layer_expert_bytes)
        settings.append((f"{name}, cache {top_k}, disk tier ({rows} host rows, Orbax)",
                         directory.with_name(directory.name + "_orbax"), {"cache": top_k, "host_budget_gb": budget_gb}))
    return settings


def decode_speed(workdir: Path, small: bool, tokens: int, copy_gbs: float | None, budget: Budget, log) -> SectionResult:
    import jax
    import jmoe
    from jmoe.memory import PINNED_HOST

    result = SectionResult()
    result.notes += [
        f"batch 1, greedy, {tokens} new tokens after a 32-token prompt, bf16, each setting loaded afresh, "
        f"one unmeasured generation first (compiles, warms the cache)",
        "device memory: bytes_in_use after loading, minus before, against the plan's device weights + slots + "
        "layer buffers (jmoe.plan without compiling; no KV cache or temporaries are held between generations)",
        "overlap: inferred from step times: 1 - (step time at the cache - resident step time) / (bytes moved per "
        "step / the in-program copy bandwidth); and measured, for the first model's smallest cache, from a "
        "jax.profiler trace of one more generation (copies' busy time that overlaps kernels)",
        "decode tokens/s: each step dispatched before the last is read back (generate's default); 'each step read "
        "back first': run_ahead=False, the host's work between steps then serial with the device's",
        "step / host ms: a third generation's medians of the compiled step (dispatch until its outputs are ready) "
        "and of the host work after it (finish_step: routing back, the cache manager)",
        "disk tier: the first model at its smallest cache with half its experts in host rows, read from its Orbax "
        "conversion (the files are in the page cache after the first generation: this measures the in-step reads' "
        "cost, not a disk); 'step ms waiting for disk reads' is the step's time in the reads' callbacks waiting for "
        "the reader threads, and it is traced too",
    ]
    first_model = next(iter(speed_models(small)))
    for name in speed_models(small):
        directory = speed_checkpoint(workdir, name, small)
        resident_step = None
        settings = speed_settings(directory, name, name == first_model, small)
        most_copying = [label for label, _, options in settings if options.keys() == {"cache"}][-1]
        for label, checkpoint, options in settings:
            cache = options["cache"]
            if (reason := budget.not_running(label)) is not None:
                result.check(label, None, reason)
                continue
            if checkpoint != directory:  # the setting reads an Orbax conversion: made at its turn, once
                convert_once(directory, checkpoint)
            gc.collect()
            before = device_bytes_in_use()
            model = jmoe.load(checkpoint, progress=False, check_finite=False, **options)
            held = device_bytes_in_use()
            plan = jmoe.plan(checkpoint, compile=False, **options).needs
            predicted = plan.device_weight_bytes + plan.slot_bytes + plan.fetch_buffer_bytes
            if held is not None:
                result.measurements[f"{label}: device bytes held / planned"] = (held - before) / predicted
            disk_tier = "host_budget_gb" in options
            # The disk tier's experts live in its host rows (engine state), not in the parameters.
            held_on_host = jax.tree.leaves(model.engine.state.host_tier) if disk_tier else jax.tree.leaves(model.params)
            offloaded = [leaf for leaf in held_on_host
                         if getattr(getattr(leaf, "sharding", None), "memory_kind", None) == PINNED_HOST]
            if cache is not None:
                result.check(f"{label}: experts in pinned host memory", len(offloaded) > 0,
                             f"{len(offloaded)} {'host-row' if disk_tier else 'parameter'} arrays with memory_kind "
                             f"{PINNED_HOST!r}, {sum(a.nbytes for a in offloaded) / 2**30:.2f} GiB (planned "
                             f"{plan.host_bytes / 2**30:.2f} GiB)")
            before_moved, before_read = stat_total(model, "bytes_moved"), stat_total(model, "disk_reads")
            tps, step = jmoe_decode(model, tokens)
            per_token = 2 * (tokens + 32)  # jmoe_decode's two generations, prompt tokens included
            moved = (stat_total(model, "bytes_moved") - before_moved) / per_token
            result.measurements[f"{label}: decode tokens/s"] = tps
            if cache is None:
                resident_step = step
            else:
                result.measurements[f"{label}: MB moved per token"] = moved / 1e6
                if options.get("miss_mode") == "direct":  # read by the expert kernel, over the link, not copied
                    result.measurements[f"{label}: MB read in place per decode token"] = (
                        decode_step_counts(model, tokens)["misses"] * model.placement_plan.expert_bytes / 1e6)
                if copy_gbs and resident_step and moved:
                    overlap = 1 - (step - resident_step) / (moved / (copy_gbs * 1e9))
                    result.measurements[f"{label}: copy time overlapped (inferred)"] = min(1.0, max(0.0, overlap))
            if disk_tier:
                result.measurements[f"{label}: experts read from disk per token"] = (
                    (stat_total(model, "disk_reads") - before_read) / per_token)
            if model.engine.runs_ahead:  # issue #54 item 3: the same with each step read back before the next
                result.measurements[f"{label}: decode tokens/s, each step read back first"] = jmoe_decode(
                    model, tokens, run_ahead=False)[0]
            generation_s = 2 * tokens * step  # a generation's decode, doubled for its prompt step and slack
            if budget.left() < generation_s:  # a slow setting (the disk tier) must not cost the later ones
                result.notes.append(f"{label}: step / host split and trace not measured: a generation takes about "
                                    f"{generation_s:.0f} s, {budget.left():.0f} s of the section were left")
            else:
                waited = model.engine.tier.wait_seconds if disk_tier else 0.0
                with step_timer(model) as times:
                    generate(model, tokens)
                for part, ms in step_split(times).items():
                    result.measurements[f"{label}: {part}"] = ms
                if disk_tier:  # the step's wait for reads, against its whole time: the reader or the device?
                    waited = (model.engine.tier.wait_seconds - waited) / len(times["step"])
                    result.measurements[f"{label}: step ms waiting for disk reads"] = waited * 1e3
                # Traces: the most copying cache, and the disk tier's in-step reads.
                if name == first_model and (label == most_copying or disk_tier) and budget.left() > generation_s:
                    summary = traced_steps(lambda: generate(model, tokens),
                                           workdir / "trace" / label.replace(", ", "_").replace(" ", "_"), tokens)
                    top = summary.pop("top device events", [])
                    result.measurements.update({f"{label}, profiled: {key}": value for key, value in summary.items()})
                    result.notes += [f"{label}, profiled, top device event: {line}" for line in top]
            log(f"decode speed: {label}: " + ", ".join(f"{key.split(': ')[-1]} {format_value(value)}" for key, value in
                                                      result.measurements.items() if key.startswith(label + ":")))
            model.close()  # the disk tier's reader threads and files
            del model
    return result


def generate(model, tokens: int) -> None:
    from jmoe.decode.sampling import SamplingParams

    model.generate_detailed([PROMPT], tokens, SamplingParams())  # jmoe_decode's length: no new compile


def _experts_and_top_k(directory: Path) -> tuple[int, int]:
    from jmoe.config import load_config

    cfg = load_config(directory)
    return cfg.num_experts, cfg.num_experts_per_tok


def stat_total(model, key: str) -> int:
    """`key` of Model.stats() summed over its layers (a layer without it, e.g. no disk tier's reads: 0)."""
    return sum(layer.get(key, 0) for layer in model.stats())


def decode_step_counts(model, tokens: int, run_ahead: bool = True) -> dict[str, float]:
    """A generation's hits, misses and bytes copied to the device per decode step (batch 1: a missed choice is one
    expert read), its prompt step's left out (counted when the first token is seen; prefill streams its misses in),
    and its decode tokens/s."""
    from jmoe.decode.sampling import SamplingParams

    def counts() -> dict[str, int]:
        return {key: stat_total(model, key) for key in ("hits", "misses", "bytes_moved")}

    after_prompt = []
    result = model.generate_detailed([PROMPT], tokens, SamplingParams(),  # jmoe_decode's length: no new compile
                                     on_tokens=lambda _: after_prompt or after_prompt.append(counts()),
                                     run_ahead=run_ahead)
    per_step = {key: (value - after_prompt[0][key]) / result.decode_steps for key, value in counts().items()}
    return {**per_step, "tokens_per_s": result.decode_steps / result.decode_seconds}


def measured_copy_gbs(result: SectionResult) -> float | None:
    value = result.measurements.get("in-program expert copies, GB/s")
    return value if value is not None and math.isfinite(value) else None
