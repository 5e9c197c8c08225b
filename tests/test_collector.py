"""jmoe.collector: what is alive at the freeze leaves the collector's walks, and what is made after is still
collected."""

import gc
import weakref

import pytest

from jmoe.collector import FIRST_GENERATION_THRESHOLD, freeze_loaded


class Node:
    pass


@pytest.mark.quick
def test_freeze_keeps_collecting_new_cycles():
    before = Node()
    before.self = before  # a cycle dropped before the freeze: its collection takes it, nothing frozen holds it
    frozen = weakref.ref(before)
    del before
    freeze_loaded()
    assert frozen() is None
    kept = Node()
    kept.self = kept
    freeze_loaded()
    assert gc.isenabled() and gc.get_freeze_count() > 0
    assert gc.get_threshold()[0] == FIRST_GENERATION_THRESHOLD
    kept_ref = weakref.ref(kept)
    del kept
    gc.collect()
    assert kept_ref() is not None  # frozen objects are not walked for cycles
    after = Node()
    after.self = after
    made_after = weakref.ref(after)
    del after
    gc.collect()
    assert made_after() is None  # a cycle made after the freeze is collected
