"""Continuous batching over one loaded Model: requests join and leave a fixed batch of rows between steps.

`ServingEngine(model, max_batch=8)` owns a KV cache of `max_batch` rows x `context` columns. A submitted
request waits in a bounded queue, takes a free row, has its prompt prefilled in chunks (new requests whose
prompts fall in one chunk bucket share a prefill step), then decodes one token per step beside whatever else
is running, and leaves on EOS, a stop token or string, `max_tokens` or cancellation; its row is free for the
next request at the following step. Every step goes through the model's expert engine, so the expert cache, policies,
prefetch, miss modes, quantized experts and `Model.stats()` serve the batch as they serve `generate`: a
decode step needs the union of its rows' experts and reads each once.

Steps run on one background thread (`start`); `submit` and `cancel` may be called from any thread. Shapes are
bucketed, so the programs are a known set: `warm_up` compiles every one (then traffic never compiles:
`compiled_programs` counts them), or with `first_only` those that requests of one row, short prompts and short
contexts need, and `start(compile_behind=True)` compiles the rest on a thread of its own while requests are served
(jmoe.serve.compiling: none twice, progress logged).
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jmoe.api import Model, check_finite_layers
from jmoe.decode.generation import check_token_ids
from jmoe.kernels.target import gpu_available
from jmoe.model import empty_kv_cache
from jmoe.serve.choice import choice_arrays, grammar_complete, has_bias
from jmoe.serve.chunks import chunk_buckets, chunk_for, later_chunks, streaming_chunk
from jmoe.serve.compiling import ProgramCache, shapes_of
from jmoe.serve.decoding import DecodeStep, DecodeSteps
from jmoe.serve.mappings import MappingBudget
from jmoe.serve.params import QueueFullError, RequestError, RequestParams
from jmoe.serve.prefixes import RowPrefixes
from jmoe.serve.program_set import program_specs
from jmoe.serve.programs import make_choose_fn, make_copy_row_fn, make_decode_fn, make_mark_prompt_fn, make_prefill_fn
from jmoe.serve.requests import Request, TokenEvent
from jmoe.serve.text import StopText

# The fewest cache columns a decode step's attention reads (then powers of two up to the context).
MIN_VISIBLE = 64
# The token-choice program's static variants (greedy, logprobs, biased): a step with a biased row runs one with
# logprobs, whose other rows' tokens are what a narrower variant would choose (two more programs per entry bucket).
# The bias is a variant rather than always passed: building and sending a [8, V] zero array took a greedy choice
# from 5.9 to 7.5 ms at V = 151,936 on two CPU cores (0.31 to 0.36 ms at 4,096), and plain greedy steps run none.
CHOOSE_VARIANTS = tuple((g, lp, False) for g in (True, False) for lp in (False, True)) + ((True, True, True),
                                                                                        (False, True, True))


def decode_visible_buckets(context: int) -> tuple[int, ...]:
    """The cache columns each decode program's attention reads, one program each. XLA's attention (a CPU's) reads
    every column it is given, so decodes are compiled for powers of two from MIN_VISIBLE, a step taking the least
    that holds its rows; a GPU's (jmoe.kernels.decode_attention) reads only the columns its rows have filled, so one
    program, the whole context's, serves every step there: a server compiles one decode program a batch bucket, not
    one a length too."""
    if gpu_available():
        return (context,)
    return tuple(sorted({min(max(MIN_VISIBLE, 1 << i), context) for i in range(context.bit_length() + 1)}))


class ServingEngine(DecodeSteps):
    """A fixed batch of decode rows over `model`; see the module docstring.

    max_batch: rows decoded together; max_queue: requests that may wait for a row (submit raises
    QueueFullError beyond it); context: cache columns per row (prompt + generated tokens), at most the
    model's max_position_embeddings; prefill_chunk: the longest prefill chunk (default: jmoe.serve.chunks'
    choice, 256 tokens unless the model's experts stream per chunk); prefix_reuse: a request skips prefilling the
    longest prefix of its prompt that a row holds (jmoe.serve.prefixes); observer: optional object with
    `step(kind, seconds, rows, routing)` (routing:
    the step's expert ids, NumPy int [L_moe, entries, T, k], -1 = none) and `finished(request)` methods, called on
    the engine's thread (metrics, logs); run_ahead: decode steps dispatched before the last is read back where they
    can be (jmoe.serve.decoding); False waits for each (the same tokens; benchmarks compare the two).
    """

    def __init__(self, model: Model, max_batch: int = 8, max_queue: int = 64, context: int | None = None,
                 observer=None, prefix_reuse: bool = True, prefill_chunk: int | None = None, run_ahead: bool = True):
        cfg = model.config
        if not isinstance(max_batch, int) or max_batch < 1:
            raise RequestError("max_batch", f"max_batch must be a whole number >= 1, found {max_batch!r}")
        if not isinstance(max_queue, int) or max_queue < 0:
            raise RequestError("max_queue", f"max_queue must be a whole number >= 0, found {max_queue!r}")
        context = min(4096, cfg.max_position_embeddings) if context is None else context
        if not isinstance(context, int) or not 2 <= context <= cfg.max_position_embeddings:
            raise RequestError("context", f"context must be a whole number in [2, {cfg.max_position_embeddings}] "
                                          f"(the model's max_position_embeddings), found {context!r}")
        if prefill_chunk is not None and not (isinstance(prefill_chunk, int) and 1 <= prefill_chunk <= context):
            raise RequestError("prefill_chunk", f"prefill_chunk must be a whole number in [1, {context}] (the "
                                                f"context), found {prefill_chunk!r}")
        self.model, self.config = model, cfg
        self.max_batch, self.max_queue, self.context = max_batch, max_queue, context
        self.observer = observer
        self.run_ahead = run_ahead and model.engine.runs_ahead
        self.eos = frozenset(cfg.eos_token_ids)
        # Only a step of first chunks (every entry from column 0, visible = chunk) takes attention's
        # prompt-from-column-0 path; a chunk as long as the context is only ever a first one (chunks.chunk_for).
        longest = streaming_chunk(model, context) if prefill_chunk is None else prefill_chunk
        self.chunks = chunk_buckets(context, longest)
        self.later_chunks = later_chunks(self.chunks, context)
        self.entry_buckets = tuple(sorted({min(1 << i, max_batch) for i in range(max_batch.bit_length() + 1)}))
        self.visible_buckets = decode_visible_buckets(context)
        # A step of first chunks reads only its own columns; a step that continues a long prompt reads them all.
        self.prefill_programs = {v: make_prefill_fn(model, v) for v in (*self.chunks, context)}
        self.decode_programs = {v: make_decode_fn(model, v) for v in self.visible_buckets}
        self.choose_programs = {variant: make_choose_fn(*variant) for variant in CHOOSE_VARIANTS}
        self.mark_prompt_program = make_mark_prompt_fn()
        self.copy_row_program = make_copy_row_fn()
        self.prefixes = RowPrefixes(max_batch) if prefix_reuse else None
        self._programs = ProgramCache(self.program_counts, MappingBudget(
            f"lower max_batch or context (--max-batch {max_batch}, --context {context}: "
            f"{self.program_count} programs)"))
        self._stop_compiling = threading.Event()
        self.kv_cache = empty_kv_cache(cfg, max_batch, context, model.kv_dtype)
        self.counts = jnp.zeros((max_batch, cfg.vocab_size), jnp.int32)
        self.seen = jnp.zeros((max_batch, cfg.vocab_size), bool)  # prompt tokens, for repetition penalties
        self._shapes = shapes_of(self.engine_arrays(abstract=False))  # the same for the engine's lifetime
        self._rows: list[Request | None] = [None] * max_batch
        self._waiting: deque[Request] = deque()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._in_flight: DecodeStep | None = None  # a decode step dispatched and not yet read back
        self._stopping = False
        self._seeds = random.Random()
        self.ready = False  # every program compiled
        self.failure: BaseException | None = None  # what stopped the step loop, if anything did

    # ---- from any thread ------------------------------------------------------------------------------
    def submit(self, prompt: list[int], params: RequestParams,
               on_event: Callable[[TokenEvent], None] | None = None) -> Request:
        """Queue a request; its events come through `Request.events()` and `on_event` (called on the
        engine's thread: keep it short). Raises RequestError for a bad prompt or one that cannot fit the
        context with max_tokens, QueueFullError when max_queue requests already wait."""
        check_token_ids(self.config, [prompt], "prompt")
        if len(prompt) + params.max_tokens > self.context:
            raise RequestError("max_tokens", f"this server's context is {self.context} tokens, but the prompt has "
                                             f"{len(prompt)} and max_tokens asks for {params.max_tokens} more; "
                                             f"shorten the prompt or lower max_tokens")
        if params.stop and self.model.tokenizer is None:
            raise RequestError("stop", "stop strings need the model's tokenizer.json; use stop_token_ids")
        params.check_vocabulary(self.config.vocab_size)
        with self._lock:
            if self._stopping:
                raise QueueFullError("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError(f"{len(self._waiting)} requests are already waiting (max_queue "
                                     f"{self.max_queue}); retry later")
            seed = self._seeds.getrandbits(32) if params.seed is None else params.seed
            text = StopText(self.model.tokenizer, params.stop, params.include_stop_str_in_output,
                            params.skip_special_tokens)
            request = Request(list(prompt), params, seed, on_event, text, self.config.vocab_size)
            self._waiting.append(request)
            self._lock.notify()
        return request

    def running(self) -> int:
        return sum(r is not None for r in self._rows)

    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def compiled_programs(self) -> int:
        return len(self._programs)

    def start(self, warm_up: bool = True, compile_behind: bool = False) -> None:
        """Compile every program (unless `warm_up` is False: then shapes compile as they first occur; with
        `compile_behind`, only the first ones, and the rest on a thread of its own while steps run), then run steps
        on a background thread until `stop`."""
        if warm_up:
            self.warm_up(first_only=compile_behind)
        if compile_behind:
            self._programs.compile_behind(sum(program_specs(self), []), self._stop_compiling)
        self._thread = threading.Thread(target=self._loop, name="jmoe-serving", daemon=True)
        self._thread.start()

    def compile_status(self) -> dict:
        """Programs compiled, of how many, and about how many seconds the rest take (the server's /ready)."""
        return self._programs.status()

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; with `drain`, finish every admitted and waiting request first, else cancel
        them. Returns when the step thread has ended."""
        self._stop_compiling.set()
        with self._lock:
            self._stopping = True
            if not drain:
                for request in [*self._waiting, *filter(None, self._rows)]:
                    request.cancel()
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- compiling ------------------------------------------------------------------------------------
    def warm_up(self, first_only: bool = False) -> None:
        """Compile, for every entry count (a power of two up to max_batch): the prefill programs for every chunk
        bucket (first chunks, which read only their own columns, and later ones, which read the context), the token
        choice (greedy or sampled, with or without logprobs) and the decode program for every visible length (a
        decode step runs the fewest first rows that hold every generating request); with `first_only`, those a short
        one-row greedy request needs (`jmoe.serve.program_set`). Each
        program also runs once, on padding entries: on XLA:CPU a program's first run cost 30-90 ms more than its
        next (the default model at context 512), which the first requests would otherwise wait for (routed tokens
        instead of padding warmed no better, measured). Those runs go around the manager, so the expert cache's
        slots, tables and counts are put back as they were (router prefetch copies even on padding), and the KV
        cache and penalty counts start empty."""
        engine = self.model.engine
        leaves, treedef = jax.tree.flatten(engine.state)
        saved = jax.device_get(leaves)
        where = [a.sharding if isinstance(a, jax.Array) else None for a in leaves]  # the manager's tables: NumPy
        first, rest = program_specs(self)
        for spec in first if first_only else first + rest:
            args = spec.args(False)
            outputs = self._program(spec.key, spec.fn, args)(*args)
            if spec.key[0] == "choose":
                self.counts = outputs[1]
            elif spec.key[0] == "mark_prompt":
                self.seen = outputs
            elif spec.key[0] == "copy_row":
                self.kv_cache = outputs
            else:
                self.kv_cache, engine.state = outputs[2:4]
        engine.state = treedef.unflatten([a if sharding is None else jax.device_put(a, sharding)
                                          for a, sharding in zip(saved, where)])
        self.kv_cache = empty_kv_cache(self.config, self.max_batch, self.context, self.model.kv_dtype)
        self.counts = jnp.zeros_like(self.counts)
        self.seen = jnp.zeros_like(self.seen)
        if self.prefixes is not None:
            self.prefixes.forget_all()
        self.ready = True

    @property
    def program_counts(self) -> dict[str, int]:
        """The programs warm_up compiles, by kind (the first item of their keys, jmoe.serve.program_set): per entry
        bucket, prefill (each chunk bucket, first or later chunks), token choice (each variant) and decode (each
        visible bucket); the one that marks a prompt's tokens and, with prefix reuse, the one that copies a row."""
        entries = len(self.entry_buckets)
        return {"prefill": entries * (len(self.chunks) + len(self.later_chunks)),
                "choose": entries * len(self.choose_programs), "decode": entries * len(self.visible_buckets),
                "mark_prompt": 1, "copy_row": int(self.prefixes is not None)}

    @property
    def program_count(self) -> int:
        return sum(self.program_counts.values())

    def _program(self, key: tuple, fn, args) -> jax.stages.Compiled:
        return self._programs.get(key, fn, args)

    # ---- the step loop (engine thread) ----------------------------------------------------------------
    def step(self) -> bool:
        """One scheduling round: drop cancelled requests, give free rows to waiting ones, run the prefill steps of
        the unfinished prompts (one per chunk bucket) and a decode step if any row is generating. The decode step of a
        round that did nothing else is left in flight: the next round reads it back after dispatching the step after
        it on its tokens, where that step needs nothing from the host (`_decode_ahead`), and is then a decode step
        alone. False when there was nothing to do. The background thread calls it in a loop; call it yourself only
        when not started."""
        if self._in_flight is not None:
            finished = self._in_flight
            self._in_flight = self._decode_ahead(finished)
            self._finish_decode(finished)
            if self._in_flight is not None:
                return True
        with self._lock:
            self._release_cancelled()
            admitted, copies = self._admit()
        for source, destination in copies:  # in order: a later copy may read what an earlier one wrote
            args = (self.kv_cache, np.int32(source), np.int32(destination))
            self.kv_cache = self._program(("copy_row",), self.copy_row_program, args)(*args)
        for request in admitted:
            if request.params.repetition_penalty != 1.0:  # its penalty reads the prompt's tokens
                args = self.mark_args(request.row, np.isin(np.arange(self.config.vocab_size), request.prompt))
                self.seen = self._program(("mark_prompt",), self.mark_prompt_program, args)(*args)
        prefilling = [r for r in self._rows if r is not None and r.prefilled < len(r.prompt)]
        for batch in self._prefill_batches(prefilling):
            self._prefill_step(batch)
        generating = any(r is not None and r.prefilled == len(r.prompt) for r in self._rows)
        if generating:
            step = self._decode_step()
            if self.run_ahead and not admitted and not prefilling:
                self._in_flight = step
            else:
                self._finish_decode(step)
        return bool(prefilling) or generating

    def _loop(self) -> None:
        try:
            while True:
                if self.step():
                    continue
                with self._lock:
                    if self._waiting:
                        continue
                    if self._stopping and not any(self._rows):
                        return
                    self._lock.wait(timeout=0.5)
        except BaseException as error:  # a broken step fails every request instead of hanging them
            self.failure = error
            with self._lock:
                for request in [*self._waiting, *filter(None, self._rows)]:
                    request.error = error
                    self._finish(request, "error")
                self._waiting.clear()
                self._stopping = True
            raise

    def _release_cancelled(self) -> None:
        for request in [r for r in self._waiting if r.cancelled]:
            self._waiting.remove(request)
            self._finish(request, "cancelled")
        for request in filter(None, self._rows):
            if request.cancelled:
                self._finish(request, "cancelled")

    def _admit(self) -> tuple[list[Request], list[tuple[int, int]]]:
        """Waiting requests into free rows, first come first served: the lowest free row, or with prefix reuse the
        row chosen for the prefix it holds (a request whose prefix a row is still prefilling waits for it). Returns
        them and the row copies to make before the next step."""
        admitted, copies = [], []
        free = [row for row, occupant in enumerate(self._rows) if occupant is None]
        for request in list(self._waiting):
            if not free:
                break
            if self.prefixes is not None and self.prefixes.should_wait(request.prompt, self._rows):
                continue
            self._waiting.remove(request)
            if self.prefixes is None:
                request.row = free[0]
            else:
                request.row, request.prefilled, moves = self.prefixes.admit(request.prompt, free, self._rows)
                request.cached_tokens = request.prefilled
                copies += moves
            free.remove(request.row)
            self._rows[request.row] = request
            admitted.append(request)
        return admitted, copies

    def _finish(self, request: Request, reason: str, token: int | None = None, text: str = "",
                logprob: float | None = None, top=None) -> None:
        """End `request` with `reason` (its last token, if the end came with one): free its row, send the text
        still held back, tell the observer."""
        if request.done:
            return
        request.finish_reason = reason
        if request.row is not None and self._rows[request.row] is request:
            self._rows[request.row] = None
            if self.prefixes is not None and reason != "error":
                self.prefixes.release(request.row, request)
        if reason != "error":
            text += request._text.delta(request.tokens, final=True)
        request._emit(TokenEvent(token, text, logprob, top, reason))
        if self.observer is not None:
            self.observer.finished(request)

    def _chunk_for(self, request: Request) -> int:
        """The chunk bucket of `request`'s next piece: the smallest that holds the rest of its prompt, else the largest
        (so a prompt's pieces start at the same columns whatever it shares a step with)."""
        return chunk_for(self.chunks, len(request.prompt) - request.prefilled, request.prefilled > 0, self.context)

    def _prefill_batches(self, prefilling: list[Request]) -> list[list[Request]]:
        """A round's prefill steps: every unfinished prompt's next piece, one step per chunk bucket, the smallest first.
        Each prompt is padded to its own bucket only (eight prompts of 88-191 tokens: 117 ms padded to 256 in one step,
        56 + 60 ms as a 128 and a 256 step), and the short ones send their first token before the long ones are
        done, while the round, which decoding rows wait for, costs no more."""
        groups: dict[int, list[Request]] = {}
        for request in prefilling:
            groups.setdefault(self._chunk_for(request), []).append(request)
        return [groups[chunk][:self.entry_buckets[-1]] for chunk in sorted(groups)]

    def _prefill_step(self, batch: list[Request]) -> None:
        """Prefill the next piece of each request of `batch` (one chunk bucket, at most the largest entry bucket)."""
        entries = next(b for b in self.entry_buckets if b >= len(batch))
        chunk = self._chunk_for(batch[0])
        tokens = np.zeros((entries, chunk), np.int32)
        rows = np.full(entries, self.max_batch, np.int32)
        start = np.zeros(entries, np.int32)
        valid = np.zeros(entries, np.int32)
        for i, request in enumerate(batch):
            piece = request.prompt[request.prefilled:request.prefilled + chunk]
            tokens[i, :len(piece)] = piece
            rows[i], start[i], valid[i] = request.row, request.prefilled, len(piece)
        # First chunks (every entry from column 0) see only the chunk's columns: attention over the whole context
        # was half of a short prompt's prefill at context 1024.
        visible = chunk if not start.any() else self.context
        began = time.perf_counter()
        args = self.prefill_args(tokens, rows, start, valid)
        (logits, finite), routing, self.kv_cache, self.model.engine.state, readback = self._program(
            ("prefill", entries, chunk, visible), self.prefill_programs[visible], args)(*args)
        for request, n in zip(batch, valid):
            request.prefilled += int(n)
        # The first token of every entry whose prompt is complete, in the step's one device-to-host read.
        complete = [r if r.prefilled == len(r.prompt) else None for r in batch]
        choice = self._choose_tokens(logits, complete + [None] * (entries - len(batch)), reset=True)
        chosen, finite, routing = self.model.finish_step(readback, routing, (choice, finite, routing))
        check_finite_layers(finite, "prefill step")
        self._observe("prefill", began, len(batch), routing)
        for i, request in enumerate(complete):
            if request is not None:
                self._accept(request, chosen, i)

    def _observe(self, kind: str, began: float, rows: int, routing) -> None:
        if self.observer is not None:
            self.observer.step(kind, time.perf_counter() - began, rows, routing)

    def _choose_tokens(self, logits, requests: list[Request | None], reset: bool, ahead: int = 0):
        """The next token of each entry of `logits` [P, V] (requests: P entries, None = padding; `ahead`: as
        choice_arrays takes it). Called once the step that makes `logits` is dispatched: the grammars' masks are
        computed while the device runs it."""
        greedy = all(r is None or r.params.greedy for r in requests)
        biased = any(r is not None and has_bias(r) for r in requests)
        variant = (greedy, True, True) if biased else \
            (greedy, any(r is not None and r.params.logprobs is not None for r in requests), False)
        args = self.choose_args(logits, requests, reset, biased, ahead=ahead)
        program = self._program(("choose", *variant, len(requests)), self.choose_programs[variant], args)
        choice, self.counts = program(*args)
        return choice

    def _accept(self, request: Request, chosen, entry: int) -> None:
        """Hand `request` its new token (entry `entry` of the chosen tokens) and end it if a stop is met."""
        tokens, token_logprobs, top_ids, top_logprobs = chosen
        token = int(tokens[entry])
        now = time.monotonic()
        request.first_token_at = request.first_token_at or now
        request.token_times.append(now)
        request.tokens.append(token)
        params = request.params
        logprob = top = None
        if params.logprobs is not None:
            logprob = float(token_logprobs[entry])
            top = tuple(zip(map(int, top_ids[entry, :params.logprobs]),
                            map(float, top_logprobs[entry, :params.logprobs])))
        text = request._text.delta(request.tokens, may_stop=len(request.tokens) > params.min_tokens)
        reason = None
        if request._text.stopped or token in params.stop_token_ids or (token in self.eos and not params.ignore_eos) \
                or grammar_complete(request, token):
            reason = "stop"
        elif len(request.tokens) >= params.max_tokens:
            reason = "length"
        if reason is None:
            request._emit(TokenEvent(token, text, logprob, top, None))
        else:
            self._finish(request, reason, token, text, logprob, top)

    # ---- program arguments: NumPy arrays, which a compiled program takes in one transfer (cheaper than a
    # jnp.asarray each, which dispatches one small program per array); `abstract`: the engine's own arrays as shapes
    # (a program compiled behind the steps, which donate those arrays meanwhile)
    def engine_arrays(self, abstract: bool) -> tuple:
        """(parameters, expert engine state, KV cache, penalty counts, prompt marks): live, or their shapes."""
        if abstract:
            return self._shapes
        return self.model.step_params, self.model.engine.state, self.kv_cache, self.counts, self.seen

    def prefill_args(self, tokens, rows, start, valid, abstract: bool = False) -> tuple:
        params, state, kv_cache, _, _ = self.engine_arrays(abstract)
        return (params, state, kv_cache, np.asarray(tokens, np.int32), np.asarray(rows, np.int32),
                np.asarray(start, np.int32), np.asarray(valid, np.int32))

    def decode_args(self, tokens, positions, active, abstract: bool = False) -> tuple:
        params, state, kv_cache, _, _ = self.engine_arrays(abstract)
        return params, state, kv_cache, tokens, positions, active

    def choose_args(self, logits, requests: list[Request | None], reset: bool, biased: bool = False,
                    abstract: bool = False, ahead: int = 0) -> tuple:
        arrays, grammar_seconds = choice_arrays(requests, self.max_batch, self.config.vocab_size, self.eos, biased,
                                                ahead)
        constrained = sum(r is not None and r.matcher is not None for r in requests)
        if constrained and self.observer is not None and hasattr(self.observer, "grammar"):
            self.observer.grammar(grammar_seconds, constrained)
        _, _, _, counts, seen = self.engine_arrays(abstract)
        return (logits, counts, seen, arrays.rows, np.full(len(requests), reset), arrays.sampling,
                arrays.presence, arrays.frequency, arrays.repetition, arrays.min_p, arrays.seeds, arrays.indices,
                arrays.bias)

    def mark_args(self, row: int, mask: np.ndarray, abstract: bool = False) -> tuple:
        return self.engine_arrays(abstract)[4], np.int32(row), mask
