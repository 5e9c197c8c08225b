"""OpenAI's completion and chat completion requests -> engine requests (prompt ids + RequestParams), and
the engine's events -> OpenAI's responses and stream chunks.

Bodies are checked by pydantic in strict mode: a wrong type is an error, never coerced ("5" is not 5).
Unknown fields are rejected (a typo such as `max_token` must not be silently ignored, and OpenAI features
jmoe lacks, such as `tools` or `logit_bias`, must not silently change nothing); `user` is accepted and
ignored, as it changes no output. Fields left out take the checkpoint's generation_config.json defaults
(temperature, top_p, top_k), then OpenAI's. A completion `prompt` may be a list of several prompts: each
gets `n` choices, numbered prompt-major (choice index = prompt index * n + j), all generated together.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Callable, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict

from jmoe.checkpoint.tokenizer import TextTokenizer
from jmoe.serve.chat import ChatTemplate
from jmoe.serve.engine import Request, TokenEvent
from jmoe.serve.params import MAX_TOP_LOGPROBS, SEED_LIMIT, RequestError, RequestParams

MAX_N = 128  # OpenAI's limit on choices per request


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class GenerationBody(BaseModel):
    """The fields completions and chat completions share."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # not OpenAI's (vLLM's): 0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False  # not OpenAI's (vLLM's): generate past the end-of-sequence token
    user: str | None = None  # accepted, unused


class CompletionBody(GenerationBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # the legacy API's top alternatives per token; jmoe allows up to 20, not 5


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatBody(GenerationBody):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class Served(NamedTuple):
    """What the API needs to know of the loaded model."""

    tokenizer: TextTokenizer | None
    context: int  # cache columns per request: prompt + completion
    capacity: int  # engine requests that may be running or waiting at once
    chat: ChatTemplate | None
    defaults: dict  # generation_config.json's sampling defaults (RequestParams fields)


class Generation(NamedTuple):
    """One HTTP request's engine requests: (prompt ids, params) per choice, in choice order."""

    choices: list[tuple[list[int], RequestParams]]
    prompt_tokens: int  # each prompt counted once, however many choices share it
    stream: bool
    include_usage: bool


def completion_generation(body: CompletionBody, served: Served) -> Generation:
    prompts = _completion_prompts(body.prompt, served.tokenizer)
    return _generation(body, prompts, served, "prompt", body.max_tokens, "max_tokens",
                       _whole_in("logprobs", body.logprobs, 0, MAX_TOP_LOGPROBS))


def chat_generation(body: ChatBody, served: Served) -> Generation:
    if served.chat is None:
        raise RequestError("messages", "this model has no chat template (no chat_template.jinja in its directory "
                                       "and no chat_template in tokenizer_config.json); use /v1/completions with "
                                       "a prompt instead")
    if served.tokenizer is None:
        raise RequestError("messages", "chat needs the model's tokenizer.json; use /v1/completions with token ids")
    if not body.messages:
        raise RequestError("messages", "messages is empty; give at least one message")
    text = served.chat.render([_message_dict(m) for m in body.messages])
    prompt = served.tokenizer.encode(text, add_special_tokens=False)  # the template writes any BOS itself
    if body.top_logprobs is not None and not body.logprobs:
        raise RequestError("top_logprobs", "top_logprobs needs logprobs: true")
    logprobs = _whole_in("top_logprobs", body.top_logprobs or 0, 0, MAX_TOP_LOGPROBS) if body.logprobs else None
    limit_name = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
    limit = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    return _generation(body, [prompt], served, "messages", limit, limit_name, logprobs)


def _generation(body: GenerationBody, prompts: list[list[int]], served: Served, prompt_name: str,
                max_tokens: int | None, max_tokens_name: str, logprobs: int | None) -> Generation:
    n = _whole_in("n", body.n, 1, MAX_N)
    if n * len(prompts) > served.capacity:
        raise RequestError("n", f"this request asks for {n * len(prompts)} generations ({len(prompts)} prompts x n "
                                f"{n}), more than this server holds at once ({served.capacity}: --max-batch + "
                                f"--max-queue); send fewer prompts or a smaller n")
    if body.stream_options is not None and not body.stream:
        raise RequestError("stream_options", "stream_options is only allowed with stream: true")
    choices = []
    for p, prompt in enumerate(prompts):
        room = served.context - len(prompt)
        if room < 1:
            raise RequestError(prompt_name, f"the prompt has {len(prompt)} tokens but this server's context is "
                                            f"{served.context} (prompt + completion); shorten the prompt")
        if max_tokens is not None and not 1 <= max_tokens <= room:
            raise RequestError(max_tokens_name, f"{max_tokens_name} must be in [1, {room}] for this prompt of "
                                                f"{len(prompt)} tokens (this server's context is {served.context}), "
                                                f"found {max_tokens}; lower it or shorten the prompt")
        params = _params(body, room if max_tokens is None else max_tokens, logprobs, served)
        for j in range(n):
            seed = None if body.seed is None else (body.seed + p * n + j) % SEED_LIMIT
            choices.append((prompt, dataclasses.replace(params, seed=seed)))
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return Generation(choices, sum(map(len, prompts)), body.stream, include_usage)


def _params(body: GenerationBody, max_tokens: int, logprobs: int | None, served: Served) -> RequestParams:
    given = {name: getattr(body, name) for name in ("temperature", "top_p", "top_k") if getattr(body, name) is not None}
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return RequestParams(max_tokens=max_tokens, **{**served.defaults, **given}, seed=body.seed,
                         presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty, stop=stop,
                         logprobs=logprobs, ignore_eos=body.ignore_eos)


def _completion_prompts(prompt, tokenizer: TextTokenizer | None) -> list[list[int]]:
    """The token ids of each prompt of a completion request."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise RequestError("prompt", "prompt is an empty list; give a string, token ids, or a list of them")
    if isinstance(prompt[0], str) and tokenizer is None:
        raise RequestError("prompt", "this model has no tokenizer.json, so it takes token ids only")
    ids = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]
    empty = [i for i, p in enumerate(ids) if not p]
    if empty:
        raise RequestError("prompt", f"prompt {empty[0]} is empty (no tokens); give some text or token ids")
    return ids


def _message_dict(message: Message) -> dict:
    """A message as the template sees it: list content flattened to its text, absent fields left out."""
    content = message.content
    if isinstance(content, list):
        content = "".join(part.text for part in content)
    return {k: v for k, v in {"role": message.role, "content": content, "name": message.name}.items()
            if v is not None}


def _whole_in(name: str, value: int | None, low: int, high: int) -> int | None:
    if value is not None and not low <= value <= high:
        raise RequestError(name, f"{name} must be a whole number in [{low}, {high}], found {value}")
    return value


# ---- responses ------------------------------------------------------------------------------------------
class Choice:
    """One choice's text, token log-probabilities and finish reason, gathered from its events."""

    def __init__(self):
        self.text = ""
        self.events: list[TokenEvent] = []
        self.finish_reason: str | None = None

    def add(self, event: TokenEvent) -> None:
        self.text += event.text
        self.events.append(event)
        self.finish_reason = event.finish_reason


def usage(prompt_tokens: int, requests: list[Request]) -> dict:
    completion = sum(r.completion_tokens for r in requests)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


class Reply:
    """The response to one HTTP request: its id (shared by every chunk), and its bodies and chunks in the shape
    of OpenAI's chat completions (`chat`) or legacy completions. `decode` turns token ids into text."""

    def __init__(self, chat: bool, model: str, decode: Callable[[list[int]], str]):
        self.chat, self.model, self._decode = chat, model, decode
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, kind: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def body(self, choices: list[Choice], usage: dict) -> dict:
        """The whole (non-streamed) response."""
        if self.chat:
            return self._envelope("chat.completion", [
                {"index": i, "message": {"role": "assistant", "content": c.text},
                 "logprobs": self._logprobs(c.events), "finish_reason": c.finish_reason}
                for i, c in enumerate(choices)], usage=usage)
        return self._envelope("text_completion", [
            {"index": i, "text": c.text, "logprobs": self._logprobs(c.events), "finish_reason": c.finish_reason}
            for i, c in enumerate(choices)], usage=usage)

    def role_chunk(self, index: int, usage_field: bool) -> dict:
        """A chat stream's first chunk of a choice: the assistant's role, no text yet."""
        return self._chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}, usage_field)

    def chunk(self, index: int, event: TokenEvent, usage_field: bool) -> dict | None:
        """The stream chunk of one event; None when it has nothing to say (text held back for a stop string)."""
        if not event.text and event.logprob is None and event.finish_reason is None:
            return None
        logprobs = self._logprobs([event])
        if self.chat:
            delta = {"content": event.text} if event.text else {}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": event.finish_reason}
        else:
            choice = {"index": index, "text": event.text, "logprobs": logprobs, "finish_reason": event.finish_reason}
        return self._chunk(choice, usage_field)

    def usage_chunk(self, usage: dict) -> dict:
        """stream_options.include_usage: the last chunk, no choices."""
        return self._chunk(None, True, usage)

    def _chunk(self, choice: dict | None, usage_field: bool, usage: dict | None = None) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        extra = {"usage": usage} if usage_field else {}
        return self._envelope(kind, [] if choice is None else [choice], **extra)

    def _logprobs(self, events: list[TokenEvent]) -> dict | None:
        """OpenAI's logprobs of these events' tokens (None when the request asked for none)."""
        events = [e for e in events if e.logprob is not None]
        if not events:
            return None
        if self.chat:
            return {"content": [dict(self._token(e.token, e.logprob),
                                     top_logprobs=[self._token(t, lp) for t, lp in e.top_logprobs])
                                for e in events]}
        return {"tokens": [self._decode([e.token]) for e in events],
                "token_logprobs": [e.logprob for e in events],
                "top_logprobs": [{self._decode([t]): lp for t, lp in e.top_logprobs} for e in events]}

    def _token(self, token: int, logprob: float) -> dict:
        text = self._decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
