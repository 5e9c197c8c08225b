"""tokenizer.json through the Hugging Face `tokenizers` library, plus incremental detokenisation."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from tokenizers import Tokenizer

from jmoe.errors import ConfigError


class TextTokenizer:
    def __init__(self, path: Path):
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ConfigError(f"{path}: cannot read tokenizer ({e}); expected a Hugging Face tokenizer.json") from e

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(model_dir: Path) -> TextTokenizer | None:
    path = model_dir / "tokenizer.json"
    return TextTokenizer(path) if path.is_file() else None


class TextStream:
    """Turns a growing list of token ids into the text added since the last call.

    Decoding the whole sequence each time keeps multi-byte characters and merged spaces right; a
    trailing U+FFFD means a character is still incomplete, so it waits for the next token.
    """

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.emitted = 0

    def delta(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids)
        if text.endswith("\ufffd"):
            return ""
        new, self.emitted = text[self.emitted:], len(text)
        return new


def stdout_streamer(tokenizer: TextTokenizer) -> Callable[[list[list[int]]], None]:
    """An on_tokens callback that prints the first row's new text to stdout as tokens arrive."""
    stream = TextStream(tokenizer)

    def write(tokens: list[list[int]]) -> None:
        sys.stdout.write(stream.delta(tokens[0]))
        sys.stdout.flush()

    return write
