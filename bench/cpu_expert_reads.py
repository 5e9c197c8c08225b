"""How fast XLA:CPU reads expert weights at batch-1 decode, and what storing experts as separate arrays would gain.

The expert FFNs of one decode token on the 215M compare checkpoint's shapes (8 MoE layers of 16 experts, hidden
512, width 1024, top-2, float32: 96 MB of expert weights per token), run three ways in one jitted program each:
- stacked: `jmoe.kernels.moe_ffn(backend="pairs")` on stacked [E, ...] weights, what `auto` runs on CPU. XLA:CPU
  copies every expert slice a dot reads before the dot.
- split, unrolled / split, loop: the same FFNs over one array per expert, the expert chosen by `lax.switch` (no
  copy), the (token, choice) pairs unrolled or in a `lax.map` loop: the storage alternative.
Each uses different experts at every call (cycling through random routings), so weights come from memory.
Then one matrix-vector product [1, 512] x [512, 2048] on an expert's own array, with every core and pinned to
one core (a child process), next to the streaming read bandwidth.

  JAX_PLATFORMS=cpu python -m bench.cpu_expert_reads      (about a minute; needs a quiet machine)
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import time

import numpy as np

LAYERS, EXPERTS, HIDDEN, WIDTH, TOP_K = 8, 16, 512, 1024, 2


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


def gemv_ms() -> float:
    """Median ms of x [1, d] @ w [d, 2f] over 64 distinct arrays (256 MB, so they come from memory)."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, HIDDEN)), jnp.float32)
    arrays = [jnp.asarray(rng.standard_normal((HIDDEN, 2 * WIDTH)), jnp.float32) for _ in range(64)]
    return timed_ms(jax.jit(jnp.dot), [(x, w) for w in arrays])[0]


def expert_ffn_programs():
    """{name: (jitted fn(x, ids, weights, w_gate_up, w_down), stacked: bool)} for the three ways."""
    import jax
    import jax.numpy as jnp

    from jmoe.kernels import moe_ffn
    from jmoe.kernels.activations import get_activation

    act = get_activation("swiglu")

    def stacked(x, ids, weights, w_gate_up, w_down):
        for layer in range(LAYERS):
            x = x + moe_ffn(x, ids[layer], weights, w_gate_up[layer], w_down[layer], backend="pairs")
        return x

    def switch_ffn(gate_up_parts, down_parts, expert, x, weight):
        def one(i):
            def ffn(x, weight):
                gate_up = jnp.dot(x, gate_up_parts[i], preferred_element_type=jnp.float32)
                return jnp.dot(act(gate_up[:, :WIDTH], gate_up[:, WIDTH:]), down_parts[i]) * weight
            return ffn

        return jax.lax.switch(expert, [one(i) for i in range(EXPERTS)], x, weight)

    def split(x, ids, weights, w_gate_up, w_down, *, loop: bool):
        for layer in range(LAYERS):
            ffn = functools.partial(switch_ffn, w_gate_up[layer], w_down[layer])
            if loop:
                y = jax.lax.map(lambda pair: ffn(pair[0], x, pair[1]), (ids[layer, 0], weights[0])).sum(0)
            else:
                y = sum(ffn(ids[layer, 0, j], x, weights[0, j]) for j in range(TOP_K))
            x = x + y
        return x

    return {"stacked (pairs kernel, what auto runs)": (jax.jit(stacked), True),
            "split, pairs unrolled": (jax.jit(functools.partial(split, loop=False)), False),
            "split, pairs in a loop": (jax.jit(functools.partial(split, loop=True)), False)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gemv-only", action="store_true", help="print the GEMV median ms and exit (child)")
    parser.add_argument("--out", default="cpu_expert_reads.md", help="result file name under bench/results")
    args = parser.parse_args(argv)
    if args.gemv_only:
        print(gemv_ms())
        return

    import jax.numpy as jnp

    from bench.common import read_bandwidth_gbs, write_result

    load = open("/proc/loadavg").read().split()[0]
    rng = np.random.default_rng(0)
    gate_up = [jnp.asarray(rng.standard_normal((EXPERTS, HIDDEN, 2 * WIDTH)) * 0.02, jnp.float32) for _ in range(LAYERS)]
    down = [jnp.asarray(rng.standard_normal((EXPERTS, WIDTH, HIDDEN)) * 0.02, jnp.float32) for _ in range(LAYERS)]
    split_gate_up = [[w[e] for e in range(EXPERTS)] for w in gate_up]
    split_down = [[w[e] for e in range(EXPERTS)] for w in down]
    x = jnp.asarray(rng.standard_normal((1, HIDDEN)), jnp.float32)
    weights = jnp.asarray([[0.6, 0.4]], jnp.float32)
    routings = [jnp.asarray(np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(LAYERS)])[:, None],
                            jnp.int32) for _ in range(64)]
    expert_bytes = LAYERS * TOP_K * 3 * HIDDEN * WIDTH * 4
    rows, outputs = [], []
    for name, (fn, is_stacked) in expert_ffn_programs().items():
        w = (gate_up, down) if is_stacked else (split_gate_up, split_down)
        ms, first = timed_ms(fn, [(x, ids, weights, *w) for ids in routings])
        outputs.append(np.asarray(fn(x, routings[1], weights, *w)))
        rows.append(f"| {name} | {ms:.2f} | {expert_bytes / ms / 1e6:.1f} | {first:.1f} |")
    agree = max(float(np.abs(o - outputs[0]).max()) for o in outputs)

    one_core = subprocess.run([sys.executable, "-m", "bench.cpu_expert_reads", "--gemv-only"], check=True,
                              capture_output=True, text=True, preexec_fn=lambda: os.sched_setaffinity(0, {0}))
    gemv_bytes = HIDDEN * 2 * WIDTH * 4
    gemv = {"every core": gemv_ms(), "one core": float(one_core.stdout.split()[-1])}
    bandwidth = read_bandwidth_gbs()
    body = "\n".join([
        f"1-minute load average at the start: {load}. Expert weights read per token: {expert_bytes / 1e6:.1f} MB.",
        "", "| expert FFNs of one token, 8 layers | ms (median) | GB/s of expert weights | first call s (compile) |",
        "|---|---|---|---|", *rows, "", f"Largest difference between the three outputs: {agree:.2e}.", "",
        "| one matrix-vector product on an expert's own array | ms (median) | GB/s |", "|---|---|---|",
        *(f"| {where} | {ms:.3f} | {gemv_bytes / ms / 1e6:.1f} |" for where, ms in gemv.items()), "",
        f"Streaming read bandwidth (a jitted sum over 1 GiB, every core): {bandwidth:.1f} GB/s.", ""])
    path = write_result(args.out, "XLA:CPU expert weight reads at batch-1 decode", body)
    print(path.read_text())


if __name__ == "__main__":
    main()
