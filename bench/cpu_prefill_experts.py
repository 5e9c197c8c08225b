"""The expert products of a 512-token prompt on CPU: jmoe's kernel against grouped products of exact sizes.

Where the resident-prefill target (jmoe >= 1.2x transformers) stands on a machine: the expert FFNs (SwiGLU, float32)
of the 8 MoE layers of bench.compare_cpu's Mixtral-shaped checkpoint (16 experts of 512 x 1024, top-2), with that
checkpoint's own routing of compare_cpu's 512-token prompt (transformers' router logits), computed five ways, each
in its own process, alternated, medians:
- jmoe: `ExpertKernel("auto")` on per-expert views, what jmoe's prompt step runs on a CPU: one program for every
  routing (group sizes are run-time values), each expert's rows in chunks of static size.
- XLA, sizes compiled in: one dot per expert of exactly its rows, every size a compile-time constant. A bound for
  static-shape XLA programs, not an option (it would compile once per routing).
- lax.ragged_dot: XLA's grouped product with run-time sizes (XLA:CPU computes it over every expert).
- PyTorch `_grouped_mm`: exact sizes at run time, the experts implementation transformers runs.
- NumPy (OpenBLAS): exact-size matmuls per expert, what a host callback from the step could run.
Each way routes the rows too (sort by expert, gather, weighted combine), as a prompt step does.

  JAX_PLATFORMS=cpu python -m bench.cpu_prefill_experts      (about five minutes; needs a quiet machine)
  JAX_PLATFORMS=cpu python -m bench.cpu_prefill_experts --smoke   (a toy checkpoint and prompt, one round, no result
                                                                  file; XLA's three ways share one process)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np

from bench.compare_cpu import load_average, load_warning, prompt_ids, quiet_start_load
from bench.decode import COMPARE_MODELS, compare_models
from bench.helpers.common import add_smoke_argument, per_expert_copies, smoke_run, write_random_checkpoint, write_result

# The same at smoke size; layers, hidden size and width are the checkpoint's (`spec`, compare_models).
EXPERTS, TOP_K = COMPARE_MODELS["mixtral"]["num_local_experts"], COMPARE_MODELS["mixtral"]["num_experts_per_tok"]
WAYS = {"jmoe": "jmoe (auto, per-expert views)", "xla_static": "XLA, sizes compiled in (bound)",
        "ragged_dot": "lax.ragged_dot (XLA:CPU)", "torch": "PyTorch _grouped_mm", "numpy": "NumPy matmuls (OpenBLAS)"}


def checkpoint_routing(directory: Path, prompt_len: int) -> np.ndarray:
    """[layers, tokens, top_k] expert ids the checkpoint's routers pick for the compare prompt (transformers)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids(prompt_len, model.config.vocab_size)]),
                       output_router_logits=True).router_logits
    return np.stack([layer.topk(TOP_K, dim=-1).indices.numpy() for layer in logits]).astype(np.int32)


def problem(routing: np.ndarray, spec: dict):
    """The same inputs in every process: x [T, d], combine weights [L, T, k], stacked experts per layer."""
    rng = np.random.default_rng(0)
    layers, tokens = routing.shape[:2]
    hidden, width = spec["hidden_size"], spec["intermediate_size"]
    x = rng.standard_normal((tokens, hidden), dtype=np.float32)
    combine = rng.random((layers, tokens, TOP_K), dtype=np.float32)
    combine /= combine.sum(-1, keepdims=True)
    experts = [(rng.standard_normal((EXPERTS, hidden, 2 * width), dtype=np.float32) * 0.02,
                rng.standard_normal((EXPERTS, width, hidden), dtype=np.float32) * 0.02) for _ in range(layers)]
    return x, combine, experts


def xla_way(way: str, routing, x, combine, experts):
    """fn() -> [T, d] numpy: the sum over layers of each layer's expert output, as one jitted program."""
    import jax
    import jax.numpy as jnp

    from jmoe.kernels import ExpertKernel, ExpertWeights, per_expert_views

    tokens = routing.shape[1]
    layers = [ExpertWeights(jnp.asarray(gate_up), jnp.asarray(down)) for gate_up, down in experts]
    # Experts below MIN_EXPERT_BYTES (a smoke run's) get no views: copies give every way the same layout.
    layers = [e._replace(per_expert=per_expert_views(e) or per_expert_copies(e)) for e in layers]

    def swiglu(rows, gate_up, down):
        gate, up = jnp.split(rows @ gate_up, 2, axis=-1)
        return (jax.nn.silu(gate) * up) @ down

    def combined(y_sorted, order, weights):
        y = jnp.zeros_like(y_sorted).at[order].set(y_sorted * weights.reshape(-1)[order][:, None])
        return y.reshape(tokens, TOP_K, -1).sum(axis=1)

    def static_layer(x, ids, weights, experts, layer):
        flat = routing[layer].reshape(-1)
        order = np.argsort(flat, kind="stable")
        rows, start, outs = x[order // TOP_K], 0, []
        for expert, size in enumerate(np.bincount(flat, minlength=EXPERTS)):
            if size:
                view = experts.per_expert[expert]
                outs.append(swiglu(rows[start:start + size], view.w_gate_up[0], view.w_down[0]))
                start += size
        return combined(jnp.concatenate(outs), order, weights)

    def ragged_layer(x, ids, weights, experts, layer):
        flat = ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        sizes = jnp.bincount(flat, length=EXPERTS).astype(jnp.int32)
        gate, up = jnp.split(jax.lax.ragged_dot(x[order // TOP_K], experts.w_gate_up, sizes), 2, axis=-1)
        return combined(jax.lax.ragged_dot(jax.nn.silu(gate) * up, experts.w_down, sizes), order, weights)

    kernel = ExpertKernel("auto", "swiglu")
    per_layer = {"jmoe": lambda x, ids, weights, experts, layer: kernel(x, ids, weights, experts),
                 "xla_static": static_layer, "ragged_dot": ragged_layer}[way]

    @jax.jit
    def run(x, ids, weights, layers):
        return sum(per_layer(x, ids[i], weights[i], layers[i], i) for i in range(len(layers)))

    args = (jnp.asarray(x), jnp.asarray(routing), jnp.asarray(combine), layers)
    return lambda: np.asarray(run(*args))


def torch_way(routing, x, combine, experts):
    import torch

    tokens = routing.shape[1]
    x, ids, combine = torch.from_numpy(x), torch.from_numpy(routing).long(), torch.from_numpy(combine)
    layers = [(torch.from_numpy(gate_up), torch.from_numpy(down)) for gate_up, down in experts]

    def run():
        total = torch.zeros_like(x)
        for layer, (gate_up, down) in enumerate(layers):
            flat = ids[layer].reshape(-1)
            order = torch.argsort(flat, stable=True)
            offsets = torch.cumsum(torch.bincount(flat, minlength=EXPERTS), 0).to(torch.int32)
            gate, up = torch._grouped_mm(x[order // TOP_K], gate_up, offs=offsets).chunk(2, dim=-1)
            y_sorted = torch._grouped_mm(torch.nn.functional.silu(gate) * up, down, offs=offsets)
            y = torch.zeros_like(y_sorted).index_copy_(0, order, y_sorted * combine[layer].reshape(-1)[order, None])
            total += y.view(tokens, TOP_K, -1).sum(1)
        return total.numpy()

    def no_grad_run():
        with torch.inference_mode():
            return run()

    return no_grad_run


def numpy_way(routing, x, combine, experts):
    tokens = routing.shape[1]

    def run():
        total = np.zeros_like(x)
        for layer, (gate_up, down) in enumerate(experts):
            flat = routing[layer].reshape(-1)
            order = np.argsort(flat, kind="stable")
            rows, y_sorted, start = x[order // TOP_K], np.empty((flat.size, x.shape[1]), np.float32), 0
            for expert, size in enumerate(np.bincount(flat, minlength=EXPERTS)):
                gate, up = np.split(rows[start:start + size] @ gate_up[expert], 2, axis=-1)
                y_sorted[start:start + size] = (gate / (1 + np.exp(-gate)) * up) @ down[expert]
                start += size
            y = np.empty_like(y_sorted)
            y[order] = y_sorted * combine[layer].reshape(-1)[order, None]
            total += y.reshape(tokens, TOP_K, -1).sum(1)
        return total

    return run


def worker(args) -> None:
    """Times each of `args.ways` (one, except in a smoke run) in this process; prints {way: samples} as JSON."""
    routing = np.load(args.workdir / "routing.npy")
    inputs = (routing, *problem(routing, compare_models(args.smoke)["mixtral"]))
    timed = {}
    for way in args.ways.split(","):
        run = (torch_way(*inputs) if way == "torch" else numpy_way(*inputs) if way == "numpy"
               else xla_way(way, *inputs))
        start = time.perf_counter()
        out = run()  # compiles the XLA ways
        first = time.perf_counter() - start
        np.save(args.workdir / f"out_{way}.npy", out)
        samples = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            run()
            samples.append(time.perf_counter() - start)
        timed[way] = {"seconds": samples, "first": first}
    print(json.dumps(timed))


def processes(smoke: bool) -> list[tuple[str, ...]]:
    """The ways each process of a round times: one each, or in a smoke run (where starting JAX is much of a process's
    time) XLA's three in one process."""
    xla = ("jmoe", "xla_static", "ragged_dot")
    return [xla, *[(way,) for way in WAYS if way not in xla]] if smoke else [(way,) for way in WAYS]


def measure(ways: tuple[str, ...], args) -> dict[str, dict]:
    command = [sys.executable, "-m", "bench.cpu_prefill_experts", "worker", "--ways", ",".join(ways),
               "--workdir", str(args.workdir), "--repeats", str(args.repeats)] + (["--smoke"] if args.smoke else [])
    before = load_average()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if done.returncode:
        raise SystemExit(f"cpu_prefill_experts: {', '.join(ways)} failed (exit {done.returncode}):\n"
                         f"{done.stderr[-3000:]}")
    load = (before, load_average())
    return {way: {**result, "load": load} for way, result in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def report(routing, samples, start_load, loads, args, wall) -> str:
    import torch

    spec = compare_models(args.smoke)["mixtral"]
    layers = len(routing)
    sizes = np.stack([np.bincount(routing[layer].reshape(-1), minlength=EXPERTS) for layer in range(layers)])
    flops = 2 * routing.size * 3 * spec["hidden_size"] * spec["intermediate_size"]
    reference = np.load(args.workdir / "out_torch.npy")
    jmoe_ms = statistics.median(s for r in samples["jmoe"] for s in r["seconds"]) * 1e3
    rows = []
    for way, label in WAYS.items():
        seconds = [s for r in samples[way] for s in r["seconds"]]
        ms = statistics.median(seconds) * 1e3
        diff = np.abs(np.load(args.workdir / f"out_{way}.npy") - reference).max()
        rows.append(f"| {label} | {ms:.1f} | {min(seconds) * 1e3:.1f} - {max(seconds) * 1e3:.1f} | "
                    f"{flops / ms / 1e6:.0f} | {jmoe_ms / ms:.2f}x | {samples[way][0]['first']:.1f} | {diff:.1e} |")
    return (load_warning(start_load) +
            f"Method: {args.rounds} rounds; in each, every way runs once in a fresh process; each process runs once "
            f"(compiling) and then times {args.repeats} calls; medians over all {args.rounds * args.repeats} samples. "
            f"{flops / 1e9:.1f} GFLOP per call ({layers} layers, {routing.shape[1]} tokens, top-{TOP_K}). jax "
            f"{version('jax')}, PyTorch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"NumPy {np.__version__}. 1-minute load average {start_load:.2f} when the run began; around each process "
            f"{min(loads):.2f} - {max(loads):.2f}, the run's own processes included; whole run {wall:.0f} s.\n\n"
            "| way | ms (median) | min - max | GFLOP/s | speed vs jmoe | first call s | max diff vs PyTorch |\n"
            "|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
            f"Rows per expert in each layer (the checkpoint's routing of the prompt; {routing.shape[1] * TOP_K:,} rows per "
            "layer):\n\n" +
            "\n".join(f"- layer {layer}: {' '.join(str(n) for n in sizes[layer])}" for layer in range(layers)) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", default="run", choices=["run", "worker"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/jmoe_bench"))
    parser.add_argument("--out", default="cpu_prefill_experts.md")
    parser.add_argument("--allow-load", action="store_true", help="write the report even if the machine is busy")
    parser.add_argument("--ways", help=f"worker: which ways to time, comma-separated ({', '.join(WAYS)})")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    if args.mode == "worker":
        return worker(args)
    with smoke_run(args):
        if args.smoke:
            args.rounds, args.repeats, args.prompt_len = 1, 1, 16
        compare(args)


def compare(args) -> None:
    """Every way in its own process, alternated over the rounds; the report."""
    start_load = quiet_start_load("cpu_prefill_experts", args.allow_load or args.smoke)
    args.workdir.mkdir(parents=True, exist_ok=True)
    directory = write_random_checkpoint(args.workdir / "compare_mixtral", **compare_models(args.smoke)["mixtral"])
    routing = checkpoint_routing(directory, args.prompt_len)
    np.save(args.workdir / "routing.npy", routing)
    began, samples, loads = time.perf_counter(), {way: [] for way in WAYS}, []
    for round_index in range(args.rounds):
        for ways in processes(args.smoke):
            for way, result in measure(ways, args).items():
                samples[way].append(result)
                loads += list(result["load"])
                print(f"round {round_index + 1}: {way}: median {statistics.median(result['seconds']) * 1e3:.1f} ms, "
                      f"load {result['load'][0]:.2f} -> {result['load'][1]:.2f}", file=sys.stderr, flush=True)
    body = report(routing, samples, start_load, loads, args, time.perf_counter() - began)
    print(write_result(args.out, "Expert products of a 512-token prompt on CPU: jmoe against exact sizes", body))


if __name__ == "__main__":
    main()
