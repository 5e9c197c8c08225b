"""Text as it is generated: incremental detokenisation and a stdout streamer for the generation loop."""

from __future__ import annotations

import sys
from typing import Callable

from jmoe.checkpoint.tokenizer import TextTokenizer


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
