"""A request as the serving engine holds it (`Request`: its prompt, parameters, grammar matcher, tokens so far and
the queue its events go through) and those events (`TokenEvent`)."""

from __future__ import annotations

import queue
import threading
import time
import uuid
from typing import Callable, Iterator, NamedTuple

from jmoe.serve.choice import static_bias
from jmoe.serve.params import RequestParams
from jmoe.serve.text import StopText


class TokenEvent(NamedTuple):
    """One generated token of a request, or (token None) the end of a request that produced no new token."""

    token: int | None
    text: str  # text to send now (held back while a stop string may still match; the stop itself never)
    logprob: float | None  # the token's log-probability under the model, when the request asked for logprobs
    top_logprobs: tuple[tuple[int, float], ...] | None  # (token id, log-probability), most likely first
    finish_reason: str | None  # None while generating; then "stop", "length", "cancelled" or "error"


class Request:
    """A submitted request: read its tokens with `events()` (or the `on_event` callback given to submit)."""

    def __init__(self, prompt: list[int], params: RequestParams, seed: int,
                 on_event: Callable[[TokenEvent], None] | None, stop_text: StopText, vocab_size: int):
        self.id = uuid.uuid4().hex
        self.prompt = prompt
        self.params = params
        self.seed = seed
        # The bias every step of the request adds (logit_bias, allowed_token_ids), None when it has none.
        self.static_bias = static_bias(params, vocab_size)
        # A grammar's matcher (jmoe.serve.grammar.Matcher), advanced with every token, asked for each step's mask.
        self.matcher = None if params.constraint is None else params.constraint.matcher()
        self.grammar_seconds = 0.0  # host time spent on the grammar's masks
        self.tokens: list[int] = []  # generated so far
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.submitted = time.monotonic()
        self.first_token_at: float | None = None
        self.token_times: list[float] = []
        self._text = stop_text
        self._on_event = on_event
        self._queue: queue.Queue[TokenEvent] = queue.Queue()
        self._cancelled = threading.Event()
        self.row: int | None = None
        self.prefilled = 0  # prompt tokens already in the row's cache
        self.cached_tokens = 0  # of those, the prefix reused from what a row held (jmoe.serve.prefixes)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def cancel(self) -> None:
        """Stop generating: the row is freed at the next step and the last event says "cancelled"."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def events(self, timeout: float | None = None) -> Iterator[TokenEvent]:
        """Events as they come, until the one with a finish_reason (queue.Empty after `timeout` seconds of
        silence)."""
        while True:
            event = self._queue.get(timeout=timeout)
            yield event
            if event.finish_reason is not None:
                return

    def _emit(self, event: TokenEvent) -> None:
        self._queue.put(event)
        if self._on_event is not None:
            self._on_event(event)
