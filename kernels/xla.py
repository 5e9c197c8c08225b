"""XLA backends: sorted grouped GEMM through lax.ragged_dot (prefill), and a decode path that
gathers each needed slot once and runs small dense products (GEMV-like)."""

import functools

import jax
import jax.numpy as jnp

from jmoe.kernels import grouping
from jmoe.kernels.activations import get_activation
from jmoe.kernels.bias import bias_rows
from jmoe.kernels.quantized import materialize, rows_of


def moe_ffn_ragged(x, slot_ids, weights, w_gate_up, w_down, b_gate_up=None, b_down=None, *, activation="swiglu"):
    act = get_activation(activation)
    num_tokens, top_k = slot_ids.shape
    num_slots, _, two_f = w_gate_up.shape
    f = two_f // 2
    flat = slot_ids.reshape(-1)
    # -1 pairs sort to the end, beyond sum(group_sizes): ragged_dot gives them no group.
    key = jnp.where(flat >= 0, flat, num_slots)
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.bincount(key, length=num_slots + 1)[:num_slots].astype(jnp.int32)
    x_sorted = x[order // top_k]
    # lax.ragged_dot takes no scales: quantized weights are dequantized whole here, which is why `auto`
    # never picks this backend for them (xla_tiled dequantizes one slot per tile).
    w_gate_up, w_down = materialize(w_gate_up, x.dtype), materialize(w_down, x.dtype)
    # XLA:CPU lowers ragged_dot densely (every row times every group's weights, masked by multiplying), so a
    # NaN in a slot no row uses would reach every row: there, unused slots are zeroed first.
    used = group_sizes > 0
    w_gate_up, w_down = jax.lax.platform_dependent(
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


def _slot_rows_ffn(w_gate_up, w_down, b_gate_up, b_down, activation, dtype):
    """ffn(slot, xs [m, d], ws [m]) -> float32 [m, d]: rows of one slot's expert FFN, each times its router
    weight; the slot's weights are read (and dequantized) once for the m rows."""
    act = get_activation(activation)
    f = w_down.shape[1]

    def ffn(slot, xs, ws):
        gate_up = jnp.dot(xs, rows_of(w_gate_up, slot, dtype), preferred_element_type=jnp.float32)
        gate_up = gate_up + bias_rows(b_gate_up, slot)
        h = act(gate_up[:, :f], gate_up[:, f:]).astype(dtype)
        out = jnp.dot(h, rows_of(w_down, slot, dtype), preferred_element_type=jnp.float32)
        return (out + bias_rows(b_down, slot)) * ws[:, None]

    return ffn


def _per_expert_ffns(per_expert, activation, dtype):
    """One `_slot_rows_ffn` per expert over its own [1, ...] arrays (called with slot 0), or None."""
    if per_expert is None:
        return None
    return [_slot_rows_ffn(part.w_gate_up, part.w_down, part.b_gate_up, part.b_down, activation, dtype)
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

    return jax.lax.platform_dependent(slot, xs, ws, cpu=branched, default=masked)


def moe_ffn_tiled(x, slot_ids, weights, w_gate_up, w_down, b_gate_up=None, b_down=None, *, activation="swiglu",
                  block_m=None, per_expert=None):
    """Sorted grouped GEMM without ragged_dot: the Pallas tile layout, one scan step per row
    tile. XLA:CPU lowers ragged_dot to a dense product over every slot; this reads only the
    slots that own a tile (an empty tile: `_unless_empty`)."""
    num_tokens, top_k = slot_ids.shape
    num_slots, d, _ = w_gate_up.shape
    if block_m is None:
        block_m = grouping.choose_xla_block_m(num_tokens * top_k, num_slots)
    layout = grouping.tile_layout(slot_ids, weights, num_slots, block_m)
    x_tiles = grouping.gather_rows(x, layout).reshape(-1, block_m, d)
    w_tiles = layout.row_weight.reshape(-1, block_m)
    ffn = _slot_rows_ffn(w_gate_up, w_down, b_gate_up, b_down, activation, x.dtype)
    apart = _per_expert_ffns(per_expert, activation, x.dtype)
    y_rows = jax.lax.map(lambda tile: _unless_empty(ffn, *tile, apart), (layout.tile_group, x_tiles, w_tiles))
    return grouping.combine_rows(y_rows.reshape(-1, d), layout, top_k)


def moe_ffn_pairs(x, slot_ids, weights, w_gate_up, w_down, b_gate_up=None, b_down=None, *, activation="swiglu",
                  per_expert=None):
    """Decode: one expert FFN per (token, j) pair, as matrix-vector products on its slot, in a loop of known trip
    count over the pairs; no sort, so a step of few tokens pays for nothing but the slots it reads (a pair of
    slot -1: `_unless_empty`). A loop rather than unrolled pairs: as fast, and compiled once for any number of
    pairs (16 pairs over 16 per-expert arrays, 8 layers: 71 s to compile unrolled, 5 s as a loop)."""
    num_tokens, top_k = slot_ids.shape
    ffn = _slot_rows_ffn(w_gate_up, w_down, b_gate_up, b_down, activation, x.dtype)
    apart = _per_expert_ffns(per_expert, activation, x.dtype)
    rows = jnp.repeat(x, top_k, axis=0)[:, None]  # [P, 1, d]: pair p is token p // top_k
    row_weights = weights.astype(jnp.float32).reshape(-1, 1)
    y = jax.lax.map(lambda pair: _unless_empty(ffn, *pair, apart), (slot_ids.reshape(-1), rows, row_weights))
    return y.reshape(num_tokens, top_k, -1).sum(axis=1)
