"""What one serving request asks for: its sampling parameters, stops and limits, checked once.

Every check raises RequestError naming the parameter (the HTTP layer turns it into OpenAI's 400 with
`param` set). Defaults the request leaves out come from the checkpoint's generation_config.json, as
Hugging Face does (`generation_defaults`), then from OpenAI's defaults.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from pathlib import Path

from jmoe.arguments import is_whole_number
from jmoe.errors import ConfigError, InputError
from jmoe.jsonfile import read_json

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs; the step always computes this many
MAX_STOP_STRINGS = 64  # OpenAI allows 4, vLLM any number; a bound on the work of matching them
SEED_LIMIT = 2**32  # a seed is a uint32 inside the step
MAX_TEMPERATURE = 100.0  # OpenAI allows 2, vLLM any: a request vLLM serves is served
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range of a logit_bias value: [-100, 100]


class RequestError(InputError):
    """A request parameter is out of range: `param` names it (OpenAI's error field)."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full: try again later (HTTP 503 with Retry-After)."""


def _number(name: str, value, low: float, high: float, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or value < low or value > high or (low_open and value == low):
        bound = f"{'(' if low_open else '['}{low}, {high}]"
        raise RequestError(name, f"{name} must be a number in {bound}, found {value!r}")
    return float(value)


def _whole(name: str, value, low: int, high: int) -> int:
    if not is_whole_number(value) or not low <= value <= high:
        raise RequestError(name, f"{name} must be a whole number in [{low}, {high}], found {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class RequestParams:
    """One request's generation settings. temperature 0 = greedy; top_k 0, top_p 1 and min_p 0 = off; presence and
    frequency penalties as OpenAI defines them, over the tokens generated so far; `repetition_penalty` as Hugging
    Face and vLLM define it (1 = off; a logit of a token in the prompt or generated so far is divided by it when
    positive, multiplied when negative); `logit_bias` (token id, value in [-100, 100]) pairs added to the logits;
    `allowed_token_ids` (vLLM's) every other token banned; `bad_words` token sequences whose last token is banned
    where the tokens before it were just generated (vLLM's, tokenized); `min_tokens` EOS and `stop_token_ids`
    banned and stop strings ignored until that many tokens are generated; `logprobs` None = none, else how many top
    alternatives (0-20) come with each token's own log-probability; `seed` None = a fresh random seed;
    `include_stop_str_in_output` keeps a matched stop string in the text; `skip_special_tokens` False decodes
    special tokens as text; `constraint` a compiled grammar (jmoe.serve.grammar.Constraint) every token must
    follow, or None."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    constraint: object | None = None

    def __post_init__(self):
        _whole("max_tokens", self.max_tokens, 1, 2**31 - 1)
        _number("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _whole("top_k", self.top_k, 0, 2**31 - 1)
        _number("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _whole("seed", self.seed, 0, SEED_LIMIT - 1)
        _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, numbers.Real) or not math.isfinite(rp) or rp <= 0:
            raise RequestError("repetition_penalty", f"repetition_penalty must be a number > 0 (1 = off), found {rp!r}")
        if not isinstance(self.logit_bias, tuple) or not all(
                isinstance(pair, tuple) and len(pair) == 2 and is_whole_number(pair[0]) and pair[0] >= 0
                for pair in self.logit_bias):
            raise RequestError("logit_bias", f"logit_bias must map token ids to numbers, found {self.logit_bias!r}")
        for token, value in self.logit_bias:
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
                    or abs(value) > LOGIT_BIAS_LIMIT:
                raise RequestError("logit_bias", f"logit_bias of token {token} must be a number in "
                                                 f"[-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], found {value!r}")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, tuple) or not self.allowed_token_ids
                or not all(is_whole_number(t) and t >= 0 for t in self.allowed_token_ids)):
            raise RequestError("allowed_token_ids", f"allowed_token_ids must be a non-empty list of token ids, found "
                                                    f"{self.allowed_token_ids!r}")
        if not isinstance(self.bad_words, tuple) or not all(
                isinstance(w, tuple) and w and all(is_whole_number(t) and t >= 0 for t in w) for w in self.bad_words):
            raise RequestError("bad_words", f"bad_words must be non-empty token sequences, found {self.bad_words!r}")
        _whole("min_tokens", self.min_tokens, 0, self.max_tokens)
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop) \
                or len(self.stop) > MAX_STOP_STRINGS:
            raise RequestError("stop", f"stop must be up to {MAX_STOP_STRINGS} non-empty strings, found "
                                       f"{self.stop!r}")
        if not isinstance(self.stop_token_ids, tuple) or not all(is_whole_number(t) and t >= 0
                                                                 for t in self.stop_token_ids):
            raise RequestError("stop_token_ids", f"stop_token_ids must be token ids (whole numbers >= 0), found "
                                                 f"{self.stop_token_ids!r}")
        if self.logprobs is not None:
            _whole("top_logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(name, f"{name} must be true or false, found {getattr(self, name)!r}")

    def check_vocabulary(self, vocab_size: int) -> None:
        """Every token id the parameters name is inside the model's vocabulary (RequestError naming the field)."""
        for name, ids in (("logit_bias", [t for t, _ in self.logit_bias]), ("stop_token_ids", self.stop_token_ids),
                          ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("bad_words", [t for w in self.bad_words for t in w])):
            outside = [t for t in ids if t >= vocab_size]
            if outside:
                raise RequestError(name, f"{name} names token {outside[0]}, outside the model's vocabulary of "
                                         f"{vocab_size} tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def biased(self) -> bool:
        """Some step of this request adds a bias over the vocabulary (logit_bias, banned or allowed tokens, a
        grammar): its steps need the token-choice program's `biased` variant."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or self.min_tokens > 0 \
            or bool(self.bad_words) or self.constraint is not None

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no penalty, no bias and no log-probabilities: the token is the argmax of the raw logits."""
        return self.greedy and not self.presence_penalty and not self.frequency_penalty \
            and self.repetition_penalty == 1.0 and self.logprobs is None and not self.biased


def generation_defaults(model_dir: str | Path | None) -> dict:
    """The sampling defaults a checkpoint's generation_config.json sets, as RequestParams fields:
    `do_sample: false` means greedy (temperature 0); otherwise its temperature, top_p and top_k where given.
    Empty without the file."""
    path = None if model_dir is None else Path(model_dir) / "generation_config.json"
    if path is None or not path.is_file():
        return {}
    config = read_json(path, "generation_config.json", ConfigError, "fix or remove it")
    if config.get("do_sample") is False:
        return {"temperature": 0.0}
    names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}
    defaults = {field: config[key] for key, field in names.items() if config.get(key) is not None}
    try:
        RequestParams(max_tokens=1, **defaults)
    except RequestError as e:
        raise ConfigError(f"{path}: {e}; fix the file or remove the key") from e
    return defaults
