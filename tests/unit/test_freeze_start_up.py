"""llmsched.server.freeze_start_up_objects: what lives at the end of
start-up leaves the collector's generations; what serving allocates later
is still collected."""

from __future__ import annotations

import gc

from llmsched.server import freeze_start_up_objects


def test_objects_alive_at_start_up_are_frozen_and_later_ones_still_collected():
    class Node:
        pass

    before = Node()
    try:
        frozen = freeze_start_up_objects()
        # Frozen objects that die later leave the permanent generation, and
        # another thread of the process (pytest-xdist's) may free some
        # between the two calls: the count can only have fallen.
        assert 0 < gc.get_freeze_count() <= frozen
        after = Node()
        tracked = {id(o) for o in gc.get_objects()}
        assert id(before) not in tracked, "an object alive at start-up is still in a collected generation"
        assert id(after) in tracked, "an object made after start-up is out of the collector's reach"
        # A cycle made after start-up is still freed.
        cycle = Node()
        cycle.self = cycle
        del cycle
        assert gc.collect() > 0
    finally:
        gc.unfreeze()
