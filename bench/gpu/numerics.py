"""bench.gpu_check's correctness sections: kernel backends against `reference` in every expert format, every
family's logits on the device against the CPU (a child process on JAX's CPU backend), and the offload engine
against the all-resident model (tokens and logits at caches 0, 2, E-1 and E; miss modes fetch and host;
prefetch; layer groups)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from bench.gpu import bookkeeping, decode_attention, norm, projection
from bench.gpu.models import FAMILY_CASES, model_config, write_checkpoint
from bench.gpu.results import OUT_OF_TIME, Budget, SectionResult

# Kernel shapes: (tokens, top-k, experts, d, f): one decode token and a prefill chunk. d and f are multiples of
# 128 so that every format's blocks (fp8's 128 x 128) divide them (small: 64, fp8 then has one partial block).
KERNEL_SHAPES = {"decode": (1, 2, 8, 256, 256), "prefill": (128, 4, 8, 256, 256)}
SMALL_KERNEL_SHAPES = {"tokens": (4, 2, 4, 64, 64)}  # one shape: the same loops, half the compiles
KERNEL_TOLERANCE = 3e-2  # bf16 inputs: h is rounded to bf16 before the down projection, at different sums
# Device against CPU logits, relative to the largest |logit|: a GPU may compute float32 dots in TF32.
FAMILY_TOLERANCE = 1e-2
ARGMAX_TIE = 1e-3
OFFLOAD_TOLERANCE = 1e-5  # the invariant: offloading never changes float32 logits beyond 1e-5
PROMPT = [3, 17, 9, 42, 5, 11, 28, 7]
NEW_TOKENS = 8


def relative_error(y, y_ref) -> float:
    y, y_ref = np.asarray(y, np.float32), np.asarray(y_ref, np.float32)
    return float(np.abs(y - y_ref).max() / max(1.0, float(np.abs(y_ref).max())))


def argmax_agrees(y, y_ref) -> tuple[bool, int]:
    """(the device's argmax is the reference's at every position that is not a near tie, how many were near ties).
    A near tie: the reference's top two logits within ARGMAX_TIE x max(1, max |logit|), a few times the TF32
    differences seen on an H100 (3e-4), where either token is a right answer (a random checkpoint's tiny
    vocabulary has some: the qwen2_moe case has a 1e-4 margin)."""
    y, y_ref = np.asarray(y, np.float32), np.asarray(y_ref, np.float32)
    top_two = np.sort(y_ref, -1)[..., -2:]
    tie = top_two[..., 1] - top_two[..., 0] <= ARGMAX_TIE * max(1.0, float(np.abs(y_ref).max()))
    return bool(((y.argmax(-1) == y_ref.argmax(-1)) | tie).all()), int(tie.sum())


def kernel_inputs(shape, fmt: str | None, seed: int = 0):
    import jax.numpy as jnp

    from jmoe.kernels.quantized import quantize

    num_tokens, top_k, num_slots, d, f = shape
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(num_tokens, d)), jnp.bfloat16)
    slot_ids = jnp.asarray(rng.integers(-1, num_slots, size=(num_tokens, top_k)), jnp.int32)  # -1: padding
    weights = jnp.asarray(rng.random((num_tokens, top_k)), jnp.float32)
    w_gate_up = rng.normal(size=(num_slots, d, 2 * f)).astype(np.float32) / d**0.5
    w_down = rng.normal(size=(num_slots, f, d)).astype(np.float32) / f**0.5
    if fmt is None:
        return x, slot_ids, weights, jnp.asarray(w_gate_up, jnp.bfloat16), jnp.asarray(w_down, jnp.bfloat16)
    return x, slot_ids, weights, quantize(w_gate_up, fmt), quantize(w_down, fmt)


def kernels(small: bool, budget: Budget, log) -> SectionResult:
    import jax

    from jmoe.kernels import moe_ffn
    from jmoe.kernels.dispatch import BACKENDS
    from jmoe.kernels.quantized import FORMATS

    result = SectionResult()
    result.notes.append(f"inputs bf16, {'; '.join(f'{n} (T, k, S, d, f) = {s}' for n, s in _shapes(small).items())}"
                        f"; some slot ids -1 (padding); pass = max |y - reference| <= {KERNEL_TOLERANCE} x "
                        f"max(1, max |reference|)")
    jitted = {b: jax.jit(functools.partial(moe_ffn, backend=b)) for b in BACKENDS}
    if small:  # tiny shapes, seconds: every check runs whatever the time (tests/test_gpu_check.py asserts on all)
        budget = budget.unbounded()
    for fmt in (None, *FORMATS):
        for shape_name, shape in _shapes(small).items():
            inputs = kernel_inputs(shape, fmt)
            names = {b: f"{b} / {fmt or 'bf16'} / {shape_name}" for b in BACKENDS if b != "reference"}
            skipped = {b: reason for b in names if (reason := _not_applicable(b, fmt))}
            together = ["reference", *(b for b in names if b not in skipped and budget.not_running(names[b]) is None)]
            outputs = _outputs_together(jitted, together, inputs, log) if small else {}  # backend -> its output
            for backend, name in names.items():
                def run(backend=backend, inputs=inputs, outputs=outputs):
                    for b in ("reference", backend):
                        if b not in outputs:
                            outputs[b] = jitted[b](*inputs)
                    error = relative_error(outputs[backend], outputs["reference"])
                    return error <= KERNEL_TOLERANCE, f"relative error {error:.2e}"

                if backend in skipped:
                    result.check(name, None, skipped[backend])
                else:
                    result.attempt(name, budget, run)
        log(f"kernels: {fmt or 'bf16'} done")
    bookkeeping.check(result, on_gpu=jax.default_backend() == "gpu")
    decode_attention.check(result, on_gpu=jax.default_backend() == "gpu")
    norm.check(result, on_gpu=jax.default_backend() == "gpu")
    projection.check(result, on_gpu=jax.default_backend() == "gpu")
    return result


def _outputs_together(jitted: dict, backends: list[str], inputs, log) -> dict:
    """{backend: output} of `backends` computed by one program (a small run's: one compile a format, not one a
    backend, on 2 CPU cores about 11 -> 9 s); {} if it fails, so that each backend then runs alone and a
    failure is recorded as its own."""
    import jax

    try:
        return jax.jit(lambda *args: {b: jitted[b](*args) for b in backends})(*inputs)
    except Exception as error:  # each check below runs its backend alone and records what fails
        log(f"kernels: one program of every backend failed ({type(error).__name__}); each runs alone")
        return {}


def _shapes(small: bool) -> dict:
    return SMALL_KERNEL_SHAPES if small else KERNEL_SHAPES


def _not_applicable(backend: str, fmt: str | None) -> str | None:
    """Why a backend does not run a case, when the reason is a package or its design (not a bug)."""
    if backend != "triton":
        return None
    if fmt is not None:  # moe_ffn_triton refuses quantized experts; auto sends them to the Pallas kernel
        return "not run: backend 'triton' takes plain float weights by design (quantized: 'pallas', 'auto')"
    import jax

    if jax.default_backend() != "gpu":
        return "not run: backend 'triton' is GPU-only"
    try:
        import jax_triton  # noqa: F401
    except ImportError:
        return "not run: jax-triton is not installed (carry its wheel to run it)"
    return None


# The families a small run compares: two that share the least (grouped softmax with MLA, plain top-k with GQA), so
# that its section completes within a smoke run's budget share (all seven did not begin to on a 2-core CPU).
SMALL_FAMILIES = ("mixtral", "deepseek_v3")


def family_directories(workdir: Path, small: bool) -> dict[str, Path]:
    # A small run's configs are written without transformers (model_config): kept apart in a reused workdir.
    families = workdir / ("families_small" if small else "families")
    return {family: families / family for family in FAMILY_CASES if not small or family in SMALL_FAMILIES}


def family_checkpoint(directory: Path, small: bool) -> Path:
    """The checkpoint of FAMILY_CASES[directory.name] in `directory`, written once."""
    if (directory / "config.json").is_file():
        return directory
    config = model_config(directory.name, small, **FAMILY_CASES[directory.name])
    return write_checkpoint(directory, config, "float32", seed=1)


@functools.cache
def resident_model(directory: Path):
    """jmoe.load(directory) with every expert resident, loaded once: the families section's device model of a family
    is the offload section's reference (its programs compiled once; the family models are a few MB)."""
    import jmoe

    return jmoe.load(directory, progress=False)


def cpu_logits(directories: dict[str, Path], out: Path) -> None:
    """Every family's logits on JAX's CPU backend, in this process (the child bench.gpu_check starts)."""
    import jmoe

    np.savez(out, **{family: np.asarray(jmoe.load(d, progress=False).logits([PROMPT]))
                     for family, d in directories.items()})


def families(workdir: Path, small: bool, budget: Budget, log) -> SectionResult:
    result = SectionResult()
    result.notes.append(f"float32 random checkpoints, one per family; {len(PROMPT)}-token prompt; pass = max "
                        f"|device - CPU| <= {FAMILY_TOLERANCE} x max(1, max |CPU logit|) (TF32 dots on a GPU) "
                        f"and the same argmax at every position but near ties (the CPU's top two logits within "
                        f"{ARGMAX_TIE} x max(1, max |CPU logit|): either is right)")
    directories = {family: family_checkpoint(d, small) for family, d in family_directories(workdir, small).items()}
    if small:  # two tiny models, and the CPU reference computes them whatever the time: compare them too
        budget = budget.unbounded()
    out = workdir / "cpu_logits.npz"
    # The CPU reference runs in its own process, on JAX's CPU backend, while this one runs on the device.
    child = subprocess.Popen([sys.executable, "-m", "bench.gpu_check", "--cpu-reference", str(workdir),
                              *(["--small"] if small else [])],
                             env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=Path(__file__).resolve().parents[2])
    device = {}
    for family, directory in directories.items():
        if budget.out_of_time():
            break
        device[family] = np.asarray(resident_model(directory).logits([PROMPT]))
    returncode = child.wait()
    if returncode != 0:
        result.check("CPU reference", False, f"the CPU reference process exited with status {returncode}")
        return result
    reference = np.load(out)
    for family in directories:
        def compare(family=family):
            error = relative_error(device[family], reference[family])
            same_argmax, near_ties = argmax_agrees(device[family], reference[family])
            return (error <= FAMILY_TOLERANCE and same_argmax,
                    f"relative error {error:.2e}, argmax equal: {same_argmax} ({near_ties} near ties)")

        if family in device:  # the device and reference logits exist: comparing them costs nothing
            result.attempt(family, None, compare)
        else:
            result.check(family, None, OUT_OF_TIME)
    log("families done")
    return result


def offload_settings(num_experts: int, layer_expert_bytes: int) -> list[tuple[str, dict]]:
    from jmoe.offload.host_tier import host_budget_gb_holding

    settings = [(f"cache {c}, miss {mode}", dict(cache=c, miss_mode=mode))
                for c in (0, 2, num_experts - 1, num_experts) for mode in ("fetch", "host", "direct")]
    # The disk tier: experts in no host row are read from the checkpoint inside the step (io_callback).
    disk = [(f"cache {c}, disk tier ({rows} host rows)", dict(cache=c, host_budget_gb=host_budget_gb_holding(
        rows, layer_expert_bytes))) for c, rows in ((0, 1), (2, num_experts // 2))]
    return settings + disk + [("cache 2, prefetch 2", dict(cache=2, prefetch=2)),
                              ("cache 2, layer groups (2, 1)", dict(cache=2, offload_group_size=2,
                                                                    offload_num_in_group=1))]


def offload(workdir: Path, small: bool, budget: Budget, log) -> SectionResult:
    import jmoe

    family = "mixtral"
    directory = family_checkpoint(family_directories(workdir, small)[family], small)
    resident = resident_model(directory)
    num_experts = resident.config.num_experts
    tokens = resident.generate(PROMPT, NEW_TOKENS)
    logits = np.asarray(resident.logits([PROMPT]))
    result = SectionResult()
    result.notes.append(f"{family} float32 ({num_experts} experts, top-{resident.config.num_experts_per_tok}, "
                        f"{resident.config.num_layers} layers): {NEW_TOKENS} greedy tokens and the prompt's logits "
                        f"against every expert resident; pass = same tokens, logits within {OFFLOAD_TOLERANCE} x "
                        f"max(1, max |logit|)")
    probe = jmoe.load(directory, cache=0, progress=False).placement_plan
    for name, options in offload_settings(num_experts, probe.layer_expert_bytes):
        def compare(options=options):
            with jmoe.load(directory, progress=False, **options) as model:
                same = model.generate(PROMPT, NEW_TOKENS) == tokens
                error = relative_error(model.logits([PROMPT]), logits)
            return same and error <= OFFLOAD_TOLERANCE, f"tokens equal: {same}, logits relative error {error:.1e}"

        result.attempt(name, budget, compare)
        log(f"offload: {name}")
    return result
