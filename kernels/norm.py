"""RMSNorm, and the residual add before it, as one Pallas kernel (Triton on a GPU): a program per row.

Why a kernel: at decode XLA:GPU made a decoder layer's norm two kernels (the sum of squares, then the multiply), and
the residual add before the next layer's norm a third (the MLP's output added, materialised, read again by the sum):
three of the fourteen kernels of a resident Mixtral-shaped decode layer, each launched for a few kilobytes. The
model's XLA form (`jmoe.model.layers.rms_norm`) is what every other platform runs; tests/test_norm.py holds the
kernel, interpreted, to it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def added_and_normalised(x, addend, scale, *, eps: float, on_gpu: bool):
    """(x + addend, that RMS-normalised times `scale` [d], whether each row of the sum is finite) for x [..., d] and
    `addend` of its shape (None: x itself, its first d columns normalised, read in place from a row of any width
    (DeepSeek's latent, the start of its projection's output), and None for the rows' finiteness), computed as
    `jmoe.model.layers.rms_norm` does: the sum rounded to x's dtype, its mean square in float32, the normalised row
    rounded before the scale's product. Interpreted where not on_gpu (tests)."""
    shape, d = x.shape, scale.shape[-1]
    if addend is not None and (addend.shape != shape or shape[-1] != d):
        raise ValueError(f"added_and_normalised: x {shape} and addend {addend.shape} must both be [..., {d}], "
                         f"the scale's width")
    rows = [a.reshape(-1, shape[-1]) for a in ((x,) if addend is None else (x, addend))]
    n, width = rows[0].shape[0], pl.next_power_of_2(d)
    results = [jax.ShapeDtypeStruct((n, d), jnp.promote_types(x.dtype, scale.dtype))]
    if addend is not None:  # the sum, and its rows' finiteness (which the step reads back a layer)
        results = [jax.ShapeDtypeStruct((n, d), x.dtype), *results, jax.ShapeDtypeStruct((n, 1), jnp.int32)]
    outs = pl.pallas_call(
        functools.partial(_kernel, d=d, width=width, eps=eps, added=addend is not None),
        out_shape=results,
        grid=(rows[0].shape[0],),
        # Whole arrays, read and written by masked loads and stores: Triton's blocks are powers of two, d need not be.
        in_specs=[pl.no_block_spec] * (len(rows) + 1),
        out_specs=[pl.no_block_spec] * len(results),
        interpret=not on_gpu,
        compiler_params=pltriton.CompilerParams(num_warps=min(8, max(1, width // 256)), num_stages=1)
        if on_gpu else None,
        name="rms_norm",
    )(*rows, scale.reshape(1, d))
    if addend is None:
        return x, outs[0].reshape(*shape[:-1], d), None
    summed, normed, finite = outs
    return summed.reshape(shape), normed.reshape(shape), finite.reshape(shape[:-1]).astype(bool)


def _kernel(*refs, d: int, width: int, eps: float, added: bool):
    """One row: the sum stored (where added), then its normalised product with the scale."""
    if added:
        x_ref, addend_ref, scale_ref, sum_ref, out_ref, finite_ref = refs
    else:
        x_ref, scale_ref, out_ref = refs
    row = pl.program_id(0)
    columns = jax.lax.broadcasted_iota(jnp.int32, (1, width), 1)
    real = columns < d
    read = lambda ref, i: pltriton.load(ref.at[pl.ds(i, 1), pl.ds(0, width)], mask=real, other=0)  # noqa: E731
    x = read(x_ref, row)
    if added:
        x = (x.astype(jnp.float32) + read(addend_ref, row).astype(jnp.float32)).astype(x.dtype)
        pltriton.store(sum_ref.at[pl.ds(row, 1), pl.ds(0, width)], x, mask=real)
        # jnp.min, not jnp.all: Triton's lowering has no reduce_and.
        finite_ref[pl.ds(row, 1), :] = jnp.min(jnp.isfinite(x).astype(jnp.int32), keepdims=True)
    x32 = x.astype(jnp.float32)
    normed = (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32) / d + eps)).astype(x.dtype)
    out = read(scale_ref, 0).astype(jnp.float32) * normed.astype(jnp.float32)
    pltriton.store(out_ref.at[pl.ds(row, 1), pl.ds(0, width)], out.astype(out_ref.dtype), mask=real)
