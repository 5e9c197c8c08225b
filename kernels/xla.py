"""XLA backends: sorted grouped GEMM through lax.ragged_dot (prefill), and a decode path that
gathers each needed slot once and runs small dense products (GEMV-like)."""

import functools

import jax
import jax.numpy as jnp

from jmoe.kernels import grouping
from jmoe.kernels.activations import get_activation
from jmoe.kernels.bias import bias_rows
from jmoe.kernels.float_bits import FloatBits, is_float_bits
from jmoe.kernels.quantized import materialize, rows_of
from jmoe.kernels.target import platform_dependent


def moe_ffn_ragged(x, slot_ids, weights, w_gate_up, w_down, b_gate_up=None, b_down=None, *, activation="swiglu"):
    act = get_activation(activation)
    num_tokens, top_k = slot_ids.shape
    num_slots, _, two_f = w_gate_up.shape
    f = two_f // 2
    # -1 pairs sort to the end, beyond sum(group_sizes): ragged_dot gives them no group.
    key, order, group_sizes, _ = grouping.sort_pairs(slot_ids, num_slots)
    x_sorted = x[order // top_k]
    # lax.ragged_dot takes no scales: quantized weights are dequantized whole here, which is why `auto`
    # never picks this backend for them (xla_tiled dequantizes one slot per tile).
    w_gate_up, w_down = materialize(w_gate_up, x.dtype), materialize(w_down, x.dtype)
    # XLA:CPU lowers ragged_dot densely (every row times every group's weights, masked by multiplying), so a
    # NaN in a slot no row uses would reach every row: there, unused slots are zeroed first.
    used = group_sizes > 0
    w_gate_up, w_down = platform_dependent(
        w_gate_up, w_down,
        cpu=lambda a, b: (jnp.where(used[:, None, None], a, 0), jnp.where(used[:, None, None], b, 0)),
        default=lambda a, b: (a, b))
    row_slot = jnp.minimum(key[order], num_slots - 1)  # rows past the groups are masked below
    gate_up = jax.lax.ragged_dot(
        x_sorted, w_gate_up, group_sizes, preferred_element_type=jnp.float32
    ) + bias_rows(b_gate_up, row_slot)
    h = act(gate_up[:, :f], gate_up[:, f:]).astype(x.dtype)
    out_sorted = jax.lax.ragged_dot(h, w_down, group_sizes, preferred_element_type=jnp.float32)
    out_sorted = out_sorted + bias_rows(b_down, row_slot)
    w_sorted = weights.reshape(-1).astype(jnp.float32)[order]
    out_sorted = jnp.where((key[order] < num_slots)[:, None], out_sorted * w_sorted[:, None], 0.0)
    out = jnp.zeros_like(out_sorted).at[order].set(out_sorted)
    return out.reshape(num_tokens, top_k, -1).sum(axis=1)


def moe_ffn_gather(x, slot_ids, weights, w_gate_up, w_down, b_gate_up=None, b_down=None, *, activation="swiglu"):
    act = get_activation(activation)
    num_tokens, top_k = slot_ids.shape
    num_slots, _, two_f = w_gate_up.shape
    f = two_f // 2
    num_pairs = num_tokens * top_k
    flat = slot_ids.reshape(-1)
    key = jnp.where(flat >= 0, flat, num_slots)
    # Distinct slots (plus the -1 marker) fit in min(P, S+1) entries; the marker sorts last.
    num_unique = min(num_pairs, num_slots + 1)
    uniq = jnp.unique(key, size=num_unique, fill_value=num_slots)
    used = uniq < num_slots
    # Unused entries re-read the first needed slot rather than an arbitrary one.
    safe = jnp.where(used, uniq, jnp.where(used[0], uniq[0], 0))
    # Each needed slot read once. Operands go to f32 here: a bf16 product is exact in f32, so
    # this equals bf16 x bf16 -> f32 accumulation, which XLA:CPU cannot run as a batched dot.
    w_gu = rows_of(w_gate_up, safe, x.dtype).astype(jnp.float32)  # [U, d, 2f]
    w_d = rows_of(w_down, safe, x.dtype).astype(jnp.float32)  # [U, f, d]
    gate_up = jnp.einsum("td,udn->tun", x.astype(jnp.float32), w_gu) + bias_rows(b_gate_up, safe)
    h = act(gate_up[..., :f], gate_up[..., f:]).astype(x.dtype).astype(jnp.float32)
    out = jnp.einsum("tuf,ufd->tud", h, w_d) + bias_rows(b_down, safe)
    # coef[t, u] = sum_j weights[t, j] * [slot_ids[t, j] == uniq[u]]
    match = (key.reshape(num_tokens, top_k, 1) == uniq[None, None, :]) & used[None, None, :]
    coef = jnp.sum(jnp.where(match, weights.astype(jnp.float32)[..., None], 0.0), axis=1)
    # Select, not multiply: a column this token does not use (or a re-read filler slot when
    # every id is -1) must not leak NaN/Inf into it through 0 * x.
    out = jnp.where(match.any(axis=1)[..., None], out, 0.0)
    return jnp.einsum("tu,tud->td", coef, out)


# K rows of a 16-bit weight a matrix-vector product converts at a time (`dot_by_blocks`).
VECTOR_BLOCK_ROWS = 64


def dot_by_blocks(xs, weight: FloatBits, slot) -> jax.Array:
    """float32 xs [m, K] @ weight[slot] ([K, N] of a FloatBits [S, K, N]), over blocks of VECTOR_BLOCK_ROWS rows.

    For a few rows XLA:CPU converts the slot's whole 16-bit weight to a float32 temporary, then its dot reads that:
    three passes over twice the bytes for one product. A block's conversion is fused with its slice and stays in
    cache, so the weight is read once (bench/results/disk_tier_orbax.md). The products are exact in float32 either
    way; only the order of the float32 sums differs."""
    num_rows, blocks = weight.shape[1], weight.shape[1] // VECTOR_BLOCK_ROWS
    xs = xs.astype(jnp.float32)

    def block_product(start, size):
        w = jax.lax.dynamic_slice(weight.bits, (slot, start, 0), (1, size, weight.shape[2]))[0]
        x = jax.lax.dynamic_slice_in_dim(xs, start, size, 1)
        return jnp.dot(x, FloatBits(w, weight.dtype).astype(jnp.float32), preferred_element_type=jnp.float32)

    y = jnp.zeros((xs.shape[0], weight.shape[2]), jnp.float32)
    if blocks:  # a loop traces its body even for no trips
        y = jax.lax.fori_loop(0, blocks, lambda i, y: y + block_product(i * VECTOR_BLOCK_ROWS, VECTOR_BLOCK_ROWS), y)
    rest = num_rows - blocks * VECTOR_BLOCK_ROWS
    return y + block_product(blocks * VECTOR_BLOCK_ROWS, rest) if rest else y


def _slot_rows_ffn(w_gate_up, w_down, b_gate_up, b_down, activation, dtype, vector=False):
    """ffn(slot, xs [m, d], ws [m]) -> float32 [m, d]: rows of one slot's expert FFN, each times its router
    weight; the slot's weights are read (and dequantized) once for the m rows. `vector`: m is one row
    (`pairs`), so a 16-bit weight held as FloatBits is multiplied by blocks (`dot_by_blocks`)."""
    act = get_activation(activation)
    f = w_down.shape[1]

    def product(rows, weight, slot):
        if vector and is_float_bits(weight):
            return dot_by_blocks(rows, weight, slot)
        return jnp.dot(rows, rows_of(weight, slot, dtype), preferred_element_type=jnp.float32)

    def ffn(slot, xs, ws):
        gate_up = product(xs, w_gate_up, slot) + bias_rows(b_gate_up, slot)
        h = act(gate_up[:, :f], gate_up[:, f:]).astype(dtype)
        out = product(h, w_down, slot)
        return (out + bias_rows(b_down, slot)) * ws[:, None]

    return ffn


def _per_expert_ffns(per_expert, activation, dtype, vector=False):
    """One `_slot_rows_ffn` per expert over its own [1, ...] arrays (called with slot 0), or None."""
    if per_expert is None:
        return None
    return [_slot_rows_ffn(part.w_gate_up, part.w_down, part.b_gate_up, part.b_down, activation, dtype, vector)
            for part in per_expert]


def _unless_empty(ffn, slot, xs, ws, apart=None):
    """ffn(slot, xs, ws), or zeros for slot -1. On CPU an empty slot is skipped with a branch, and with
    `apart` (`_per_expert_ffns`) the branch chosen is the slot's own FFN, whose dots read the expert's array
    in place (XLA:CPU copies the slice of a stacked array before a dot reads it); lowered for a GPU it is
    computed on slot 0 and masked instead, because a branch there makes the host wait for the predicate."""

    def zeros(*operands):  # (slot, xs, ws) from cond, (xs, ws) from switch
        return jnp.zeros(operands[-2].shape, jnp.float32)

    def branched(slot, xs, ws):
        if apart is not None:
            return jax.lax.switch(slot + 1, [zeros, *(functools.partial(f, 0) for f in apart)], xs, ws)
        return jax.lax.cond(slot >= 0, ffn, zeros, slot, xs, ws)

    def masked(slot, xs, ws):
        # Select, not multiply: slot 0's weights may hold anything (NaN included).
        return jnp.where(slot >= 0, ffn(jnp.maximum(slot, 0), xs, ws), 0.0)

    return platform_dependent(slot, xs, ws, cpu=branched, default=masked)


def moe_ffn_tiled(x, slot_ids, weights, w_gate_up, w_down, b_gate_up=None, b_down=None, *, activation="swiglu",
                  block_m=None, per_expert=None):
    """Sorted grouped GEMM without ragged_dot: the Pallas tile layout, one scan step per row
    tile. XLA:CPU lowers ragged_dot to a dense product over every slot; this reads only the
    slots that own a tile (an empty tile: `_unless_empty`). With `per_expert` arrays on a CPU, each
    expert's rows are computed in chunks instead (`_per_expert_chunks`)."""
    num_tokens, top_k = slot_ids.shape
    num_slots, d, _ = w_gate_up.shape
    if block_m is None:
        block_m = grouping.choose_xla_block_m(num_tokens * top_k, num_slots)

    def tiles(x, slot_ids, weights):
        layout = grouping.tile_layout(slot_ids, weights, num_slots, block_m)
        x_tiles = grouping.gather_rows(x, layout).reshape(-1, block_m, d)
        w_tiles = layout.row_weight.reshape(-1, block_m)
        ffn = _slot_rows_ffn(w_gate_up, w_down, b_gate_up, b_down, activation, x.dtype)
        y_rows = jax.lax.map(lambda tile: _unless_empty(ffn, *tile), (layout.tile_group, x_tiles, w_tiles))
        return grouping.combine_rows(y_rows.reshape(-1, d), layout, top_k)

    if per_expert is None:
        return tiles(x, slot_ids, weights)
    chunks = functools.partial(_per_expert_chunks, ffns=_per_expert_ffns(per_expert, activation, x.dtype),
                               block_m=block_m)
    return platform_dependent(x, slot_ids, weights, cpu=chunks, default=tiles)


# The rows of `_per_expert_chunks`' small chunks: an 8-row product runs at a third of a 16-row one's speed (XLA:CPU,
# [m, 512] x [512, 2048] on a Zen 4 core pair: 41 against 113 GFLOP/s), and every chunk size is one more copy of each
# expert's FFN to compile.
SMALL_CHUNK_ROWS = 16


def chunk_sizes(block_m: int) -> tuple[int, ...]:
    """Row counts of `_per_expert_chunks`' stages: block_m, then SMALL_CHUNK_ROWS where that is smaller."""
    return (block_m, SMALL_CHUNK_ROWS) if block_m > SMALL_CHUNK_ROWS else (block_m,)


def _per_expert_chunks(x, slot_ids, weights, *, ffns, block_m):
    """CPU only, experts held one per array: each expert's run of the slot-sorted rows, computed in place on its own
    array by chunks of block_m rows while at least 3/4 of one is left, then of SMALL_CHUNK_ROWS while any row is.
    An expert computes fewer than max(block_m / 4, 16) rows it does not need, where padding its group to whole
    tiles costs ~40% more rows at 512 tokens of top-2 over 16 experts (bench/results/compare_cpu_chunks.md). The
    loops' trip counts follow the routing: cheap on a CPU, a host wait per iteration on a GPU (the other branch of
    moe_ffn_tiled)."""
    num_tokens, top_k = slot_ids.shape
    num_pairs, d = slot_ids.size, x.shape[1]
    sizes = chunk_sizes(block_m)
    pairs = grouping.sort_pairs(slot_ids, len(ffns))
    pad = sizes[0]  # a chunk may reach past the last group: zero rows there
    x_sorted = jnp.concatenate([x[pairs.order // top_k], jnp.zeros((pad, d), x.dtype)])
    w_sorted = jnp.concatenate([weights.reshape(-1).astype(jnp.float32)[pairs.order], jnp.zeros(pad, jnp.float32)])
    y = jnp.zeros((num_pairs + pad, d), jnp.float32)
    slice_rows = jax.lax.dynamic_slice_in_dim
    for expert, ffn in enumerate(ffns):
        end = pairs.group_starts[expert] + pairs.group_sizes[expert]

        # A chunk's rows past the group are the next experts' (rewritten when their turn comes), or -1 pairs'
        # and padding (dropped below).
        def chunk(rows, start, y, ffn=ffn):
            out = ffn(0, slice_rows(x_sorted, start, rows), slice_rows(w_sorted, start, rows))
            return jax.lax.dynamic_update_slice_in_dim(y, out, start, 0)

        start = pairs.group_starts[expert]
        for stage, rows in enumerate(sizes):
            least = 1 if stage == len(sizes) - 1 else rows - rows // 4
            start, y = jax.lax.while_loop(lambda s, least=least, end=end: end - s[0] >= least,
                                          lambda s, rows=rows, chunk=chunk: (s[0] + rows, chunk(rows, *s)), (start, y))
    y_pairs = jnp.zeros((num_pairs, d), jnp.float32).at[pairs.order].set(y[:num_pairs])
    # Select, not multiply: what a chunk left in a -1 pair's row may be anything (NaN included).
    y_pairs = jnp.where((pairs.key < len(ffns))[:, None], y_pairs, 0.0)
    return y_pairs.reshape(num_tokens, top_k, d).sum(axis=1)


def moe_ffn_pairs(x, slot_ids, weights, w_gate_up, w_down, b_gate_up=None, b_down=None, *, activation="swiglu",
                  per_expert=None):
    """Decode: one expert FFN per (token, j) pair, as matrix-vector products on its slot, in a loop of known trip
    count over the pairs; no sort, so a step of few tokens pays for nothing but the slots it reads (a pair of
    slot -1: `_unless_empty`). A loop rather than unrolled pairs: as fast, and compiled once for any number of
    pairs (16 pairs over 16 per-expert arrays, 8 layers: 71 s to compile unrolled, 5 s as a loop)."""
    num_tokens, top_k = slot_ids.shape
    ffn = _slot_rows_ffn(w_gate_up, w_down, b_gate_up, b_down, activation, x.dtype, vector=True)
    apart = _per_expert_ffns(per_expert, activation, x.dtype, vector=True)
    rows = jnp.repeat(x, top_k, axis=0)[:, None]  # [P, 1, d]: pair p is token p // top_k
    row_weights = weights.astype(jnp.float32).reshape(-1, 1)
    y = jax.lax.map(lambda pair: _unless_empty(ffn, *pair, apart), (slot_ids.reshape(-1), rows, row_weights))
    return y.reshape(num_tokens, top_k, -1).sum(axis=1)
