"""Whole experts copied into slots by one Pallas kernel (Triton on a GPU): slot destinations[j] of every leaf of the
slot buffers gets expert experts[j] of the same leaf of the sources, for each j whose expert and destination are
both >= 0; the other entries read and write nothing.

Why a kernel: on a GPU a loop whose trip count is data (the misses of a step) copies its predicate to the host and
waits for it every iteration, and an unrolled copy of a dynamic slice moves its bytes whether its write is kept or
dropped. One kernel launch over (chunk, entry) programs, each program of a wanted entry moving one chunk of one leaf,
moves only the wanted experts' bytes with no host round trip; the sources may lie in pinned host memory (the
programs read them over the link, as the grouped GEMM does in miss mode "direct"), and the buffers are updated in
place (aliased to the output)."""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jmoe.kernels.pallas_grouped import triton_addressable

# Elements a program moves (its last chunk masked): 16 KiB of bfloat16, large enough to keep loads in flight.
CHUNK = 8192
# A copy is memory-bound: one stage, no software pipelining to set up.
TRITON_PARAMS = pltriton.CompilerParams(num_warps=4, num_stages=1)


def copy_experts(buffers, sources, experts, destinations, *, on_gpu: bool, chunk: int = CHUNK):
    """`buffers` (a pytree of [S, ...] leaves) with slot destinations[j] replaced by expert experts[j] of `sources`
    (the same pytree structure, [E, ...] leaves) for every j where both are >= 0. Interpreted where not on_gpu
    (tests); the wanted entries' destinations must be distinct. `chunk`: elements a program moves (a power of
    two; bench.gpu_check times a few)."""
    leaves, treedef = jax.tree.flatten(buffers)
    flat = [as_words(leaf) for leaf in leaves]
    flat_sources = [as_words(leaf) for leaf in treedef.flatten_up_to(sources)]
    if not all(map(triton_addressable, flat_sources)):
        raise ValueError(f"copy_experts cannot address source arrays of {[a.shape for a in flat_sources]} "
                         f"{[str(a.dtype) for a in flat_sources]}: Pallas' Triton lowering offsets an array of 2-4 GiB "
                         f"of one-byte elements with 32-bit integers (rows of a multiple of 4 bytes go as words)")
    sizes = [leaf.shape[1] for leaf in flat]
    chunks = [pl.cdiv(size, chunk) for size in sizes]
    n = len(leaves)
    out = pl.pallas_call(
        functools.partial(_copy_kernel, chunk=chunk, sizes=tuple(sizes),
                          first_chunks=tuple(itertools.accumulate(chunks[:-1], initial=0))),
        out_shape=[jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in flat],
        # Chunks on the grid's x axis: a CUDA grid's y axis stops at 65,535 blocks, 0.5 G elements of one expert.
        grid=(sum(chunks), experts.shape[0]),
        in_specs=[pl.no_block_spec] * (2 + 2 * n),  # whole arrays: each program indexes its own expert and chunk
        out_specs=[pl.no_block_spec] * n,
        input_output_aliases={2 + n + i: i for i in range(n)},
        interpret=not on_gpu,
        compiler_params=TRITON_PARAMS if on_gpu else None,
        name="copy_experts",
    )(experts, destinations, *flat_sources, *flat)
    return treedef.unflatten([from_words(o, leaf) for o, leaf in zip(out, leaves)])


def as_words(leaf):
    """[S, ...] -> [S, n]: one row per expert; one-byte values (quantized codes) as 32-bit words where a row's bytes
    allow. Pallas' Triton lowering offsets an array of at most 4 GiB by 32-bit signed integers, which a 2-4 GiB
    array of bytes (DeepSeek-V3's fp8 or int4 experts of one layer) would overflow past its 2^31st byte."""
    size = math.prod(leaf.shape[1:])
    if leaf.dtype.itemsize == 1 and size % 4 == 0:
        return jax.lax.bitcast_convert_type(leaf.reshape(leaf.shape[0], size // 4, 4), jnp.uint32)
    return leaf.reshape(leaf.shape[0], size)


def from_words(words, like):
    """as_words undone: `words` back to the shape and dtype of `like`."""
    if words.dtype != like.dtype:
        words = jax.lax.bitcast_convert_type(words, like.dtype)
    return words.reshape(like.shape)


def _copy_kernel(experts_ref, destinations_ref, *refs, chunk, sizes, first_chunks):
    n = len(sizes)
    source_refs, out_refs = refs[:n], refs[2 * n:]  # refs[n:2n]: the aliased inputs, written through out_refs
    c, j = pl.program_id(0), pl.program_id(1)
    expert, slot = experts_ref[j], destinations_ref[j]
    wanted = (expert >= 0) & (slot >= 0)
    for source_ref, out_ref, size, first in zip(source_refs, out_refs, sizes, first_chunks):
        last = first + pl.cdiv(size, chunk)

        @pl.when(wanted & (c >= first) & (c < last))
        def _(source_ref=source_ref, out_ref=out_ref, size=size, first=first):
            start = (c - first) * chunk
            inside = start + jnp.arange(chunk) < size
            piece = pl.ds(start, chunk)
            values = pltriton.load(source_ref.at[expert, piece], mask=inside)
            pltriton.store(out_ref.at[slot, piece], values, mask=inside)
