"""Discrete-event core: one environment owns the clock, the event queue, ids and RNGs.

Events run in ``(time, priority, order scheduled)`` order, so ties are deterministic and
the same seed always yields the same run. Nothing here is global: two environments never
interact.

The queue is a binary heap of *distinct times* (plain floats) plus a dict from each time to
its event ``(priority, callback, args)``, or to a list of them in the order they were
scheduled when several share the time. A heap of floats compares far faster than one of
tuples, and the heap is popped once per simulated event; ties (rare but real: a whole
batch launched at t=0, identical engines) are resolved by priority, then scheduling order,
exactly as a ``(time, priority, sequence)`` tuple would be.

The simulator's engines and cluster schedule events inline (see :meth:`Environment.push`
for the lines they repeat); everything else calls :meth:`Environment.schedule`. An engine
whose decode epoch is cut short withdraws the epoch's end (:meth:`Environment.withdraw`)
instead of leaving it to run as a no-op; its time stays in the heap and is skipped.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

# Lower runs first among events at the same instant: completions free capacity before
# new work is placed, and the controller observes the settled state.
PRIORITY_COMPLETE = 0
PRIORITY_ARRIVAL = 1
PRIORITY_PLAN = 2
PRIORITY_CONTROL = 3

#: One scheduled event: ``(priority, callback, args)``.
Event = tuple[int, Callable[..., Any], tuple]


class StopSimulation(Exception):
    """Raised inside a callback to end :meth:`Environment.run` early."""


class Environment:
    """Clock, event queue, id counters and random generators of one simulation.

    Attributes:
        heap: the distinct times that have events, as a binary heap of floats.
        queue: time -> its event, or the list of its events in scheduling order.
    """

    __slots__ = ("_ids", "_stopped", "heap", "now", "queue", "rng", "seed")

    def __init__(self, seed: int = 0) -> None:
        self.now = 0.0
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.heap: list[float] = []
        self.queue: dict[float, Event | list[Event]] = {}
        self._ids: dict[str, itertools.count] = {}
        self._stopped = False

    def schedule(
        self,
        time: float,
        callback: Callable[..., Any],
        *args: Any,
        priority: int = PRIORITY_ARRIVAL,
    ) -> None:
        """Run ``callback(*args)`` at ``time`` (never in the past)."""
        if time < self.now:
            time = self.now
        self.push(time, (priority, callback, args))

    def push(self, time: float, event: Event) -> None:
        """Queue ``event`` at ``time`` (not before :attr:`now`). Hot paths inline it as::

        if queue.setdefault(time, event) is event:
            heappush(heap, time)
        else:
            env.tie(time, event)
        """
        if self.queue.setdefault(time, event) is event:
            heapq.heappush(self.heap, time)
        else:
            self.tie(time, event)

    def tie(self, time: float, event: Event) -> None:
        """Queue ``event`` at a time that already has events (after them, in order)."""
        queue = self.queue
        found = queue[time]
        if type(found) is list:
            found.append(event)
        else:
            queue[time] = [found, event]

    def withdraw(self, time: float, event: Event) -> None:
        """Drop ``event`` (queued at ``time``) when it is the only event there; otherwise
        it stays and its callback must recognise it as stale."""
        queue = self.queue
        if queue.get(time) is event:
            del queue[time]

    def _skip_withdrawn(self) -> None:
        heap, queue = self.heap, self.queue
        while heap and heap[0] not in queue:
            heapq.heappop(heap)

    def peek(self) -> float:
        """Time of the next event, or ``inf`` when none is left."""
        self._skip_withdrawn()
        return self.heap[0] if self.heap else float("inf")

    def _next(self) -> Event:
        """Remove and return the next event (its time becomes :attr:`now`)."""
        self._skip_withdrawn()
        time = self.heap[0]
        event = self.queue.pop(time)
        self.now = time
        if type(event) is not list:
            heapq.heappop(self.heap)
            return event
        return self._next_of_tie(time, event)

    def _next_of_tie(self, time: float, events: list[Event]) -> Event:
        """The first event of the lowest priority among ``events`` (all at ``time``); the
        rest stay queued at ``time``."""
        best = 0
        for i in range(1, len(events)):
            if events[i][0] < events[best][0]:
                best = i
        event = events.pop(best)
        if len(events) == 1:
            self.queue[time] = events[0]
        else:
            self.queue[time] = events
        return event

    def step(self) -> None:
        """Process exactly one event."""
        _prio, callback, args = self._next()
        callback(*args)

    def run(self, until: float | None = None) -> float:
        """Process events until none is left, ``until`` is reached or a callback stops it.

        Returns the simulated time reached.
        """
        heap = self.heap
        queue = self.queue
        pop = heapq.heappop
        limit = float("inf") if until is None else until
        self._stopped = False
        try:
            while heap and not self._stopped:
                time = heap[0]
                if time > limit:
                    self.now = limit
                    break
                event = queue.pop(time, None)
                if event is None:  # withdrawn
                    pop(heap)
                    continue
                self.now = time
                if type(event) is list:
                    event = self._next_of_tie(time, event)
                else:
                    pop(heap)
                event[1](*event[2])
        except StopSimulation:
            pass
        return self.now

    def stop(self) -> None:
        """End :meth:`run` after the current event."""
        self._stopped = True

    def next_id(self, kind: str) -> int:
        """A fresh integer id of ``kind``, counted per environment."""
        counter = self._ids.get(kind)
        if counter is None:
            counter = self._ids[kind] = itertools.count()
        return next(counter)

    @property
    def pending(self) -> int:
        """Events queued and not yet run."""
        return sum(len(e) if type(e) is list else 1 for e in self.queue.values())
