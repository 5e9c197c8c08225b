"""A checkpoint's chat template: the conversation -> prompt text, rendered as transformers renders it.

The template is `chat_template.jinja` in the model directory, else `chat_template` in tokenizer_config.json
(a string, or a list of named templates: the one named "tool_use" when the request has tools and the checkpoint
names one, else the one named "default", as transformers' `get_chat_template` picks). It runs in jinja2's
immutable sandbox (templates from the Hub are untrusted code) with transformers' settings: trim_blocks,
lstrip_blocks, the loopcontrols extension, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII
text, the tokenizer's special tokens (`bos_token`, `eos_token`, ...), `add_generation_prompt=True`, and
`tools` (the request's tool definitions as OpenAI's API sends them, `{"type": "function", "function": {...}}`,
or None) and `documents=None`, as `apply_chat_template(messages, tools=...)` passes them.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jmoe.errors import ConfigError
from jmoe.jsonfile import read_json
from jmoe.serve.params import RequestError

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class ChatTemplate:
    """A compiled chat template (and, if the checkpoint names one, its "tool_use" template for requests with
    tools) and the special tokens it may refer to. `source(tools)` is the text of the one a request renders
    through (jmoe.serve.tools reads from it how the model writes its calls)."""

    def __init__(self, source: str, special_tokens: dict[str, str], origin: str, tool_use: str | None = None):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        self._sources = {"default": source, "tool_use": tool_use if tool_use is not None else source}
        self._templates = {}
        for name, text in {"default": source, "tool_use": tool_use}.items():
            if text is None:
                continue
            try:
                self._templates[name] = env.from_string(text)
            except jinja2.TemplateError as e:
                which = "" if name == "default" else " named tool_use"
                raise ConfigError(f"{origin}: the chat template{which} does not compile ({e}); fix it or remove "
                                  f"it") from e
        self._templates.setdefault("tool_use", self._templates["default"])
        self.special_tokens = special_tokens
        self.origin = origin

    def source(self, tools: list[dict] | None = None) -> str:
        """The text of the template a request with these tools renders through."""
        return self._sources["default" if tools is None else "tool_use"]

    def render(self, messages: list[dict], tools: list[dict] | None = None, documents: list[dict] | None = None,
               template_kwargs: dict | None = None) -> str:
        """The prompt text of `messages` (dicts with role, content, ...), ending where the assistant's reply
        begins; `tools` (OpenAI's tool definitions, or None), `documents` and `template_kwargs` (vLLM's
        chat_template_kwargs, such as enable_thinking) reach the template as transformers' apply_chat_template
        passes them (a kwarg never replaces the messages, tools, documents or special tokens). A template that
        rejects the conversation (raise_exception) or fails on it (content null where it concatenates strings, say)
        raises RequestError."""
        template = self._templates["default" if tools is None else "tool_use"]
        try:
            return template.render(**{**(template_kwargs or {}), "messages": messages, "tools": tools,
                                      "documents": documents, "add_generation_prompt": True, **self.special_tokens})
        except Exception as e:  # the template is the checkpoint's code: whatever it raises, this input set it off
            raise RequestError("messages", f"the model's chat template cannot render this conversation "
                                           f"({type(e).__name__}: {e})") from e


def load_chat_template(model_dir: str | Path) -> ChatTemplate | None:
    """The chat template of the checkpoint in `model_dir`, or None when it has none."""
    model_dir = Path(model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = read_json(config_path, "tokenizer_config.json", ConfigError, "fix or remove it") \
        if config_path.is_file() else {}
    special = {name: _token_text(config[name]) for name in SPECIAL_TOKENS if config.get(name) is not None}
    jinja_path = model_dir / "chat_template.jinja"
    if jinja_path.is_file():
        return ChatTemplate(jinja_path.read_text(encoding="utf-8"), special, str(jinja_path))
    source, tool_use = _template_in_config(config.get("chat_template"), config_path)
    return None if source is None else ChatTemplate(source, special, f"{config_path} chat_template", tool_use)


def _token_text(token) -> str:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict with `content`."""
    return token["content"] if isinstance(token, dict) else str(token)


def _template_in_config(value, path: Path) -> tuple[str | None, str | None]:
    """(the default template, the one named "tool_use" or None) of tokenizer_config.json's chat_template."""
    if value is None or isinstance(value, str):
        return value, None
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            tool_use = named.get("tool_use")
            return named["default"], tool_use if isinstance(tool_use, str) else None
    raise ConfigError(f"{path}: chat_template must be a string or a list of {{name, template}} with one named "
                      f"'default', found {type(value).__name__}; fix it or put the template in chat_template.jinja")
