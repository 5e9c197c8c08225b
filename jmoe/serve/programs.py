"""The jitted programs of a serving batch: prefill chunks into chosen rows, one decode step over every row,
and the choice of each row's next token (a deep model's prefill and decode chained in blocks of layers:
jmoe.decode.chain).

The batch has a fixed number of rows sharing one KV cache [rows, context, ...]; each row sits at its own
cache column (`positions`), so the model is called with per-row write indices. Shapes are bucketed
(`prefill_shapes`, `visible_buckets`) and every program is compiled by `ServingEngine.warm_up`, so no mix of
prompt lengths, parameters or occupancy compiles anything later. Row index `rows` (the batch size) marks a
padding entry: it gathers a clipped row, computes nothing that routes to an expert, and its writes are
dropped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmoe.decode.sampling import SamplingArrays, greedy_tokens, sample
from jmoe.decode.steps import forward
from jmoe.model.transformer import chunk_cache, chunk_written
from jmoe.serve.params import MAX_TOP_LOGPROBS


def make_prefill_fn(model, visible: int):
    """(params, engine state, kv cache, tokens int32 [P, T], rows int32 [P], start int32 [P], valid int32 [P])
    -> (float32 logits [P, V] at each entry's last real token, bool [L] finite per layer), routing, kv cache,
    engine state, its readback. Entry p writes its first valid[p] tokens into row rows[p] from column start[p];
    the columns after them may hold padding, which later writes of that row replace before anything reads them.
    Attention reads the first `visible` columns (static, >= every start + T). `visible` == T is the program
    for first chunks (every start 0): it reads nothing of the rows' cache and writes only their first T
    columns, where gathering and scattering whole rows was a third of an 8-entry, 128-token step at context
    1024 (22 of 66 ms). A deep model's is chained (Model.step_chain, jmoe.decode.chain)."""
    if model.step_chain is not None:
        return model.step_chain.prefill_program(visible)
    graphdef, engine = model.graphdef, model.engine

    def prefill(params, engine_state, kv_cache, tokens, rows, start, valid):
        pad = jnp.zeros(tokens.shape[:1], jnp.int32)
        first_chunks = visible == tokens.shape[1]
        out, engine_state, readback = forward(graphdef, params, engine, engine_state, tokens,
                                              chunk_cache(kv_cache, rows, tokens.shape, first_chunks), start, pad,
                                              last_only=True, visible_len=visible, valid_len=valid)
        kv_cache = chunk_written(kv_cache, rows, out.kv_cache, first_chunks)
        return (out.logits[:, 0], out.finite), out.routing, kv_cache, engine_state, readback

    return jax.jit(prefill, donate_argnums=(1, 2))


def make_decode_fn(model, visible: int):
    """(params, engine state, kv cache, tokens int32 [R], positions int32 [R], active bool [R]) -> (float32
    logits [R, V], int32 [R] each row's argmax, bool [L] finite), routing, kv cache, engine state, its readback:
    the cache's first R rows (R, static, may be fewer than the cache holds: every active row is among them), each row's
    token written at its own column; inactive rows route nowhere (their write lands on a column their next real
    write replaces). Attention reads the first `visible` columns (static; every active position is below it).
    The argmax is the token of a plain greedy row (RequestParams.plain_greedy): a step of only those needs no
    choice program. A deep model's is chained (Model.step_chain, jmoe.decode.chain)."""
    if model.step_chain is not None:
        return model.step_chain.decode_program(visible)
    graphdef, engine = model.graphdef, model.engine

    def decode(params, engine_state, kv_cache, tokens, positions, active):
        pad = jnp.zeros(tokens.shape, jnp.int32)
        out, engine_state, readback = forward(graphdef, params, engine, engine_state, tokens[:, None], kv_cache,
                                              positions, pad, last_only=True, visible_len=visible,
                                              valid_len=active.astype(jnp.int32))
        logits = out.logits[:, 0]
        return (logits, greedy_tokens(logits), out.finite), out.routing, out.kv_cache, \
            engine_state, readback

    return jax.jit(decode, donate_argnums=(1, 2))


def make_choose_fn(greedy: bool, logprobs: bool, biased: bool):
    """The next token of P entries from their logits [P, V]: the entry's additive `bias` [P, V] (static variant
    `biased`; logit_bias values, -inf on banned tokens: min_tokens, allowed_token_ids, a grammar's mask), then the
    repetition penalty over `seen` [B, V] (the row's prompt tokens, set by make_mark_prompt_fn for a request that
    asks for the penalty) and the tokens it has generated, then the presence and frequency penalties from `counts`
    [B, V] (tokens each row has generated; `reset` entries start from none), then argmax, or per-row temperature /
    top-k / top-p / min-p sampling with the entry's own key (seed and token index), so a row's draw never depends
    on its neighbours. Every parameter is a traced per-entry array (repetition 1 and min_p 0 = off, exactly: x / 1
    and x * 1 are x). Returns (tokens int32 [P], their log-probabilities, the top MAX_TOP_LOGPROBS ids and
    log-probabilities, counts with each entry's token added). Log-probabilities are the model's own (log-softmax
    of the raw logits, before bias, penalties and temperature), as vLLM reports them. Static variants: `greedy`,
    every entry is greedy and nothing is sorted; without `logprobs` no entry asked for them, and zeros stand in (a
    top-k over the vocabulary costs about as much as the rest of the choice); without `biased` no entry has a
    bias this step and `bias` is None (a [P, V] array built and sent every step costs the host and the link)."""

    def choose(logits, counts, seen, rows, reset, sampling: SamplingArrays, presence, frequency, repetition, min_p,
               seeds, indices, bias):
        row_counts = jnp.where(reset[:, None], 0, jnp.take(counts, rows, axis=0, mode="clip"))
        row_seen = jnp.take(seen, rows, axis=0, mode="clip") | (row_counts > 0)
        scores = logits + bias if biased else logits
        penalty = repetition[:, None]
        scores = jnp.where(row_seen, jnp.where(scores > 0, scores / penalty, scores * penalty), scores)
        penalised = scores - frequency[:, None] * row_counts - presence[:, None] * (row_counts > 0)
        tokens = jnp.argmax(penalised, axis=-1).astype(jnp.int32)
        if not greedy:
            drawn = jax.vmap(_sample_one)(penalised, seeds, indices, sampling, min_p)
            tokens = jnp.where(sampling.temperature > 0, drawn, tokens)
        entries = tokens.shape[0]
        if logprobs:
            logprob_rows = jax.nn.log_softmax(logits, axis=-1)
            top_logprobs, top_ids = jax.lax.top_k(logprob_rows, MAX_TOP_LOGPROBS)
            token_logprobs = jnp.take_along_axis(logprob_rows, tokens[:, None], axis=-1)[:, 0]
        else:
            token_logprobs = jnp.zeros((entries,), jnp.float32)
            top_logprobs, top_ids = jnp.zeros((entries, MAX_TOP_LOGPROBS), jnp.float32), jnp.zeros(
                (entries, MAX_TOP_LOGPROBS), jnp.int32)
        row_counts = row_counts.at[jnp.arange(entries), tokens].add(1)
        counts = counts.at[rows].set(row_counts, mode="drop")
        return (tokens, token_logprobs, top_ids.astype(jnp.int32), top_logprobs), counts

    return jax.jit(choose, donate_argnums=(1,))


def make_mark_prompt_fn():
    """(seen bool [B, V], row int32, mask bool [V]) -> seen with row `row` replaced by `mask` (the prompt's tokens
    of a request with a repetition penalty; rows past B dropped)."""
    return jax.jit(lambda seen, row, mask: seen.at[row].set(mask, mode="drop"), donate_argnums=(0,))


def _sample_one(logits, seed, index, sampling: SamplingArrays, min_p):
    """One row's draw: its key is its seed folded with the index of the token it draws. min_p (0 = off) drops the
    tokens whose probability after temperature is below min_p times the most likely one's, as Hugging Face's
    MinPLogitsWarper does after top-k and top-p (the most likely token survives both, so the order does not matter):
    p_i < min_p * p_max <=> logit_i < logit_max + temperature * log(min_p)."""
    key = jax.random.fold_in(jax.random.PRNGKey(seed), index)
    params = jax.tree.map(lambda a: a[None], sampling)
    params = params._replace(temperature=jnp.where(params.temperature > 0, params.temperature, 1.0))
    floor = jnp.max(logits) + params.temperature[0] * jnp.log(min_p)
    logits = jnp.where(logits < floor, -jnp.inf, logits)
    return sample(logits[None], key, params)[0]


def make_copy_row_fn():
    """(kv cache, source int32, destination int32) -> the cache with row `destination` a copy of row `source`, every
    column (prefix reuse, jmoe.serve.prefixes: the columns past the prefix are never read before they are written)."""

    def copy_row(kv_cache, source, destination):
        return jax.tree.map(lambda c: jax.lax.dynamic_update_index_in_dim(
            c, jax.lax.dynamic_index_in_dim(c, source, keepdims=False), destination, axis=0), kv_cache)

    return jax.jit(copy_row, donate_argnums=(0,))
