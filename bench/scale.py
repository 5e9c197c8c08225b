"""Expert parallelism over CPU devices in one process: decode tokens/s, per-device bytes and hit rates at 1, 2 and 4
devices.

  python -m bench.scale           # -> bench/results/scale_cpu.md
  python -m bench.scale --smoke   # toy size, one row per table (1 device, then 4), 2 new tokens, no result file

A Mixtral-shaped random checkpoint (16 experts, top-2) with its own (near-uniform) router, batch 4. Rows: the
experts split over N = 1, 2, 4 devices (`jmoe.load(..., devices=N)`), first with the same cache per device (the
total grows N-fold), then with the same total cache (split over the devices). Each row: a load, an unmeasured
generation (compiles, warms the caches), then the same generation measured. Hit rate: accesses whose expert sat
in its device's slots, over every device, prompt and decode of the measured generation. Bytes are per device:
its slots, its share of the pinned experts, its device-resident weights (dense weights are replicated).
The 4 CPU devices share this machine's cores and its RAM (a copy is a memcpy): the times show the step's
overheads, not a speed-up; the bytes and hit rates are the result.

Then the 8xH100 plan (not in a smoke run: bench.plan's smoke covers its code): jmoe.plan(..., devices=8) for
DeepSeek-V3 and Kimi K2 with int4 experts (header-only checkpoints, bench.plan's), cache 16 per GPU, context 4096,
programs compiled for one host's 8 H100s (extrapolated from two shallow depths): bytes per GPU and for the host,
the estimate, and what crosses between the GPUs in each compiled program.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import numpy as np

from bench.compare_cpu import load_average, load_warning, quiet_start_load
from bench.helpers.common import (add_smoke_argument, smoke_run, smoke_spec, write_random_checkpoint,
                                  write_smoke_checkpoint, write_result)

DEVICES = (1, 2, 4)
SPEC = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, num_local_experts=16, num_experts_per_tok=2, max_position_embeddings=512)
CACHE_PER_DEVICE = 2  # of each device's 16 / N experts per layer
TOTAL_CACHE = 4  # the same slots per layer over all devices
BATCH, PROMPT_LEN = 4, 16
TABLE_HEAD = ("| devices | cache per device (total) | decode tok/s | hit rate | slots MB / device | "
              "pinned experts MB / device | device MB / device |\n|---|---|---|---|---|---|---|")


def totals(stats: list[dict]) -> np.ndarray:
    """[hits, misses] over every device and layer."""
    return np.array([sum(row["hits"] for row in stats), sum(row["misses"] for row in stats)])


def measure(path: Path, devices: int, cache: int, prompts: list[list[int]], tokens: int) -> str:
    import jmoe
    from jmoe.decode.sampling import SamplingParams

    model = jmoe.load(path, cache=cache, devices=devices, progress=False, compile_cache=False)
    model.generate(prompts, max_new_tokens=tokens)  # compiles, warms the caches
    before = totals(model.stats())
    result = model.generate_detailed(prompts, tokens, SamplingParams())
    hits, misses = totals(model.stats()) - before
    placed = model.placement_plan.totals()
    tok_s = result.decode_steps * len(prompts) / result.decode_seconds
    return (f"| {devices} | {cache} ({cache * devices}) | {tok_s:.1f} | {hits / max(1, hits + misses):.1%} | "
            f"{model.placement_plan.slot_bytes / 2**20:.2f} | {placed['host_bytes'] / 2**20:.2f} | "
            f"{placed['device_bytes'] / 2**20:.2f} |")


PLANNED = ["deepseek-v3 (int4)", "kimi-k2 (int4)"]  # bench.plan's rows, planned on 8 H100s
PLANNED_CACHE, PLANNED_CONTEXT = 16, 4096


def plan_section(workdir: Path) -> str:
    """jmoe.plan of the PLANNED rows on one host's 8 H100s: bench.plan's table, and each program's collectives."""
    from bench import plan as bench_plan

    rows, crossing = [], []
    for name in PLANNED:
        model, expert_dtype = bench_plan.ROWS[name]
        directory = bench_plan.write_header_only_checkpoint(workdir / model, bench_plan.MODELS[model])
        row = bench_plan.plan_row(directory, "8xh100", PLANNED_CACHE, PLANNED_CONTEXT, True, expert_dtype,
                                  extrapolate_layers=True)
        rows.append(bench_plan.labelled(row, name, "8xh100", PLANNED_CACHE))
        for program, compiled in row["programs"].items():
            crossing += [f"- {name}, {program}: {c['count']} x {c['op']} of {', '.join(c['shapes'])} "
                         f"({c['bytes']:,} bytes each)" for c in compiled["collectives"]]
    return (f"## The 8xH100 plan\n\n`jmoe.plan(..., target=\"h100\", devices=8, cache={PLANNED_CACHE}, "
            f"context={PLANNED_CONTEXT}, extrapolate_layers=True)`; device columns per GPU, pinned host for the "
            f"host ({bench_plan.HOST_GB['8xh100']} GiB assumed).\n\n{bench_plan.table(rows)}\n\n"
            f"What crosses between the GPUs (the compiled programs' collectives):\n\n" + "\n".join(crossing) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/jmoe_scale_bench"))
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per row of the measured generation")
    parser.add_argument("--allow-load", action="store_true", help="run on a busy machine (the report says so)")
    add_smoke_argument(parser)
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", max(DEVICES))  # before JAX's CPU backend starts
    with smoke_run(args):
        start_load = quiet_start_load("bench.scale", args.allow_load or args.smoke)
        spec = smoke_spec(SPEC) if args.smoke else SPEC
        tokens = 2 if args.smoke else args.tokens
        write = write_smoke_checkpoint if args.smoke else write_random_checkpoint  # smoke: no PyTorch to import
        path = write(args.workdir / ("scale_smoke" if args.smoke else "scale"), "mixtral", **spec)
        prompts = np.random.default_rng(0).integers(0, spec["vocab_size"], (BATCH, PROMPT_LEN)).tolist()
        # smoke: the one-device row of the first table and the widest of the second (every row runs the same code and
        # compiles its own programs)
        per_device, total = ((DEVICES[0],), (DEVICES[-1],)) if args.smoke else (DEVICES, DEVICES)
        same_per_device = [measure(path, n, CACHE_PER_DEVICE, prompts, tokens) for n in per_device]
        same_total = [measure(path, n, TOTAL_CACHE // n, prompts, tokens) for n in total]
        end_load = load_average()
        body = (f"{load_warning(start_load)}Load average {start_load:.2f} at the start, {end_load:.2f} at the end.\n\n"
                f"Mixtral-shaped random checkpoint: {spec['num_hidden_layers']} layers, hidden "
                f"{spec['hidden_size']}, {spec['num_local_experts']} experts of width {spec['intermediate_size']}, "
                f"top-{spec['num_experts_per_tok']}, float32; batch {BATCH}, {PROMPT_LEN}-token random prompts, "
                f"{tokens} new tokens, greedy, LFRU, miss mode fetch. {__doc__.split(chr(10) * 2, 2)[2]}\n"
                f"## Same cache per device\n\n{TABLE_HEAD}\n" + "\n".join(same_per_device) +
                f"\n\n## Same total cache\n\n{TABLE_HEAD}\n" + "\n".join(same_total) + "\n")
        if not args.smoke:
            body += "\n" + plan_section(args.workdir)
        print(write_result("scale_cpu.md", "Expert parallelism over CPU devices", body))


if __name__ == "__main__":
    main()
