"""Pallas grouped-GEMM MoE FFN over slot buffers. Lowered through Triton when the program is lowered
for a CUDA GPU; on other platforms it runs with interpret=True (slow: for tests, never picked by `auto`
on CPU). The choice follows the platform the program is lowered for (`lax.platform_dependent`), not
`jax.default_backend()`, so a program compiled for a GPU target on a CPU machine gets Triton kernels.

Two kernels over the tile layout of grouping.py, one program per (row tile, output block):
  1. h = act(x Wg, x Wu) for the tile's slot, gate and up accumulated side by side in f32;
  2. y = weight * (h Wd), written in f32 so the sum over k stays in f32.
Weights stay whole in memory and each program indexes its tile's slot, so only slots that own
a tile are read; empty tiles (tile_group == -1) read nothing."""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jmoe.kernels import grouping
from jmoe.kernels.activations import get_activation
from jmoe.kernels.xla import moe_ffn_tiled

# tl.dot needs every block dimension >= 16 on GPU.
GPU_MIN_BLOCK = 16
# Triton launch settings for both kernels (Pallas' GPU default would be Mosaic GPU, sm_90 only).
TRITON_PARAMS = pltriton.CompilerParams(num_warps=4, num_stages=2)


def gpu_shapes_supported(d: int, f: int) -> bool:
    """Whether the Triton lowering can tile d and f (blocks of at least GPU_MIN_BLOCK)."""
    return min(grouping.largest_pow2_divisor(d, 128), grouping.largest_pow2_divisor(f, 128)) >= GPU_MIN_BLOCK


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


def _gate_up_kernel(tile_group_ref, x_ref, w_ref, h_ref, *, block_d, block_f, f, act):
    tile, n = pl.program_id(0), pl.program_id(1)
    slot = tile_group_ref[tile]

    @pl.when(slot < 0)
    def _():
        h_ref[...] = jnp.zeros(h_ref.shape, h_ref.dtype)

    @pl.when(slot >= 0)
    def _():
        def step(kk, acc):
            acc_gate, acc_up = acc
            xs = x_ref[:, pl.ds(kk * block_d, block_d)]
            w_gate = w_ref[slot, pl.ds(kk * block_d, block_d), pl.ds(n * block_f, block_f)]
            w_up = w_ref[slot, pl.ds(kk * block_d, block_d), pl.ds(f + n * block_f, block_f)]
            acc_gate += jnp.dot(xs, w_gate, preferred_element_type=jnp.float32)
            acc_up += jnp.dot(xs, w_up, preferred_element_type=jnp.float32)
            return acc_gate, acc_up

        zeros = jnp.zeros(h_ref.shape, jnp.float32)
        num_k = x_ref.shape[1] // block_d
        acc_gate, acc_up = jax.lax.fori_loop(0, num_k, step, (zeros, zeros))
        h_ref[...] = act(acc_gate, acc_up).astype(h_ref.dtype)


def _down_kernel(tile_group_ref, h_ref, row_weight_ref, w_ref, y_ref, *, block_f, block_d):
    tile, n = pl.program_id(0), pl.program_id(1)
    slot = tile_group_ref[tile]

    @pl.when(slot < 0)
    def _():
        y_ref[...] = jnp.zeros(y_ref.shape, y_ref.dtype)

    @pl.when(slot >= 0)
    def _():
        def step(kk, acc):
            hs = h_ref[:, pl.ds(kk * block_f, block_f)]
            w = w_ref[slot, pl.ds(kk * block_f, block_f), pl.ds(n * block_d, block_d)]
            return acc + jnp.dot(hs, w, preferred_element_type=jnp.float32)

        num_k = h_ref.shape[1] // block_f
        acc = jax.lax.fori_loop(0, num_k, step, jnp.zeros(y_ref.shape, jnp.float32))
        # Router weight after the down projection, as Hugging Face does.
        y_ref[...] = acc * row_weight_ref[...][:, None]


def moe_ffn_pallas(x, slot_ids, weights, w_gate_up, w_down, *, activation="swiglu", blocks=None):
    """The grouped GEMM as Triton kernels where the program is lowered for a CUDA GPU (shapes whose d and
    f Triton cannot tile run the portable XLA kernel there instead), interpreted elsewhere."""
    args = (x, slot_ids, weights, w_gate_up, w_down)
    d, f = w_down.shape[2], w_down.shape[1]
    if gpu_shapes_supported(d, f):
        on_cuda = functools.partial(_grouped_gemm, activation=activation, blocks=blocks, on_gpu=True)
    else:
        on_cuda = functools.partial(moe_ffn_tiled, activation=activation)
    return jax.lax.platform_dependent(
        *args, cuda=on_cuda, default=functools.partial(_grouped_gemm, activation=activation, blocks=blocks,
                                                       on_gpu=False))


def _grouped_gemm(x, slot_ids, weights, w_gate_up, w_down, *, activation, blocks, on_gpu: bool):
    act = get_activation(activation)
    num_tokens, top_k = slot_ids.shape
    num_slots, d, two_f = w_gate_up.shape
    f = two_f // 2
    if blocks is None:
        blocks = choose_blocks(num_tokens * top_k, num_slots, d, f, on_gpu=on_gpu)
    block_m, block_f, block_d = blocks
    layout = grouping.tile_layout(slot_ids, weights, num_slots, block_m)
    x_rows = grouping.gather_rows(x, layout)
    num_rows = x_rows.shape[0]
    num_tiles = num_rows // block_m

    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, block_d=block_d, block_f=block_f, f=f, act=act),
        out_shape=jax.ShapeDtypeStruct((num_rows, f), x.dtype),
        grid=(num_tiles, f // block_f),
        in_specs=[
            pl.no_block_spec,  # tile_group: whole, read one scalar per program
            pl.BlockSpec((block_m, d), lambda i, n: (i, 0)),
            pl.no_block_spec,  # w_gate_up: whole, indexed by the tile's slot
        ],
        out_specs=pl.BlockSpec((block_m, block_f), lambda i, n: (i, n)),
        interpret=not on_gpu,
        compiler_params=TRITON_PARAMS if on_gpu else None,
        name="moe_gate_up",
    )(layout.tile_group, x_rows, w_gate_up)

    y_rows = pl.pallas_call(
        functools.partial(_down_kernel, block_f=block_f, block_d=block_d),
        out_shape=jax.ShapeDtypeStruct((num_rows, d), jnp.float32),
        grid=(num_tiles, d // block_d),
        in_specs=[
            pl.no_block_spec,
            pl.BlockSpec((block_m, f), lambda i, n: (i, 0)),
            pl.BlockSpec((block_m,), lambda i, n: (i,)),
            pl.no_block_spec,  # w_down: whole, indexed by the tile's slot
        ],
        out_specs=pl.BlockSpec((block_m, block_d), lambda i, n: (i, n)),
        interpret=not on_gpu,
        compiler_params=TRITON_PARAMS if on_gpu else None,
        name="moe_down",
    )(layout.tile_group, h, layout.row_weight, w_down)
    return grouping.combine_rows(y_rows, layout, top_k, x.dtype)
