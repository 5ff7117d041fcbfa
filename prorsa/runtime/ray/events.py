"""Lifecycle telemetry from the real runtime: a thin, optional wrapper over ``Recorder``.

Times are seconds on an injected clock (by default wall-clock seconds since the router
started), so the stream lines up with the simulator's. Every event of one trajectory is
emitted in order from one coroutine, which keeps the recorder's per-trajectory ordering
check satisfied.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from prorsa.telemetry.recorder import Recorder
from prorsa.telemetry.schema import EventKind, detail_json

logger = logging.getLogger(__name__)


def monotonic_clock() -> Callable[[], float]:
    """A clock reading seconds since it was made."""
    origin = time.monotonic()
    return lambda: time.monotonic() - origin


class EventSink:
    """Records lifecycle events when a recorder is given; a no-op otherwise."""

    def __init__(self, recorder: Recorder | None, clock: Callable[[], float] | None) -> None:
        self.recorder = recorder
        self.clock = clock or monotonic_clock()

    def now(self) -> float:
        return self.clock()

    def turn(
        self,
        kind: EventKind,
        at: float,
        trajectory_id: str,
        turn: int,
        *,
        engine_id: int = -1,
        group_id: str = "",
        task: str = "",
        context_tokens: int = 0,
        new_tokens: int = 0,
        cached_tokens: int = 0,
        output_tokens: int = 0,
        **detail: Any,
    ) -> None:
        """One trajectory-stage event."""
        if self.recorder is None:
            return
        self.recorder.record(
            at,
            trajectory_id,
            kind,
            turn=turn,
            group_id=group_id,
            task=task,
            engine_id=engine_id,
            context_tokens=max(0, context_tokens),
            new_tokens=max(0, new_tokens),
            cached_tokens=max(0, cached_tokens),
            output_tokens=max(0, output_tokens),
            detail=detail_json(**detail),
        )

    def cluster(self, kind: EventKind, engine_id: int, **detail: Any) -> None:
        """One cluster event (role switch, allocation); not tied to a trajectory."""
        if self.recorder is None:
            return
        self.recorder.record(
            self.now(), "", kind, engine_id=engine_id, detail=detail_json(**detail)
        )
