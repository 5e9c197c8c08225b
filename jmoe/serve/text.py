"""A request's text as its tokens arrive: incremental detokenisation that holds back what a stop string
might still claim."""

from __future__ import annotations

from jmoe.checkpoint.tokenizer import TextTokenizer


class StopText:
    """Turns a growing list of generated token ids into the text that may be sent now.

    The whole sequence is decoded each time (merged spaces and multi-byte characters come out right); a
    trailing U+FFFD is an incomplete character and waits. Text that could be the start of a stop string is
    held back until the next token settles it; when a stop string appears, the text before it is the last
    to go out and `stopped` turns true (OpenAI leaves the stop string itself out; `include_stop` keeps it, as
    vLLM's include_stop_str_in_output does). `skip_special_tokens` False decodes special tokens as text.
    """

    def __init__(self, tokenizer: TextTokenizer | None, stops: tuple[str, ...] = (), include_stop: bool = False,
                 skip_special_tokens: bool = True):
        if stops and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")  # RequestParams checks are made before this
        self.tokenizer = tokenizer
        self.stops = stops
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self.sent = 0  # characters of the decoded text already returned
        self.stopped = False

    def delta(self, ids: list[int], final: bool = False, may_stop: bool = True) -> str:
        """The text to send after `ids` (all tokens so far); `final`: nothing follows, send what is held;
        `may_stop` False (before min_tokens): stop strings are not looked for, and nothing is held back."""
        if self.tokenizer is None or self.stopped:
            return ""
        text = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        if text.endswith("\ufffd") and not final:
            return ""
        end = len(text)
        if self.stops and may_stop:
            # A stop string may straddle what was sent and what is new: search from the longest stop back.
            search_from = max(0, self.sent - max(map(len, self.stops)) + 1)
            found = [(i, len(s)) for i, s in ((text.find(s, search_from), s) for s in self.stops) if i >= 0]
            if found:
                start, length = min(found)
                end, self.stopped = start + length * self.include_stop, True
            elif not final:
                end -= self._held_back(text)
        end = max(end, self.sent)
        new, self.sent = text[self.sent:end], end
        return new

    def _held_back(self, text: str) -> int:
        """Length of the longest end of `text` that begins some stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if stop.startswith(text[-size:]):
                    longest = size
                    break
        return longest
