"""Memory housekeeping of long runs (`specula.runtime.heap`)."""

import gc

from specula.runtime.heap import long_lived_objects_frozen


def test_objects_alive_at_startup_are_hidden_from_collections_inside_and_given_back_after():
    """A bench's timed questions and a server's requests run with the startup's objects frozen, so that a full
    collection walks only what the run made since; on exit the collector sees everything again."""
    assert gc.get_freeze_count() == 0
    with long_lived_objects_frozen():
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # torch and pytest alone make this many
        made_inside = [[i] for i in range(1000)]
        # What the run makes stays collectable: the frozen set does not grow (it may shrink: a frozen object
        # whose last reference goes, say another test thread's, is freed by its count).
        assert gc.get_freeze_count() <= frozen
    assert gc.get_freeze_count() == 0
    del made_inside


def test_a_cycle_made_inside_is_still_collected():
    with long_lived_objects_frozen():
        cycle: list = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1
