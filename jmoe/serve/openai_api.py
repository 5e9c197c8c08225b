"""OpenAI's completion and chat completion requests -> engine requests (prompt ids + RequestParams), and
the engine's events -> OpenAI's responses and stream chunks.

The bodies (jmoe.serve.bodies) hold every field OpenAI and vLLM define, strictly typed. Fields left out take
the checkpoint's generation_config.json defaults (temperature, top_p, top_k), then OpenAI's. A completion
`prompt` may be a list of several prompts: each gets `n` choices, numbered prompt-major (choice index = prompt
index * n + j), all generated together. Structured outputs (`response_format`, vLLM's `structured_outputs` and
`guided_*`) compile through `Served.grammars` (jmoe.serve.grammar) into the RequestParams' constraint. Chat's
`tools` / `tool_choice` go through jmoe.serve.tools: the tools rendered by the template, `required` and named
calls constrained by its grammar (instead of a structured output: a request asking for both is a 400), the reply
parsed into `tool_calls` (`Reply`, whole and streamed alike). What jmoe cannot serve is a 400 naming the field:
image, audio, file and video content; audio output; beam search; prompt log-probabilities (and so echo with
logprobs); a completion suffix; best_of above n; structural tags.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Callable, NamedTuple

from jmoe.checkpoint.tokenizer import TextTokenizer
from jmoe.errors import ConfigError
from jmoe.serve.bodies import (ChatBody, CompletionBody, GenerationBody, Message, StructuredOutputs,
                               unknown_fields)
from jmoe.serve.chat import ChatTemplate
from jmoe.serve.engine import Request, TokenEvent
from jmoe.serve.params import LOGIT_BIAS_LIMIT, MAX_TOP_LOGPROBS, SEED_LIMIT, RequestError, RequestParams
from jmoe.serve.tools import (ToolCallParser, ToolPlan, plan_tools, reply_finish_reason, reply_message,
                             template_tool_calls)

__all__ = ["ChatBody", "CompletionBody", "Served", "Generation", "chat_generation", "completion_generation",
           "unknown_fields", "Reply", "Choice", "usage"]

MAX_N = 128  # OpenAI's limit on choices per request
TEXT_PARTS = {"text"}  # content parts rendered as text; "refusal" parts are left out
MEDIA_PARTS = {"image_url": "image", "input_image": "image", "image": "image", "input_audio": "audio",
               "audio_url": "audio", "audio": "audio", "file": "file", "input_file": "file", "video_url": "video",
               "video": "video"}


class Served(NamedTuple):
    """What the API needs to know of the loaded model."""

    tokenizer: TextTokenizer | None
    context: int  # cache columns per request: prompt + completion
    capacity: int  # engine requests that may be running or waiting at once
    chat: ChatTemplate | None
    defaults: dict  # generation_config.json's sampling defaults (RequestParams fields)
    grammars: object = None  # jmoe.serve.grammar.Grammars, None without a tokenizer


class Generation(NamedTuple):
    """One HTTP request's engine requests: (prompt ids, params) per choice, in choice order."""

    choices: list[tuple[list[int], RequestParams]]
    prompt_tokens: int  # each prompt counted once, however many choices share it
    stream: bool
    include_usage: bool
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage in every chunk
    echo: list[str] | None = None  # text each choice starts with (completions' echo: its prompt)
    tools: ToolPlan | None = None  # chat's tools: how the reply is read for calls
    per_prompt: int = 1  # choices of each prompt (n), which follow each other in `choices`


def completion_generation(body: CompletionBody, served: Served) -> Generation:
    if body.suffix:
        raise RequestError("suffix", "suffix (fill in the middle) is not supported by this model: it has no "
                                     "fill-in-the-middle format; put the text before the gap in the prompt")
    if body.prompt_embeds is not None:
        raise RequestError("prompt_embeds", "prompt_embeds is not supported; send the prompt as text or token ids")
    n = body.n if body.n is not None else 1
    if body.best_of is not None and body.best_of != n:
        raise RequestError("best_of", f"best_of {body.best_of} is not supported: this server returns every "
                                      f"generation it makes, so best_of must equal n ({n}) or be left out")
    if body.echo and body.logprobs is not None:
        raise RequestError("echo", "echo with logprobs needs the prompt tokens' log-probabilities, which this "
                                   "server does not compute; drop echo or logprobs")
    texts, prompts = _completion_prompts(body.prompt, served.tokenizer, body.add_special_tokens is not False)
    prompts = [_truncated(body, p) for p in prompts]
    generation = _generation(body, prompts, served, "prompt", body.max_tokens, "max_tokens",
                             _whole_in("logprobs", body.logprobs, 0, MAX_TOP_LOGPROBS))
    if body.echo:
        decode = (lambda ids: "") if served.tokenizer is None else served.tokenizer.decode
        echo = [text if text is not None else decode(ids) for text, ids in zip(texts, prompts)]
        generation = generation._replace(echo=[echo[i // generation_n(body)] for i in range(len(generation.choices))])
    return generation


def generation_n(body: GenerationBody) -> int:
    return body.n if body.n is not None else 1


def chat_generation(body: ChatBody, served: Served) -> Generation:
    if served.chat is None and body.chat_template is None:
        raise RequestError("messages", "this model has no chat template (no chat_template.jinja in its directory "
                                       "and no chat_template in tokenizer_config.json); use /v1/completions with "
                                       "a prompt instead")
    if served.tokenizer is None:
        raise RequestError("messages", "chat needs the model's tokenizer.json; use /v1/completions with token ids")
    if not body.messages:
        raise RequestError("messages", "messages is empty; give at least one message")
    if body.audio is not None or "audio" in (body.modalities or ()):
        raise RequestError("modalities" if body.audio is None else "audio",
                           "audio output is not supported: this server generates text only; leave out audio and "
                           "ask for modalities [\"text\"]")
    if body.add_generation_prompt is False or body.continue_final_message:
        name = "continue_final_message" if body.continue_final_message else "add_generation_prompt"
        raise RequestError(name, f"{name} is not supported yet: the prompt always ends where the assistant's "
                                 f"reply begins")
    template = served.chat
    if body.chat_template is not None:
        special = served.chat.special_tokens if served.chat is not None else {}
        try:
            template = ChatTemplate(body.chat_template, special, "the request's chat_template")
        except ConfigError as e:
            raise RequestError("chat_template", str(e)) from e
    tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, template.source(body.tools or None))
    text = template.render([_message_dict(m, i) for i, m in enumerate(body.messages)], tools.tools, body.documents,
                           body.chat_template_kwargs)
    prompt = _truncated(body, served.tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens)))
    if body.top_logprobs is not None and not body.logprobs:
        raise RequestError("top_logprobs", "top_logprobs needs logprobs: true")
    logprobs = _whole_in("top_logprobs", body.top_logprobs or 0, 0, MAX_TOP_LOGPROBS) if body.logprobs else None
    limit_name = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
    limit = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    generation = _generation(body, [prompt], served, "messages", limit, limit_name, logprobs,
                             _tool_constraint(tools, served))._replace(tools=tools)
    last = body.messages[-1]
    if body.echo and last.role == "assistant":  # vLLM's: the reply starts with the assistant's own last words
        echo = _message_dict(last, len(body.messages) - 1).get("content") or ""
        generation = generation._replace(echo=[echo] * len(generation.choices))
    return generation


def _generation(body: GenerationBody, prompts: list[list[int]], served: Served, prompt_name: str,
                max_tokens: int | None, max_tokens_name: str, logprobs: int | None,
                tool_constraint=None) -> Generation:
    n = _whole_in("n", generation_n(body), 1, MAX_N)
    if n * len(prompts) > served.capacity:
        raise RequestError("n", f"this request asks for {n * len(prompts)} generations ({len(prompts)} prompts x n "
                                f"{n}), more than this server holds at once ({served.capacity}: --max-batch + "
                                f"--max-queue); send fewer prompts or a smaller n")
    if body.stream_options is not None and not body.stream:
        raise RequestError("stream_options", "stream_options is only allowed with stream: true")
    _refuse_unserved(body)
    constraint = _constraint(body, served)
    if tool_constraint is not None:
        if constraint is not None:
            raise RequestError("tool_choice", "tool_choice \"required\" or a named function constrains the reply to "
                                              "tool calls, so it cannot also follow a structured output "
                                              "(response_format, structured_outputs, guided_*); drop one of them")
        constraint = tool_constraint
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
        params = _params(body, room if max_tokens is None else max_tokens, logprobs, served, constraint)
        for j in range(n):
            seed = None if body.seed is None else (body.seed + p * n + j) % SEED_LIMIT
            choices.append((prompt, dataclasses.replace(params, seed=seed)))
    options = body.stream_options
    include_usage = bool(options is not None and options.include_usage)
    continuous = include_usage and bool(options.continuous_usage_stats)
    return Generation(choices, sum(map(len, prompts)), bool(body.stream), include_usage, continuous, per_prompt=n)


def _tool_constraint(tools: ToolPlan, served: Served):
    """The grammar of a `required` or named tool_choice (jmoe.serve.grammar.Constraint), or None."""
    if not tools.constrained:
        return None
    if served.grammars is None:
        raise RequestError("tool_choice", f"tool_choice {tools.choice!r} needs the model's tokenizer.json")
    return served.grammars.lark(tools.grammar(), "tools", "tool_calls")


def _refuse_unserved(body: GenerationBody) -> None:
    """400 for a field whose meaning this server cannot give (never silently ignored)."""
    if body.use_beam_search:
        raise RequestError("use_beam_search", "beam search is not supported; sample n choices instead")
    if body.prompt_logprobs is not None:
        raise RequestError("prompt_logprobs", "prompt_logprobs is not supported: this server computes the "
                                              "log-probabilities of generated tokens only")
    if body.logprob_token_ids is not None:
        raise RequestError("logprob_token_ids", "logprob_token_ids is not supported; use logprobs / top_logprobs")
    if body.watermarking:
        raise RequestError("watermarking", "watermarking is not supported")
    if body.logits_processors:
        raise RequestError("logits_processors", "logits_processors is not supported; use logit_bias, "
                                                "allowed_token_ids or structured outputs")


def _params(body: GenerationBody, max_tokens: int, logprobs: int | None, served: Served,
            constraint) -> RequestParams:
    given = {name: getattr(body, name) for name in ("temperature", "top_p", "min_p", "repetition_penalty")
             if getattr(body, name) is not None}
    if body.top_k is not None:
        given["top_k"] = 0 if body.top_k == -1 else body.top_k  # vLLM's -1 = off
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    seed = None if body.seed is None else body.seed % SEED_LIMIT  # vLLM takes any int64
    return RequestParams(max_tokens=max_tokens, **{**served.defaults, **given}, seed=seed,
                         presence_penalty=body.presence_penalty or 0.0,
                         frequency_penalty=body.frequency_penalty or 0.0, stop=stop,
                         stop_token_ids=tuple(body.stop_token_ids or ()), logprobs=logprobs,
                         ignore_eos=bool(body.ignore_eos), min_tokens=_whole_in("min_tokens", body.min_tokens or 0, 0,
                                                                                max_tokens),
                         logit_bias=_logit_bias(body.logit_bias),
                         allowed_token_ids=None if body.allowed_token_ids is None else tuple(body.allowed_token_ids),
                         bad_words=_bad_words(body.bad_words, served.tokenizer),
                         include_stop_str_in_output=bool(body.include_stop_str_in_output),
                         skip_special_tokens=body.skip_special_tokens is not False, constraint=constraint)


def _bad_words(words: list[str] | None, tokenizer: TextTokenizer | None) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token sequences: each word as written and after a space (how it reads mid-text)."""
    if not words:
        return ()
    if tokenizer is None:
        raise RequestError("bad_words", "bad_words needs the model's tokenizer.json; use logit_bias with token ids")
    sequences = {tuple(tokenizer.encode(form, add_special_tokens=False)) for word in words
                 for form in (word, " " + word.lstrip())}
    return tuple(sorted(s for s in sequences if s))


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias ({"token id": value}; null and {} = none) as (id, value) pairs, each value clamped to
    [-100, 100] as vLLM does (OpenAI answers 400 beyond it; a request vLLM serves is served)."""
    pairs = []
    for key, value in (bias or {}).items():
        if not key.strip().isdigit():
            raise RequestError("logit_bias", f"logit_bias keys must be token ids written as strings (\"1234\"), "
                                             f"found {key!r}")
        pairs.append((int(key), min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, value))))
    return tuple(pairs)


def _constraint(body: GenerationBody, served: Served):
    """The request's structured-output constraint (jmoe.serve.grammar.Constraint), or None. One source at most:
    response_format, structured_outputs, or the guided_* fields."""
    sources = []
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        sources.append("response_format")
    outputs = body.structured_outputs
    if outputs is not None:
        sources.append("structured_outputs")
    guided = {name: getattr(body, name) for name in ("guided_json", "guided_regex", "guided_choice",
                                                       "guided_grammar") if getattr(body, name) is not None}
    sources += list(guided)
    if body.structural_tag is not None:
        raise RequestError("structural_tag", "structural tags are not supported; use a JSON schema or a grammar")
    if not sources:
        return None
    if len(sources) > 1:
        raise RequestError(sources[1], f"give one structured output constraint, found {', '.join(sources)}")
    if served.grammars is None:
        raise RequestError(sources[0], "structured outputs need the model's tokenizer.json")
    grammars = served.grammars
    if fmt is not None and fmt.type != "text":
        if fmt.type == "structural_tag":
            raise RequestError("response_format", "response_format structural_tag is not supported; use json_schema")
        if fmt.type == "json_object":
            return grammars.json_object("response_format")
        if fmt.json_schema is None:
            raise RequestError("response_format.json_schema", "response_format json_schema needs its json_schema: "
                                                              "{\"name\": ..., \"schema\": {...}}")
        schema = fmt.json_schema.schema_
        return grammars.json_schema({} if schema is None else schema, "response_format.json_schema.schema")
    if outputs is None:
        name, value = next(iter(guided.items()))
        outputs = StructuredOutputs.model_validate({name.removeprefix("guided_"): value,
                                                    "whitespace_pattern": body.guided_whitespace_pattern})
    return _structured_outputs(outputs, grammars, sources[0])


def _structured_outputs(outputs: StructuredOutputs, grammars, source: str):
    given = {name: value for name, value in (("json", outputs.json_), ("regex", outputs.regex),
                                             ("choice", outputs.choice), ("grammar", outputs.grammar),
                                             ("json_object", outputs.json_object or None)) if value is not None}
    if outputs.structural_tag is not None:
        raise RequestError(f"{source}.structural_tag", "structural tags are not supported; use json or grammar")
    if len(given) != 1:
        raise RequestError(source, f"{source} needs exactly one of json, regex, choice, grammar, json_object; found "
                                   f"{', '.join(given) or 'none'}")
    (kind, value), = given.items()
    param = source if source.startswith("guided_") else f"{source}.{kind}"
    if kind == "json":
        schema = value if not isinstance(value, dict) or not outputs.disable_additional_properties \
            else _closed(value)
        return grammars.json_schema(schema, param, outputs.whitespace_pattern)
    if kind == "json_object":
        return grammars.json_object(param)
    return getattr(grammars, kind)(value, param)


def _closed(schema):
    """A schema whose objects allow no properties beyond those named (vLLM's disable_additional_properties)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(value) for key, value in schema.items()}
    if (closed.get("type") == "object" or "properties" in closed) and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def _truncated(body: GenerationBody, prompt: list[int]) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last (or, truncation_side "right", the first) k tokens; -1 = as many
    as the context holds with room for one more."""
    k = body.truncate_prompt_tokens
    if k is None:
        return prompt
    if k < -1 or k == 0:
        raise RequestError("truncate_prompt_tokens", f"truncate_prompt_tokens must be -1 or >= 1, found {k}")
    if k == -1:
        return prompt  # the context check below names the limit when the prompt does not fit
    return prompt[:k] if body.truncation_side == "right" else prompt[-k:]


def _completion_prompts(prompt, tokenizer: TextTokenizer | None,
                        add_special_tokens: bool) -> tuple[list[str | None], list[list[int]]]:
    """Each prompt of a completion request: its text (None for token ids) and its token ids."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise RequestError("prompt", "prompt is an empty list; give a string, token ids, or a list of them")
    if isinstance(prompt[0], str) and tokenizer is None:
        raise RequestError("prompt", "this model has no tokenizer.json, so it takes token ids only")
    ids = [tokenizer.encode(p, add_special_tokens=add_special_tokens) if isinstance(p, str) else list(p)
           for p in prompt]
    empty = [i for i, p in enumerate(ids) if not p]
    if empty:
        raise RequestError("prompt", f"prompt {empty[0]} is empty (no tokens); give some text or token ids")
    return [p if isinstance(p, str) else None for p in prompt], ids


def _message_dict(message: Message, index: int) -> dict:
    """A message as the template sees it: list content flattened to its text, absent fields left out. Image,
    audio, file and video parts are a 400 naming them."""
    content = message.content
    if isinstance(content, list):
        for j, part in enumerate(content):
            if part.type not in TEXT_PARTS and part.type != "refusal":
                kind = MEDIA_PARTS.get(part.type, part.type)
                raise RequestError(f"messages.{index}.content.{j}",
                                   f"{part.type} content is not supported: this server's model reads text only, "
                                   f"so {kind} parts cannot be served; send text parts")
        content = "".join(part.text or "" for part in content if part.type in TEXT_PARTS)
    calls = None if message.tool_calls is None else template_tool_calls(message.tool_calls,
                                                                         f"messages.{index}.tool_calls")
    fields = {"role": message.role, "content": content, "name": message.name, "tool_calls": calls or None,
              "tool_call_id": message.tool_call_id}
    return {k: v for k, v in fields.items() if v is not None}


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


def usage(generation: Generation, requests: list[Request]) -> dict:
    """OpenAI's usage: each prompt counted once, its cached tokens those its first choice reused (prefix reuse)."""
    completion = sum(r.completion_tokens for r in requests)
    prompt = generation.prompt_tokens
    cached = sum(r.cached_tokens for r in requests[::generation.per_prompt])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class Reply:
    """The response to one HTTP request: its id (shared by every chunk), and its bodies and chunks in the shape
    of OpenAI's chat completions (`chat`) or legacy completions. `decode` turns token ids into text."""

    def __init__(self, chat: bool, model: str, decode: Callable[[list[int]], str], tools: ToolPlan | None = None):
        self.chat, self.model, self._decode = chat, model, decode
        self.tools = tools if chat and tools is not None and tools.parses else None  # None: replies are content
        self._parsers: dict[int, ToolCallParser] = {}  # a streamed choice's, by index
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, kind: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def body(self, choices: list[Choice], usage: dict, echo: list[str] | None = None) -> dict:
        """The whole (non-streamed) response; `echo`: the text each choice starts with."""
        echo = echo or [""] * len(choices)
        if self.chat:
            return self._envelope("chat.completion", [
                {"index": i, **self._message(c.text, e, c.finish_reason), "logprobs": self._logprobs(c.events)}
                for i, (c, e) in enumerate(zip(choices, echo))], usage=usage)
        return self._envelope("text_completion", [
            {"index": i, "text": e + c.text, "logprobs": self._logprobs(c.events), "finish_reason": c.finish_reason}
            for i, (c, e) in enumerate(zip(choices, echo))], usage=usage)

    def _message(self, text: str, echo: str, reason: str | None) -> dict:
        """A whole chat choice's message and finish reason: its calls parsed out when the request has tools."""
        if self.tools is None:
            return {"message": {"role": "assistant", "content": echo + text}, "finish_reason": reason}
        parser = self.tools.parser()
        parsed = parser.feed(text).add(parser.finish())
        return {"message": reply_message(echo + parsed.content, parsed.calls),
                "finish_reason": reply_finish_reason(reason, parsed.calls)}

    def role_chunk(self, index: int, usage_field: bool) -> dict:
        """A chat stream's first chunk of a choice: the assistant's role, no text yet."""
        return self._chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}, usage_field)

    def chunk(self, index: int, event: TokenEvent, usage_field: bool, usage: dict | None = None,
              echo: bool = False) -> dict | None:
        """The stream chunk of one event; None when it has nothing to say (text held back for a stop string, or for
        a tool call still being written). `usage`: the usage so far, sent in the chunk (vLLM's
        continuous_usage_stats); `echo`: the event is echoed text, not the model's (never read for calls)."""
        if not event.text and event.logprob is None and event.finish_reason is None:
            return None
        logprobs = self._logprobs([event])
        if self.chat:
            text, calls, reason = event.text, [], event.finish_reason
            if self.tools is not None and not echo:
                if index not in self._parsers:
                    self._parsers[index] = self.tools.parser()
                parser = self._parsers[index]
                parsed = parser.feed(event.text)
                if reason is not None:
                    parsed.add(parser.finish())
                    reason = reply_finish_reason(reason, parser.calls)
                text, calls = parsed.content, parsed.calls
                if not text and not calls and logprobs is None and reason is None:
                    return None
            delta = {"content": text} if text else {}
            if calls:
                delta["tool_calls"] = calls
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": index, "text": event.text, "logprobs": logprobs, "finish_reason": event.finish_reason}
        return self._chunk(choice, usage_field, usage)

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
