"""Structured outputs: a request's text constrained to a JSON schema, any JSON object, a regular expression, a
list of choices or a grammar, through llguidance (a maintained grammar engine: Rust, no dependencies).

The API, for the HTTP layer and for tool calls:

    grammars = Grammars(tokenizer, vocab_size, eos_token_ids)  # once per served model: its token table
    constraint = grammars.json_schema(schema)                  # or json_object(), regex(p), choice(options),
                                                               # grammar(lark_or_gbnf), lark(text, kind=...):
                                                               # RequestError (400) naming why when the engine
                                                               # cannot compile it
    params = RequestParams(..., constraint=constraint)          # the engine does the rest

A `Constraint` is compiled and checked once and shared by every request that uses it (`n` choices); the engine
makes each request its own `Matcher` (`constraint.matcher()`), asks it for the allowed tokens before each step
(`allowed()`: bool [V], computed on the host while the device runs the step; the token-choice program adds -inf
on the others through its per-entry bias, so constrained and free rows share one batch and nothing recompiles),
and advances it with each token (`accept`). EOS is allowed only where the grammar may end; once it can take
nothing else (`stopped`) the request finishes with "stop".

JSON is generated compactly with ", " and ": " between items (the separators json.dumps writes) and no other
whitespace, so a model cannot spend its tokens on whitespace (vLLM's `disable_any_whitespace`); a schema's
keywords llguidance does not implement are an error, not silently dropped.
"""

from __future__ import annotations

import json
import threading

import numpy as np

from jmoe.checkpoint.tokenizer import TextTokenizer
from jmoe.serve.params import RequestError

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # the serve extra is not installed
        raise RequestError(None, f"structured outputs need llguidance ({e}); pip install -e '.[serve]'") from e
    return llguidance


class Constraint:
    """A compiled grammar: `kind` ("json_schema", "json_object", "regex", "choice", "grammar") and a matcher in its
    initial state, which `matcher()` copies."""

    def __init__(self, kind: str, initial, vocab_size: int):
        self.kind = kind
        self._initial = initial
        self._vocab_size = vocab_size

    def matcher(self) -> "Matcher":
        """A fresh matcher for one request."""
        return Matcher(self._initial.deep_copy(), self._vocab_size)

    def __repr__(self) -> str:
        return f"Constraint({self.kind})"


class Matcher:
    """One request's position in its grammar: `allowed()` before each token, `accept(token)` after."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher = matcher
        self._vocab_size = vocab_size

    def allowed(self) -> np.ndarray:
        """bool [V]: the tokens the grammar allows next (EOS where it may end). A matcher in an error state (a token
        outside its last mask was forced on it, which the engine never does) allows only EOS."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:self._vocab_size].astype(bool)
        if allowed.size < self._vocab_size:  # a tokenizer shorter than the model's vocabulary: the rest banned
            allowed = np.concatenate([allowed, np.zeros(self._vocab_size - allowed.size, bool)])
        return allowed

    def accept(self, token: int) -> bool:
        """Advance past `token`; False if the grammar did not allow it (the matcher then allows only EOS)."""
        return self._matcher.consume_token(token)

    @property
    def stopped(self) -> bool:
        """Nothing but EOS may follow (the grammar is complete, or the matcher is in an error state)."""
        return self._matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """The text so far is a complete sentence of the grammar."""
        return self._matcher.is_accepting()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class Grammars:
    """Compiles constraints for one model: its tokenizer's token table (built once, by `prepare` or on first use:
    about a second for a 150k vocabulary) and its vocabulary size and EOS tokens."""

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int, eos_token_ids):
        self._tokenizer_source = tokenizer
        self.vocab_size = vocab_size
        self.eos = list(eos_token_ids)
        self._tokenizer = None
        self._lock = threading.Lock()

    def prepare(self) -> None:
        """Build the token table now (the server does while it loads) rather than for the first constrained request;
        without llguidance installed, nothing (constrained requests then get a 400 that says what to install)."""
        try:
            self._token_table()
        except RequestError:
            pass

    def _token_table(self):
        with self._lock:
            if self._tokenizer is None:
                llg = _llguidance()
                self._tokenizer = llg.LLTokenizer(self._tokenizer_source.to_json(), n_vocab=self.vocab_size,
                                                  eos_token=self.eos)
            return self._tokenizer

    def json_schema(self, schema, param: str = "response_format", whitespace_pattern: str | None = None) -> Constraint:
        """Text that is a JSON value valid under `schema` (a dict, or its JSON text); `whitespace_pattern` (vLLM's
        guided_whitespace_pattern), a regular expression of the whitespace allowed between items, instead of none."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise RequestError(param, f"{param}: the JSON schema is not valid JSON ({e})") from e
        if not isinstance(schema, (dict, bool)):
            raise RequestError(param, f"{param}: a JSON schema must be an object, found {type(schema).__name__}")
        llg = _llguidance()
        try:
            options = JSON_OPTIONS if whitespace_pattern is None else \
                {**JSON_OPTIONS, "whitespace_flexible": True, "whitespace_pattern": whitespace_pattern}
            grammar = llg.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except ValueError as e:
            raise RequestError(param, f"{param}: the JSON schema cannot be compiled ({e})") from e
        return self._compile("json_schema", grammar, param)

    def json_object(self, param: str = "response_format") -> Constraint:
        """Text that is a JSON object (OpenAI's response_format {"type": "json_object"})."""
        llg = _llguidance()
        grammar = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        return self._compile("json_object", grammar, param)

    def regex(self, pattern: str, param: str = "structured_outputs.regex") -> Constraint:
        """Text that matches `pattern` whole (Rust's regex syntax, as vLLM's guided_regex)."""
        return self._compile("regex", _llguidance().LLMatcher.grammar_from_regex(pattern), param)

    def choice(self, options: list[str], param: str = "structured_outputs.choice") -> Constraint:
        """Text that is exactly one of `options`."""
        if not options or not all(isinstance(o, str) for o in options):
            raise RequestError(param, f"{param} must be a non-empty list of strings, found {options!r}")
        lark = "start: " + " | ".join(json.dumps(o) for o in options)
        return self._compile("choice", _llguidance().LLMatcher.grammar_from_lark(lark), param)

    def grammar(self, text: str, param: str = "structured_outputs.grammar") -> Constraint:
        """Text in the language of a context-free grammar: Lark syntax as llguidance reads it, or llama.cpp's GBNF."""
        llg = _llguidance()
        try:
            grammar = llg.grammar_from("grammar", text)
        except ValueError as e:
            raise RequestError(param, f"{param}: the grammar cannot be read ({e})") from e
        return self._compile("grammar", grammar, param)

    def lark(self, text: str, param: str = "tools", kind: str = "grammar") -> Constraint:
        """Text in the language of a Lark grammar in llguidance's dialect (which may embed JSON schemas with
        `%json`), as written by jmoe rather than a client; `kind` names it in metrics."""
        return self._compile(kind, _llguidance().LLMatcher.grammar_from_lark(text), param)

    def _compile(self, kind: str, grammar: str, param: str) -> Constraint:
        llg = _llguidance()
        matcher = llg.LLMatcher(self._token_table(), grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(param, f"{param}: the grammar engine cannot compile this {kind.replace('_', ' ')} "
                                      f"({matcher.get_error()})")
        return Constraint(kind, matcher, self.vocab_size)
