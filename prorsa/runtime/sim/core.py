"""Discrete-event core: one environment owns the clock, the event heap, ids and RNGs.

Events are ``(time, priority, sequence, callback, args)`` on a binary heap; the sequence
number makes ties deterministic (first scheduled, first run), so the same seed always
yields the same run. Nothing here is global: two environments never interact.

The simulator's engines and cluster push onto :attr:`Environment.heap` directly (see
:meth:`Environment.schedule` for the tuple), because a method call per event is a
measurable share of a simulated turn; everything else calls :meth:`schedule`.
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


class StopSimulation(Exception):
    """Raised inside a callback to end :meth:`Environment.run` early."""


class Environment:
    """Clock, event heap, id counters and random generators of one simulation.

    Attributes:
        heap: the event heap of ``(time, priority, next(sequence), callback, args)``;
            hot paths may ``heapq.heappush`` onto it directly with a time not before
            :attr:`now`.
        sequence: the tie-breaking counter (``next(env.sequence)`` for each pushed event).
    """

    __slots__ = ("_ids", "_stopped", "heap", "now", "rng", "seed", "sequence")

    def __init__(self, seed: int = 0) -> None:
        self.now = 0.0
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.heap: list[tuple] = []
        self.sequence = itertools.count()
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
        heapq.heappush(self.heap, (time, priority, next(self.sequence), callback, args))

    def peek(self) -> float:
        """Time of the next event, or ``inf`` when none is left."""
        return self.heap[0][0] if self.heap else float("inf")

    def step(self) -> None:
        """Process exactly one event."""
        time, _prio, _seq, callback, args = heapq.heappop(self.heap)
        self.now = time
        callback(*args)

    def run(self, until: float | None = None) -> float:
        """Process events until none is left, ``until`` is reached or a callback stops it.

        Returns the simulated time reached.
        """
        heap = self.heap
        pop = heapq.heappop
        self._stopped = False
        try:
            if until is None:
                while heap and not self._stopped:
                    time, _prio, _seq, callback, args = pop(heap)
                    self.now = time
                    callback(*args)
            else:
                while heap and not self._stopped:
                    if heap[0][0] > until:
                        self.now = until
                        break
                    time, _prio, _seq, callback, args = pop(heap)
                    self.now = time
                    callback(*args)
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
        return len(self.heap)
