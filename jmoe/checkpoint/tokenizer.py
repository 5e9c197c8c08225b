"""tokenizer.json of a model directory, through the Hugging Face `tokenizers` library."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from jmoe.errors import ConfigError


class TextTokenizer:
    def __init__(self, path: Path):
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ConfigError(f"{path}: cannot read tokenizer ({e}); expected a Hugging Face tokenizer.json") from e

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens=False` leaves out what the tokenizer's post-processor would
        add (a BOS, say): a chat template writes those itself."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json's text (what a grammar engine builds its token table from)."""
        return self._tok.to_str()


def load_tokenizer(model_dir: Path) -> TextTokenizer | None:
    path = model_dir / "tokenizer.json"
    return TextTokenizer(path) if path.is_file() else None
