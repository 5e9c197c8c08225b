"""The continuous-batching engine (jmoe.serve.ServingEngine) without HTTP: exactness against Model.generate
whatever the neighbours, at several cache sizes; seeded sampling independent of neighbours; penalties, biases,
min_tokens, min_p and logprobs against the model's own logits and transformers' processors; grammar-constrained
rows beside free ones; stops, cancellation, limits; no compilation after warm-up."""

from __future__ import annotations

import collections
import json
import logging
import re
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import jmoe
from jmoe.serve import QueueFullError, RequestError, RequestParams, ServingEngine
from jmoe.serve import engine as engine_module
from jmoe.serve.engine import CHOOSE_VARIANTS
from jmoe.errors import InsufficientMemoryError
from jmoe.serve import mappings
from jmoe.serve.program_set import program_specs

# One pytest-xdist worker runs this module (--dist loadgroup): its module fixtures are expensive, and each
# worker that ran some of its tests would build them again.
pytestmark = pytest.mark.xdist_group("serve_engine")

DEFAULT = Path(__file__).resolve().parents[1] / "checkpoints" / "default"  # its tokenizer
PROMPTS = ["def f(x):", "class Parser:\n    def __init__(self", "import os\n", "for i in range(10):\n    ",
           "x = [", "# a comment about"]


@pytest.fixture(scope="module")
def model(default_two_layers):
    return jmoe.load(default_two_layers, progress=False)


@pytest.fixture(scope="module")
def prompt_ids(model):
    return [model.tokenizer.encode(p) for p in PROMPTS]


def run_until_done(engine: ServingEngine, requests, joins=None):
    """Step the engine by hand until every request is done; `joins` {step number: callable} submits more
    requests at given steps (so they join mid-generation). Returns the number of steps."""
    joins = dict(joins or {})
    steps = 0
    while not all(r.done for r in requests) or joins:
        if steps in joins:
            requests.extend(joins.pop(steps)())
        engine.step()
        steps += 1
        assert steps < 2000
    return steps


def tokens_of(request) -> list[int]:
    events = list(request.events(timeout=0))
    assert events[-1].finish_reason is not None
    return [e.token for e in events if e.token is not None]


def greedy(n: int) -> RequestParams:
    return RequestParams(max_tokens=n, temperature=0.0)


@pytest.mark.parametrize("cache", [None, 0, 4])
def test_greedy_tokens_equal_generate_alone_and_with_neighbours_joining_and_leaving(cache, prompt_ids,
                                                                                    default_two_layers):
    model = jmoe.load(default_two_layers, cache=cache, progress=False)
    lengths = [12, 5, 9, 3, 12, 7]
    expected = model.generate(prompt_ids, max_new_tokens=12)  # one batch: rows stop at EOS or 12 tokens
    expected = [tokens[:n] for tokens, n in zip(expected, lengths)]
    engine = ServingEngine(model, max_batch=2, context=64)
    alone = engine.submit(prompt_ids[0], greedy(lengths[0]))
    run_until_done(engine, [alone])
    assert tokens_of(alone) == expected[0]
    # Six requests over two rows: later ones wait for a row, and join while others are mid-generation.
    requests = [engine.submit(ids, greedy(n)) for ids, n in zip(prompt_ids[:4], lengths[:4])]
    late = lambda: [engine.submit(ids, greedy(n)) for ids, n in zip(prompt_ids[4:], lengths[4:])]
    run_until_done(engine, requests, joins={4: late})
    assert [tokens_of(r) for r in requests] == expected
    assert all(r.finish_reason == "length" for r in requests)
    if cache is not None:
        assert sum(s["hits"] + s["misses"] for s in model.stats()) > 0
    # Prefix reuse: a conversation's second turn continues in the row its first left; a request sharing a running
    # row's prefix copies it into the free row (evicting what that row held); a third waits for a row.
    first = [(ids * 8)[:20] for ids in prompt_ids[:2]]
    turn1 = [engine.submit(p, greedy(6)) for p in first]
    run_until_done(engine, turn1)
    second = [r.prompt + r.tokens + prompt_ids[2] for r in turn1]
    branch = second[0] + prompt_ids[3]
    expected = model.generate([second[0], branch, second[1]], max_new_tokens=6)
    turn2 = [engine.submit(second[0], greedy(6))]
    run_until_done(engine, turn2, joins={2: lambda: [engine.submit(branch, greedy(6)),
                                                     engine.submit(second[1], greedy(6))]})
    assert [tokens_of(r) for r in turn2] == expected
    assert turn2[0].cached_tokens == 20 + 6 - 1 and turn2[1].cached_tokens >= len(second[0])


def record_decode_order(engine: ServingEngine) -> list[str]:
    """"dispatch" and "finish" for each decode step the engine dispatches and reads back, in order."""
    events, dispatch, finish = [], engine._dispatch_decode, engine._finish_decode

    def dispatched(*args, **ahead):
        events.append("dispatch")
        return dispatch(*args, **ahead)

    def finished(step):
        events.append("finish")
        return finish(step)

    engine._dispatch_decode, engine._finish_decode = dispatched, finished
    return events


@pytest.mark.parametrize("cache", [None, 4])
def test_decode_steps_run_ahead_of_their_read_back(cache, model, prompt_ids, default_two_layers):
    """With no request waiting for a row and no row's next token needing the host, each decode step is dispatched on
    the last one's tokens before that one is read back (issue #54 item 3): generate's tokens, and the row that ends
    first drops the token its row computed past its end; sampled rows draw what they draw waiting for each step (their
    keys count the token not yet read back). A row whose bias depends on its tokens (bad words) waits for each."""
    if cache is not None:
        model = jmoe.load(default_two_layers, cache=cache, progress=False)
    lengths = [10, 4]
    expected = [tokens[:n] for tokens, n in zip(model.generate(prompt_ids[:2], max_new_tokens=10), lengths)]
    engine = ServingEngine(model, max_batch=2, context=64)
    events = record_decode_order(engine)
    requests = [engine.submit(ids, greedy(n)) for ids, n in zip(prompt_ids, lengths)]
    run_until_done(engine, requests)
    assert [tokens_of(r) for r in requests] == expected
    assert events.count("dispatch") == events.count("finish") >= 9
    assert ("dispatch", "dispatch") in set(zip(events, events[1:]))  # one dispatched before the last was read back
    sampling = [RequestParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=seed, logprobs=2) for seed in (1, 2)]
    drawn = {}
    for run_ahead in (True, False):
        engine = ServingEngine(model, max_batch=2, context=64, run_ahead=run_ahead)
        events = record_decode_order(engine)
        sampled = [engine.submit(ids, params) for ids, params in zip(prompt_ids[2:], sampling)]
        run_until_done(engine, sampled)
        drawn[run_ahead] = [[(e.token, e.logprob) for e in r.events(timeout=0)] for r in sampled]
        assert (("dispatch", "dispatch") in set(zip(events, events[1:]))) == run_ahead
    assert drawn[True] == drawn[False]
    engine = ServingEngine(model, max_batch=2, context=64)
    events = record_decode_order(engine)
    banned = engine.submit(prompt_ids[0], RequestParams(max_tokens=5, temperature=0.0, bad_words=((1, 2),)))
    run_until_done(engine, [banned])
    assert len(tokens_of(banned)) == 5 and events == ["dispatch", "finish"] * 4


def test_a_padded_last_chunk_reaching_past_the_context_writes_only_its_real_tokens(model, prompt_ids):
    """Context 100, a 90-token prompt: chunks of 64 and 26 tokens, the second padded to 64 (columns 64-127): its
    padding falls off the cache instead of shifting the chunk onto earlier columns."""
    prompt = (prompt_ids[1] * 30)[:90]
    expected = model.generate(prompt, max_new_tokens=8)[0]
    engine = ServingEngine(model, max_batch=1, context=100)
    request = engine.submit(prompt, greedy(8))
    run_until_done(engine, [request])
    assert tokens_of(request) == expected


class StepLog:
    """An engine observer that keeps (kind, rows, tokens per entry) of every step."""

    def __init__(self):
        self.steps = []

    def step(self, kind, seconds, rows, routing):
        self.steps.append((kind, rows, routing.shape[2]))

    def finished(self, request):
        pass


def test_requests_sharing_a_prefix_that_a_row_is_prefilling_wait_for_it_and_copy_it(model, prompt_ids):
    """Two requests sent at once with the same 40-token prefix (agents with one system prompt): the second waits
    while the first prefills it, then copies it from the first's row, so it is prefilled once. Tokens equal
    generate's."""
    shared = (prompt_ids[1] * 20)[:40]
    prompts = [shared + prompt_ids[0], shared + prompt_ids[2]]
    expected = model.generate(prompts, max_new_tokens=6)
    log = StepLog()
    engine = ServingEngine(model, max_batch=2, context=64, observer=log)
    requests = [engine.submit(p, greedy(6)) for p in prompts]
    run_until_done(engine, requests)
    assert [tokens_of(r) for r in requests] == expected
    assert requests[0].cached_tokens == 0 and requests[1].cached_tokens >= len(shared)
    assert sum(rows * tokens for kind, rows, tokens in log.steps if kind == "prefill") < 2 * len(shared)


def test_a_chunk_as_long_as_the_context_takes_only_first_pieces(model, prompt_ids):
    """prefill_chunk = context = 64 (chunks of 16, 32, 64): a 50-token prompt is one first chunk of 64; the next
    request shares its first 10 tokens, so its other 40 continue the row in chunks of 32 and 16, never in the 64 one,
    whose program reads none of the row's columns. Tokens equal generate's."""
    log = StepLog()
    engine = ServingEngine(model, max_batch=1, context=64, prefill_chunk=64, observer=log)
    first = (prompt_ids[1] * 30)[:50]
    branch = first[:10] + (prompt_ids[3] * 20)[:40]
    expected = model.generate([first, branch], max_new_tokens=6)
    requests = [engine.submit(p, greedy(6)) for p in (first, branch)]
    run_until_done(engine, requests)  # one row: the second waits for it
    assert [tokens_of(r) for r in requests] == expected
    assert [r.cached_tokens for r in requests] == [0, 10]
    assert [tokens for kind, _, tokens in log.steps if kind == "prefill"] == [64, 32, 16]


def test_a_round_prefills_one_step_per_chunk_bucket_smallest_first(model, prompt_ids):
    """A short and a 100-token prompt arrive together (context 128: chunks of 16 and 64): the round prefills the short
    one alone in a 16-token step, so its first token does not wait for the long one, then the long one's first 64
    tokens; the next round the long one's last 36, padded to 64. The tokens are still generate's."""
    long_prompt = (prompt_ids[1] * 40)[:100]
    log = StepLog()
    engine = ServingEngine(model, max_batch=2, context=128, observer=log)
    short, long = engine.submit(prompt_ids[0], greedy(6)), engine.submit(long_prompt, greedy(6))
    engine.step()
    assert log.steps == [("prefill", 1, 16), ("prefill", 1, 64), ("decode", 1, 1)]
    assert short.completion_tokens == 2 and long.completion_tokens == 0 and long.prefilled == 64
    run_until_done(engine, [short, long])
    assert log.steps[3] == ("prefill", 1, 64)
    assert tokens_of(short) == model.generate(prompt_ids[0], max_new_tokens=6)[0]
    assert tokens_of(long) == model.generate(long_prompt, max_new_tokens=6)[0]


@pytest.mark.parametrize("family", ["deepseek_v3_qlora_groups", "gpt_oss_e4k2_window"])
def test_other_families_serve_their_generate_tokens(family, hf_checkpoints):
    """Latent attention's compressed cache (per-row writes into both of its arrays), and attention sinks with
    sliding windows, through a batch whose rows sit at different columns, at cache 1."""
    model = jmoe.load(hf_checkpoints[family][0], cache=1, progress=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, model.config.vocab_size, n).tolist() for n in (5, 11, 3)]
    expected = [model.generate(p, max_new_tokens=n)[0] for p, n in zip(prompts, (9, 4, 7))]
    engine = ServingEngine(model, max_batch=2, context=64)
    requests = [engine.submit(p, RequestParams(max_tokens=n, temperature=0.0, ignore_eos=True))
                for p, n in zip(prompts, (9, 4, 7))]
    run_until_done(engine, requests)
    assert [r.tokens[:len(e)] for r, e in zip(requests, expected)] == expected  # generate stops at an EOS
    assert all(len(r.tokens) == n for r, n in zip(requests, (9, 4, 7)))


def test_engine_serves_offload_options_exactly(prompt_ids, default_two_layers):
    """Host miss mode with router prefetch and int8 experts: the batch's tokens equal generate's (here without prefix
    reuse: a prompt sent again is prefilled again)."""
    model = jmoe.load(default_two_layers, cache=4, miss_mode="host", prefetch=2, expert_dtype="int8", progress=False)
    expected = [model.generate(ids, max_new_tokens=8)[0] for ids in prompt_ids[:3]]
    engine = ServingEngine(model, max_batch=4, context=64, prefix_reuse=False)
    requests = [engine.submit(ids, greedy(8)) for ids in prompt_ids[:3]]
    run_until_done(engine, requests)
    again = engine.submit(prompt_ids[0], greedy(8))
    run_until_done(engine, [again])
    assert [tokens_of(r) for r in [*requests, again]] == [*expected, expected[0]]
    assert again.cached_tokens == 0 and again.row == 0


@pytest.fixture(scope="module")
def engine(model):
    engine = ServingEngine(model, max_batch=2, context=128, max_queue=3)
    engine.warm_up()
    return engine


def test_seeded_sampling_does_not_depend_on_neighbours(engine, prompt_ids):
    params = RequestParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=40, seed=1234)
    alone = engine.submit(prompt_ids[1], params)
    run_until_done(engine, [alone])
    crowd = [engine.submit(prompt_ids[0], RequestParams(max_tokens=6, temperature=1.0, seed=7)),
             engine.submit(prompt_ids[2], greedy(10))]
    again = lambda: [engine.submit(prompt_ids[1], params)]
    run_until_done(engine, crowd, joins={2: again})
    assert tokens_of(crowd[2]) == alone.tokens and len(alone.tokens) == 10
    other_seed = engine.submit(prompt_ids[1], RequestParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=40,
                                                            seed=4321))
    run_until_done(engine, [other_seed])
    assert tokens_of(other_seed) != alone.tokens


def reference_choices(model, prompt, generated, presence=0.0, frequency=0.0):
    """What each generated token should have been: argmax of the model's logits at its prefix minus the
    penalties over the tokens generated before it; and the model's log-softmax there."""
    logits = np.asarray(model.logits([prompt + generated])[0, len(prompt) - 1:-1], np.float64)
    counts = np.zeros(logits.shape[-1])
    choices, logprobs = [], []
    for t, token in enumerate(generated):
        penalised = logits[t] - frequency * counts - presence * (counts > 0)
        choices.append(int(np.argmax(penalised)))
        logprobs.append(logits[t] - np.log(np.exp(logits[t] - logits[t].max()).sum()) - logits[t].max())
        counts[token] += 1
    return choices, np.array(logprobs)


def test_penalties_and_logprobs_follow_the_models_logits(engine, model, prompt_ids):
    prompt = prompt_ids[2]  # greedy decoding of this prompt repeats itself, so penalties change the text
    plain = engine.submit(prompt, RequestParams(max_tokens=12, temperature=0.0, logprobs=5))
    penalised = engine.submit(prompt, RequestParams(max_tokens=12, temperature=0.0, frequency_penalty=1.5,
                                                    presence_penalty=0.5))
    run_until_done(engine, [plain, penalised])
    plain_events = [e for e in plain.events(timeout=0) if e.token is not None]
    assert plain.tokens != penalised.tokens
    choices, _ = reference_choices(model, prompt, penalised.tokens, presence=0.5, frequency=1.5)
    assert choices == penalised.tokens
    choices, logprobs = reference_choices(model, prompt, plain.tokens)
    assert choices == plain.tokens
    for event, row in zip(plain_events, logprobs):
        assert event.logprob == pytest.approx(row[event.token], abs=1e-4)
        top = np.argsort(-row)[:5]
        assert [t for t, _ in event.top_logprobs] == list(top)
        assert [lp for _, lp in event.top_logprobs] == pytest.approx(list(row[top]), abs=1e-4)


def test_plain_greedy_decode_steps_run_no_choice_and_a_later_penalised_request_starts_clean(engine, model,
                                                                                             prompt_ids):
    prompt = prompt_ids[2]
    resets = []
    choose = engine._choose_tokens
    engine._choose_tokens = lambda logits, requests, reset, **ahead: resets.append(reset) or choose(logits, requests,
                                                                                                     reset, **ahead)
    try:
        plain = [engine.submit(prompt, greedy(12)), engine.submit(prompt_ids[0], greedy(12))]
        run_until_done(engine, plain)
        assert resets and all(resets)  # only the prefill steps chose: the decode steps took each row's argmax
        # Row 0 again: its penalty counts were left behind by the decode steps, and the prefill starts them over.
        penalised = engine.submit(prompt, RequestParams(max_tokens=12, temperature=0.0, frequency_penalty=1.5,
                                                        presence_penalty=0.5))
        run_until_done(engine, [penalised])
    finally:
        del engine._choose_tokens  # the method again
    assert penalised.row == plain[0].row
    for request in plain:
        assert reference_choices(model, request.prompt, request.tokens)[0] == request.tokens
    assert reference_choices(model, prompt, penalised.tokens, presence=0.5, frequency=1.5)[0] == penalised.tokens


def greedy_reference(model, prompt, generated, process):
    """What each generated greedy token should have been: argmax of process(prefix ids, the model's logits there)
    (a transformers LogitsProcessor applied to the full prefix, prompt + generated so far)."""
    import torch

    logits = torch.tensor(np.asarray(model.logits([prompt + generated])[0, len(prompt) - 1:-1], np.float32))
    choices = []
    for t in range(len(generated)):
        ids = torch.tensor([prompt + generated[:t]])
        choices.append(int(torch.argmax(process(ids, logits[t:t + 1].clone())[0])))
    return choices


def test_repetition_penalty_min_tokens_and_logit_bias_match_transformers(engine, model, prompt_ids):
    """Greedy rows side by side, each against transformers' own processor over the model's logits: the repetition
    penalty over prompt + generated tokens, min_tokens' ban of EOS and the stop tokens, logit_bias adding to the
    logits (-100 bans the greedy token, +100 forces one); bad_words' bans."""
    from transformers import MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor

    prompt = prompt_ids[2]  # its greedy continuation repeats itself
    free = engine.submit(prompt, greedy(12))
    run_until_done(engine, [free])
    stop = free.tokens[1]
    repeated = engine.submit(prompt, RequestParams(max_tokens=12, temperature=0.0, repetition_penalty=1.8))
    late_stop = engine.submit(prompt, RequestParams(max_tokens=12, temperature=0.0, min_tokens=6,
                                                    stop_token_ids=(stop,)))
    run_until_done(engine, [repeated, late_stop])
    assert repeated.tokens != free.tokens
    assert greedy_reference(model, prompt, repeated.tokens, RepetitionPenaltyLogitsProcessor(1.8)) == repeated.tokens
    bans = MinNewTokensLengthLogitsProcessor(len(prompt), 6, [*model.config.eos_token_ids, stop])
    assert greedy_reference(model, prompt, late_stop.tokens, bans) == late_stop.tokens
    assert stop not in late_stop.tokens[:6] and len(late_stop.tokens) > 6
    assert late_stop.finish_reason == ("stop" if {stop, *model.config.eos_token_ids} & set(late_stop.tokens)
                                       else "length")
    banned = engine.submit(prompt, RequestParams(max_tokens=12, temperature=0.0, logit_bias=((free.tokens[0], -100),)))
    forced = engine.submit(prompt, RequestParams(max_tokens=4, temperature=0.9, seed=5, logit_bias=((7, 100.0),)))
    run_until_done(engine, [banned, forced])
    assert banned.tokens[0] != free.tokens[0] and free.tokens[0] not in banned.tokens
    assert forced.tokens == [7] * 4
    # vLLM's bad_words: a sequence's last token is banned right after the rest of it.
    pair = engine.submit(prompt, RequestParams(max_tokens=3, temperature=0.0, bad_words=(tuple(free.tokens[:2]),)))
    run_until_done(engine, [pair])
    assert pair.tokens[0] == free.tokens[0] and pair.tokens[1] != free.tokens[1]


@pytest.mark.quick
def test_choice_program_samples_as_transformers_warpers_filter():
    """The token-choice program on random logits (no model): bias, repetition penalty, temperature, top-k and
    min-p as transformers' processors and warpers compute them, then the row's own key's draw, for rows side by
    side in one call; a -inf bias is never chosen."""
    import torch
    from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                              TopKLogitsWarper)

    from jmoe.decode.sampling import SamplingArrays
    from jmoe.serve.programs import make_choose_fn

    vocab, rows = 64, 4
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (rows, vocab)).astype(np.float32)
    seen = np.zeros((rows, vocab), bool)
    seen[:, :8] = True  # the prompts' tokens
    bias = np.zeros((rows, vocab), np.float32)
    bias[:, np.argmax(logits, axis=1)] = -np.inf  # every row's most likely token banned
    bias[1, 9] = 2.5
    settings = [(0.7, 0, 0.1, 1.3), (1.0, 5, 0.0, 1.0), (1.3, 0, 0.3, 0.7), (0.5, 3, 0.05, 2.0)]
    temperature, top_k, min_p, repetition = (np.array(column, dtype) for column, dtype in
                                              zip(zip(*settings), (np.float32, np.int32, np.float32, np.float32)))
    choose = make_choose_fn(False, False, True)
    zeros = np.zeros(rows, np.float32)
    for index in range(20):
        seeds = np.arange(rows, dtype=np.uint32) + 100
        counts = jax.numpy.zeros((rows, vocab), np.int32)
        (tokens, *_), _ = choose(logits, counts, seen, np.arange(rows, dtype=np.int32), np.ones(rows, bool),
                                 SamplingArrays(temperature, top_k, np.ones(rows, np.float32)), zeros, zeros,
                                 repetition, min_p, seeds, np.full(rows, index, np.int32), bias)
        for r, (t, k, p, penalty) in enumerate(settings):
            ids = torch.arange(8)[None]
            scores = torch.tensor(logits[r] + bias[r])[None]
            scores = RepetitionPenaltyLogitsProcessor(penalty)(ids, scores)
            for warper in [TemperatureLogitsWarper(t)] + ([TopKLogitsWarper(k)] if k else []) + \
                    ([MinPLogitsWarper(p)] if p else []):
                scores = warper(ids, scores)
            key = jax.random.fold_in(jax.random.PRNGKey(seeds[r]), index)
            expected = jax.random.categorical(key, jax.numpy.asarray(scores.numpy()), axis=-1)[0]
            assert int(tokens[r]) == int(expected), (index, r)
            assert bias[r, int(tokens[r])] != -np.inf


@pytest.mark.quick
def test_grammar_masks_follow_the_schema_and_end_where_it_does():
    """jmoe.serve.grammar without a model: a schema's matcher allows the tokens of a valid answer one by one and EOS
    only where the value is complete; choices, regexes and Lark grammars compile; what llguidance cannot compile
    is a RequestError naming the field and why."""
    from jmoe.checkpoint.tokenizer import load_tokenizer
    from jmoe.serve.grammar import Grammars

    tokenizer = load_tokenizer(DEFAULT)
    grammars = Grammars(tokenizer, 4096, [0])
    schema = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer"}},
              "required": ["kind", "age"], "additionalProperties": False}
    matcher = grammars.json_schema(schema).matcher()
    answer = tokenizer.encode('{"kind": "dog", "age": 7}', add_special_tokens=False)
    for token in answer:
        allowed = matcher.allowed()
        assert allowed.shape == (4096,) and allowed[token] and not allowed[0]  # no EOS mid-value
        assert matcher.accept(token)
    assert matcher.stopped and matcher.accepting and matcher.allowed()[0]
    assert not grammars.json_schema(schema).matcher().allowed()[tokenizer.encode(" ", add_special_tokens=False)[0]]
    assert grammars.choice(["yes", "no"]).kind == "choice" and grammars.lark('start: "a"+').kind == "grammar"
    assert grammars.regex("[0-9]+").matcher().allowed().any()
    for compile_, param, why in [(lambda: grammars.regex("(", "guided_regex"), "guided_regex", "unclosed group"),
                                 (lambda: grammars.json_schema({"type": "string", "format": "nope"}),
                                  "response_format", "Unknown format"),
                                 (lambda: grammars.grammar("start: undefined_rule"), "structured_outputs.grammar",
                                  "undefined_rule")]:
        with pytest.raises(RequestError, match=why) as error:
            compile_()
        assert error.value.param == param


def test_grammar_rows_and_free_rows_share_a_batch(engine, model, prompt_ids):
    """A JSON-schema row and a regex row beside a free greedy row: the constrained texts follow their grammars (and
    end when the grammar does), the free row's tokens are its tokens alone."""
    from jmoe.serve.grammar import Grammars

    grammars = Grammars(model.tokenizer, model.config.vocab_size, model.config.eos_token_ids)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    alone = engine.submit(prompt_ids[0], greedy(10))
    run_until_done(engine, [alone])
    json_row = engine.submit(prompt_ids[1], RequestParams(max_tokens=40, temperature=0.0,
                                                          constraint=grammars.json_schema(schema)))
    free = engine.submit(prompt_ids[0], greedy(10))
    regex_row = engine.submit(prompt_ids[2], RequestParams(max_tokens=20, temperature=1.0, seed=3,
                                                           constraint=grammars.regex(r"[a-c]{2,5}!")))
    run_until_done(engine, [json_row, free, regex_row])
    assert free.tokens == alone.tokens
    value = json.loads(model.tokenizer.decode(json_row.tokens))
    assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 99 and isinstance(value["ok"], bool)
    assert json_row.finish_reason == "stop" and json_row.grammar_seconds > 0
    assert re.fullmatch(r"[a-c]{2,5}!", model.tokenizer.decode(regex_row.tokens))
    with pytest.raises(RequestError, match="cannot compile") as error:
        grammars.json_schema({"type": "string", "format": "no-such-format"})
    assert error.value.param == "response_format"


def test_stop_strings_stop_tokens_and_eos(engine, model, prompt_ids):
    tokenizer = model.tokenizer
    free = engine.submit(prompt_ids[0], greedy(16))
    run_until_done(engine, [free])
    text = tokenizer.decode(free.tokens)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip()
    by_string = engine.submit(prompt_ids[0], RequestParams(max_tokens=16, temperature=0.0, stop=(stop,)))
    by_token = engine.submit(prompt_ids[0], RequestParams(max_tokens=16, temperature=0.0,
                                                          stop_token_ids=(free.tokens[3],)))
    run_until_done(engine, [by_string, by_token])
    events = list(by_string.events(timeout=0))
    sent = "".join(e.text for e in events)
    assert by_string.finish_reason == "stop" and sent == text[:text.index(stop)]
    assert by_token.finish_reason == "stop" and by_token.tokens == free.tokens[:free.tokens.index(free.tokens[3]) + 1]


def test_cancel_frees_the_row_and_ends_the_stream(engine, prompt_ids):
    request = engine.submit(prompt_ids[0], greedy(100))
    for _ in range(3):
        engine.step()
    assert engine.running() == 1
    request.cancel()
    engine.step()
    assert engine.running() == 0
    events = list(request.events(timeout=0))
    assert events[-1].finish_reason == "cancelled" and 0 < len(request.tokens) < 100


def test_bad_requests_and_a_full_queue(engine, prompt_ids):
    with pytest.raises(RequestError, match="context is 128 tokens") as error:
        engine.submit(prompt_ids[0], greedy(128))
    assert error.value.param == "max_tokens"
    with pytest.raises(jmoe.InputError, match="empty"):
        engine.submit([], greedy(4))
    with pytest.raises(jmoe.InputError, match="outside the vocabulary"):
        engine.submit([5, 10**6], greedy(4))
    with pytest.raises(RequestError, match="temperature must be a number in") as error:
        RequestParams(max_tokens=4, temperature=-1)
    assert error.value.param == "temperature"
    waiting = [engine.submit(prompt_ids[0], greedy(2)) for _ in range(3)]
    with pytest.raises(QueueFullError, match="max_queue 3"):
        engine.submit(prompt_ids[0], greedy(2))
    run_until_done(engine, waiting)


def test_no_program_compiles_after_warm_up(engine, model, prompt_ids):
    """Long prompts (chunked), every occupancy, greedy and sampled rows, logprobs, penalties, biases and a grammar:
    the warm engine compiles nothing (counted by JAX's own compile events, not only the engine's table)."""
    compiled = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *_, **__: compiled.append(name) if name == "/jax/core/compile/backend_compile_duration" else None)
    programs = engine.compiled_programs
    assert programs == engine.program_count  # the count the memory-mapping check projects from
    long_prompt = (prompt_ids[1] * 40)[:100]
    mixes = [[(prompt_ids[0], greedy(3))],
             [(long_prompt, RequestParams(max_tokens=20, temperature=0.7, seed=3, logprobs=2)),
              (prompt_ids[3], RequestParams(max_tokens=5, temperature=0.0, presence_penalty=1.0))],
             [(ids, RequestParams(max_tokens=2 + i, temperature=0.5 * (i % 2), seed=i)) for i, ids in
              enumerate(prompt_ids[:3])]]
    from jmoe.serve.grammar import Grammars

    choice = Grammars(model.tokenizer, model.config.vocab_size, model.config.eos_token_ids).choice(["yes", "no"])
    mixes.append([(prompt_ids[0], RequestParams(max_tokens=4, temperature=0.0, constraint=choice)),
                  (prompt_ids[1], RequestParams(max_tokens=6, temperature=0.8, seed=1, min_p=0.1,
                                                repetition_penalty=1.2, min_tokens=2, logit_bias=((3, -100),)))])
    for mix in mixes:
        requests = [engine.submit(ids, params) for ids, params in mix]
        run_until_done(engine, requests)
    assert engine.compiled_programs == programs
    assert compiled == []


def test_background_thread_serves_while_the_rest_compiles_behind_and_drains_on_stop(model, prompt_ids, caplog):
    """start(compile_behind=True): warm-up compiles the programs of one-row steps first, the step thread serves at
    once while another compiles the rest; a request that needs one not compiled yet (a prompt's later chunks) waits
    for it or compiles it; the tokens are generate's; in the end every program is compiled, each once; stop drains."""
    long_prompt = (prompt_ids[1] * 20)[:40]  # three chunks of 16
    prompts = [*prompt_ids[:3], long_prompt]
    expected = [model.generate(ids, max_new_tokens=6)[0] for ids in prompts]
    two_rows = ServingEngine(model, max_batch=2, context=64)
    first, rest = program_specs(two_rows)
    # the kinds' counts the memory-mapping budget projects from, as the specs list them
    assert collections.Counter(spec.key[0] for spec in first + rest) == +collections.Counter(two_rows.program_counts)
    greedy_choices, sampled_choices = ([("choose", *v, 1) for v in CHOOSE_VARIANTS if v[0] == g] for g in (True, False))
    assert [spec.key for spec in first + rest] == [
        ("prefill", 1, 16, 16), *greedy_choices, ("decode", 64, 1), *sampled_choices, ("mark_prompt",),
        ("copy_row",), ("prefill", 1, 16, 64), *(("choose", *variant, 2) for variant in CHOOSE_VARIANTS),
        ("prefill", 2, 16, 16), ("decode", 64, 2), ("prefill", 2, 16, 64)]
    assert len(first) == 5
    engine = ServingEngine(model, max_batch=1, context=64)  # its programs: those of the first row above
    with caplog.at_level(logging.INFO, logger="jmoe.serve"):
        engine.start(compile_behind=True)
        assert engine.ready and engine.compiled_programs >= len(first)
        requests = [engine.submit(ids, greedy(6)) for ids in prompts]
        deadline = time.monotonic() + 300
        while engine.compile_status()["compiled_programs"] < engine.program_count:
            assert time.monotonic() < deadline and engine.failure is None
            time.sleep(0.2)
        late = engine.submit(prompt_ids[3], greedy(6))
        engine.stop(drain=True, timeout=300)
        assert [tokens_of(r) for r in requests] == expected
        assert tokens_of(late) == model.generate(prompt_ids[3], max_new_tokens=6)[0]
    assert engine.compile_status() == {"compiled_programs": 11, "programs": 11, "compile_seconds_left": 0}
    compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiled ")]
    assert len(compiled) == engine.program_count  # none twice
    assert re.fullmatch(r"compiled 1 of 11 programs \(prefill 1 16 16\), about \d+ s left", compiled[0])
    with pytest.raises(QueueFullError, match="shutting down"):
        engine.submit(prompt_ids[0], greedy(2))


def test_on_a_gpu_one_decode_program_at_the_whole_context_serves_every_step(model, prompt_ids, monkeypatch):
    """Where the attention kernel reads only the columns rows have filled (a GPU), the engine keeps one decode program
    a batch bucket, the whole context's, among the first it compiles; its tokens are generate's (run here on the CPU,
    where that program reads every column)."""
    monkeypatch.setattr(engine_module, "gpu_available", lambda: True)
    engine = ServingEngine(model, max_batch=2, context=512)
    assert engine.visible_buckets == (512,)
    first, rest = program_specs(engine)
    assert ("decode", 512, 1) in [spec.key for spec in first]
    assert [spec.key for spec in first + rest if spec.key[0] == "decode"] == [("decode", 512, 1), ("decode", 512, 2)]
    requests = [engine.submit(ids, greedy(5)) for ids in prompt_ids[:2]]
    run_until_done(engine, requests)
    assert [tokens_of(r) for r in requests] == [model.generate(ids, max_new_tokens=5)[0] for ids in prompt_ids[:2]]


def test_warm_up_runs_every_program_but_leaves_the_expert_cache_as_it_was(prompt_ids, default_two_layers):
    """warm_up runs each program once on padding entries (router prefetch copies into slots even then);
    the slots, tables and counts the manager knows come back exactly, its statistics see no warm-up step, and
    the first request's tokens are generate's."""
    model = jmoe.load(default_two_layers, cache=4, prefetch=1, progress=False)
    expected = model.generate(prompt_ids[0], max_new_tokens=6)[0]  # fills the cache
    before, stats = jax.device_get(model.engine.state), model.stats()
    engine = ServingEngine(model, max_batch=1, context=64)  # the fewest programs: the restore is the same
    engine.warm_up()
    after = jax.device_get(model.engine.state)
    assert jax.tree.structure(after) == jax.tree.structure(before)
    for old, new in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(new, old)
    assert model.stats() == stats
    assert not np.asarray(jax.device_get(engine.counts)).any()
    request = engine.submit(prompt_ids[0], greedy(6))
    run_until_done(engine, [request])
    assert tokens_of(request) == expected


def test_warm_up_stops_with_an_error_before_its_programs_pass_the_memory_mapping_limit(model, monkeypatch):
    """A compiled XLA:CPU program holds hundreds of memory mappings, and a process that passes Linux's
    vm.max_map_count crashes inside LLVM. warm_up measures what a program takes and refuses the next compile when
    the programs still to come would pass the limit (after a garbage collection has freed what dead programs held),
    saying what to change. Here the limit is always 1,000 mappings above what the process holds: no two programs fit."""
    real = mappings.held_and_limit
    assert real() is not None  # Linux: /proc has the counts
    monkeypatch.setattr(mappings, "held_and_limit", lambda: (real()[0], real()[0] + 1000))
    engine = ServingEngine(model, max_batch=1, context=64)
    with pytest.raises(InsufficientMemoryError, match=r"vm\.max_map_count.*--max-batch 1, --context 64: 11 programs"):
        engine.warm_up()
    assert engine.compiled_programs == 1
    assert engine._programs.budget.per_kind["prefill"] > 100  # the first program's own mappings, measured


def test_the_mapping_budget_counts_each_kind_of_program_at_its_own_size(monkeypatch):
    """Token-choice programs hold a tenth of a decode program's mappings: the budget projects the programs left at
    the most each kind took (a kind not seen yet at the most any took), not every one at the largest, so a server
    whose programs fit is not refused. Simulated: each compile adds its kind's mappings to the process's count."""
    held = {"count": 1_000}
    monkeypatch.setattr(mappings, "held_and_limit", lambda: (held["count"], 20_000))  # 19,000 usable
    budget = mappings.MappingBudget("fewer programs")
    for kind, size in (("decode", 600), ("choose", 30)):
        with budget.compiling(kind, {"decode": 1, "choose": 1}):
            held["count"] += size
    assert budget.per_kind == {"decode": 600, "choose": 30}
    # 1,630 held: 10 decodes and 100 choices take 9,000 more mappings (fits); at the largest, 66,000 would not.
    assert budget.needed({"decode": 10, "choose": 100}) == 9_000
    with budget.compiling("decode", {"decode": 10, "choose": 100}):
        held["count"] += 600
    assert budget.needed({"prefill": 2}) == 1_200  # not seen yet: at the largest
    with pytest.raises(InsufficientMemoryError, match=r"about 17,400 memory mappings \(a program of each kind on "
                                                      r"this backend: choose 30, decode 600\).*fewer programs"):
        with budget.compiling("decode", {"decode": 9, "prefill": 20}):  # 2,230 held
            pass
