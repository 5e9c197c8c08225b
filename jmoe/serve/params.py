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
MAX_STOP_STRINGS = 4  # OpenAI's limit on `stop`
SEED_LIMIT = 2**32  # a seed is a uint32 inside the step


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
    """One request's generation settings. temperature 0 = greedy; top_k 0 and top_p 1 = off; penalties as
    OpenAI defines them, over the tokens generated so far; `logprobs` None = none, else how many top
    alternatives (0-20) come with each token's own log-probability; `seed` None = a fresh random seed."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        _whole("max_tokens", self.max_tokens, 1, 2**31 - 1)
        _number("temperature", self.temperature, 0.0, 2.0)
        _number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _whole("top_k", self.top_k, 0, 2**31 - 1)
        if self.seed is not None:
            _whole("seed", self.seed, 0, SEED_LIMIT - 1)
        _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
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
        if not isinstance(self.ignore_eos, bool):
            raise RequestError("ignore_eos", f"ignore_eos must be true or false, found {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no penalty and no log-probabilities: the token is the argmax of the raw logits."""
        return self.greedy and not self.presence_penalty and not self.frequency_penalty and self.logprobs is None


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
