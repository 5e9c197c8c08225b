"""bench.depth's h100_chain part, run by it in a process of its own (`main`): JAX on its CPU platform before any backend
starts, so that the CUDA plugin offers compile-only H100 topologies (as jmoe.plan.compile_worker, whose step
arguments it builds). A model's greedy decode step (batch 1, 1,024 cache columns), every expert resident or offloaded
with 16 cache slots a layer and router prefetch, compiled for an H100 from abstract parameters, nothing allocated: as
one program over every layer (jmoe.decode.steps.make_step_fn) and chained in layer blocks (jmoe.decode.chain), each
at several depths. Prints Markdown table rows.
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

import jax

jax.config.update("jax_platforms", "cpu")

import numpy as np  # noqa: E402


def compile_decode(spec: dict, layers: int, chained: bool, layers_per_program: int,
                   options) -> tuple[float, int, object]:
    """(compile seconds, programs compiled, jmoe.plan.hlo.control_flow of their HLO) of the decode step."""
    from flax import nnx

    from jmoe.config import parse_config
    from jmoe.decode import chain
    from jmoe.decode.steps import make_step_fn
    from jmoe.kernels.target import compiling_for_gpu
    from jmoe.plan.compile_worker import step_arguments
    from jmoe.plan.hlo import control_flow
    from jmoe.plan.programs import CompileJob
    from jmoe.plan.targets import compute_capability, load_target

    target = load_target("h100")
    cfg = parse_config({**spec, "num_hidden_layers": layers})
    job = CompileJob(cfg, np.dtype(cfg.dtype), options, "auto", 1, 1, 1024, target.config_text)
    with compiling_for_gpu(compute_capability(target.config_text)), \
            mock.patch.object(chain, "LAYERS_PER_PROGRAM", layers_per_program):
        graphdef, engine, mesh, args = step_arguments(job)
        with jax.set_mesh(mesh):
            steps = chain.StepChain(nnx.merge(graphdef, args[0].state), engine) if chained else None
            program = steps.step_program(True) if chained else make_step_fn(graphdef, engine, greedy=True)
            began = time.perf_counter()
            compiled = program.lower(*args).compile()
            seconds = time.perf_counter() - began
    return seconds, len(steps.pieces) if chained else 1, control_flow(compiled.as_text())


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
                seconds, programs, flow = compile_decode(spec, layers, chained, size, options)
                form = f"chained, blocks of {size}" if chained else "one program"
                print(f"| {name} | {experts} | {layers} | {form} | {seconds:.1f} | {programs} | "
                      f"{flow.loops_with_known_trip_count}, {flow.data_dependent_loops} | {flow.conditionals} |",
                      flush=True)
