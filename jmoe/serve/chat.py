"""A checkpoint's chat template: the conversation -> prompt text, rendered as transformers renders it.

The template is `chat_template.jinja` in the model directory, else `chat_template` in tokenizer_config.json
(a string, or a list of named templates: the one named "default"). It runs in jinja2's immutable sandbox
(templates from the Hub are untrusted code) with transformers' settings: trim_blocks, lstrip_blocks, the
loopcontrols extension, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, the
tokenizer's special tokens (`bos_token`, `eos_token`, ...) and `add_generation_prompt=True`.
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
    """A compiled chat template and the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str], origin: str):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ConfigError(f"{origin}: the chat template does not compile ({e}); fix it or remove it") from e
        self.special_tokens = special_tokens
        self.origin = origin

    def render(self, messages: list[dict]) -> str:
        """The prompt text of `messages` (dicts with role, content, ...), ending where the assistant's reply
        begins. A template that rejects the conversation (raise_exception) or fails on it (content null where it
        concatenates strings, say) raises RequestError."""
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **self.special_tokens)
        except Exception as e:  # the template is the checkpoint's code: whatever it raises, this input set it off
            raise RequestError("messages", f"the model's chat template cannot render this conversation "
                                           f"({type(e).__name__}: {e})") from e


def load_chat_template(model_dir: Path) -> ChatTemplate | None:
    """The chat template of the checkpoint in `model_dir`, or None when it has none."""
    config_path = model_dir / "tokenizer_config.json"
    config = read_json(config_path, "tokenizer_config.json", ConfigError, "fix or remove it") \
        if config_path.is_file() else {}
    special = {name: _token_text(config[name]) for name in SPECIAL_TOKENS if config.get(name) is not None}
    jinja_path = model_dir / "chat_template.jinja"
    if jinja_path.is_file():
        return ChatTemplate(jinja_path.read_text(encoding="utf-8"), special, str(jinja_path))
    source = _template_in_config(config.get("chat_template"), config_path)
    return None if source is None else ChatTemplate(source, special, f"{config_path} chat_template")


def _token_text(token) -> str:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict with `content`."""
    return token["content"] if isinstance(token, dict) else str(token)


def _template_in_config(value, path: Path) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ConfigError(f"{path}: chat_template must be a string or a list of {{name, template}} with one named "
                      f"'default', found {type(value).__name__}; fix it or put the template in chat_template.jinja")
