"""How the serving engine cuts prompts into prefill chunks.

On a CPU (and wherever an offloaded model's experts are read in place) short chunks give the best time to first
token. Where an offloaded layer's experts stream from host memory once per chunk (a GPU), chunks grow as long as
streaming needs to be hidden behind computing them (jmoe.offload.prefill_chunks, the rule jmoe.plan's estimate
follows), so a long prompt streams the experts a few times instead of once per 256 tokens.
"""

from __future__ import annotations

import jax

from jmoe.model.params import abstract_params
from jmoe.offload.prefill_chunks import SMALL_CHUNK, prefill_chunk_for, prefill_streams

# Prompt tokens per prefill entry and step; shorter chunks are padded up to the next of these. 192 halves the most
# a 129-256-token prompt pads. The bench's burst of eight 88-191-token prompts, in-process at cache 4, two processes
# each, alternated: the last first token 110.6 and 120.9 -> 85.5 and 108.4 ms; a lone 157-191-token prompt's first
# token 21.9 and 23.6 -> 16.4 and 19.2 ms. It costs 10 more programs at max_batch 16.
CHUNK_BUCKETS = (16, 64, 128, 192, SMALL_CHUNK)


def chunk_buckets(context: int, longest: int | None = None) -> tuple[int, ...]:
    """The chunk lengths of a server with `context` (>= 2) columns per row: CHUNK_BUCKETS below the context; with a
    `longest` chunk (1 to the context), those below it, then powers of two up to it and itself (so a prompt pads
    to at most twice its length)."""
    small = tuple(c for c in CHUNK_BUCKETS if c < context) or (context // 2,)
    if longest is None:
        return small
    shorter = [c for c in small if c < longest]
    if not shorter:
        return (longest,)
    return (*shorter, *(1 << i for i in range(shorter[-1].bit_length(), longest.bit_length()) if (1 << i) < longest),
            longest)


def streaming_chunk(model, context: int) -> int | None:
    """The longest chunk for `model` where its offloaded experts stream per chunk, else None (keep CHUNK_BUCKETS).
    The host link and the device's peak are jmoe.offload.prefill_chunks' defaults: nothing measures them here."""
    platform = jax.default_backend()
    if not prefill_streams(model.placement_plan, platform):
        return None  # before tracing the parameters' shapes
    mesh = getattr(model.engine, "mesh", None)  # expert parallelism: each device streams its share
    devices = 1 if mesh is None else mesh.devices.size
    return prefill_chunk_for(model.placement_plan, model.config, abstract_params(model.config, model.kv_dtype),
                             platform=platform, context=context, devices=devices)


def later_chunks(buckets: tuple[int, ...], context: int) -> tuple[int, ...]:
    """The chunks a piece that continues a prompt (columns before it written) may take: none as long as the context,
    whose program is the one that reads none of the row's columns (jmoe.serve.programs.make_prefill_fn)."""
    return tuple(c for c in buckets if c < context)


def chunk_for(buckets: tuple[int, ...], remaining: int, continues: bool, context: int) -> int:
    """The chunk of a prompt's next piece, `remaining` tokens left: the smallest bucket that holds them, else the
    largest; a piece that `continues` a prompt chooses among `later_chunks`."""
    usable = later_chunks(buckets, context) if continues else buckets
    return next((c for c in usable if c >= remaining), usable[-1])
