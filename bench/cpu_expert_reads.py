"""How fast XLA:CPU reads expert weights at decode: stacked, and as the per-expert arrays jmoe holds on a CPU.

The expert FFNs of one decode token on the 215M compare checkpoint's shapes (8 MoE layers of 16 experts, hidden
512, width 1024, top-2, float32: 96 MB of expert weights per token), in one jitted program each:
- stacked: the `pairs` kernel on stacked [E, ...] weights. XLA:CPU copies every expert slice a dot reads before
  the dot.
- per-expert arrays: the same kernel given `jmoe.kernels.per_expert_views` of those weights (what `auto` runs on
  a CPU for resident experts): the expert is chosen by `lax.switch` and read in place.
Each uses different experts at every call (cycling through random routings), so weights come from memory.
Then `pairs` against `xla_tiled` on the per-expert arrays for growing decode batches and on stacked weights of 64
and 128 small experts (where `auto` switches, jmoe.kernels.dispatch.cpu_backend), stacked against per-expert
arrays for several expert sizes (where jmoe.kernels.per_expert.MIN_EXPERT_BYTES comes from), and one
matrix-vector product [1, 512] x [512, 2048] on an expert's own array, with every core and pinned to one core (a
child process), next to the streaming read bandwidth.

  JAX_PLATFORMS=cpu python -m bench.cpu_expert_reads      (about four minutes; needs a quiet machine)
  JAX_PLATFORMS=cpu python -m bench.cpu_expert_reads --smoke   (1 layer, one row per table, no result file)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import NamedTuple

import numpy as np

from bench.helpers.common import add_smoke_argument, per_expert_copies, read_bandwidth_gbs, smoke_run, write_result

EXPERTS, HIDDEN, WIDTH, TOP_K = 16, 512, 1024, 2


class Sizes(NamedTuple):
    """What a run measures: the real run's, or a smoke run's (fewer layers, calls and rows)."""

    layers: int  # MoE layers of the decode programs
    calls: int  # most routings cycled per measurement
    batches: tuple  # decode batches of pairs against xla_tiled
    expert_shapes: tuple  # (hidden, width) of stacked against per-expert arrays
    crossings: tuple  # (slots, hidden, width) of the stacked crossing
    per_slot: tuple  # (token, choice) pairs per slot of the stacked crossing


FULL = Sizes(8, 64, (8, 16, 24, 32), ((256, 512), (512, 512), (384, 768), (512, 1024)),
             ((64, 256, 128), (128, 256, 96)), (0.5, 1, 1.5))
# a smoke run: one layer (its random experts are 100 MB of float64 to draw, and each layer compiles its own code)
SMOKE = Sizes(1, 2, (8,), ((256, 512),), ((64, 256, 128),), (1,))


def timed_ms(fn, inputs: list) -> tuple[float, float]:
    """(median ms per call over `inputs` cycled three times, first-call seconds (compilation included))."""
    start = time.perf_counter()
    fn(*inputs[0]).block_until_ready()
    first = time.perf_counter() - start
    times = []
    for _ in range(3):
        for args in inputs:
            start = time.perf_counter()
            fn(*args).block_until_ready()
            times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3, first


def gemv_ms(sizes: Sizes) -> float:
    """Median ms of x [1, d] @ w [d, 2f] over `sizes.calls` distinct arrays (a real run:
    64, 256 MB, so they come from memory)."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, HIDDEN)), jnp.float32)
    arrays = [jnp.asarray(rng.standard_normal((HIDDEN, 2 * WIDTH)), jnp.float32) for _ in range(sizes.calls)]
    return timed_ms(jax.jit(jnp.dot), [(x, w) for w in arrays])[0]


def expert_layers(rng, layers: int, hidden: int = HIDDEN, width: int = WIDTH, *, copies: bool = False) -> list:
    """`layers` layers of random stacked experts, each with its per-expert views (or, with `copies`, per-expert copies:
    the same layout at any size, where views are only made from MIN_EXPERT_BYTES on)."""
    import jax.numpy as jnp

    from jmoe.kernels import ExpertWeights, per_expert_views

    out = []
    for _ in range(layers):
        experts = ExpertWeights(jnp.asarray(rng.standard_normal((EXPERTS, hidden, 2 * width)) * 0.02, jnp.float32),
                                jnp.asarray(rng.standard_normal((EXPERTS, width, hidden)) * 0.02, jnp.float32))
        per_expert = per_expert_copies(experts) if copies else per_expert_views(experts)
        out.append(experts._replace(per_expert=per_expert))
    return out


def size_rows(rng, sizes: Sizes) -> list[str]:
    """Stacked against per-expert arrays at batch 1 for several expert sizes (where MIN_EXPERT_BYTES comes from)."""
    import jax.numpy as jnp

    rows = []
    for hidden, width in sizes.expert_shapes:
        layers = expert_layers(rng, sizes.layers, hidden, width, copies=True)
        x = jnp.asarray(rng.standard_normal((1, hidden)), jnp.float32)
        inputs = [(x, ids, jnp.asarray([[0.6, 0.4]], jnp.float32))
                  for ids in routings(rng, 1, min(32, sizes.calls), layers=sizes.layers)]
        times = [timed_ms(expert_ffns("pairs"), [(*args, experts) for args in inputs])[0]
                 for experts in ([e.stacked() for e in layers], layers)]
        mib = 3 * hidden * width * 4 / 2**20
        rows.append(f"| {hidden} x {width} | {mib:.1f} | {times[0]:.2f} | {times[1]:.2f} |")
    return rows


def stacked_crossing_rows(rng, sizes: Sizes) -> list[str]:
    """`pairs` against `xla_tiled` on stacked weights of many small experts (one layer, top-8), at 0.5, 1 and 1.5
    (token, choice) pairs per slot: where `auto` switches there (dispatch.CPU_PAIRS_PER_SLOT)."""
    import jax
    import jax.numpy as jnp

    from jmoe.kernels import moe_ffn

    rows, top_k = [], 8
    for slots, hidden, width in sizes.crossings:
        w_gate_up = jnp.asarray(rng.standard_normal((slots, hidden, 2 * width)) * 0.02, jnp.float32)
        w_down = jnp.asarray(rng.standard_normal((slots, width, hidden)) * 0.02, jnp.float32)
        for per_slot in sizes.per_slot:
            num_tokens = int(slots * per_slot) // top_k
            x = jnp.asarray(rng.standard_normal((num_tokens, hidden)), jnp.float32)
            weights = jnp.full((num_tokens, top_k), 1 / top_k, jnp.float32)
            inputs = [(x, ids[0], weights)
                      for ids in routings(rng, num_tokens, min(16, sizes.calls), experts=slots, top_k=top_k, layers=1)]
            times = [timed_ms(jax.jit(lambda x, ids, w, b=backend: moe_ffn(x, ids, w, w_gate_up, w_down, backend=b)),
                              inputs)[0] for backend in ("pairs", "xla_tiled")]
            rows.append(f"| {slots} | {hidden} x {width} | {num_tokens} | {per_slot:g} | {times[0]:.2f} | "
                        f"{times[1]:.2f} |")
    return rows


def expert_ffns(backend: str):
    """jitted fn(x, ids [L, T, k], weights, layers) running the expert FFNs of every layer with `backend`."""
    import jax

    from jmoe.kernels import ExpertKernel

    kernel = ExpertKernel(backend, "swiglu")

    def run(x, ids, weights, layers):
        for layer, experts in enumerate(layers):
            x = x + kernel(x, ids[layer], weights, experts)
        return x

    return jax.jit(run)


def routings(rng, num_tokens: int, count: int, *, layers: int, experts: int = EXPERTS, top_k: int = TOP_K) -> list:
    """`count` random routings, each [layers, num_tokens, top_k] of distinct experts per token."""
    import jax.numpy as jnp

    return [jnp.asarray(np.stack([[rng.choice(experts, top_k, replace=False) for _ in range(num_tokens)]
                                  for _ in range(layers)]), jnp.int32) for _ in range(count)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gemv-only", action="store_true", help="print the GEMV median ms and exit (child)")
    parser.add_argument("--out", default="cpu_expert_reads.md", help="result file name under bench/results")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    if args.gemv_only:
        print(gemv_ms(SMOKE if args.smoke else FULL))
        return
    with smoke_run(args):
        report(args, SMOKE if args.smoke else FULL)


def report(args, sizes: Sizes) -> None:
    import jax.numpy as jnp

    load = open("/proc/loadavg").read().split()[0]
    rng = np.random.default_rng(0)
    layers = expert_layers(rng, sizes.layers)
    stacked = [experts.stacked() for experts in layers]
    x = jnp.asarray(rng.standard_normal((1, HIDDEN)), jnp.float32)
    weights = jnp.asarray([[0.6, 0.4]], jnp.float32)
    token_routings = routings(rng, 1, sizes.calls, layers=sizes.layers)
    expert_bytes = sizes.layers * TOP_K * 3 * HIDDEN * WIDTH * 4
    rows, outputs = [], []
    for name, experts in (("stacked (pairs)", stacked), ("per-expert arrays (pairs, what auto runs)", layers)):
        fn = expert_ffns("pairs")
        ms, first = timed_ms(fn, [(x, ids, weights, experts) for ids in token_routings])
        outputs.append(np.asarray(fn(x, token_routings[1], weights, experts)))
        rows.append(f"| {name} | {ms:.2f} | {expert_bytes / ms / 1e6:.1f} | {first:.1f} |")
    agree = float(np.abs(outputs[1] - outputs[0]).max())

    batch_rows = []
    for num_tokens in sizes.batches:
        batch_x = jnp.asarray(rng.standard_normal((num_tokens, HIDDEN)), jnp.float32)
        batch_weights = jnp.tile(weights, (num_tokens, 1))
        inputs = [(batch_x, ids, batch_weights, layers)
                  for ids in routings(rng, num_tokens, min(16, sizes.calls), layers=sizes.layers)]
        times = [timed_ms(expert_ffns(backend), inputs)[0] for backend in ("pairs", "xla_tiled")]
        batch_rows.append(f"| {num_tokens} | {num_tokens * TOP_K / EXPERTS:g} | {times[0]:.1f} | {times[1]:.1f} |")

    shapes = size_rows(rng, sizes)
    crossing = stacked_crossing_rows(rng, sizes)

    one_core = subprocess.run([sys.executable, "-m", "bench.cpu_expert_reads", "--gemv-only",
                               *(["--smoke"] if args.smoke else [])], check=True,
                              capture_output=True, text=True, preexec_fn=lambda: os.sched_setaffinity(0, {0}))
    gemv_bytes = HIDDEN * 2 * WIDTH * 4
    gemv = {"every core": gemv_ms(sizes), "one core": float(one_core.stdout.split()[-1])}
    bandwidth = read_bandwidth_gbs(args.smoke)
    body = "\n".join([
        f"1-minute load average at the start: {load}. Expert weights read per token: {expert_bytes / 1e6:.1f} MB.",
        "", f"| expert FFNs of one token, {sizes.layers} layers | ms (median) | GB/s of expert weights | "
            "first call s (compile) |",
        "|---|---|---|---|", *rows, "", f"Largest difference between the two outputs: {agree:.2e}.", "",
        f"| tokens (per-expert arrays, {sizes.layers} layers) | pairs per slot | pairs ms | xla_tiled ms |",
        "|---|---|---|---|",
        *batch_rows, "",
        f"| expert d x f ({sizes.layers} layers, batch 1) | MiB per expert | stacked ms | per-expert ms |",
        "|---|---|---|---|",
        *shapes, "",
        "| slots (stacked, one layer, top-8) | expert d x f | tokens | pairs per slot | pairs ms | xla_tiled ms |",
        "|---|---|---|---|---|---|", *crossing, "",
        "| one matrix-vector product on an expert's own array | ms (median) | GB/s |", "|---|---|---|",
        *(f"| {where} | {ms:.3f} | {gemv_bytes / ms / 1e6:.1f} |" for where, ms in gemv.items()), "",
        f"Streaming read bandwidth (a jitted sum over 1 GiB, every core): {bandwidth:.1f} GB/s.", ""])
    path = write_result(args.out, "XLA:CPU expert weight reads at batch-1 decode", body)
    print(path.read_text())


if __name__ == "__main__":
    main()
