"""Benchmark jmoe.kernels.moe_ffn backends on Mixtral-8x7B and Qwen3-30B-A3B expert shapes.

Reports tokens/s and achieved GB/s = bytes of expert weights the step needs (distinct slots
referenced x slot size) / median time. Without --full the dims are divided by --scale (8) so a
CPU run finishes in a few minutes; --full uses the real dims in bf16 and, on GPU, adds the
share of HBM bandwidth at decode and of peak bf16 TFLOP/s at prefill.

  JAX_PLATFORMS=cpu python -m bench.kernels            # scaled, float32, CPU
  python -m bench.kernels --full --hbm-gbs 3350 --peak-tflops 989   # H100 SXM
  JAX_PLATFORMS=cpu python -m bench.kernels --smoke    # dims / 64, T = 1 and 64, one timed call each
"""

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.helpers.common import add_smoke_argument, smoke_run
from jmoe.kernels import moe_ffn

MODELS = {
    # name: (d_model, expert ffn dim f, experts E, top-k)
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
}
DECODE_T = (1, 4, 16)
PREFILL_T = (512, 4096)
SMOKE_DECODE_T, SMOKE_PREFILL_T, SMOKE_SCALE = (1,), (64,), 64


def plain_ragged_dot(x_sorted, group_sizes, w_gate_up, w_down):
    """The grouped GEMMs alone on pre-sorted rows: the floor the xla backend adds routing to."""
    f = w_down.shape[1]
    gu = jax.lax.ragged_dot(x_sorted, w_gate_up, group_sizes, preferred_element_type=jnp.float32)
    h = (jax.nn.silu(gu[:, :f]) * gu[:, f:]).astype(x_sorted.dtype)
    return jax.lax.ragged_dot(h, w_down, group_sizes, preferred_element_type=jnp.float32)


def time_fn(fn, args, min_time, max_reps):
    out = fn(*args)
    jax.block_until_ready(out)  # compile
    jax.block_until_ready(fn(*args))  # warm
    times = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() - start < min_time):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def backends_for(platform, num_tokens, top_k):
    names = ["xla_tiled"]
    # XLA:CPU lowers ragged_dot densely (every slot for every row): past T=512 a single call
    # takes tens of seconds here, so the CPU run measures it at decode and T=512 only.
    if platform != "cpu" or num_tokens <= 512:
        names += ["xla", "ragged_dot"]
    if num_tokens * top_k <= 64 * 8:
        names.insert(0, "gather")
    # The reference gathers weights per (token, j): T*k slot copies, only viable at decode.
    if num_tokens * top_k <= 256:
        names.insert(0, "reference")
    if num_tokens * top_k <= 128:  # one unrolled FFN per (token, j): decode-sized steps only
        names.append("pairs")
    if platform == "gpu":
        names += ["pallas", "triton"]
    names.append("auto")
    return names


def run(args):
    platform = jax.default_backend()
    dtype = jnp.bfloat16 if args.full else jnp.float32
    scale = 1 if args.full else args.scale
    rows = []
    rng = np.random.default_rng(0)
    for model, (d, f, num_experts, top_k) in MODELS.items():
        d, f = d // scale, f // scale
        key = jax.random.key(0)
        w_gate_up = (jax.random.normal(key, (num_experts, d, 2 * f), jnp.float32) / d**0.5)
        w_down = (jax.random.normal(key, (num_experts, f, d), jnp.float32) / f**0.5)
        w_gate_up, w_down = w_gate_up.astype(dtype), w_down.astype(dtype)
        slot_bytes = (d * 2 * f + f * d) * jnp.dtype(dtype).itemsize
        for num_tokens in args.decode_tokens + args.prefill_tokens:
            phase = "decode" if num_tokens in args.decode_tokens else "prefill"
            x = jnp.asarray(rng.normal(size=(num_tokens, d)), dtype)
            slot_ids = np.argsort(rng.random((num_tokens, num_experts)), axis=1)[:, :top_k]
            slot_ids = jnp.asarray(slot_ids, jnp.int32)
            weights = jnp.asarray(rng.random((num_tokens, top_k)), jnp.float32)
            needed = len(np.unique(np.asarray(slot_ids)))
            flops = 2 * num_tokens * top_k * 3 * d * f
            for backend in backends_for(platform, num_tokens, top_k):
                if backend == "ragged_dot":
                    flat = np.asarray(slot_ids).reshape(-1)
                    order = np.argsort(flat, kind="stable")
                    sizes = jnp.asarray(np.bincount(flat, minlength=num_experts), jnp.int32)
                    fn = jax.jit(plain_ragged_dot)
                    call_args = (x[order // top_k], sizes, w_gate_up, w_down)
                else:
                    fn = jax.jit(functools.partial(moe_ffn, backend=backend))
                    call_args = (x, slot_ids, weights, w_gate_up, w_down)
                try:
                    sec = time_fn(fn, call_args, args.min_time, args.max_reps)
                except Exception as err:  # e.g. triton without jax-triton: report, go on (a smoke run fails)
                    if args.smoke:
                        raise
                    rows.append((model, phase, num_tokens, backend, None, None, None,
                                 str(err).splitlines()[0][:80]))
                    continue
                gbs = needed * slot_bytes / sec / 1e9
                tflops = flops / sec / 1e12
                if platform == "gpu" and phase == "decode" and args.hbm_gbs:
                    share = f"{100 * gbs / args.hbm_gbs:.1f}% HBM"
                elif platform == "gpu" and phase == "prefill" and args.peak_tflops:
                    share = f"{100 * tflops / args.peak_tflops:.1f}% bf16 peak"
                else:
                    share = ""
                rows.append((model, phase, num_tokens, backend, sec * 1e3,
                             num_tokens / sec, gbs, share or f"{tflops:.3f} TFLOP/s"))
                print(format_row(rows[-1]), flush=True)
    return rows


def format_row(row):
    model, phase, t, backend, ms, tok_s, gbs, note = row
    if ms is None:
        return f"| {model} | {phase} | {t} | {backend} | - | - | - | {note} |"
    return (f"| {model} | {phase} | {t} | {backend} | {ms:.3f} | {tok_s:,.0f} | {gbs:.2f} "
            f"| {note} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="real dims, bf16 (GPU sizes)")
    parser.add_argument("--scale", type=int, default=8, help="divide d and f by this (not --full)")
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds of repeats per case")
    parser.add_argument("--max-reps", type=int, default=10)
    parser.add_argument("--hbm-gbs", type=float, default=3350.0, help="GPU HBM GB/s (H100 SXM)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="GPU dense bf16 TFLOP/s")
    add_smoke_argument(parser)
    args = parser.parse_args()
    args.decode_tokens, args.prefill_tokens = (SMOKE_DECODE_T, SMOKE_PREFILL_T) if args.smoke else (DECODE_T, PREFILL_T)
    if args.smoke:  # prints only, like a real run (its work directory stays empty)
        args.full, args.scale, args.min_time, args.max_reps = False, SMOKE_SCALE, 0.0, 1
    with smoke_run(args):  # before JAX starts: a smoke run's XLA flags
        print(f"platform={jax.default_backend()} devices={jax.devices()} "
              f"scale={'1 (full)' if args.full else args.scale}")
        print("| model | phase | T | backend | ms (median) | tokens/s | GB/s (expert bytes) | note |")
        print("|---|---|---|---|---|---|---|---|")
        run(args)


if __name__ == "__main__":
    main()
