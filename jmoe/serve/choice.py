"""The host side of the token-choice program (jmoe.serve.programs.make_choose_fn): each step's per-entry arrays
of sampling parameters, and the per-entry bias over the vocabulary that logit_bias, min_tokens, allowed_token_ids
and grammars go through.

A bias row is built only for an entry that has one this step; a step with none runs a variant without the
[P, V] array. A grammar's mask is computed here, after the step that makes the logits was dispatched, so the host
works while the device runs it.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from jmoe.decode.sampling import SamplingArrays
from jmoe.serve.params import RequestParams


class ChoiceArrays(NamedTuple):
    """Per-entry inputs of the choice program (padding entries: row `max_batch`, every parameter off)."""

    rows: np.ndarray  # int32 [P]
    sampling: SamplingArrays
    presence: np.ndarray  # float32 [P]
    frequency: np.ndarray
    repetition: np.ndarray  # 1 = off
    min_p: np.ndarray  # 0 = off
    seeds: np.ndarray  # uint32 [P]
    indices: np.ndarray  # int32 [P]: the index of the token each entry draws
    bias: np.ndarray | None  # float32 [P, V], None in a step without biases


def choice_arrays(requests: list, max_batch: int, vocab_size: int, eos: frozenset[int],
                  biased: bool, ahead: int = 0) -> tuple[ChoiceArrays, float]:
    """The arrays of a step whose entries are `requests` (engine Requests, None = padding), and the seconds the
    grammars' masks took. `ahead`: tokens each request gets before this step's that it does not hold yet (1 for a
    step dispatched before the last is read back; they count in the token index its sampling key is drawn with)."""
    n = len(requests)
    temperature, presence, frequency, min_p = (np.zeros(n, np.float32) for _ in range(4))
    top_p, repetition = np.ones(n, np.float32), np.ones(n, np.float32)
    top_k, indices = np.zeros(n, np.int32), np.zeros(n, np.int32)
    seeds = np.zeros(n, np.uint32)
    rows = np.full(n, max_batch, np.int32)
    bias = np.zeros((n, vocab_size), np.float32) if biased else None
    grammar_seconds = 0.0
    for i, request in enumerate(requests):
        if request is None:
            continue
        p = request.params
        temperature[i], top_p[i], top_k[i], min_p[i] = p.temperature, p.top_p, p.top_k, p.min_p
        presence[i], frequency[i], repetition[i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
        seeds[i], indices[i], rows[i] = request.seed, len(request.tokens) + ahead, request.row
        if biased and has_bias(request):
            grammar_seconds += fill_bias(request, bias[i], eos)
    return ChoiceArrays(rows, SamplingArrays(temperature, top_k, top_p), presence, frequency, repetition, min_p,
                        seeds, indices, bias), grammar_seconds


def has_bias(request) -> bool:
    """Whether the request's next token has a bias: logit_bias or allowed tokens, a grammar, min_tokens' or
    bad_words' bans."""
    return request.static_bias is not None or request.matcher is not None \
        or len(request.tokens) < request.params.min_tokens or bool(_bad_words_banned(request))


def chosen_without_the_host(request) -> bool:
    """Whether the token after the request's next one is chosen without the host, whatever the next one is: no grammar,
    no static bias, no bad words, and min_tokens met by then (a decode step dispatched before the last is read
    back, jmoe.serve.decoding)."""
    return (request.matcher is None and request.static_bias is None and not request.params.bad_words
            and len(request.tokens) + 1 >= request.params.min_tokens)


def fill_bias(request, row: np.ndarray, eos: frozenset[int]) -> float:
    """Write the request's bias for its next token into `row` (float32 [V], zeros): its static bias; -inf on the EOS
    and stop tokens before min_tokens; -inf on what its grammar does not allow (EOS only where the grammar may end;
    where min_tokens' bans would leave the grammar nothing, the grammar wins). Returns the grammar's seconds."""
    if request.static_bias is not None:
        row[:] = request.static_bias
    if len(request.tokens) < request.params.min_tokens:
        row[list(eos | set(request.params.stop_token_ids))] = -np.inf
    row[_bad_words_banned(request)] = -np.inf
    if request.matcher is None:
        return 0.0
    began = time.perf_counter()
    allowed = request.matcher.allowed()
    if not np.isfinite(row[allowed]).any():
        row[:] = 0.0 if request.static_bias is None else request.static_bias
    row[~allowed] = -np.inf
    seconds = time.perf_counter() - began
    request.grammar_seconds += seconds
    return seconds


def _bad_words_banned(request) -> list[int]:
    """The last tokens of the bad words whose other tokens the request has just generated (vLLM's bad_words)."""
    tokens = request.tokens
    return [word[-1] for word in request.params.bad_words
            if len(word) - 1 <= len(tokens) and tokens[len(tokens) - len(word) + 1:] == list(word[:-1])]


def grammar_complete(request, token: int) -> bool:
    """Advance the request's grammar past its new token; True when nothing but EOS may follow (the text is
    complete, and the request ends)."""
    if request.matcher is None:
        return False
    began = time.perf_counter()
    request.matcher.accept(token)
    request.grammar_seconds += time.perf_counter() - began
    return request.matcher.stopped


def static_bias(params: RequestParams, vocab_size: int) -> np.ndarray | None:
    """The float32 [V] bias of every step of a request: logit_bias added, -inf outside allowed_token_ids."""
    if not params.logit_bias and params.allowed_token_ids is None:
        return None
    bias = np.zeros(vocab_size, np.float32)
    for token, value in params.logit_bias:
        bias[token] += value
    if params.allowed_token_ids is not None:
        banned = np.ones(vocab_size, bool)
        banned[list(params.allowed_token_ids)] = False
        bias[banned] = -np.inf
    return bias
