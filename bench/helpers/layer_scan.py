"""bench.depth's scan part, run by it in a process of its own (`main`): JAX on its CPU platform before any backend
starts, so that the CUDA plugin offers compile-only H100 topologies (as jmoe.plan.compile_worker). Prints Markdown
table rows.

CPU: L dense layers (x + tanh(x W1) W2) at batch 1, the loop unrolled over per-layer weights against `lax.scan` over
stacked ones: XLA:CPU runs a product from a buffer, so it copies the slice of a stacked weight each iteration reads;
and against a loop over the per-layer weights that picks each layer's arrays with lax.switch, which slices nothing.
H100 (compile-only): L stand-in MoE layers (x + tanh(x Wq), a router's top-k, jmoe.kernels.moe_ffn's Triton grouped
GEMM): unrolled; scanned over slices of the stacked experts; scanned with the ids offset into every layer's experts.
The dense layers for an H100 too: XLA:GPU also copies what a product reads of a stacked weight (one
`dynamic_slice_fusion` per weight and layer), so a scan on a GPU reads weights in place only through kernels that
take the layer as an offset.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import time

import jax

jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def dense_layer(x, w1, w2):
    return x + jnp.tanh(x @ w1) @ w2


def unrolled_dense(x, w1s, w2s):
    for w1, w2 in zip(w1s, w2s):
        x = dense_layer(x, w1, w2)
    return x


def scanned_dense(x, w1, w2):
    return jax.lax.scan(lambda x, w: (dense_layer(x, *w), None), x, (w1, w2))[0]


def switched_dense(x, w1s, w2s):
    """The layer loop under lax.fori_loop over per-layer weights, each product taking its layer's own array through
    lax.switch (a branch a layer, one product each): nothing is sliced out of a stack, so XLA:CPU reads them in
    place."""

    def product(layer, v, weights):
        return jax.lax.switch(layer, [lambda v, w=w: v @ w for w in weights], v)

    return jax.lax.fori_loop(0, len(w1s), lambda i, x: x + product(i, jnp.tanh(product(i, x, w1s)), w2s), x)


def median_step_ms(compiled, args, repeats: int) -> float:
    compiled(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(10):
            out = compiled(*args)
        out.block_until_ready()
        times.append((time.perf_counter() - start) / 10)
    return 1e3 * float(np.median(times))


def cpu_rows(shapes, depths, repeats: int) -> list[str]:
    rows = ["| CPU, dense layers | layers | d x f | dtype | unrolled: compile s, step ms | scanned: compile s, "
            "step ms | looped, weights by switch: compile s, step ms | scanned / unrolled step | switch / unrolled "
            "step |", "|---|---|---|---|---|---|---|---|---|"]
    rng = np.random.default_rng(0)
    for layers, (d, f, dtype) in ((layers, shape) for layers in depths for shape in shapes):
        w1 = [jnp.asarray(rng.standard_normal((d, f)) * 0.02, dtype) for _ in range(layers)]
        w2 = [jnp.asarray(rng.standard_normal((f, d)) * 0.02, dtype) for _ in range(layers)]
        x = jnp.ones((1, d), dtype)
        results = []
        for fn, weights in ((unrolled_dense, (w1, w2)), (scanned_dense, (jnp.stack(w1), jnp.stack(w2))),
                            (switched_dense, (w1, w2))):
            start = time.perf_counter()
            compiled = jax.jit(fn).lower(x, *weights).compile()
            results.append((time.perf_counter() - start, median_step_ms(compiled, (x, *weights), repeats)))
        (cu, su), (cs, ss), (cw, sw) = results
        rows.append(f"| | {layers} | {d} x {f} | {jnp.dtype(dtype).name} | {cu:.2f}, {su:.3f} | {cs:.2f}, {ss:.3f} "
                    f"| {cw:.2f}, {sw:.3f} | {ss / su:.2f}x | {sw / su:.2f}x |")
    return rows


@contextlib.contextmanager
def compiling_for_h100():
    """Within it, programs trace and compile for a compile-only H100; yields a function making bfloat16 shape
    structs on its one device."""
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    from jmoe.kernels.target import compiling_for_gpu
    from jmoe.plan.targets import compute_capability, load_target

    target = load_target("h100")
    topology = topologies.get_topology_desc(platform="cuda", target_config=target.config_text, topology="1x1x1")
    mesh = topologies.make_mesh(topology, (1,), ("x",))

    def struct(shape):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec()))

    with compiling_for_gpu(compute_capability(target.config_text)), jax.set_mesh(mesh):
        yield struct


def h100_rows(depths, d: int, f: int, experts: int, top_k: int) -> list[str]:
    from jmoe.kernels import moe_ffn

    dtype = jnp.bfloat16

    def moe_layer(x, wq, router, w_gate_up, w_down, offset=0):
        h = x + jnp.tanh(x @ wq)
        scores, ids = jax.lax.top_k((h @ router).astype(jnp.float32), top_k)
        y = moe_ffn(h, ids.astype(jnp.int32) + offset, jax.nn.softmax(scores).astype(dtype), w_gate_up, w_down)
        return h + y.astype(dtype)

    def unrolled(x, wq, router, w_gate_up, w_down):
        for layer in zip(wq, router, w_gate_up, w_down):
            x = moe_layer(x, *layer)
        return x

    def scanned(x, wq, router, w_gate_up, w_down):
        return jax.lax.scan(lambda x, w: (moe_layer(x, *w), None), x, (wq, router, w_gate_up, w_down))[0]

    def offset_ids(x, wq, router, w_gate_up, w_down):
        layers = wq.shape[0]
        every_gate_up = w_gate_up.reshape(layers * experts, *w_gate_up.shape[2:])  # a bitcast: nothing copied
        every_down = w_down.reshape(layers * experts, *w_down.shape[2:])
        body = lambda x, w: (moe_layer(x, w[0], w[1], every_gate_up, every_down, w[2] * experts), None)  # noqa: E731
        return jax.lax.scan(body, x, (wq, router, jnp.arange(layers)))[0]

    shapes = ((d, d), (d, experts), (experts, d, 2 * f), (experts, f, d))
    rows = [f"| H100 compile-only, MoE layers (d {d}, f {f}, {experts} experts, top-{top_k}, bf16) | layers | "
            "compile s | temporaries MiB | fusions | Triton calls |", "|---|---|---|---|---|---|"]
    with compiling_for_h100() as struct:
        for layers in depths:
            for name, fn in (("unrolled", unrolled), ("scanned over slices", scanned),
                             ("scanned, ids offset", offset_ids)):
                weights = ([[struct(shape)] * layers for shape in shapes] if fn is unrolled
                           else [struct((layers, *shape)) for shape in shapes])
                lowered = jax.jit(fn).trace(struct((1, d)), *weights).lower()
                start = time.perf_counter()
                compiled = lowered.compile()
                seconds = time.perf_counter() - start
                text = compiled.as_text()
                temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
                rows.append(f"| {name} | {layers} | {seconds:.2f} | {temp:.1f} | {text.count(' fusion(')} | "
                            f"{text.count('__gpu$xla.gpu.triton')} |")
    return rows


def h100_dense_rows(layers: int, d: int, f: int, batches) -> list[str]:
    """Dense layers compiled for an H100, unrolled and scanned over stacked weights: what the scanned program
    copies out of the stack every layer (XLA:GPU's `dynamic_slice_fusion`, a copy the product then reads)."""
    rows = [f"| H100 compile-only, dense layers (d {d}, f {f}, bf16) | batch | layers | temporaries MiB | "
            "weights a layer MiB | sliced out of the stack a layer: copies, MiB |", "|---|---|---|---|---|---|"]
    with compiling_for_h100() as struct:
        for batch in batches:
            for name, fn in (("unrolled", unrolled_dense), ("scanned", scanned_dense)):
                weights = ([[struct((d, f))] * layers, [struct((f, d))] * layers] if fn is unrolled_dense
                           else [struct((layers, d, f)), struct((layers, f, d))])
                compiled = jax.jit(fn).trace(struct((batch, d)), *weights).lower().compile()
                # The dynamic-slice fusions (not their bodies' copy) whose result is a whole weight of a layer.
                copies = [line for line in compiled.as_text().splitlines()
                          if '"dynamic_slice_fusion"' in line and " fusion(" in line
                          and sorted(n for n in _dims(line) if n != 1) == sorted((d, f))]
                temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
                weight_mib = d * f * jnp.dtype(jnp.bfloat16).itemsize / 2**20
                rows.append(f"| {name} | {batch} | {layers} | {temp:.1f} | {2 * weight_mib:.1f} | "
                            f"{len(copies)}, {len(copies) * weight_mib:.1f} |")
    return rows


def _dims(instruction: str) -> list[int]:
    """The dimensions of an HLO instruction's (first) result, e.g. [1, 2048, 8192] of `%f = bf16[1,2048,8192]{...}`."""
    dims = re.search(r"= \(?\w+\[([\d,]*)\]", instruction).group(1)
    return [int(n) for n in dims.split(",") if n]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        rows = (cpu_rows([(32, 64, jnp.float32)], (2,), 2) + [""] + h100_rows((2,), 64, 32, 4, 2) + [""]
                + h100_dense_rows(2, 64, 128, (1,)))
    else:
        shapes = [(192, 384, jnp.float32), (1024, 4096, jnp.float32), (1024, 4096, jnp.bfloat16)]
        rows = (cpu_rows(shapes, (8,), 7) + cpu_rows(shapes[:2], (32,), 5)[2:] + [""]
                + h100_rows((8, 32, 61), 2048, 1024, 16, 2) + [""]
                + h100_dense_rows(8, 2048, 8192, (1, 64)))
    print("\n".join(rows))
