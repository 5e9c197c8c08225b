"""Sorted, tile-padded row layout shared by the grouped-GEMM kernels (Pallas, Triton).

The T*k (token, j) pairs are sorted by slot and each slot's rows are padded up to a multiple
of block_m, so every row tile belongs to exactly one slot: a kernel program reads the weights
of one slot only, and tiles past the last group (tile_group == -1) read nothing. Pairs with
slot id -1 get no row at all, so their slot is never read."""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jmoe.kernels.target import gpu_available


class TileLayout(NamedTuple):
    row_of_pair: jax.Array  # [T*k] int32: padded row of each pair; num_rows for -1 pairs
    row_token: jax.Array  # [num_rows] int32: token of each padded row; T for padding rows
    row_weight: jax.Array  # [num_rows] float32: router weight of the row; 0 for padding
    tile_group: jax.Array  # [num_tiles] int32: slot of each row tile; -1 = empty tile


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def num_padded_rows(num_pairs: int, num_slots: int, block_m: int) -> int:
    """Static bound on the padded row count: each non-empty group wastes < block_m rows."""
    return _round_up(num_pairs + min(num_slots, num_pairs) * (block_m - 1), block_m)


class SortedPairs(NamedTuple):
    key: jax.Array  # [T*k] int32: slot of each pair; num_slots for -1 pairs
    order: jax.Array  # [T*k]: pair indices sorted by key (stable), the -1 pairs last
    group_sizes: jax.Array  # [S] int32: pairs per slot
    group_starts: jax.Array  # [S] int32: first sorted position of each slot's pairs


def sort_pairs(slot_ids, num_slots: int) -> SortedPairs:
    """The (token, j) pairs sorted by slot: slot s owns sorted positions [start_s, start_s + size_s); pairs of
    slot -1 sort last, past every group, as a dummy group num_slots."""
    flat = slot_ids.reshape(-1)
    key = jnp.where(flat >= 0, flat, num_slots)
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.bincount(key, length=num_slots + 1)[:num_slots].astype(jnp.int32)
    return SortedPairs(key, order, group_sizes, jnp.cumsum(group_sizes) - group_sizes)


# On a GPU, up to this many (token, j) pairs (a decode step's of several rows; one row's are laid out a tile a pair,
# tile_layout_per_pair) are laid out by comparing every pair with every pair and every row instead of by a sort and
# scatters: compiled for an H100, 6 kernels instead of 13 (one row, top-2 of 16 slots), 10 instead of 15 (8 rows,
# top-8 of 256). Its [rows, pairs] comparison grows with the square of the pairs, and a CPU, which launches nothing,
# runs it slower (1.3 ms against 94 us at 256 pairs of 256 slots): a prompt's pairs, and a CPU's, are sorted.
COMPARED_PAIRS = 256


def tile_layout(slot_ids, weights, num_slots: int, block_m: int) -> TileLayout:
    """The pairs' padded rows, sorted by slot (stable), each slot's rows padded to a multiple of block_m; one token's
    a tile a pair, in the order of its choices."""
    num_tokens, top_k = slot_ids.shape
    if num_tokens == 1 and num_slots >= top_k:
        return tile_layout_per_pair(slot_ids, weights, num_slots, block_m)
    if gpu_available() and num_tokens * top_k <= COMPARED_PAIRS:
        return tile_layout_by_comparison(slot_ids, weights, num_slots, block_m)
    return tile_layout_by_sort(slot_ids, weights, num_slots, block_m)


def tile_layout_per_pair(slot_ids, weights, num_slots: int, block_m: int) -> TileLayout:
    """tile_layout for one token (a decode step of one row): tile p is pair p's (its first row; a pair of no slot
    leaves its tile empty). A token's choices are distinct experts, so each slot has at most one of its pairs and
    this is the sorted layout but for the order of the tiles, which no kernel reads (two pairs on one slot would
    read it twice, the same result). Every index is a constant; only the slots and weights are data, so nothing is
    compared or sorted. With fewer slots than choices the kernels' rows (num_padded_rows) are fewer than a tile a
    choice: tile_layout groups those as it groups several tokens' pairs."""
    top_k = slot_ids.shape[1]
    num_rows = num_padded_rows(top_k, num_slots, block_m)
    flat = slot_ids.reshape(-1)
    pair_of_row = jnp.arange(num_rows, dtype=jnp.int32) // block_m
    row_valid = (jnp.arange(num_rows) % block_m == 0) & (flat[pair_of_row] >= 0)
    return TileLayout(
        row_of_pair=jnp.where(flat >= 0, jnp.arange(top_k, dtype=jnp.int32) * block_m, num_rows),
        row_token=jnp.where(row_valid, 0, 1).astype(jnp.int32),
        row_weight=jnp.where(row_valid, weights.reshape(-1)[pair_of_row].astype(jnp.float32), 0.0),
        tile_group=jnp.where(flat >= 0, flat, -1).astype(jnp.int32))


def tile_layout_by_comparison(slot_ids, weights, num_slots: int, block_m: int) -> TileLayout:
    """tile_layout for few pairs: each pair's rank among the earlier pairs of its slot, and each row's pair, found
    by comparing all with all (the same layout as the sort's)."""
    num_tokens, top_k = slot_ids.shape
    num_pairs = num_tokens * top_k
    num_rows = num_padded_rows(num_pairs, num_slots, block_m)
    flat = slot_ids.reshape(-1)
    key = jnp.where(flat >= 0, flat, num_slots)
    group_sizes = jnp.sum(key[None, :] == jnp.arange(num_slots, dtype=key.dtype)[:, None], axis=1, dtype=jnp.int32)
    pair = jnp.arange(num_pairs, dtype=jnp.int32)
    rank = jnp.sum((key[None, :] == key[:, None]) & (pair[None, :] < pair[:, None]), axis=1, dtype=jnp.int32)
    row_of_pair, padded_ends = padded_rows(key, rank, group_sizes, num_rows, block_m)
    match = row_of_pair[None, :] == jnp.arange(num_rows, dtype=jnp.int32)[:, None]  # [rows, pairs]: at most one
    row_token = jnp.where(match.any(axis=1), jnp.argmax(match, axis=1).astype(jnp.int32) // top_k, num_tokens)
    row_weight = jnp.sum(jnp.where(match, weights.reshape(-1).astype(jnp.float32)[None, :], 0.0), axis=1)
    return TileLayout(row_of_pair, row_token, row_weight, tile_groups(padded_ends, num_rows, num_slots, block_m))


def tile_layout_by_sort(slot_ids, weights, num_slots: int, block_m: int) -> TileLayout:
    """tile_layout for many pairs (a prompt's): a stable sort by slot, the rows written by scatters."""
    num_tokens, top_k = slot_ids.shape
    num_pairs = num_tokens * top_k
    num_rows = num_padded_rows(num_pairs, num_slots, block_m)
    key, order, group_sizes, group_starts = sort_pairs(slot_ids, num_slots)
    sorted_key = key[order]
    rank = jnp.arange(num_pairs, dtype=jnp.int32) - group_starts[jnp.minimum(sorted_key, num_slots - 1)]
    dest, padded_ends = padded_rows(sorted_key, rank, group_sizes, num_rows, block_m)
    row_of_pair = jnp.zeros(num_pairs, jnp.int32).at[order].set(dest)
    pair_token = jnp.arange(num_pairs, dtype=jnp.int32) // top_k
    row_token = jnp.full(num_rows, num_tokens, jnp.int32).at[row_of_pair].set(
        pair_token, mode="drop"
    )
    row_weight = jnp.zeros(num_rows, jnp.float32).at[row_of_pair].set(
        weights.reshape(-1).astype(jnp.float32), mode="drop"
    )
    return TileLayout(row_of_pair, row_token, row_weight, tile_groups(padded_ends, num_rows, num_slots, block_m))


def padded_rows(key, rank, group_sizes, num_rows: int, block_m: int):
    """(each pair's padded row: its slot's first row plus its rank among the slot's pairs, num_rows for a pair of no
    slot (key = the number of slots); the end of each slot's rows), every slot's rows padded to a multiple of
    block_m."""
    num_slots = group_sizes.shape[0]
    padded_sizes = (group_sizes + block_m - 1) // block_m * block_m
    padded_ends = jnp.cumsum(padded_sizes)
    starts = padded_ends - padded_sizes
    rows = jnp.where(key < num_slots, starts[jnp.minimum(key, num_slots - 1)] + rank, num_rows).astype(jnp.int32)
    return rows, padded_ends


def tile_groups(padded_ends, num_rows: int, num_slots: int, block_m: int):
    """int32 [num_rows / block_m]: the slot of each row tile, -1 past the last group."""
    tile_start = jnp.arange(num_rows // block_m, dtype=jnp.int32) * block_m
    # Every tile against every group's end at once: JAX's default search is a loop of log2(groups) iterations, which
    # on a GPU launched its body's 4 kernels and its condition each time (25 launches a grouped GEMM call, a resident
    # decode's 4 layers 100 of its ~250). On CPU the same: 7 us either way at 16 groups, 134 against 72 us at 256
    # groups x 2048 tiles (a prompt's), well inside a prefill step's noise.
    tile_group = jnp.searchsorted(padded_ends, tile_start, side="right", method="compare_all").astype(jnp.int32)
    return jnp.where(tile_group < num_slots, tile_group, -1)


def gather_rows(x, layout: TileLayout):
    """x [T, d] -> [num_rows, d]; padding rows are zero."""
    return jnp.take(x, layout.row_token, axis=0, mode="fill", fill_value=0)


def combine_rows(y_rows, layout: TileLayout, top_k: int):
    """Per-row outputs (already router-weighted, float32) -> y [T, d] float32, summed over k."""
    per_pair = jnp.take(y_rows, layout.row_of_pair, axis=0, mode="fill", fill_value=0)
    per_pair = per_pair.astype(jnp.float32).reshape(-1, top_k, y_rows.shape[-1])
    return per_pair.sum(axis=1)


def largest_pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap that divides n (Triton blocks must be powers of two)."""
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def mean_group_rows(num_pairs: int, num_slots: int) -> float:
    """Pairs per group when `num_pairs` spread over as many of `num_slots` as they can fill."""
    return num_pairs / max(1, min(num_slots, num_pairs))


def choose_block_m(num_pairs: int, num_slots: int, *, min_block: int, max_block: int = 128) -> int:
    """Rows per tile ~ the mean group size: decode (few pairs per slot) gets small tiles so
    padding does not multiply compute; prefill gets large tiles for weight reuse."""
    mean_rows = max(1, math.ceil(mean_group_rows(num_pairs, num_slots)))
    b = 1
    while b < mean_rows:
        b *= 2
    return max(min_block, min(max_block, b))


def choose_xla_block_m(num_pairs: int, num_slots: int) -> int:
    """Rows per tile for the XLA tiled kernel (any multiple of 8; it has no Triton constraint): just above
    the typical group, mean + sqrt(mean) (about one binomial spread), so that most groups fill one tile and
    their slot is read once. Measured on CPU (Mixtral-like d=512, f=1024, 16 slots, 512 tokens, top-2, mean
    64 rows): 72 rows per tile 30 ms, 64 rows 42 ms (half the groups spill into a second tile)."""
    mean = mean_group_rows(num_pairs, num_slots)
    return min(128, max(8, -(-int(mean + mean ** 0.5) // 8) * 8))
