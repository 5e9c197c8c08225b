"""A decode step's grouped-query attention over its KV cache, with the new column's write, as one Pallas kernel
(Triton on a GPU): per (row, kv head, part of the cache) a program writes nothing or the new key and value, then
reads only the cache columns its row can see (`columns`: the row's first and last), in blocks, with an online
softmax (flash decoding); where the cache is long, its parts' partial results are combined after.

Why a kernel: XLA:GPU made a one-token attention five kernels a layer (the key and value cache writes, the scores,
the softmax, the products with the values) and read every column of the cache, filled or not, masking the rest: at
a serving cache of 32k columns a step read all of them in every layer; and roping the queries and the keys was a
kernel each. The kernel reads the queries, the keys (roped together) and the values as one array, one fusion's
output. The model's XLA form (`jmoe.model.attention`) is what every other platform runs;
tests/test_decode_attention.py holds the kernel, interpreted, to it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# Cache columns one program reads at most: a longer cache is split into parts whose partial softmaxes are combined
# after (one small kernel more), so that a one-row step at a long context still spreads its reads over the GPU.
COLUMNS_PER_PART = 1024
# Columns of one block of the loop: a [64, head_dim] tile of keys, then of values.
BLOCK = 64
# Triton's matrix products need at least 16 rows: a kv head's query heads are padded to it.
MIN_ROWS = 16


def attend_one_token(qkv, k_cache, v_cache, columns, sinks=None, *, groups: int, scale: float, on_gpu: bool,
                     columns_per_part: int = COLUMNS_PER_PART):
    """(out [B, Hkv, G, hd] in qkv's dtype, k_cache, v_cache) for one query token per row.

    qkv [B, Hkv*G + 2*Hkv, hd]: the token's query heads (each kv head's G together, kv head h's from row h*G), then
    its keys (queries and keys roped), then its values; the keys and values are written into column columns[b, 1] of rows b < B of
    k_cache, v_cache [Bc, S, Hkv, hd] (Bc >= B; a column outside the cache is not written). Row b attends to columns
    columns[b, 0] ..= columns[b, 1] (none if the first is past the last: its output is zeros). `sinks` [Hkv, G]: each
    query head's sink logit, which joins the softmax's denominator only. Scores are rounded to the queries' dtype
    before the float32 softmax, as the XLA form's product is. Interpreted where not on_gpu (tests)."""
    batch, all_heads, head_dim = qkv.shape
    kv_heads = all_heads // (groups + 2)
    parts = pl.cdiv(k_cache.shape[1], columns_per_part)
    with_sinks = sinks is not None and parts == 1  # several parts: the sinks join when they are combined
    kernel = functools.partial(_attend_kernel, heads=kv_heads * groups, kv_heads=kv_heads, groups=groups,
                               head_dim=head_dim, scale=scale, with_sinks=with_sinks,
                               **sizes(k_cache.shape[1], parts, columns_per_part))
    inputs = (qkv, columns.astype(jnp.int32), *((sinks,) if with_sinks else ()))
    out, k_cache, v_cache = call_with_caches(kernel, inputs, (k_cache, v_cache), (batch, kv_heads, groups, head_dim),
                                             qkv.dtype, grid=(batch, kv_heads, parts), num_warps=4,
                                             name="attend_one_token", on_gpu=on_gpu)
    if parts > 1:
        out = combine_parts(*out, sinks).astype(qkv.dtype)
    return out, k_cache, v_cache


def sizes(length: int, parts: int, columns_per_part: int, block: int = BLOCK) -> dict:
    """A kernel's static sizes: the cache's columns, a part's, a block's (a power of two, at least MIN_ROWS: a
    product's dimension)."""
    return dict(length=length, part_len=length if parts == 1 else columns_per_part,
                block=min(block, max(MIN_ROWS, pl.next_power_of_2(length))), combined=parts == 1)


def call_with_caches(kernel, inputs, caches, out_shape, dtype, *, grid, num_warps: int, name: str, on_gpu: bool):
    """(out, *caches) of a decode-attention `kernel` over `grid` (row, head or head block, part): `inputs`, then the
    caches (aliased to the outputs, updated in place). out: [B, Hkv, G, dv] of `dtype` where the grid has one part,
    else each part's (unnormalised output [B, Hkv, P, G, dv], running max, sum of exponentials [B, Hkv, P, G])
    in float32, for combine_parts."""
    parts = grid[2]
    float32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)
    if parts == 1:
        results = [jax.ShapeDtypeStruct(out_shape, dtype)]
    else:
        batch, heads, groups, width = out_shape
        results = [float32((batch, heads, parts, groups, width)), float32((batch, heads, parts, groups)),
                   float32((batch, heads, parts, groups))]
    *results, k_cache, v_cache = pl.pallas_call(
        kernel,
        out_shape=[*results, *(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches)],
        grid=grid,
        # Whole arrays, read and written by masked loads and stores: Triton's blocks are powers of two, the head
        # dimension, the query heads and the cache's length need not be.
        in_specs=[pl.no_block_spec] * (len(inputs) + len(caches)),
        out_specs=[pl.no_block_spec] * (len(results) + len(caches)),
        input_output_aliases={len(inputs) + i: len(results) + i for i in range(len(caches))},
        interpret=not on_gpu,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2) if on_gpu else None,
        name=name,
    )(*inputs, *caches)
    return (results[0] if parts == 1 else results), k_cache, v_cache


def combine_parts(out, running_max, total, sinks=None):
    """The softmax-weighted output [B, Hkv, G, hd] of parts' unnormalised outputs out [B, Hkv, P, G, hd], running
    maxima and sums of exponentials [B, Hkv, P, G] (a part that saw no column: -inf and 0), a sink logit per query
    head [Hkv, G] (any float dtype) joining the denominator."""
    best = jnp.max(running_max, axis=2)
    if sinks is not None:
        best = jnp.maximum(best, sinks.astype(jnp.float32))
    best = jnp.where(jnp.isfinite(best), best, 0.0)  # a row that sees no column: zeros, not NaN
    weight = jnp.exp(running_max - best[:, :, None])
    total = jnp.sum(weight * total, axis=2)
    if sinks is not None:
        total = total + jnp.exp(sinks.astype(jnp.float32) - best)
    out = jnp.sum(weight[..., None] * out, axis=2)
    return jnp.where(total[..., None] > 0, out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)


def _attend_kernel(qkv_ref, columns_ref, *refs, heads, kv_heads, groups, head_dim, length, part_len, block, scale,
                   combined, with_sinks):
    """One (row, kv head, part): the new column written by part 0, then the part's visible columns in blocks."""
    sinks_ref, refs = (refs[0], refs[1:]) if with_sinks else (None, refs)
    k_in, v_in, *results, k_out, v_out = refs
    row, head, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows_p, dims_p = max(MIN_ROWS, pl.next_power_of_2(groups)), pl.next_power_of_2(head_dim)
    query_rows = jax.lax.broadcasted_iota(jnp.int32, (rows_p, 1), 0)
    dims = jax.lax.broadcasted_iota(jnp.int32, (1, dims_p), 1)
    real_dims = dims < head_dim
    q = pltriton.load(qkv_ref.at[row, pl.ds(head * groups, rows_p), pl.ds(0, dims_p)],
                      mask=jnp.logical_and(query_rows < groups, real_dims), other=0)
    k_new = pltriton.load(qkv_ref.at[pl.ds(row, 1), heads + head, pl.ds(0, dims_p)], mask=real_dims, other=0)
    v_new = pltriton.load(qkv_ref.at[pl.ds(row, 1), heads + kv_heads + head, pl.ds(0, dims_p)], mask=real_dims,
                          other=0)
    k_new, v_new = k_new.astype(k_out.dtype), v_new.astype(v_out.dtype)  # as the cache holds them
    first, last = columns_ref[row, 0], columns_ref[row, 1]
    write_new_column(((k_out, k_new), (v_out, v_new)), row, head, last, length, part == 0, dims_p, real_dims)

    def scores_and_values(start):
        tile = (row, pl.ds(start, block), head, pl.ds(0, dims_p))
        keys = column_tile(k_in, tile, k_new, last, length, real_dims)
        values = column_tile(v_in, tile, v_new, last, length, real_dims)
        scores = pltriton.dot(q, keys.astype(q.dtype), trans_b=True, precision=precision_for(q.dtype))
        return scores.astype(q.dtype).astype(jnp.float32) * scale, values

    sink_logits = None
    if with_sinks:
        sink_logits = pltriton.load(sinks_ref.at[head, pl.ds(0, rows_p)], mask=query_rows[:, 0] < groups,
                                    other=0.0).astype(jnp.float32)
    carry = online_softmax(*part_bounds(first, last, part, part_len, length), block, scores_and_values,
                           (rows_p, dims_p), sink_logits)
    store_results(results, (row, head, part), 0, carry, query_rows < groups, real_dims, combined)


def write_new_column(writes, row, head, last, length: int, writer, dims_p: int, real_dims):
    """Each (cache ref [Bc, S, H, d], value [1, d']) of `writes` stored at column `last` of `row` and `head`, by the
    `writer` program only and only where the column lies in the cache."""
    written = jnp.logical_and(real_dims, jnp.logical_and(writer, jnp.logical_and(last >= 0, last < length)))
    for cache, value in writes:
        pltriton.store(cache.at[row, pl.ds(last, 1), head, pl.ds(0, dims_p)], value, mask=written)


def column_tile(cache, tile, new, last, length: int, real_dims):
    """A tile of cache columns [block, d'] (past the cache: zeros), with column `last` taken from `new`: the cache's
    may not hold it yet (another program writes it)."""
    cols = tile[1].start + jax.lax.broadcasted_iota(jnp.int32, (tile[1].size, 1), 0)
    loaded = pltriton.load(cache.at[tile], mask=jnp.logical_and(cols < length, real_dims), other=0)
    return jnp.where(cols == last, new, loaded)


def part_bounds(first, last, part, part_len: int, length: int):
    """The visible columns [lo, hi] of a row whose first and last visible columns are given, within its part."""
    lo = jnp.maximum(first, part * part_len)
    hi = jnp.minimum(jnp.minimum(last, length - 1), (part + 1) * part_len - 1)
    return lo, hi


def online_softmax(lo, hi, block: int, scores_and_values, shape, sink_logits=None):
    """(acc [rows, d'], running max, sum of exponentials [rows, 1]) over the blocks of columns holding [lo, hi]: per
    block, `scores_and_values(start)` gives the scores (float32 [rows, block], scaled) and the values ([block, d'])
    of columns start .. start + block - 1, the columns outside [lo, hi] masked here. `sink_logits` [rows]: each
    row's sink, which starts the sum (its exponential) and the running max (its logit)."""
    def body(index, carry):
        acc, running_max, total = carry
        start = index * block
        scores, values = scores_and_values(start)
        visible = start + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)
        scores = jnp.where(jnp.logical_and(visible >= lo, visible <= hi), scores, -jnp.inf)
        new_max = jnp.maximum(running_max, jnp.max(scores, axis=1, keepdims=True))
        correction = jnp.exp(running_max - new_max)
        probs = jnp.exp(scores - new_max)
        total = total * correction + jnp.sum(probs, axis=1, keepdims=True)
        acc = acc * correction + pltriton.dot(probs.astype(values.dtype), values, precision=precision_for(values.dtype))
        return acc, new_max, total

    rows = shape[0]
    acc = jnp.zeros(shape, jnp.float32)
    if sink_logits is None:
        running_max, total = jnp.full((rows, 1), -jnp.inf, jnp.float32), jnp.zeros((rows, 1), jnp.float32)
    else:
        running_max, total = sink_logits[:, None], jnp.ones((rows, 1), jnp.float32)
    # Every block of the loop holds at least one visible column, so the running max is finite after the first.
    return jax.lax.fori_loop(lo // block, jnp.where(lo <= hi, hi // block + 1, lo // block), body,
                             (acc, running_max, total))


def store_results(results, index, first_query: int, carry, real_rows, real_dims, combined: bool):
    """A program's results stored for (row, head, part) = index, its query rows from `first_query`: the normalised
    output (a row that saw nothing: zeros) where its part is the only one, else the part's acc, max and sum."""
    acc, running_max, total = carry
    row, head, part = index
    rows_p, dims_p = acc.shape
    mask = jnp.logical_and(real_rows, real_dims)
    if combined:
        out = jnp.where(total > 0, acc / jnp.where(total > 0, total, 1.0), 0.0)
        pltriton.store(results[0].at[row, head, pl.ds(first_query, rows_p), pl.ds(0, dims_p)],
                       out.astype(results[0].dtype), mask=mask)
        return
    out_ref, max_ref, total_ref = results
    pltriton.store(out_ref.at[row, head, part, pl.ds(first_query, rows_p), pl.ds(0, dims_p)], acc, mask=mask)
    pltriton.store(max_ref.at[row, head, part, pl.ds(first_query, rows_p)], running_max[:, 0], mask=real_rows[:, 0])
    pltriton.store(total_ref.at[row, head, part, pl.ds(first_query, rows_p)], total[:, 0], mask=real_rows[:, 0])


def precision_for(dtype):
    """Full float32 products for float32 models (Triton would round their inputs to TF32)."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
