"""Prefix reuse: which tokens' keys and values each row of the serving engine's KV cache holds, and where a new
request should go to skip prefilling the longest prefix of its prompt that some row already holds.

Chat front-ends and agents resend the whole conversation every turn. A row keeps what its last request wrote when
that request ends (its prompt and every generated token but the last, never fed back), so the rows are a store of
`max_batch` prefixes, the least recently used overwritten first; a running request's columns are a source too (its
written columns never change while it runs: n choices of one prompt, agents sending one system prompt at once).
A request goes into the free row that holds its longest prefix, if that is worth having (MIN_COPIED tokens);
otherwise into the lowest free row (decode steps run the fewest first rows that hold every generating request), a
running row's prefix copied there, what that row held first moved to the free row least worth keeping. A reused
prefix always leaves the prompt's last token to compute, whose logits choose the first generated token.
"""

from __future__ import annotations

from typing import NamedTuple

# Fewer matching tokens than this are not worth a row copy (nor leaving the lowest free row): the smallest prefill
# chunk bucket, whose cost is about that of any shorter piece.
MIN_COPIED = 16


class Admission(NamedTuple):
    """Where a request goes: its row, the prompt tokens it skips, and the whole-row copies to make first, in order
    (source row, destination row)."""

    row: int
    reused: int
    copies: tuple[tuple[int, int], ...]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def written_tokens(request) -> list[int]:
    """The tokens whose keys and values `request` has written into its row, in column order."""
    if request.prefilled < len(request.prompt):
        return request.prompt[:request.prefilled]
    return request.prompt + request.tokens[:-1]


class RowPrefixes:
    """What every row holds (`held[row]`: token ids of columns 0..n-1) and when it was last used, for `rows` rows."""

    def __init__(self, rows: int):
        self.held: list[list[int]] = [[] for _ in range(rows)]
        self._last_used = [0] * rows
        self._clock = 0

    def forget_all(self) -> None:
        """The cache was emptied (warm-up, a failed step)."""
        self.held = [[] for _ in self.held]

    def spare_column(self, row: int) -> int:
        """A column of free `row` that a step may write without harm (the first one past what it holds; a request
        holds at most context - 1 columns, since its last token is never fed back)."""
        return len(self.held[row])

    def release(self, row: int, request) -> None:
        """`request` leaves `row`: the row keeps what it wrote."""
        self.held[row] = written_tokens(request)
        self._touch(row)

    def should_wait(self, prompt: list[int], occupants: list) -> bool:
        """Whether a request with `prompt` should wait for a row still prefilling a longer prefix of it than any row
        holds now (agents sending one long system prompt at once: the first computes it, the others copy it)."""
        usable = len(prompt) - 1
        now = max(min(common_prefix(prompt, tokens), usable) for tokens in self._contents(occupants))
        coming = max((min(common_prefix(prompt, o.prompt), usable) for o in occupants
                      if o is not None and o.prefilled < len(o.prompt)), default=0)
        return coming >= MIN_COPIED and coming > now

    def admit(self, prompt: list[int], free: list[int], occupants: list) -> Admission:
        """The row (one of `free`, in any order) for a request with `prompt`, given every row's occupant (None =
        free); the caller makes the copies, then sets the row's occupant."""
        free = sorted(free)
        held = self._contents(occupants)
        usable = len(prompt) - 1  # the last prompt token is always computed
        matches = [min(common_prefix(prompt, tokens), usable) for tokens in held]
        # The longest match; a free row before a running one (no copy), then the lowest row.
        best = max(range(len(held)), key=lambda r: (matches[r], occupants[r] is None, -r))
        if occupants[best] is None and matches[best] >= MIN_COPIED:
            return self._take(best, prompt, matches[best], ())
        lowest = free[0]
        copies = self._move_out(lowest, free[1:])
        if matches[best] >= MIN_COPIED:  # a running row's
            return self._take(lowest, prompt, matches[best], (*copies, (best, lowest)))
        return self._take(lowest, prompt, matches[lowest], copies)

    def _contents(self, occupants: list) -> list[list[int]]:
        """What every row holds: a free row what it kept, an occupied one what its occupant has written."""
        return [held if occupant is None else written_tokens(occupant)
                for held, occupant in zip(self.held, occupants)]

    def _move_out(self, row: int, others: list[int]) -> tuple[tuple[int, int], ...]:
        """Before free `row` is overwritten, the copy that keeps what it holds in the free row of `others` least
        worth keeping, unless what `row` holds is itself the least recently used."""
        if not self._worth_keeping(row) or not others:
            return ()
        spare = min(others, key=lambda r: (self._worth_keeping(r), self._last_used[r], r))
        if self._worth_keeping(spare) and self._last_used[spare] > self._last_used[row]:
            return ()
        self.held[spare] = self.held[row]
        self._last_used[spare] = self._last_used[row]
        return ((row, spare),)

    def _take(self, row: int, prompt: list[int], reused: int, copies) -> Admission:
        self.held[row] = prompt[:reused]  # until it is released, its occupant says what it holds
        self._touch(row)
        return Admission(row, reused, copies)

    def _worth_keeping(self, row: int) -> bool:
        return len(self.held[row]) >= MIN_COPIED

    def _touch(self, row: int) -> None:
        self._clock += 1
        self._last_used[row] = self._clock
