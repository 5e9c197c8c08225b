"""A few rows times a large dense weight, as one Pallas kernel (Triton on a GPU): a decode step's projections whose
weights XLA:GPU does not read as a matrix-vector reduction.

Why a kernel: XLA:GPU rewrites a product of a vector and a weight of under 10M elements into one reduction kernel,
but runs a larger one as a Triton GEMM of the row padded to a tile, split over K into partial products that a
second kernel sums (where its K is long against its outputs; and a K no multiple of 64 was padded by two kernels
more): GPT-OSS-120B's attention output (2880 x 4096) two kernels a layer, DeepSeek-V3's q_a (1536 x 7168), attention
output and shared expert's gate-up each two. This kernel is one a projection, a program per 16 outputs reading its
rows of the weight once. The model's XLA form (`jmoe.model.layers.project`) is what every other shape and platform
runs; tests/test_projection.py holds the kernel, interpreted, to it."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jmoe.kernels.decode_attention import MIN_ROWS, precision_for

# XLA:GPU's limit for the matrix-vector rewrite (weights of fewer elements are read by one reduction kernel, which
# fuses with its neighbours; checked by tests/test_projection.py against the compiled program).
LARGE_WEIGHT = 10_000_000
# Rows the kernel takes: Triton's products pad them to MIN_ROWS.
MAX_ROWS = MIN_ROWS
# Outputs a program computes (an H100's 132 multiprocessors: 180 programs for GPT-OSS-120B's 2880 outputs) and
# columns of K a loop step reads: [16, 256] weights, 8 KiB of bfloat16.
BLOCK_OUT, BLOCK_K = 16, 256


def read_by_kernel(x, weight) -> bool:
    """Whether the kernel computes x [..., in] times `weight` [out, in] on a GPU: a few rows (a decode step's), a
    weight past XLA's matrix-vector rewrite, both of one float dtype."""
    return (math.prod(x.shape[:-1]) <= MAX_ROWS and math.prod(weight.shape) >= LARGE_WEIGHT
            and x.dtype == weight.dtype and jnp.issubdtype(x.dtype, jnp.floating))


def projected_rows(x, weight, bias=None, *, on_gpu: bool, block_out: int = BLOCK_OUT, block_k: int = BLOCK_K):
    """x [N, K] (N <= MAX_ROWS) times `weight` [O, K] (stored [out, in]), plus `bias` [O]: [N, O] in x's dtype, from
    float32 products and sums rounded once, as `jmoe.model.layers.project` computes it; a program per `block_out`
    outputs (powers of two, at least 16), `block_k` columns a step (bench.gpu.projection_forms times others).
    Interpreted where not on_gpu (tests)."""
    (rows, k), outputs = x.shape, weight.shape[0]
    if rows > MAX_ROWS or weight.shape[1] != k:
        raise ValueError(f"projected_rows: x [N <= {MAX_ROWS}, K] and a weight [O, K]; got x {x.shape}, weight "
                         f"{weight.shape}")
    inputs = (x, weight) if bias is None else (x, weight, bias.reshape(1, outputs))
    return pl.pallas_call(
        functools.partial(_kernel, rows=rows, k=k, outputs=outputs, has_bias=bias is not None, block_out=block_out,
                          block_k=block_k),
        out_shape=jax.ShapeDtypeStruct((rows, outputs), x.dtype),
        grid=(pl.cdiv(outputs, block_out),),
        # Whole arrays, read and written by masked loads and stores: neither K nor the outputs need be a multiple of
        # a block.
        in_specs=[pl.no_block_spec] * len(inputs),
        out_specs=pl.no_block_spec,
        interpret=not on_gpu,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=3) if on_gpu else None,
        name="projected_rows",
    )(*inputs)


def _kernel(x_ref, w_ref, *refs, rows: int, k: int, outputs: int, has_bias: bool, block_out: int, block_k: int):
    """One block of `block_out` outputs for every row: the weight's rows read once, `block_k` columns a step."""
    b_ref, out_ref = refs if has_bias else (None, *refs)
    first = pl.program_id(0) * block_out
    row_ids = jax.lax.broadcasted_iota(jnp.int32, (MIN_ROWS, 1), 0)
    out_ids = first + jax.lax.broadcasted_iota(jnp.int32, (block_out, 1), 0)
    columns = jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)

    def step(i, acc):
        start = i * block_k
        cols = columns + start < k
        xs = pltriton.load(x_ref.at[pl.ds(0, MIN_ROWS), pl.ds(start, block_k)],
                           mask=jnp.logical_and(row_ids < rows, cols), other=0)
        w = pltriton.load(w_ref.at[pl.ds(first, block_out), pl.ds(start, block_k)],
                          mask=jnp.logical_and(out_ids < outputs, cols), other=0)
        product = pltriton.dot(xs, w.astype(xs.dtype), trans_b=True, precision=precision_for(xs.dtype))
        return acc + product.astype(jnp.float32)

    acc = jax.lax.fori_loop(0, pl.cdiv(k, block_k), step, jnp.zeros((MIN_ROWS, block_out), jnp.float32))
    out_cols = first + jax.lax.broadcasted_iota(jnp.int32, (1, block_out), 1)
    if b_ref is not None:
        acc += pltriton.load(b_ref.at[pl.ds(0, 1), pl.ds(first, block_out)], mask=out_cols < outputs,
                             other=0).astype(jnp.float32)
    pltriton.store(out_ref.at[pl.ds(0, MIN_ROWS), pl.ds(first, block_out)], acc.astype(out_ref.dtype),
                   mask=jnp.logical_and(row_ids < rows, out_cols < outputs))
