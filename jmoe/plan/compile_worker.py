"""Child process of jmoe.plan.programs: compile some of jmoe's generation steps for a GPU this machine does not
have, and write each one's memory analysis and optimized HLO.

`python -m jmoe.plan.compile_worker JOBS` reads the pickled list of (CompileJob, OUT_DIR) pairs (jmoe.plan.workers
writes it); for each it builds the step exactly as a Model does (jmoe.decode.steps.make_step_fn over the engine the
placement asks for) but from abstract parameters, traces it for a compile-only CUDA topology of the job's devices
(the target config; N > 1: one host's N GPUs, the experts split over them by jmoe.offload.expert_parallel) and
writes OUT_DIR/hlo.txt, then OUT_DIR/result.json. The programs are traced and lowered one after another and each
compiled on a thread of its own as soon as it is lowered: XLA's compile releases the GIL, so one process imports
JAX and jmoe once for all of a plan's programs and a multi-core machine still compiles them side by side. It runs
in a process apart because JAX must be on `jax_platforms=cpu` before any backend starts for the CUDA plugin to
offer compile-only topologies, and because some XLA:GPU compiler failures abort the process instead of raising.

Pinned-host parameters get a sharding on the mesh's AbstractMesh under `jax.set_mesh`: the concrete
compile-only mesh has no memory kinds, and this is the way the compiled program still places them in
host memory (`host_argument_size_in_bytes`). The mesh and the target's compute capability
(jmoe.kernels.target.compiling_for_gpu) are needed while tracing and lowering only.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
from flax import nnx
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec

from jmoe.collector import freeze_loaded
from jmoe.decode.steps import abstract_step_inputs, make_step_fn
from jmoe.kernels.target import compiling_for_gpu
from jmoe.memory import PINNED_HOST
from jmoe.model.params import StepParams, abstract_model, flat_params, nest_params
from jmoe.offload.engine import make_engine
from jmoe.offload.expert_parallel import EXPERT_AXIS, ExpertParallelEngine, device_placement, param_spec
from jmoe.plan.targets import compute_capability

MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
                 "generated_code_size_in_bytes", "peak_memory_in_bytes", "host_argument_size_in_bytes",
                 "host_output_size_in_bytes", "host_alias_size_in_bytes", "host_temp_size_in_bytes")


def lowered_step(job):
    """The job's step traced and lowered for its compile-only topology (within compiling_for_gpu)."""
    graphdef, engine, mesh, args = step_arguments(job)
    step = make_step_fn(graphdef, engine, greedy=True)
    with jax.set_mesh(mesh):
        return step.trace(*args).lower()


def step_arguments(job):
    """(graphdef, engine, compile-only mesh, the step's arguments as shape structs on it) for the job's step, built
    as a Model builds it from abstract parameters (within compiling_for_gpu)."""
    # One host's N GPUs (slices x hosts x devices), on the expert axis the expert-parallel engine splits over.
    topology = topologies.get_topology_desc(platform="cuda", target_config=job.target_config,
                                            topology=f"1x1x{job.devices}")
    mesh = topologies.make_mesh(topology, (job.devices,), (EXPERT_AXIS,))
    on_device = NamedSharding(mesh, PartitionSpec())
    parallel = job.devices > 1

    def sharding(path, kind):
        spec = param_spec(path) if parallel else PartitionSpec()
        return (NamedSharding(mesh.abstract_mesh, spec, memory_kind=PINNED_HOST) if kind == PINNED_HOST
                else NamedSharding(mesh, spec))

    def placed(tree, where=lambda a: on_device):  # shape structs on the target devices
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where(a)), tree)

    cfg = job.config
    graphdef, state = abstract_model(cfg, job.dtype)
    abstract = flat_params(nnx.to_pure_dict(state))
    placement = device_placement(cfg, abstract, job.options, job.devices)
    engine = (ExpertParallelEngine(cfg, placement, job.options, job.backend, mesh) if parallel
              else make_engine(cfg, placement, job.options, job.backend))
    params = {path: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding(path, placement.memory_kind_of(path)))
              for path, a in abstract.items()}
    nnx.replace_by_pure_dict(state, nest_params(params))
    engine_state = placed(engine.abstract_state(nnx.merge(graphdef, state).moe_layer_views()),
                          engine.placed if parallel else lambda a: on_device)
    inputs = abstract_step_inputs(cfg, job.batch, job.num_tokens, job.context, job.dtype)
    inputs = placed(inputs[:-2]) + inputs[-2:]  # no sampling arrays, no forced routing
    return graphdef, engine, mesh, (StepParams.of(state), engine_state, *inputs)


def write_compiled(lowered, lower_seconds: float, out_dir: Path) -> None:
    """Compile a lowered step; write its optimized HLO, then result.json (written last: it says the job is done)."""
    start = time.perf_counter()
    compiled = lowered.compile()
    compile_seconds = time.perf_counter() - start
    analysis = compiled.memory_analysis()
    (out_dir / "hlo.txt").write_text(compiled.as_text())
    result = {"memory_analysis": {field: int(getattr(analysis, field)) for field in MEMORY_FIELDS},
              "cost_analysis": cost_analysis(compiled), "lower_seconds": lower_seconds,
              "compile_seconds": compile_seconds}
    (out_dir / "result.json.tmp").write_text(json.dumps(result))
    os.replace(out_dir / "result.json.tmp", out_dir / "result.json")  # whole or absent, even if killed


def cost_analysis(compiled) -> dict | None:
    """XLA's cost analysis of the optimized program: {"flops", "bytes accessed"} (None if unavailable).

    A compile-only executable answers `compiled.cost_analysis()` with None (jax 0.10), so the optimized HLO
    module is handed to XLA's own HloCostAnalysis through the CPU client, which needs no GPU; it counts what
    the module's instructions read and write, a while loop's body once."""
    from jax._src.lib import xla_client

    found = compiled.cost_analysis()
    if not found:
        try:
            modules = compiled._executable.xla_executable.hlo_modules()
            found = xla_client._xla.hlo_module_cost_analysis(jax.devices("cpu")[0].client, modules[0])
        except Exception:  # a private API that moved or an analysis that fails costs the estimate, not the memory
            return None
    found = found[0] if isinstance(found, (list, tuple)) else found
    return {key: float(found[key]) for key in ("flops", "bytes accessed") if key in found}


def main(argv: list[str]) -> int:
    with open(argv[0], "rb") as f:
        jobs = pickle.load(f)
    jax.config.update("jax_platforms", "cpu")  # before any backend starts: see the module docstring
    freeze_loaded()  # tracing and lowering next: jmoe.collector says why
    (capability,) = {compute_capability(job.target_config) for job, _ in jobs}
    # The pool inside: its compiles end before compiling_for_gpu clears JAX's caches on the way out.
    with compiling_for_gpu(capability), ThreadPoolExecutor(max_workers=len(jobs)) as compiles:
        running = []
        for job, out_dir in jobs:
            start = time.perf_counter()
            lowered = lowered_step(job)
            running.append(compiles.submit(write_compiled, lowered, time.perf_counter() - start, Path(out_dir)))
    for compiled in running:
        compiled.result()  # a compile that raised: its traceback, and exit status 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
