"""Tool calls: OpenAI's `tools` and `tool_choice`, the calls a model writes parsed out of its text, and the
grammar that makes `required` and named calls valid.

A request's tools reach the chat template as transformers passes them (`tools=`, OpenAI's own dicts); the
conversation's assistant `tool_calls` reach it with their `arguments` parsed from OpenAI's JSON string into an
object (what Hugging Face templates expect, `| tojson` writing it back), and `role: "tool"` messages with their
`tool_call_id`.

How a model writes a call is its template's business, so the format is read from the template's text
(`tool_format`):

- `hermes` (Hermes, Qwen 2.5/3, the shipped model): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks, with text allowed around them;
- `llama3_json` (Llama 3.1-3.3): the whole reply is `{"name": ..., "parameters": {...}}` (several joined by `;`),
  after an optional `<|python_tag|>`;
- `mistral` (Mistral's v3 tokenizers' templates): `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}`; the
  marker is a special token, which decoding leaves out, so a reply that opens with the list is read as calls.

A template that names none of them gets `hermes`. `tool_choice` `auto` parses what the model writes; `none`
parses nothing (the tools are still rendered, as OpenAI's API shows them to the model); `required` and a named
function constrain decoding to a grammar of the format's calls whose arguments follow each function's
`parameters` schema (`ToolPlan.grammar`, Lark with embedded JSON schemas, for llguidance; `required` makes
one call or, with `parallel_tool_calls`, more; a named function is called once), then parse the same way.
A call to a function the request did not define, or whose text is not a JSON object of the format's shape,
stays in the content as the model wrote it.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from jmoe.serve.params import RequestError

NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
# A function without `parameters` takes none (a constrained call writes `{}`).
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# llguidance's JSON options inside a grammar's `%json`: compact JSON with json.dumps' separators, as
# jmoe.serve.grammar writes JSON (a model cannot spend its tokens on whitespace), and as templates' tojson writes calls.
JSON_IN_GRAMMAR = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# ---- request fields --------------------------------------------------------------------------------------
# The bodies (jmoe.serve.bodies) hold tools, tool_choice and a message's tool_calls as plain JSON; these models check
# them here, strictly typed, fields nobody defines ignored (as the bodies' own unknown fields are).
class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # accepted: required / named calls always follow the schema, `auto` never does


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class CallFunction(_Strict):
    name: str
    arguments: str | dict  # OpenAI's shape is a JSON object as text; an object itself is taken too


class ToolCall(_Strict):
    """An assistant message's call, as a client sends it back."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CallFunction


def _checked(model: type[BaseModel], value, param: str):
    """`value` (plain JSON) as `model`; a 400 naming the first field that is wrong."""
    try:
        return model.model_validate(value)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join([param, *(str(p) for p in first["loc"])])
        raise RequestError(where, f"{where}: {first['msg'].lower()}, found {_shown(first.get('input'))}") from e


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def template_tool_calls(calls: list, param: str) -> list[dict]:
    """An assistant message's `tool_calls` as a chat template reads them: {id, type, function: {name, arguments}}
    with `arguments` parsed into an object (what Hugging Face templates expect; vLLM does the same). Arguments
    that are not a JSON object are a 400 naming the field."""
    if not isinstance(calls, list):
        raise RequestError(param, f"{param} must be a list of tool calls, found {_shown(calls)}")
    rendered = []
    for j, value in enumerate(calls):
        call = _checked(ToolCall, value, f"{param}.{j}")
        arguments = call.function.arguments
        if isinstance(arguments, str):
            arguments = _json_value(arguments)
        if not isinstance(arguments, dict):
            where = f"{param}.{j}.function.arguments"
            raise RequestError(where, f"{where} must be a JSON object as text (as this server returns it), found "
                                      f"{_shown(call.function.arguments)}")
        rendered.append({k: v for k, v in {"id": call.id, "type": call.type,
                                           "function": {"name": call.function.name, "arguments": arguments}}.items()
                         if v is not None})
    return rendered


# ---- formats ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolFormat:
    """How a family writes its calls: `kind` "tagged" (calls between `start` and `end`, text around them) or
    "leading" (the reply is calls when it opens with one of `triggers`); `arguments_key` the call object's
    arguments field; `separator` between calls a grammar writes."""

    name: str
    kind: Literal["tagged", "leading"]
    arguments_key: str = "arguments"
    start: str = ""
    end: str = ""
    triggers: tuple[str, ...] = ()
    separator: str = "\n"
    written: tuple[str, str] = ("", "")  # what a grammar writes around a tagged call (the template's spacing)
    listed: bool = False  # the calls are one JSON list (Mistral)
    id_chars: int = 0  # >0: ids of this many letters and digits (Mistral's templates insist on 9), else call_...


HERMES = ToolFormat("hermes", "tagged", start="<tool_call>", end="</tool_call>",
                    written=("<tool_call>\n", "\n</tool_call>"))
LLAMA3_JSON = ToolFormat("llama3_json", "leading", arguments_key="parameters", triggers=("<|python_tag|>", "{"),
                         separator="; ")
MISTRAL = ToolFormat("mistral", "leading", triggers=("[TOOL_CALLS]", "["), listed=True, id_chars=9)
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}


def tool_format(template_source: str) -> ToolFormat:
    """The format a chat template teaches its model, read from the template's text."""
    if "[TOOL_CALLS]" in template_source:
        return MISTRAL
    if "<|python_tag|>" in template_source or '"parameters": dictionary of argument name' in template_source:
        return LLAMA3_JSON
    return HERMES


# ---- the request's plan ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools do: `tools` for the template (None: none), `choice` ("none", "auto", "required" or
    "named": the function in `names`), the functions a call may name, the format, and whether several calls
    may be made at once (`parallel_tool_calls`)."""

    tools: list[dict] | None
    choice: Literal["none", "auto", "required", "named"]
    functions: dict  # name -> its parameters schema, for the functions a call may name
    format: ToolFormat
    parallel: bool = True

    @property
    def parses(self) -> bool:
        """Whether the reply is read for calls."""
        return self.choice != "none"

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    def parser(self) -> ToolCallParser | None:
        """A fresh parser for one choice's text (None: the reply is plain content)."""
        return ToolCallParser(self.format, frozenset(self.functions)) if self.parses else None

    @property
    def several(self) -> bool:
        """Whether a constrained reply may make more than one call: `required` with parallel_tool_calls (a
        named function is called once)."""
        return self.choice == "required" and self.parallel

    def call_schema(self, name: str) -> dict:
        """The JSON schema of one call object of function `name`: its name, then its arguments."""
        return {"type": "object",
                "properties": {"name": {"const": name}, self.format.arguments_key: self.functions[name]},
                "required": ["name", self.format.arguments_key], "additionalProperties": False}

    def grammar(self) -> str | None:
        """`required` / named as a Lark grammar (llguidance's dialect, JSON schemas embedded with `%json`): the
        calls written in the model's own format, one or (`parallel`) more, nothing else. None for `auto`/`none`."""
        if not self.constrained:
            return None
        f = self.format
        calls = [json.dumps({"x-guidance": JSON_IN_GRAMMAR, **self.call_schema(name)}, ensure_ascii=False,
                            separators=(",", ":")) for name in self.functions]
        lines = ["call_json: " + "\n    | ".join(f"%json {schema}" for schema in calls)]
        if f.listed:  # one JSON list: the list's own commas separate calls
            item = "call_json"
            more = f' (", " {item})*' if self.several else ""
            return "\n".join([f'start: "[" {item}{more} "]"', *lines]) + "\n"
        call = f"{_lark_string(f.written[0])} call_json {_lark_string(f.written[1])}" if f.kind == "tagged" \
            else "call_json"
        more = f" ({_lark_string(f.separator)} call)*" if self.several else ""
        return "\n".join([f"start: call{more}", f"call: {call}", *lines]) + "\n"


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a Lark string literal takes JSON's escapes


def plan_tools(tools: list | None, tool_choice: str | dict | None, parallel_tool_calls: bool | None,
               template_source: str) -> ToolPlan:
    """The request's tool fields (plain JSON, as the body holds them), checked (each error a 400 naming its field),
    as a ToolPlan. No tools (or an empty list) with no tool_choice or "none" is a plan that renders and parses
    nothing."""
    if tools is not None and not isinstance(tools, list):
        raise RequestError("tools", f"tools must be a list of {{\"type\": \"function\", \"function\": {{...}}}}, "
                                    f"found {_shown(tools)}")
    given = tools or None  # what the template gets: the tools as the client sent them, as transformers passes them
    tools = [_checked(Tool, t, f"tools.{i}") for i, t in enumerate(tools or ())] or None
    if isinstance(tool_choice, dict):
        tool_choice = _checked(NamedToolChoice, tool_choice, "tool_choice")
    elif tool_choice is not None and tool_choice not in ("none", "auto", "required"):
        raise RequestError("tool_choice", f"tool_choice must be \"none\", \"auto\", \"required\" or "
                                          f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, found "
                                          f"{_shown(tool_choice)}")
    names: dict[str, dict] = {}
    for i, tool in enumerate(tools or ()):
        name = tool.function.name
        if not NAME_PATTERN.fullmatch(name):
            raise RequestError(f"tools.{i}.function.name", f"function name {name!r} must be 1-64 letters, digits, "
                                                           f"underscores or dashes")
        if name in names:
            raise RequestError(f"tools.{i}.function.name", f"two tools are named {name!r}; names must differ")
        names[name] = tool.function.parameters if tool.function.parameters is not None else EMPTY_PARAMETERS
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        if name not in names:
            raise RequestError("tool_choice", f"tool_choice names function {name!r}, which is not among tools "
                                              f"({', '.join(names) or 'none given'})")
        choice, functions = "named", {name: names[name]}
    else:
        choice = tool_choice or ("auto" if tools else "none")
        functions = names
        if choice in ("auto", "required") and not tools:
            raise RequestError("tool_choice", f"tool_choice {choice!r} needs tools; give tools or leave "
                                              f"tool_choice out")
    return ToolPlan(given, choice, functions, tool_format(template_source),
                    True if parallel_tool_calls is None else parallel_tool_calls)


# ---- parsing ---------------------------------------------------------------------------------------------
@dataclass
class Parsed:
    """What one piece of a reply says: content text to send, and calls completed (OpenAI's tool call dicts with
    their `index` among the choice's calls)."""

    content: str = ""
    calls: list[dict] | None = None

    def __post_init__(self):
        self.calls = [] if self.calls is None else self.calls

    def add(self, other: Parsed) -> Parsed:
        self.content += other.content
        self.calls += other.calls
        return self


class ToolCallParser:
    """One choice's reply -> content and tool calls, as its text arrives (`feed`, then `finish`).

    A streamed reply and a whole one come out the same: the whole one is this parser fed everything at once.
    Text that may still become a call waits (a tagged format's partial start marker; a leading format's whole
    reply once it opens with a trigger, read at the end); a call goes out once its end marker (or the reply's
    end) is seen, whole, arguments and all. Whitespace that only separates calls from each other or from the
    text is dropped; when no call is made the content is the text exactly.
    """

    def __init__(self, format: ToolFormat, functions: frozenset[str]):
        self.format, self.functions = format, functions
        self.calls: list[dict] = []
        self._buffer = ""
        self._in_call = False  # tagged: inside start ... end
        self._held_ws = ""  # trailing whitespace of the content, sent when more content follows
        self._ws_before_call = ""  # the whitespace before the current call, sent if it does not parse
        self._after_call = False  # drop the whitespace that follows a call
        self._leading: str | None = None  # leading: undecided (None), "content" or "calls"

    def feed(self, text: str) -> Parsed:
        self._buffer += text
        return self._tagged() if self.format.kind == "tagged" else self._lead()

    def finish(self) -> Parsed:
        """The end of the reply: what was held back, and a call cut short if it is complete anyway."""
        out = Parsed()
        if self.format.kind == "tagged":
            out.add(self._tagged())
            if self._in_call:
                out.add(self._close_call(self._buffer))
            else:
                out.content += self._content(self._buffer)
        elif self._leading == "calls":
            calls = self._leading_calls(self._buffer)
            if calls is None:
                out.content += self._buffer
            else:
                out.calls += [self._record(name, args) for name, args in calls]
        else:
            out.content += self._buffer
        self._buffer = ""
        if not self.calls:
            out.content += self._held_ws
        self._held_ws = ""
        return out

    # tagged --------------------------------------------------------------------------------------------
    def _tagged(self) -> Parsed:
        out = Parsed()
        start, end = self.format.start, self.format.end
        while True:
            if not self._in_call:
                i = self._buffer.find(start)
                if i < 0:
                    keep = _partial_suffix(self._buffer, start)
                    out.content += self._content(self._buffer[:len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return out
                out.content += self._content(self._buffer[:i])
                self._ws_before_call, self._held_ws = self._held_ws, ""
                self._buffer, self._in_call = self._buffer[i + len(start):], True
            else:
                j = self._buffer.find(end)
                if j < 0:
                    return out
                body, self._buffer = self._buffer[:j], self._buffer[j + len(end):]
                out.add(self._close_call(body, end))

    def _close_call(self, body: str, end: str = "") -> Parsed:
        """The call between the markers, or, if it does not parse, its text (and the whitespace before it)."""
        self._in_call = False
        call = _call_object(_json_value(body), self.format.arguments_key, self.functions)
        if call is None:
            raw = self._ws_before_call + self.format.start + body + end
            self._ws_before_call, self._after_call = "", False
            return Parsed(raw)
        self._ws_before_call, self._after_call = "", True
        return Parsed(calls=[self._record(*call)])

    def _content(self, text: str) -> str:
        """Content text, less the whitespace right after a call, with its trailing whitespace held back."""
        text = self._held_ws + text
        self._held_ws = ""
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        kept = text.rstrip()
        self._held_ws = text[len(kept):]
        return kept

    # leading -------------------------------------------------------------------------------------------
    def _lead(self) -> Parsed:
        if self._leading == "content":
            text, self._buffer = self._buffer, ""
            return Parsed(text)
        if self._leading is None:
            opening = self._buffer.lstrip()
            if not opening or any(t.startswith(opening) for t in self.format.triggers):
                return Parsed()  # not yet known
            if any(opening.startswith(t) for t in self.format.triggers):
                self._leading = "calls"
                return Parsed()
            self._leading = "content"
            return self._lead()
        return Parsed()

    def _leading_calls(self, text: str) -> list[tuple[str, dict]] | None:
        text = text.strip()
        for marker in self.format.triggers[:1]:  # the special token, where decoding kept it
            if text.startswith(marker):
                text = text[len(marker):].strip()
        values = _json_values(text)
        if values is None:
            return None
        calls = [_call_object(v, self.format.arguments_key, self.functions) for v in values]
        return None if not calls or any(c is None for c in calls) else calls

    def _record(self, name: str, arguments: dict) -> dict:
        call = {"index": len(self.calls), "id": self._new_id(), "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
        self.calls.append(call)
        return call

    def _new_id(self) -> str:
        if self.format.id_chars:
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(self.format.id_chars))
        return "call_" + secrets.token_hex(12)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (and may yet become it)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _json_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _json_values(text: str) -> list | None:
    """JSON values one after another, whitespace and at most one `;` or `,` between them; None if the text is
    not that. A list's items count as values of their own (Mistral writes its calls as one list)."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        i = _skip_space(text, i)
        if i == len(text):
            return values or None
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        values += value if isinstance(value, list) else [value]
        i = _skip_space(text, i)
        if i < len(text) and text[i] in ";,":
            i += 1


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _call_object(value, arguments_key: str, functions: frozenset[str]) -> tuple[str, dict] | None:
    """(name, arguments) of a call object `{"name": ..., arguments_key: {...}}` naming one of `functions`; the
    arguments may be JSON text of an object, and `arguments` / `parameters` are taken for each other (models
    mix them up). None for anything else."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in functions:
        return None
    keys = [arguments_key] + [k for k in ("arguments", "parameters") if k != arguments_key]
    arguments = next((value[k] for k in keys if k in value), {})
    if isinstance(arguments, str):
        arguments = _json_value(arguments)
    if not isinstance(arguments, dict) or set(value) - {"name", *keys}:
        return None
    return value["name"], arguments


# ---- the reply -------------------------------------------------------------------------------------------
def reply_finish_reason(reason: str | None, calls: list[dict]) -> str | None:
    """OpenAI's finish reason: "tool_calls" when the model stopped after making calls (a reply cut by the
    token limit keeps "length", so the client knows it was cut)."""
    return "tool_calls" if calls and reason == "stop" else reason


def reply_message(content: str, calls: list[dict]) -> dict:
    """A whole reply's assistant message: content null when the model only called tools."""
    if not calls:
        return {"role": "assistant", "content": content}
    return {"role": "assistant", "content": content or None,
            "tool_calls": [{k: v for k, v in c.items() if k != "index"} for c in calls]}
