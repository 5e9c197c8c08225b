"""bench.gpu_check's check of the RMSNorm kernel (jmoe.kernels.norm, Triton on a GPU, interpreted elsewhere) against
the XLA form every other platform runs (jmoe.model.layers.rms_norm, after the residual add): rows of model widths and
odd ones, with and without the add, a row's leading columns read from a wider one (DeepSeek's latent), a scale of
another dtype, and rows that are not finite. The sums and finiteness must be equal; the normalised rows within a
unit in their last place (the mean square's float32 sum in another order can round a value the other way)."""

from __future__ import annotations

import functools

import numpy as np

# Largest difference from the XLA form, relative to the largest normalised value: a unit in the last place.
TOLERANCE = {"float32": 2.0 ** -22, "bfloat16": 2.0 ** -7}
# (leading shape, row width, the scale's width (less: leading columns), added, dtype, scale dtype, rows made
# infinite or NaN): a decode step's row at Mixtral's width; a serving batch's at GPT-OSS's (no power of two); a
# prompt's rows; Qwen3's per-head q/k norm rows; DeepSeek's latent, the first 512 of 576 columns; float32 with a
# bfloat16 scale.
CASES = [((1, 1), 4096, 4096, True, "bfloat16", "bfloat16", 0),
         ((8, 1), 2880, 2880, True, "bfloat16", "bfloat16", 2),
         ((2, 37), 80, 80, False, "float32", "float32", 0),
         ((3, 5), 80, 80, True, "float32", "float32", 1),
         ((2, 1, 4), 128, 128, False, "bfloat16", "bfloat16", 0),
         ((4, 1), 576, 512, False, "bfloat16", "bfloat16", 0),
         ((3, 1), 200, 200, True, "float32", "bfloat16", 0)]


def check(result, on_gpu: bool) -> None:
    """Each case a check of `result` (a SectionResult), whatever the time: a few small programs."""
    for case in CASES:
        result.attempt(f"rms_norm kernel / rows {case[0]} of {case[1]}, scale {case[2]}, added {case[3]}, {case[4]} "
                       f"(scale {case[5]}), {case[6]} rows not finite", None, functools.partial(norm_agrees, case,
                                                                                               on_gpu))


def random_inputs(case, seed: int = 0):
    """(x, addend or None, scale) of a case, NumPy-drawn: rows of values around 1, a few far larger (a residual
    stream's outliers); the first `bad` rows of the sum hold an infinity or a NaN."""
    import jax.numpy as jnp

    shape, width, scale_width, added, dtype, scale_dtype, bad = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((*shape, width)) * np.where(rng.random((*shape, width)) < 0.01, 30.0, 1.0)
    flat = x.reshape(-1, width)
    for row in range(bad):
        flat[row, rng.integers(width)] = (np.inf, np.nan)[row % 2]
    addend = rng.standard_normal((*shape, width)) if added else None
    scale = 1.0 + 0.1 * rng.standard_normal(scale_width)
    as_array = lambda a, t: None if a is None else jnp.asarray(a, t)  # noqa: E731
    return as_array(x, dtype), as_array(addend, dtype), as_array(scale, scale_dtype)


def norm_agrees(case, on_gpu: bool) -> tuple[bool, str]:
    """(whether the kernel's sum, finiteness and normalised rows agree with XLA's form, the largest difference)."""
    import jax
    import jax.numpy as jnp

    from jmoe.kernels.norm import added_and_normalised
    from jmoe.model.layers import added_and_normalised_by_xla

    x, addend, scale = random_inputs(case)
    summed, normed, finite = jax.jit(functools.partial(added_and_normalised, eps=1e-5, on_gpu=on_gpu))(x, addend,
                                                                                                      scale)
    want_sum, want_normed, want_finite = jax.jit(functools.partial(added_and_normalised_by_xla, eps=1e-5))(x, addend,
                                                                                                           scale)
    if not np.array_equal(np.asarray(summed), np.asarray(want_sum), equal_nan=True):
        return False, "the sums differ"
    if (finite is None) != (addend is None) or (finite is not None and
                                                not np.array_equal(np.asarray(finite), np.asarray(want_finite))):
        return False, f"finiteness {finite} against {want_finite}"
    if normed.dtype != want_normed.dtype or normed.shape != want_normed.shape:
        return False, f"normalised rows {normed.dtype}{normed.shape} against {want_normed.dtype}{want_normed.shape}"
    rows = np.asarray(want_finite if addend is not None else jnp.isfinite(x).all(axis=-1)).reshape(-1)
    got = np.asarray(normed, np.float32).reshape(rows.size, -1)[rows]
    want = np.asarray(want_normed, np.float32).reshape(rows.size, -1)[rows]
    error = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    return error <= TOLERANCE[jnp.dtype(x.dtype).name], f"largest difference {error:.2e} of the largest value"
