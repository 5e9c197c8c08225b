"""A decode step's multi-head latent attention (DeepSeek's MLA, absorbed: the queries meet the cached latents
themselves) as one Pallas kernel (Triton on a GPU): per (row, block of query heads, part of the cache) a program
writes nothing or the token's latent and shared rope key, then reads only the cache columns its row can see, in
blocks, with an online softmax (jmoe.kernels.decode_attention's loop), the latents serving as keys and values both.

Why a kernel: XLA:GPU made a one-token MLA eleven kernels a layer (the two cache writes, the rope scores, the latent
scores in split-K pieces and their sum with the mask, the softmax's max, exponentials, sum and division, the product
with the latents in pieces and their sum) and read every column of both caches, masked. The queries' absorption into
the latent space (their product with kv_b's key part) is a kernel of its own too (`absorbed_queries`), which reads
the weight as it lies. The model's XLA form (`jmoe.model.mla`) is what every other platform runs;
tests/test_decode_attention.py holds the kernels, interpreted, to it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jmoe.kernels.decode_attention import (COLUMNS_PER_PART, MIN_ROWS, call_with_caches, column_tile, combine_parts,
                                           online_softmax, part_bounds, precision_for, sizes, store_results,
                                           write_new_column)

# Columns of the latent space a program of absorbed_queries computes, for every row and one head.
RANK_CHUNK = 128
# Query heads a program holds: its output is [16, kv_lora_rank] in float32 (DeepSeek-V3: 512 wide) and a block of
# latents [32, 512]; 128 heads are 8 programs a row and part, each reading the same columns (from L2 after the first).
HEADS_PER_PROGRAM = MIN_ROWS
BLOCK = 32


def attend_latent_one_token(q_latent, ropes, latent_new, latent_cache, rope_cache, columns, *, scale: float,
                            on_gpu: bool, columns_per_part: int = COLUMNS_PER_PART):
    """(out [B, H, r] in q_latent's dtype, latent_cache, rope_cache) for one query token per row.

    q_latent [B, H, r]: each head's query absorbed into the latent space; ropes [B, H + 1, dr]: each head's roped
    query part, then the token's roped shared key, which is written with latent_new [B, r] into column
    columns[b, 1] of rows b < B of latent_cache [Bc, S, 1, r] and rope_cache [Bc, S, 1, dr] (a column outside the
    cache is not written). Row b attends to columns columns[b, 0] ..= columns[b, 1] (none: zeros). A score is the
    query's product with a latent plus its rope part's with the rope key, each rounded to q_latent's dtype and so is
    their sum, as the XLA form's are, times `scale`; the output the softmax's sum of the latents. Interpreted where
    not on_gpu (tests)."""
    batch, heads, rank = q_latent.shape
    parts = pl.cdiv(latent_cache.shape[1], columns_per_part)
    kernel = functools.partial(_latent_kernel, heads=heads, rank=rank, rope_dim=ropes.shape[2], scale=scale,
                               **sizes(latent_cache.shape[1], parts, columns_per_part, BLOCK))
    out, latent_cache, rope_cache = call_with_caches(
        kernel, (q_latent, ropes, latent_new, columns.astype(jnp.int32)), (latent_cache, rope_cache),
        (batch, 1, heads, rank), q_latent.dtype, grid=(batch, pl.cdiv(heads, HEADS_PER_PROGRAM), parts), num_warps=8,
        name="attend_latent_one_token", on_gpu=on_gpu)
    if parts > 1:
        out = combine_parts(*out).astype(q_latent.dtype)
    return out[:, 0], latent_cache, rope_cache


def _latent_kernel(q_ref, ropes_ref, latent_new_ref, columns_ref, latent_in, rope_in, *refs, heads, rank, rope_dim,
                   length, part_len, block, scale, combined):
    """One (row, block of heads, part): the new column written by the first block's part 0, then the part's visible
    columns in blocks."""
    *results, latent_out, rope_out = refs
    row, head_block, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    first_head = head_block * HEADS_PER_PROGRAM
    only_head = jnp.int32(0)  # the caches' one head (an array: a Python int does not index a ref interpreted)
    rank_p, rope_p = pl.next_power_of_2(rank), pl.next_power_of_2(rope_dim)
    real_rows = first_head + jax.lax.broadcasted_iota(jnp.int32, (HEADS_PER_PROGRAM, 1), 0) < heads
    real_rank = jax.lax.broadcasted_iota(jnp.int32, (1, rank_p), 1) < rank
    real_rope = jax.lax.broadcasted_iota(jnp.int32, (1, rope_p), 1) < rope_dim
    heads_here = pl.ds(first_head, HEADS_PER_PROGRAM)
    q_latent = pltriton.load(q_ref.at[row, heads_here, pl.ds(0, rank_p)], mask=jnp.logical_and(real_rows, real_rank),
                             other=0)
    q_rope = pltriton.load(ropes_ref.at[row, heads_here, pl.ds(0, rope_p)], mask=jnp.logical_and(real_rows, real_rope),
                           other=0)
    dtype = q_latent.dtype
    key_new = pltriton.load(ropes_ref.at[pl.ds(row, 1), only_head + heads, pl.ds(0, rope_p)], mask=real_rope, other=0)
    latent_new = pltriton.load(latent_new_ref.at[pl.ds(row, 1), pl.ds(0, rank_p)], mask=real_rank, other=0)
    key_new, latent_new = key_new.astype(rope_out.dtype), latent_new.astype(latent_out.dtype)  # as cached
    first, last = columns_ref[row, 0], columns_ref[row, 1]
    writer = jnp.logical_and(part == 0, head_block == 0)
    write_new_column(((latent_out, latent_new),), row, only_head, last, length, writer, rank_p, real_rank)
    write_new_column(((rope_out, key_new),), row, only_head, last, length, writer, rope_p, real_rope)

    def scores_and_values(start):
        columns = pl.ds(start, block)
        latents = column_tile(latent_in, (row, columns, only_head, pl.ds(0, rank_p)), latent_new, last, length,
                              real_rank).astype(dtype)
        keys = column_tile(rope_in, (row, columns, only_head, pl.ds(0, rope_p)), key_new, last, length,
                           real_rope).astype(dtype)
        latent_scores = pltriton.dot(q_latent, latents, trans_b=True, precision=precision_for(dtype)).astype(dtype)
        rope_scores = pltriton.dot(q_rope, keys, trans_b=True, precision=precision_for(dtype)).astype(dtype)
        return (latent_scores + rope_scores).astype(jnp.float32) * scale, latents

    carry = online_softmax(*part_bounds(first, last, part, part_len, length), block, scores_and_values,
                           (HEADS_PER_PROGRAM, rank_p))
    store_results(results, (row, only_head, part), first_head, carry, real_rows, real_rank, combined)


def absorbed_queries(q, kv_b, *, nope_dim: int, value_dim: int, on_gpu: bool):
    """q_latent [B, H, r] in q's dtype: each head's query part without rope (the first nope_dim = dn of q
    [B, H, dn + dr]) times its key part of kv_b [H * (dn + dv), r] (stored [out, in]: head h's rows h * (dn + dv) ..
    + dn), float32 sums rounded once. A program per (head, chunk of RANK_CHUNK columns) reads its part of the
    weight once for every row (a batch's rows, padded to a power of two of at least 16, are one product's). XLA:GPU
    made this product a reduction over the weight's middle axis, and wrote the weight's products out transposed
    first (2 x its bytes more, a kernel more) where a custom call consumed it. Interpreted where not on_gpu
    (tests)."""
    batch, heads, _ = q.shape
    rank = kv_b.shape[1]
    kernel = functools.partial(_absorb_kernel, rows=batch, nope_dim=nope_dim, stride=nope_dim + value_dim,
                               rank=rank)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((batch, heads, rank), q.dtype),
        grid=(heads, pl.cdiv(rank, RANK_CHUNK)),
        in_specs=[pl.no_block_spec] * 2,
        out_specs=pl.no_block_spec,
        interpret=not on_gpu,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1) if on_gpu else None,
        name="absorbed_queries",
    )(q, kv_b)


def _absorb_kernel(q_ref, kv_b_ref, out_ref, *, rows, nope_dim, stride, rank):
    head, chunk = pl.program_id(0), pl.program_id(1)
    rows_p, nope_p = max(MIN_ROWS, pl.next_power_of_2(rows)), pl.next_power_of_2(nope_dim)
    real_rows = jax.lax.broadcasted_iota(jnp.int32, (rows_p, 1), 0) < rows
    real_nope = jax.lax.broadcasted_iota(jnp.int32, (1, nope_p), 1) < nope_dim
    columns = chunk * RANK_CHUNK + jax.lax.broadcasted_iota(jnp.int32, (1, RANK_CHUNK), 1)
    q = pltriton.load(q_ref.at[pl.ds(0, rows_p), head, pl.ds(0, nope_p)], mask=jnp.logical_and(real_rows, real_nope),
                      other=0)
    weight = pltriton.load(kv_b_ref.at[pl.ds(head * stride, nope_p), pl.ds(chunk * RANK_CHUNK, RANK_CHUNK)],
                           mask=jnp.logical_and(real_nope.T, columns < rank), other=0)
    out = pltriton.dot(q, weight.astype(q.dtype), precision=precision_for(q.dtype))
    pltriton.store(out_ref.at[pl.ds(0, rows_p), head, pl.ds(chunk * RANK_CHUNK, RANK_CHUNK)], out.astype(out_ref.dtype),
                   mask=jnp.logical_and(real_rows, columns < rank))
