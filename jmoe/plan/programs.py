"""jmoe's decode and prefill programs compiled ahead of time for a GPU target in a child process
(jmoe.plan.workers, jmoe.plan.compile_worker), and what their memory analysis says.

The programs are the steps a Model runs (jmoe.decode.steps.make_step_fn, greedy): "decode" feeds one token per row
into a KV cache of `context` tokens, "prefill" feeds a prompt of `context` tokens into it (the longest one it
holds); rows are the batch padded as generation pads it (a power of two). A program's device memory is its
arguments (parameters on the device, slots, KV cache) plus its outputs that are not donated back into them plus its
temporaries; pinned-host arguments are counted apart. Compile-only XLA:GPU does not autotune and nothing runs:
memory is exact, kernel choices are heuristic.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import numpy as np

from jmoe.config import ModelConfig
from jmoe.model.params import abstract_params
from jmoe.offload.options import OffloadOptions
from jmoe.offload.expert_parallel import device_placement
from jmoe.plan.depth import Reduction, extrapolated_flow, plan_reduction, reduced_config
from jmoe.plan.hlo import Collective, ControlFlow, collectives, control_flow, kernel_count
from jmoe.plan.workers import compile_in_workers

PROGRAMS = ("decode", "prefill")
PLUGIN_HINT = ('compiling for a GPU target needs the CUDA PJRT plugin and ptxas: pip install -e ".[gpu-compile]" '
               '(no NVIDIA driver or GPU needed)')


@dataclasses.dataclass(frozen=True)
class CompileJob:
    """What compile_worker needs to rebuild the step (pickled to it)."""

    config: ModelConfig
    dtype: np.dtype
    options: OffloadOptions
    backend: str
    batch: int
    num_tokens: int
    context: int
    target_config: str
    devices: int = 1  # GPUs of one host the experts are split over (expert parallelism)


@dataclasses.dataclass(frozen=True)
class Program:
    name: str  # "decode" | "prefill"
    tokens: tuple[int, int]  # the step's tokens shape [B, T]
    memory_analysis: dict | None = None  # the compiled program's memory_analysis() fields, in bytes
    cost_analysis: dict | None = None  # XLA's cost analysis of it: "flops", "bytes accessed" (compile_worker)
    lower_seconds: float | None = None
    compile_seconds: float | None = None
    hlo_text: str | None = dataclasses.field(default=None, repr=False)  # the optimized HLO
    error: str | None = None  # why it did not compile
    # A deep model's program extrapolated from two shallow ones (jmoe.plan.depth): the decoder layers those had,
    # its control flow and kernel count (hlo_text is then the deeper shallow program's); its memory analysis
    # lacks the temporaries (temp_size_in_bytes, peak_memory_in_bytes), which do not scale with depth.
    compiled_layers: tuple[int, int] | None = None
    extrapolated_flow: ControlFlow | None = None
    extrapolated_kernels: int | None = None
    extrapolated_collectives: dict[Collective, int] | None = None

    @property
    def device_bytes(self) -> int | None:
        """Device memory while the program runs: arguments + outputs not aliased to them + temporaries."""
        if self.memory_analysis is None:
            return None
        m = self.memory_analysis
        return (m["argument_size_in_bytes"] + m["output_size_in_bytes"] - m["alias_size_in_bytes"]
                + m.get("temp_size_in_bytes", 0))

    @property
    def control_flow(self) -> ControlFlow | None:
        """Conditionals, loops and Triton kernels of the compiled program (None: it did not compile)."""
        if self.extrapolated_flow is not None:
            return self.extrapolated_flow
        return None if self.hlo_text is None else control_flow(self.hlo_text)

    @property
    def kernels(self) -> int:
        """Kernels the program launches, roughly (jmoe.plan.hlo.kernel_count)."""
        if self.extrapolated_kernels is not None:
            return self.extrapolated_kernels
        return kernel_count(self.hlo_text) if self.hlo_text else 0

    @property
    def collectives(self) -> dict[Collective, int]:
        """What crosses between the devices of an expert-parallel program: each collective and how often it
        occurs (none on one device)."""
        if self.extrapolated_collectives is not None:
            return self.extrapolated_collectives
        return collectives(self.hlo_text or "")

    def as_dict(self) -> dict:
        flow = self.control_flow
        return {"tokens": list(self.tokens), "memory_analysis": self.memory_analysis, "device_bytes": self.device_bytes,
                "cost_analysis": self.cost_analysis,
                "collectives": [{"op": c.op, "shapes": list(c.shapes), "bytes": c.bytes, "count": n}
                                for c, n in self.collectives.items()],
                "control_flow": None if flow is None else flow.as_dict(),
                "lower_seconds": self.lower_seconds, "compile_seconds": self.compile_seconds, "error": self.error,
                "compiled_layers": None if self.compiled_layers is None else list(self.compiled_layers)}


def plugin_available() -> bool:
    """Whether a CUDA PJRT plugin is installed: the `gpu-compile` extra's CUDA 12 one, or a GPU machine's own
    (jax 0.11 images carry jax_plugins.xla_cuda13)."""
    import pkgutil

    try:
        import jax_plugins
    except ModuleNotFoundError:  # no plugin at all
        return False
    return any(module.name.startswith("xla_cuda") for module in pkgutil.iter_modules(jax_plugins.__path__))


def compile_programs(config: ModelConfig, dtype, options: OffloadOptions, backend: str, batch: int, context: int,
                     target_config: str, extrapolate_layers: bool = False, devices: int = 1,
                     programs: tuple[str, ...] = PROGRAMS) -> dict[str, Program]:
    """Compile "decode" and "prefill" (or those of `programs`) for the target in a child process: the whole model,
    or (a deep one, with `extrapolate_layers`) two shallow ones extrapolated to its depth (jmoe.plan.depth); for
    `devices` GPUs of one host with the experts split over them (each program is then one device's share)."""
    shapes = {name: {"decode": 1, "prefill": context}[name] for name in programs}
    if not plugin_available():
        return {name: Program(name, (batch, t), error=PLUGIN_HINT) for name, t in shapes.items()}
    # The policy only steers the manager between steps, never the compiled program; a policy object may
    # not survive pickling, so the child gets the default by name.
    options = dataclasses.replace(options, policy="lfru")
    reduction = None if not extrapolate_layers else plan_reduction(
        config, lambda cfg: device_placement(cfg, abstract_params(cfg, dtype), options, devices))
    depths = [config.num_layers] if reduction is None else list(reduction.layers)
    jobs = {f"{name}-{layers}": CompileJob(reduced_config(config, layers), np.dtype(dtype), options, backend, batch,
                                           num_tokens, context, target_config, devices)
            for name, num_tokens in shapes.items() for layers in depths}
    with tempfile.TemporaryDirectory(prefix="jmoe-plan-") as tmp:
        results = compile_in_workers(jobs, Path(tmp))
    compiled = {(name, layers): program(name, (batch, num_tokens), results[f"{name}-{layers}"])
                for name, num_tokens in shapes.items() for layers in depths}
    if reduction is None:
        return {name: compiled[name, config.num_layers] for name in shapes}
    return {name: extrapolated(reduction, *(compiled[name, layers] for layers in reduction.layers))
            for name in shapes}


def program(name: str, tokens: tuple[int, int], result: dict | str) -> Program:
    """A Program from a worker's result, or from why it did not compile."""
    if isinstance(result, str):
        return Program(name, tokens, error=result)
    return Program(name, tokens, result["memory_analysis"], result["cost_analysis"], result["lower_seconds"],
                   result["compile_seconds"], result["hlo_text"])


# What a shallow program's temporaries say of a deep one's: nothing reliable. XLA's scheduler overlaps more of a
# short program (Qwen3-30B's prefill at 1024 tokens: 2.5 and 3.6 GB of temporaries at 2 and 3 layers, 1.4 GB at
# all 48), and a deep one's can grow with depth (the default model's: 3 MB a layer); bench/results/plan_depth.md.
TEMPORARIES = ("temp_size_in_bytes", "peak_memory_in_bytes")


def extrapolated(reduction: Reduction, small: Program, large: Program) -> Program:
    """The deep model's program from its two shallow compiles."""
    if small.error or large.error:
        return dataclasses.replace(large, error=large.error or small.error, compiled_layers=reduction.layers)

    def each(a: dict | None, b: dict | None, whole: bool) -> dict | None:
        if a is None or b is None:
            return None
        return {key: (round if whole else float)(reduction.extrapolate(a[key], b[key])) for key in a
                if key in b and key not in TEMPORARIES}

    return Program(large.name, large.tokens, each(small.memory_analysis, large.memory_analysis, True),
                   each(small.cost_analysis, large.cost_analysis, False),
                   small.lower_seconds + large.lower_seconds, small.compile_seconds + large.compile_seconds,
                   large.hlo_text, compiled_layers=reduction.layers,
                   extrapolated_flow=extrapolated_flow(reduction, small.control_flow, large.control_flow),
                   extrapolated_kernels=round(reduction.extrapolate(small.kernels, large.kernels)),
                   extrapolated_collectives={c: round(reduction.extrapolate(small.collectives.get(c, 0), n))
                                             for c, n in large.collectives.items()})
