"""bench.gpu_check's check of the projection kernel (jmoe.kernels.projection, Triton on a GPU, interpreted elsewhere)
against the XLA form every other shape and platform runs (jmoe.model.layers.project): a decode step's rows times
weights of model shapes past XLA's matrix-vector rewrite, and odd ones (K and the outputs no multiple of a block,
with a bias). Within a unit in the last place of the largest output: float32 sums in another order."""

from __future__ import annotations

import functools

import numpy as np

TOLERANCE = {"float32": 2.0 ** -20, "bfloat16": 2.0 ** -7}
# (rows, outputs, K, bias, dtype): GPT-OSS-120B's attention output (a row; 8 serving rows, its bias); DeepSeek-V3's
# q_a; odd sizes in float32.
CASES = [(1, 2880, 4096, False, "bfloat16"),
         (8, 2880, 4096, True, "bfloat16"),
         (1, 1536, 7168, False, "bfloat16"),
         (3, 50, 300, True, "float32")]


def check(result, on_gpu: bool) -> None:
    """Each case a check of `result` (a SectionResult), whatever the time: a few small programs."""
    for case in CASES:
        result.attempt(f"projected_rows kernel / {case[0]} rows x [{case[1]}, {case[2]}], bias {case[3]}, {case[4]}",
                       None, functools.partial(projection_agrees, case, on_gpu))


def projection_agrees(case, on_gpu: bool) -> tuple[bool, str]:
    """(whether the kernel's outputs agree with XLA's form, the largest difference)."""
    import jax
    import jax.numpy as jnp

    from jmoe.kernels.projection import projected_rows
    from jmoe.model.layers import projected_by_xla

    rows, outputs, k, with_bias, dtype = case
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    weight = jnp.asarray(rng.standard_normal((outputs, k)) / k ** 0.5, dtype)
    bias = jnp.asarray(rng.standard_normal(outputs), dtype) if with_bias else None
    got = jax.jit(functools.partial(projected_rows, on_gpu=on_gpu))(x, weight, bias)
    want = jax.jit(projected_by_xla)(x, weight, bias)
    if got.shape != want.shape or got.dtype != want.dtype:
        return False, f"{got.dtype}{got.shape} against {want.dtype}{want.shape}"
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    error = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    return error <= TOLERANCE[dtype], f"largest difference {error:.2e} of the largest output"
