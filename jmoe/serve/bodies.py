"""The request bodies of /v1/completions and /v1/chat/completions: every field of OpenAI's request schemas and of
vLLM's documented extensions, checked by pydantic in strict mode (a wrong type is a 400, never coerced: "5" is
not 5).

A field nobody defines is kept aside (`extra="allow"`), and `unknown_fields` lists it: the HTTP layer logs those
once per request and ignores them, as vLLM does, or answers 400 under `--strict-fields`. Fields that change
nothing here are accepted and ignored (the provider's storage, tiers and caches, ids, vLLM's disaggregation and
return_* extras; docs/serving.md lists them); fields that would change the output in ways jmoe cannot serve
(images, audio, beam search, prompt log-probabilities) get a 400 that names them (jmoe.serve.openai_api).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

class Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(Body):
    include_usage: bool | None = False
    include_obfuscation: bool | None = None  # OpenAI's padding against side channels: nothing to pad here
    continuous_usage_stats: bool | None = False  # vLLM's: usage in every chunk


class JsonSchemaFormat(Body):
    name: str | None = None
    description: str | None = None
    schema_: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Body):
    """vLLM's `structured_outputs` (and the older guided_* fields): one of json / regex / choice / grammar /
    json_object."""

    json_: dict | str | bool | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False  # always: JSON is generated without free whitespace
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class GenerationBody(Body):
    """The fields completions and chat completions share."""

    model: str
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    # vLLM's sampling parameters
    top_k: int | None = None  # 0 or -1 = off
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    ignore_eos: bool | None = False  # generate past the end-of-sequence token
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    use_beam_search: bool | None = False
    length_penalty: float | None = 1.0
    watermarking: bool | None = None
    logits_processors: list[Any] | None = None
    # vLLM's structured outputs, and the fields that came before them
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | bool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: str | dict | None = None
    # vLLM's request extras that change nothing here
    priority: int | None = 0
    request_id: str | None = None
    session_id: str | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict | None = None
    ec_transfer_params: dict | None = None
    vllm_xargs: dict | None = None
    repetition_detection: dict | None = None
    stream_interval: int | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    return_prompt_text: bool | None = None
    return_token_offsets: bool | None = None
    return_mm_kwargs: bool | None = None
    routed_experts_prompt_start: int | None = 0
    thinking_token_budget: int | None = None
    mm_processor_kwargs: dict | None = None
    media_io_kwargs: dict | None = None


class CompletionBody(GenerationBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # the legacy API's top alternatives per token; jmoe allows up to 20, not 5
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool | None = True
    prompt_embeds: str | list[str] | None = None


class ContentPart(Body):
    """A part of a message's content: text is rendered; image, audio, file and video parts are named in a 400."""

    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None
    video_url: Any = None
    audio_url: Any = None


class Message(Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    function_call: dict | None = None
    refusal: str | None = None
    audio: dict | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatBody(GenerationBody):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict] | None = None
    function_call: str | dict | None = None
    prediction: dict | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict | None = None
    moderation: dict | None = None
    # vLLM's chat extras
    echo: bool | None = False  # the reply starts with the last message's content when it is the assistant's
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    add_special_tokens: bool | None = False
    documents: list[dict] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    include_reasoning: bool | None = True


def unknown_fields(body: BaseModel, prefix: str = "") -> list[str]:
    """The fields of `body` and its nested bodies that no schema defines, as dotted paths (messages.0.foo)."""
    found = [prefix + name for name in (body.model_extra or {})]
    for name in type(body).model_fields:
        found += _unknown_in(getattr(body, name), f"{prefix}{name}.")
    return found


def _unknown_in(value, prefix: str) -> list[str]:
    if isinstance(value, BaseModel):
        return unknown_fields(value, prefix)
    if isinstance(value, list):
        return [path for i, item in enumerate(value) for path in _unknown_in(item, f"{prefix}{i}.")]
    return []
