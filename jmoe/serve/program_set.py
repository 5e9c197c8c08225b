"""The serving engine's programs as a known set, in the order a server compiles them: first those a short one-row
request needs (the server answers once they exist), then the rest behind the first requests (jmoe.serve.compiling).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jmoe.serve.compiling import ProgramSpec

# warm_up(first_only=True): the programs of a one-row greedy request whose prompt fits one chunk of at most FIRST_CHUNK
# tokens and whose decode reads at most FIRST_VISIBLE cache columns; the rest are compiled behind the first requests,
# the decodes reading at most SHORT_VISIBLE columns before the longer ones. The default model at max_batch 8 (85
# programs), two Zen 3 cores: the 16 programs of one row, every chunk and choice, up to 512 columns, were ready 43 s
# after a cold start and 12 s after a warm one.
FIRST_CHUNK, FIRST_VISIBLE, SHORT_VISIBLE = 64, 256, 512


def program_specs(engine) -> tuple[list[ProgramSpec], list[ProgramSpec]]:
    """Every program `engine` (a ServingEngine) may run, in two lists: those a one-row greedy request with a prompt of
    at most FIRST_CHUNK tokens and a context of at most FIRST_VISIBLE needs; then the rest, in the order they are
    compiled behind the first requests: for one row, then more rows (fewest first), the token choices, the first-chunk
    prefills and the decodes up to SHORT_VISIBLE columns (after one row's: the prompt marking, and with prefix reuse
    the row copy and the prefills that continue a prompt, which a conversation's second turn needs); then the longer
    decodes and the other prefills of later chunks. Their arguments are padding entries (a clipped row: writes
    dropped; from column 0, no valid token)."""

    def prefill(entries, chunk, visible):
        return ProgramSpec(("prefill", entries, chunk, visible), engine.prefill_programs[visible], lambda abstract: (
            engine.prefill_args(np.zeros((entries, chunk), np.int32), np.full(entries, engine.max_batch),
                                np.zeros(entries), np.zeros(entries), abstract)))

    def choose(entries, variant):
        logits = jax.ShapeDtypeStruct((entries, engine.config.vocab_size), jnp.float32)
        return ProgramSpec(("choose", *variant, entries), engine.choose_programs[variant], lambda abstract: (
            engine.choose_args(logits if abstract else jnp.zeros(logits.shape), [None] * entries, reset=True,
                               biased=variant[2], abstract=abstract)))

    def decode(entries, visible):
        return ProgramSpec(("decode", visible, entries), engine.decode_programs[visible], lambda abstract: (
            engine.decode_args(np.zeros(entries, np.int32), np.zeros(entries, np.int32), np.zeros(entries, bool),
                               abstract)))

    shortest = engine.visible_buckets[0]  # every step can run it (a GPU's only decode is the whole context's)
    first = ([prefill(1, chunk, chunk) for chunk in engine.chunks if chunk <= FIRST_CHUNK]
             + [choose(1, variant) for variant in engine.choose_programs if variant[0]]
             + [decode(1, visible) for visible in engine.visible_buckets if visible <= FIRST_VISIBLE or
                visible == shortest])
    short, long = [], []
    for entries in engine.entry_buckets:  # the first is 1
        short += [choose(entries, variant) for variant in engine.choose_programs]
        short += [prefill(entries, chunk, chunk) for chunk in engine.chunks]
        short += [decode(entries, visible) for visible in engine.visible_buckets
                  if visible <= SHORT_VISIBLE or visible == shortest]
        if entries == 1:
            short.append(ProgramSpec(("mark_prompt",), engine.mark_prompt_program, lambda abstract: engine.mark_args(
                engine.max_batch, np.zeros(engine.config.vocab_size, bool), abstract)))
            if engine.prefixes is not None:
                short.append(ProgramSpec(("copy_row",), engine.copy_row_program, lambda abstract: (
                    engine.engine_arrays(abstract)[2], np.int32(0), np.int32(0))))
                short += [prefill(entries, chunk, engine.context) for chunk in engine.later_chunks]
        long += [decode(entries, visible) for visible in engine.visible_buckets
                 if visible > SHORT_VISIBLE and visible != shortest]
        if entries > 1 or engine.prefixes is None:
            long += [prefill(entries, chunk, engine.context) for chunk in engine.later_chunks]
    compiled_first = {spec.key for spec in first}
    return first, [spec for spec in short if spec.key not in compiled_first] + long
