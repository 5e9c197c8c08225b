"""Triton grouped-GEMM MoE FFN through jax-triton (GPU only; imported lazily so the package
works without triton). Same tile layout and two-kernel split as pallas_grouped.py, written
directly in Triton so block sizes, warps and stages can be tuned past what Pallas exposes."""

import functools

import jax
import jax.numpy as jnp

from jmoe.kernels import grouping
from jmoe.kernels.quantized import is_quantized
from jmoe.kernels.target import gpu_available, target_compute_capability

# Activations with a Triton implementation (the JAX registry cannot be called from Triton).
TRITON_ACTIVATIONS = ("swiglu",)
MIN_BLOCK = 16  # tl.dot needs block dims >= 16


def require_triton(activation="swiglu"):
    """Import jax_triton, or raise saying what is missing and what to use instead."""
    if activation not in TRITON_ACTIVATIONS:
        raise ValueError(
            f"moe_ffn backend='triton' implements activations {TRITON_ACTIVATIONS}, "
            f"not {activation!r}; use backend='pallas' or 'xla'."
        )
    if not gpu_available():
        raise RuntimeError(
            f"moe_ffn backend='triton' needs a GPU, but JAX's default backend is "
            f"{jax.default_backend()!r} and no GPU target is being compiled for "
            f"(jmoe.kernels.target.compiling_for_gpu); use backend='xla' (or 'auto') here."
        )
    try:
        import jax_triton  # noqa: F401
    except ImportError as err:
        raise RuntimeError(
            "moe_ffn backend='triton' needs the jax-triton package, which is not installed "
            "(pip install 'jmoe[cuda12]'); use backend='pallas' or 'xla' instead."
        ) from err
    return jax_triton


def triton_launch(num_pairs, num_slots, d, f):
    """Blocks and grids for both kernels: dict with block_m/f/d, num_rows, grids."""
    block_m = grouping.choose_block_m(num_pairs, num_slots, min_block=MIN_BLOCK)
    block_f = grouping.largest_pow2_divisor(f, 64)
    block_d = grouping.largest_pow2_divisor(d, 64)
    if min(block_f, block_d) < MIN_BLOCK:
        raise ValueError(
            f"moe_ffn backend='triton' needs d and f divisible by {MIN_BLOCK}; got d={d}, "
            f"f={f}. Use backend='xla' for these shapes."
        )
    num_rows = grouping.num_padded_rows(num_pairs, num_slots, block_m)
    num_tiles = num_rows // block_m
    return dict(
        block_m=block_m, block_f=block_f, block_d=block_d, num_rows=num_rows,
        gate_up_grid=(num_tiles, f // block_f), down_grid=(num_tiles, d // block_d),
    )


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def gate_up_kernel(tile_group_ptr, x_ptr, w_ptr, h_ptr, D: tl.constexpr, F: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr):
        tile = tl.program_id(0)
        n = tl.program_id(1)
        slot = tl.load(tile_group_ptr + tile).to(tl.int64)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = n * BLOCK_F + tl.arange(0, BLOCK_F)
        ks = tl.arange(0, BLOCK_D)
        acc_gate = tl.zeros((BLOCK_M, BLOCK_F), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_F), dtype=tl.float32)
        if slot >= 0:  # empty tiles read no weights
            w_slot = w_ptr + slot * D * (2 * F)
            for k0 in range(0, D, BLOCK_D):
                xs = tl.load(x_ptr + rows[:, None] * D + (k0 + ks)[None, :])
                w_rows = (k0 + ks)[:, None] * (2 * F)
                acc_gate += tl.dot(xs, tl.load(w_slot + w_rows + cols[None, :]))
                acc_up += tl.dot(xs, tl.load(w_slot + w_rows + F + cols[None, :]))
        h = acc_gate * tl.sigmoid(acc_gate) * acc_up
        tl.store(h_ptr + rows[:, None] * F + cols[None, :], h.to(h_ptr.dtype.element_ty))

    @triton.jit
    def down_kernel(tile_group_ptr, h_ptr, row_weight_ptr, w_ptr, y_ptr, D: tl.constexpr,
                    F: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
                    BLOCK_D: tl.constexpr):
        tile = tl.program_id(0)
        n = tl.program_id(1)
        slot = tl.load(tile_group_ptr + tile).to(tl.int64)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = n * BLOCK_D + tl.arange(0, BLOCK_D)
        ks = tl.arange(0, BLOCK_F)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        if slot >= 0:
            w_slot = w_ptr + slot * F * D
            for k0 in range(0, F, BLOCK_F):
                hs = tl.load(h_ptr + rows[:, None] * F + (k0 + ks)[None, :])
                acc += tl.dot(hs, tl.load(w_slot + (k0 + ks)[:, None] * D + cols[None, :]))
        acc = acc * tl.load(row_weight_ptr + rows)[:, None]
        tl.store(y_ptr + rows[:, None] * D + cols[None, :], acc)

    return gate_up_kernel, down_kernel


def moe_ffn_triton(x, slot_ids, weights, w_gate_up, w_down, b_gate_up=None, b_down=None, *, activation="swiglu"):
    if b_gate_up is not None or b_down is not None:
        raise ValueError("moe_ffn backend='triton' has no expert biases; use backend='pallas' or 'auto'")
    if is_quantized(w_gate_up):
        raise ValueError("moe_ffn backend='triton' takes plain float weights; quantized experts run on "
                         "backend='pallas' (its Triton lowering dequantizes inside the kernel) or 'auto'")
    jt = require_triton(activation)
    gate_up_kernel, down_kernel = _kernels()
    num_tokens, top_k = slot_ids.shape
    num_slots, d, two_f = w_gate_up.shape
    f = two_f // 2
    launch = triton_launch(num_tokens * top_k, num_slots, d, f)
    layout = grouping.tile_layout(slot_ids, weights, num_slots, launch["block_m"])
    x_rows = grouping.gather_rows(x, layout)
    blocks = dict(D=d, F=f, BLOCK_M=launch["block_m"], BLOCK_F=launch["block_f"],
                  BLOCK_D=launch["block_d"])
    # A compile-only GPU target cannot be asked for its compute capability: the compiling caller names it.
    capability = target_compute_capability()
    h = jt.triton_call(
        layout.tile_group, x_rows, w_gate_up, kernel=gate_up_kernel,
        out_shape=jax.ShapeDtypeStruct((launch["num_rows"], f), x.dtype),
        grid=launch["gate_up_grid"], compute_capability=capability, **blocks,
    )
    y_rows = jt.triton_call(
        layout.tile_group, h, layout.row_weight, w_down, kernel=down_kernel,
        out_shape=jax.ShapeDtypeStruct((launch["num_rows"], d), jnp.float32),
        grid=launch["down_grid"], compute_capability=capability, **blocks,
    )
    return grouping.combine_rows(y_rows, layout, top_k)
