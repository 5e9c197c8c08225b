"""A model's greedy decode step compiled for an H100 on this CPU, from abstract parameters, nothing allocated
(`compile_step`: as jmoe.plan.compile_worker builds the step, and chained in layer blocks where a Model would chain
it, or as asked), for bench.depth's h100_chain part (`main`, run by it in a process of its own) and
bench.gpu_decode_programs. JAX must be on its CPU platform before any backend starts, so that the CUDA plugin offers
compile-only H100 topologies; importing this module sets it.

`main`: a model's decode step (batch 1, 1,024 cache columns), every expert resident or offloaded with 16 cache
slots a layer and router prefetch, as one program over every layer (jmoe.decode.steps.make_step_fn) and chained in
layer blocks (jmoe.decode.chain), each at several depths. Prints Markdown table rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from unittest import mock

import jax

jax.config.update("jax_platforms", "cpu")

import numpy as np  # noqa: E402


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    seconds: float  # compiling every program of the step
    chained: bool
    programs_compiled: int  # distinct programs (alike blocks share one)
    programs_a_step: int  # the programs a step dispatches, in the order they run
    flow: object  # jmoe.plan.hlo.control_flow of every program a step runs
    kernels: int  # the kernels a step launches (jmoe.plan.hlo.kernel_count over its programs)
    beside_side_stream: list[int]  # per call on a second stream, the kernels scheduled beside it (side_stream_overlaps)
    scatters: list[tuple]  # (operand dims, updates dims) of each scatter of its programs (jmoe.plan.hlo.scatters)
    mb_accessed: float | None  # what a step's programs read and write, by XLA's cost analysis (None: unknown)


def compile_step(cfg, options, chained: bool | None = None, context: int = 1024) -> CompiledStep:
    """`cfg`'s greedy decode step (batch 1, `context` cache columns) with the offload `options`, compiled for an
    H100; chained as a Model would chain it (jmoe.decode.chain.chains) unless `chained` says."""
    from flax import nnx

    from jmoe.decode import chain
    from jmoe.decode.steps import make_step_fn
    from jmoe.kernels.target import compiling_for_gpu
    from jmoe.plan.compile_worker import cost_analysis, step_arguments
    from jmoe.plan.hlo import control_flow, kernel_count, module_count, scatters, side_stream_overlaps
    from jmoe.plan.programs import CompileJob
    from jmoe.plan.targets import compute_capability, load_target

    target = load_target("h100")
    job = CompileJob(cfg, np.dtype(cfg.dtype), options, "auto", 1, 1, context, target.config_text)
    with compiling_for_gpu(compute_capability(target.config_text)):
        graphdef, engine, mesh, args = step_arguments(job)
        with jax.set_mesh(mesh):
            chained = chain.chains(cfg, engine) if chained is None else chained
            steps = chain.StepChain(nnx.merge(graphdef, args[0].state), engine) if chained else None
            program = steps.step_program(True) if chained else make_step_fn(graphdef, engine, greedy=True)
            began = time.perf_counter()
            compiled = program.lower(*args).compile()
            seconds = time.perf_counter() - began
    text = compiled.as_text()
    costs = [cost_analysis(piece) for piece in (compiled.pieces if chained else [compiled])]
    accessed = None if None in costs else sum(cost.get("bytes accessed", math.nan) for cost in costs) / 1e6
    return CompiledStep(seconds, chained, len(steps.pieces) if chained else 1, module_count(text), control_flow(text),
                        kernel_count(text), side_stream_overlaps(text), scatters(text), accessed)


def compile_decode(spec: dict, layers: int, chained: bool, layers_per_program: int, options) -> CompiledStep:
    """compile_step of `spec` cut to `layers` decoder layers, chained in blocks of `layers_per_program` or not."""
    from jmoe.config import parse_config
    from jmoe.decode import chain

    with mock.patch.object(chain, "LAYERS_PER_PROGRAM", layers_per_program):
        return compile_step(parse_config({**spec, "num_hidden_layers": layers}), options, chained)


def main(argv: list[str] | None = None) -> None:
    from bench.helpers.common import DEFAULT_MODEL, smoke_spec
    from bench.plan import MODELS
    from jmoe.offload.options import OffloadOptions

    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:  # the shipped model's layer at smoke width, blocks of one layer
        import json
        config = json.loads((DEFAULT_MODEL / "config.json").read_text())
        name, spec, size = "default width (smoke)", smoke_spec(config), 1
        engines = {"resident": ((2,), OffloadOptions()), "cache 2": ((2,), OffloadOptions(cache=2, prefetch=1))}
    else:
        name, spec, size = "DeepSeek-V3", MODELS["deepseek-v3"], None
        engines = {"resident": ((8, 32, 61), OffloadOptions()),
                   "cache 16, prefetch 2": ((8, 61), OffloadOptions(cache=16, prefetch=2))}
    from jmoe.decode.chain import LAYERS_PER_PROGRAM

    size = size or LAYERS_PER_PROGRAM
    print("| model | experts | layers | step | decode compile (s) | programs compiled | loops (known trip count, "
          "data-dependent) | conditionals |")
    print("|---|---|---|---|---|---|---|---|")
    for experts, (depths, options) in engines.items():
        for layers in depths:
            for chained in (False, True):
                step = compile_decode(spec, layers, chained, size, options)
                flow = step.flow
                form = f"chained, blocks of {size}" if chained else "one program"
                print(f"| {name} | {experts} | {layers} | {form} | {step.seconds:.1f} | {step.programs_compiled} | "
                      f"{flow.loops_with_known_trip_count}, {flow.data_dependent_loops} | {flow.conditionals} |",
                      flush=True)
