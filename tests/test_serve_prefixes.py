"""Which row a request takes and which prefix it reuses (jmoe.serve.prefixes), without a model: the engine's tests
check the tokens of reused prefixes against generate."""

from types import SimpleNamespace

import pytest

from jmoe.serve.prefixes import MIN_COPIED, RowPrefixes, written_tokens

pytestmark = pytest.mark.quick

SYSTEM = list(range(100, 100 + 2 * MIN_COPIED))  # a shared prefix long enough to copy


def running(prompt, prefilled, tokens=()):
    return SimpleNamespace(prompt=list(prompt), prefilled=prefilled, tokens=list(tokens))


def released(prefixes, row, prompt, tokens):
    prefixes.release(row, running(prompt, len(prompt), tokens))


def test_written_tokens_leave_out_the_last_generated_token_and_the_unprefilled_prompt():
    assert written_tokens(running([1, 2, 3], 2)) == [1, 2]
    assert written_tokens(running([1, 2, 3], 3, [7, 8])) == [1, 2, 3, 7]


def test_a_second_turn_takes_its_own_row_in_place_and_always_computes_its_last_token():
    prefixes = RowPrefixes(4)
    released(prefixes, 2, SYSTEM + [1], [5, 6, 7])
    turn2 = SYSTEM + [1, 5, 6, 7, 9]
    assert prefixes.admit(turn2, [0, 1, 2, 3], [None] * 4) == (2, len(SYSTEM) + 3, ())
    # The same prompt again, its row the lowest free one: all but the last token reused, however few.
    released(prefixes, 1, [1, 2, 3], [4])
    assert prefixes.admit([1, 2, 3], [1, 3], [running([9], 1), None, running(turn2, 4), None]) == (1, 2, ())


def test_short_matches_stay_in_the_lowest_free_row():
    prefixes = RowPrefixes(3)
    released(prefixes, 2, [1, 2, 3, 4], [5])
    assert prefixes.admit([1, 2, 3, 9], [0, 1, 2], [None] * 3) == (0, 0, ())
    released(prefixes, 0, [1, 2, 3, 4], [5])
    assert prefixes.admit([1, 2, 3, 9], [0, 1, 2], [None] * 3) == (0, 3, ())


def test_a_running_rows_prefix_is_copied_into_the_lowest_free_row_whose_own_prefix_moves_to_an_empty_one():
    prefixes = RowPrefixes(4)
    released(prefixes, 1, [7] * MIN_COPIED, [1])  # worth keeping
    occupants = [running(SYSTEM + [1, 2], len(SYSTEM) + 2, [3]), None, None, None]
    admission = prefixes.admit(SYSTEM + [4], [1, 2, 3], occupants)
    assert admission == (1, len(SYSTEM), ((1, 2), (0, 1)))
    assert prefixes.held[2] == [7] * MIN_COPIED  # moved, then found where it went
    assert prefixes.admit([7] * MIN_COPIED + [1, 5], [2, 3], [*occupants[:1], running([0], 1), None, None]) == \
        (2, MIN_COPIED, ())


def test_the_least_recently_used_prefix_is_the_one_overwritten():
    prefixes = RowPrefixes(3)
    released(prefixes, 0, [1] * MIN_COPIED, [0])  # oldest
    released(prefixes, 2, [2] * MIN_COPIED, [0])
    released(prefixes, 1, [3] * MIN_COPIED, [0])
    # Row 0 is the lowest free row and holds the oldest prefix: overwritten, nothing moved.
    assert prefixes.admit([9] * 40, [0, 1, 2], [None] * 3) == (0, 0, ())
    # Now row 1 is the lowest free row; its prefix is newer than row 2's, so it moves over row 2's.
    assert prefixes.admit([8] * 40, [1, 2], [running([9] * 40, 40), None, None]) == (1, 0, ((1, 2),))
    assert prefixes.held[2] == [3] * MIN_COPIED


def test_a_request_waits_for_a_row_still_prefilling_a_longer_prefix_of_it():
    prefixes = RowPrefixes(2)
    prefilling = running(SYSTEM + [1], MIN_COPIED)  # half of the shared prompt written so far
    assert prefixes.should_wait(SYSTEM + [2], [prefilling, None])
    assert not prefixes.should_wait([5] * 40, [prefilling, None])  # nothing to share
    assert not prefixes.should_wait(SYSTEM + [2], [running(SYSTEM + [1], len(SYSTEM) + 1), None])  # copy it now
    released(prefixes, 1, SYSTEM + [1], [3])
    assert not prefixes.should_wait(SYSTEM + [2], [prefilling, None])  # a free row holds all it would get
