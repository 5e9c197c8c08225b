"""Pallas grouped-GEMM MoE FFN over slot buffers. Lowered through Triton when the program is lowered
for a CUDA GPU; on other platforms it runs with interpret=True (slow: for tests, never picked by `auto`
on CPU). The choice follows the platform the program is lowered for (`target.platform_dependent`), not
`jax.default_backend()` alone, so a program compiled for a GPU target on a CPU machine gets Triton kernels.

Two kernels over the tile layout of grouping.py, one program per (row tile, output block):
  1. h = act(x Wg, x Wu) for the tile's slot, gate and up accumulated side by side in f32;
  2. y = weight * (h Wd), written in f32 so the sum over k stays in f32.
Weights stay whole in memory and each program indexes its tile's slot, so only slots that own
a tile are read; empty tiles (tile_group == -1) read nothing. A step of one row (a decode of one
sequence) runs the same two kernels with a program per choice instead of per tile: the row read as it
is, multiplied as a vector, no layout built; its down projection split over f where its programs
would be too few to fill a GPU (down_parts)."""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jmoe.kernels import grouping, quantized
from jmoe.kernels.activations import get_activation
from jmoe.kernels.target import platform_dependent
from jmoe.kernels.xla import moe_ffn_tiled

# tl.dot needs every block dimension >= 16 on GPU.
GPU_MIN_BLOCK = 16
# Triton launch settings for both kernels (Pallas' GPU default would be Mosaic GPU, sm_90 only).
TRITON_PARAMS = pltriton.CompilerParams(num_warps=4, num_stages=2)
# A one-row step's matrix-vector programs (one_row): rows of K multiplied and summed at once, [64, 128] float32
# products of 32 values a thread of 8 warps (128 rows would hold 64), and 16 KiB of bf16 weights read a step, two
# steps in flight. Unmeasured on a GPU: bench.gpu.kernel_forms times it against the tiles.
GEMV_K_BLOCK = 64
TRITON_GEMV_PARAMS = pltriton.CompilerParams(num_warps=8, num_stages=2)
MIN_DOWN_PROGRAMS = 256  # about two programs a multiprocessor of an H100's or H200's 132 (down_parts)


def gpu_shapes_supported(w_gate_up, w_down) -> bool:
    """Whether the Triton lowering can tile these weights (blocks of at least GPU_MIN_BLOCK) and address them."""
    d, f = w_down.shape[2], w_down.shape[1]
    blocks = (grouping.largest_pow2_divisor(d, 128), grouping.largest_pow2_divisor(f, 128),
              contraction_block(w_gate_up, 128), contraction_block(w_down, 128))
    return min(blocks) >= GPU_MIN_BLOCK and all(map(triton_addressable, jax.tree.leaves((w_gate_up, w_down))))


def triton_addressable(array) -> bool:
    """Whether Pallas' Triton lowering reaches every element of `array` (a real or abstract array): it offsets an
    array of at most 4 GiB with signed 32-bit integers, so one of more than 2^31 one-byte elements (2-4 GiB of
    quantized codes, e.g. DeepSeek-V3's fp8 w_down of one layer, 3.76 GB) would wrap to negative offsets."""
    size = math.prod(array.shape)
    return size <= 2**31 or size * jnp.dtype(array.dtype).itemsize > 2**32


def contraction_block(weight, cap: int) -> int:
    """Rows of K one loop step reads: a power of two dividing the rows looped over and, for a quantized
    weight, dividing the rows that share a scale (so a block never straddles two scale rows)."""
    extent = quantized.contraction_extent(weight)
    shared = quantized.scale_rows(weight)
    return grouping.largest_pow2_divisor(math.gcd(extent, shared) if shared else extent, cap)


def choose_blocks(num_pairs, num_slots, d, f, *, on_gpu):
    """(block_m, block_f, block_d): row tile, block over f, block over d (all powers of 2)."""
    min_block = GPU_MIN_BLOCK if on_gpu else 1
    block_m = grouping.choose_block_m(num_pairs, num_slots, min_block=max(min_block, 8))
    block_f = grouping.largest_pow2_divisor(f, 128)
    block_d = grouping.largest_pow2_divisor(d, 128)
    if on_gpu and min(block_f, block_d) < GPU_MIN_BLOCK:
        raise ValueError(
            f"moe_ffn backend='pallas' on GPU needs d and f divisible by {GPU_MIN_BLOCK} "
            f"(Triton dot blocks); got d={d}, f={f}. Use backend='xla' for these shapes."
        )
    return block_m, block_f, block_d


def _weight_blocks(w_refs, fmt, group, slot, row, block_k, col, block_n):
    """[(first x column, weight block [block_k, block_n])] for weight rows [row, row + block_k) of one slot
    and columns [col, col + block_n): the block itself for a plain weight; dequantized in float32 for a
    quantized one, where packed formats give the low-nibble rows and the high-nibble rows K/2 further."""
    cols = pl.ds(col, block_n)
    if fmt is None:
        (w_ref,) = w_refs
        return [(row, w_ref[slot, pl.ds(row, block_k), cols])]
    values_ref, scales_ref = w_refs
    codes = quantized.decode_codes(fmt, values_ref[slot, pl.ds(row, block_k), cols])
    if fmt == "int8":
        return [(row, codes * scales_ref[slot, pl.ds(0, 1), cols])]
    if fmt == "fp8":
        block = quantized.FP8_BLOCK
        return [(row, codes * scales_ref[slot, pl.ds(row // block, 1), pl.ds(col // block, 1)])]
    half = values_ref.shape[1]

    def scale(first_row):
        return quantized.scale_values(fmt, scales_ref[slot, pl.ds(first_row // group, 1), cols])

    low, high = codes
    return [(row, low * scale(row)), (half + row, high * scale(half + row))]


def _gate_up_kernel(slots_ref, x_ref, *refs, one_row, sources, block_d, block_f, f, act, fmt, group, has_bias):
    """One program of h = act(x Wg, x Wu) over a block of f, gate and up accumulated side by side in float32: for a
    row tile (its slot from tile_group) or, `one_row`, for one choice of a one-row step (its slot from the row of
    slot ids [sources, k] of the first source holding it; the row read as it is and multiplied as a vector, since
    Triton's dot needs 16 rows)."""
    *source_refs, h_ref = refs
    i, n = pl.program_id(0), pl.program_id(1)
    product = _row_product if one_row else _tile_product

    def read_x(first):
        return x_ref[0, pl.ds(first, block_d)] if one_row else x_ref[:, pl.ds(first, block_d)]

    def compute(w_refs, b_ref, slot):
        def step(kk, acc):
            acc_gate, acc_up = acc
            row = kk * block_d
            for first, w_gate in _weight_blocks(w_refs, fmt, group, slot, row, block_d, n * block_f, block_f):
                acc_gate += product(read_x(first), w_gate)
            for first, w_up in _weight_blocks(w_refs, fmt, group, slot, row, block_d, f + n * block_f, block_f):
                acc_up += product(read_x(first), w_up)
            return acc_gate, acc_up

        zeros = jnp.zeros(h_ref.shape, jnp.float32)
        num_k = w_refs[0].shape[1] // block_d
        acc_gate, acc_up = jax.lax.fori_loop(0, num_k, step, (zeros, zeros))
        if b_ref is not None:
            acc_gate += b_ref[pl.ds(slot, 1), pl.ds(n * block_f, block_f)].astype(jnp.float32)
            acc_up += b_ref[pl.ds(slot, 1), pl.ds(f + n * block_f, block_f)].astype(jnp.float32)
        h_ref[...] = act(acc_gate, acc_up).astype(h_ref.dtype)

    _from_first_source(slots_ref, i, one_row, _by_source(source_refs, sources, has_bias), compute, h_ref)


def _down_kernel(slots_ref, h_ref, weights_ref, *refs, one_row, sources, block_f, block_d, steps, fmt, group,
                 has_bias):
    """One program of y = weight * (h Wd) in float32 over a block of d and a part of f (`steps` blocks of f a part,
    the last one's fewer; the parts are summed afterwards): for a row tile (the rows' router weights) or, `one_row`,
    for one choice of a one-row step (its weight from weights [1, k], its slot as the gate-up kernel's)."""
    *source_refs, y_ref = refs
    i, part, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    product = _row_product if one_row else _tile_product

    def read_h(first):
        return h_ref[0, pl.ds(first, block_f)] if one_row else h_ref[:, pl.ds(first, block_f)]

    def compute(w_refs, b_ref, slot):
        def step(kk, acc):
            for first, w in _weight_blocks(w_refs, fmt, group, slot, kk * block_f, block_f, n * block_d, block_d):
                acc += product(read_h(first), w)
            return acc

        num_k = w_refs[0].shape[1] // block_f
        split = steps < num_k  # else one part, whose loop bounds stay static
        bounds = (part * steps, jnp.minimum((part + 1) * steps, num_k)) if split else (0, num_k)
        acc = jax.lax.fori_loop(*bounds, step, jnp.zeros(y_ref.shape, jnp.float32))
        if b_ref is not None:
            bias = b_ref[pl.ds(slot, 1), pl.ds(n * block_d, block_d)].astype(jnp.float32)
            acc += jnp.where(part == 0, bias, 0.0) if split else bias  # once, in the first part
        weight = weights_ref[0, i].astype(jnp.float32) if one_row else weights_ref[...][:, None]
        y_ref[...] = acc * weight  # the router weight after the down projection, as Hugging Face does

    _from_first_source(slots_ref, i, one_row, _by_source(source_refs, sources, has_bias), compute, y_ref)


def _by_source(refs, sources: int, has_bias: bool):
    """[(weight refs, bias ref or None)] of each source, from their refs one source after another."""
    size = len(refs) // sources
    groups = [list(refs[s * size:(s + 1) * size]) for s in range(sources)]
    return [(group[:-1], group[-1]) if has_bias else (group, None) for group in groups]


def _from_first_source(slots_ref, i, one_row: bool, sources, compute, out_ref):
    """compute(weight refs, bias ref, slot) for program i's slot in the first source that holds it (a slot id in
    [0, S) of that source's S; a row tile's from the layout, -1 or a slot of its one source), else zeros."""
    held = None  # by an earlier source
    for source, (w_refs, b_ref) in enumerate(sources):
        slot = slots_ref[source, i] if one_row else slots_ref[i]
        in_range = jnp.logical_and(slot >= 0, slot < w_refs[0].shape[0])
        first = in_range if held is None else jnp.logical_and(in_range, jnp.logical_not(held))
        pl.when(first)(functools.partial(compute, w_refs, b_ref, slot))
        held = in_range if held is None else jnp.logical_or(held, in_range)

    @pl.when(jnp.logical_not(held))
    def _():
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)


def _tile_product(xs, w):
    """xs [M, K] @ w [K, N] in float32."""
    return jnp.dot(xs, w.astype(xs.dtype), preferred_element_type=jnp.float32)


def _row_product(v, w):
    """v [K] times w [K, N], summed over K in float32: [1, N]."""
    return jnp.sum(v.astype(jnp.float32)[:, None] * w.astype(jnp.float32), axis=0)[None, :]


def moe_ffn_pallas(x, slot_ids, weights, w_gate_up, w_down, b_gate_up=None, b_down=None, *, activation="swiglu",
                   blocks=None, one_row_gemv: bool = True, also=()):
    """The grouped GEMM as Triton kernels where the program is lowered for a CUDA GPU (weights Triton cannot
    tile run the portable XLA kernel there instead), interpreted elsewhere. A step of one row runs as
    matrix-vector programs unless `one_row_gemv` is False (bench.gpu.kernel_forms times both). `also`: more
    sources of experts for a one-row step, each (slot_ids [1, k], w_gate_up, w_down, b_gate_up, b_down) of the
    same shapes but the slot count (e.g. the pinned-host experts of miss mode "direct" beside the cache slots): a
    choice reads the first source whose slot ids name a slot for it, in the same two kernels."""
    if also and not (x.shape[0] == 1 and one_row_gemv):
        raise ValueError(f"moe_ffn_pallas: `also` serves one-row steps read as matrix-vector programs; got "
                         f"{x.shape[0]} rows, one_row_gemv={one_row_gemv}")
    args = (x, slot_ids, weights, w_gate_up, w_down, b_gate_up, b_down, tuple(also))
    gemm = functools.partial(_grouped_gemm, activation=activation, blocks=blocks, one_row_gemv=one_row_gemv)
    on_cuda = (functools.partial(gemm, on_gpu=True) if gpu_shapes_supported(w_gate_up, w_down)
               else functools.partial(_tiled_by_xla, activation=activation))
    return platform_dependent(*args, cuda=on_cuda, default=functools.partial(gemm, on_gpu=False))


def _tiled_by_xla(x, slot_ids, weights, w_gate_up, w_down, b_gate_up, b_down, also, *, activation):
    if also:
        raise ValueError(f"moe_ffn_pallas: `also` needs weights Triton can tile; got w_gate_up {w_gate_up.shape}")
    return moe_ffn_tiled(x, slot_ids, weights, w_gate_up, w_down, b_gate_up, b_down, activation=activation)


def _grouped_gemm(x, slot_ids, weights, w_gate_up, w_down, b_gate_up, b_down, also, *, activation, blocks,
                  on_gpu: bool, one_row_gemv: bool):
    act = get_activation(activation)
    num_tokens, top_k = slot_ids.shape
    num_slots, d, two_f = w_gate_up.shape
    f = two_f // 2
    if blocks is None:
        blocks = choose_blocks(num_tokens * top_k, num_slots, d, f, on_gpu=on_gpu)
    block_m, block_f, block_d = blocks
    # Quantized weights loop over K in blocks that stay inside one scale row (and over K/2 when packed).
    k_block_d, k_block_f = min(block_d, contraction_block(w_gate_up, 128)), min(block_f, contraction_block(w_down, 128))
    fmt = w_gate_up.fmt if quantized.is_quantized(w_gate_up) else None
    group = w_gate_up.group if fmt else 0
    one_row = num_tokens == 1 and one_row_gemv
    if one_row:
        # A program per choice: a row's choices are distinct experts, so no slot is read twice, and there is no tile
        # layout to build (the row gathered into tiles and the tiles' router weights were two kernels a MoE layer on
        # a GPU, and each tile multiplied 15 rows of padding).
        layout, programs, rows, x_rows, row_weights = None, top_k, 1, x, weights
        slots = jnp.concatenate([slot_ids, *(ids for ids, *_ in also)])  # [sources, k]
        k_block_d, k_block_f = min(k_block_d, GEMV_K_BLOCK), min(k_block_f, GEMV_K_BLOCK)
    else:
        layout = grouping.tile_layout(slot_ids, weights, num_slots, block_m)
        x_rows, slots, row_weights = grouping.gather_rows(x, layout), layout.tile_group, layout.row_weight
        rows = block_m
        programs = x_rows.shape[0] // block_m
    num_k = quantized.contraction_extent(w_down) // k_block_f
    parts = down_parts(programs, d // block_d, num_k) if one_row else 1
    sources = [(w_gate_up, w_down, b_gate_up, b_down), *(weights_of for _, *weights_of in also)]
    gate_up_leaves = jax.tree.leaves([(gate_up, b_up) for gate_up, _, b_up, _ in sources])
    down_leaves = jax.tree.leaves([(down, b_dn) for _, down, _, b_dn in sources])
    suffix, params = ("_gemv", TRITON_GEMV_PARAMS) if one_row else ("", TRITON_PARAMS)

    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, one_row=one_row, sources=len(sources), block_d=k_block_d, block_f=block_f,
                          f=f, act=act, fmt=fmt, group=group, has_bias=b_gate_up is not None),
        out_shape=jax.ShapeDtypeStruct((programs * rows, f), x.dtype),
        grid=(programs, f // block_f),
        in_specs=[
            pl.no_block_spec,  # the slots: whole, one read per program
            pl.BlockSpec((rows, d), lambda i, n: (0 if one_row else i, 0)),
            *[pl.no_block_spec] * len(gate_up_leaves),  # each source's w_gate_up (+ bias): whole, indexed by slot
        ],
        out_specs=pl.BlockSpec((rows, block_f), lambda i, n: (i, n)),
        interpret=not on_gpu,
        compiler_params=params if on_gpu else None,
        name="moe_gate_up" + suffix,
    )(slots, x_rows, *gate_up_leaves)

    y = pl.pallas_call(
        functools.partial(_down_kernel, one_row=one_row, sources=len(sources), block_f=k_block_f, block_d=block_d,
                          steps=-(-num_k // parts), fmt=fmt, group=group, has_bias=b_down is not None),
        out_shape=jax.ShapeDtypeStruct((programs * parts * rows, d), jnp.float32),
        grid=(programs, parts, d // block_d),
        in_specs=[
            pl.no_block_spec,
            pl.BlockSpec((rows, f), lambda i, s, n: (i, 0)),
            pl.no_block_spec if one_row else pl.BlockSpec((block_m,), lambda i, s, n: (i,)),  # the router weights
            *[pl.no_block_spec] * len(down_leaves),  # each source's w_down (+ bias): whole, by slot
        ],
        out_specs=pl.BlockSpec((rows, block_d), lambda i, s, n: (i * parts + s, n)),
        interpret=not on_gpu,
        compiler_params=params if on_gpu else None,
        name="moe_down" + suffix,
    )(slots, h, row_weights, *down_leaves)
    # A one-row step's parts summed: more than a few are a kernel of their own (XLA no longer fuses the sum with the
    # residual add and the next norm's reduction), one launch against the down kernel's idle multiprocessors.
    return jnp.sum(y, axis=0, keepdims=True) if one_row else grouping.combine_rows(y, layout, top_k)


def down_parts(programs: int, d_blocks: int, steps: int) -> int:
    """The parts a one-row step's down projection splits f into: the fewest (a power of two, at most one a step of f)
    that make MIN_DOWN_PROGRAMS programs. Unsplit, a layer's few blocks of d leave most multiprocessors idle: on an
    H100, gpu_check's Mixtral-shaped layer's down kernel (2 pairs x 16 blocks of d, 32 programs) took 59 us a call
    against its gate-up kernel's 42 (2 x 56 programs) for half the bytes, 2.8 times as long a byte (the 2026-11-27
    profile, bench/results/gpu_check_h100_2026-11-27.md: the row-tile kernels, whose grids the one-row ones had
    copied)."""
    parts = 1
    while programs * d_blocks * parts < MIN_DOWN_PROGRAMS and parts * 2 <= steps:
        parts *= 2
    return parts
