"""The serving process's start-up heap is kept out of full collections while it serves."""

from __future__ import annotations

import gc
import weakref

import pytest

from prorsa.runtime.gc_heap import startup_heap_frozen


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


@pytest.fixture(autouse=True)
def _unfrozen(monkeypatch):
    """Each test starts with nothing frozen and no server holding a freeze (one left
    running by an earlier test of the session must not decide these)."""
    from prorsa.runtime import gc_heap

    monkeypatch.setattr(gc_heap, "_holders", 0)
    monkeypatch.setattr(gc_heap, "_frozen_before", False)
    frozen_by_others = gc.get_freeze_count() > 0
    gc.unfreeze()
    yield
    gc.unfreeze()
    if frozen_by_others:
        gc.freeze()


def test_objects_alive_at_start_leave_the_collector_until_the_server_stops():
    node = _Node()
    ref = weakref.ref(node)
    with startup_heap_frozen() as frozen:
        assert frozen > 0 and gc.get_freeze_count() > 0
        del node
        gc.collect()
        assert ref() is not None  # frozen: a full collection does not even look at it
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None  # back in view once serving stops, and freed


def test_garbage_left_by_start_up_is_freed_not_frozen():
    node = _Node()
    ref = weakref.ref(node)
    del node
    with startup_heap_frozen():
        assert ref() is None


def test_switched_off_nothing_is_frozen():
    with startup_heap_frozen(False) as frozen:
        assert frozen == 0 == gc.get_freeze_count()


def test_servers_of_one_process_share_the_freeze_until_the_last_stops():
    with startup_heap_frozen():
        with startup_heap_frozen():
            assert gc.get_freeze_count() > 0
        assert gc.get_freeze_count() > 0  # the other server still serves
    assert gc.get_freeze_count() == 0


def test_a_freeze_the_process_made_itself_is_left_in_place():
    gc.freeze()
    before = gc.get_freeze_count()
    with startup_heap_frozen():
        assert gc.get_freeze_count() >= before
    assert gc.get_freeze_count() >= before > 0
