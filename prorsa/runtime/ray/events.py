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
    """Records lifecycle events when a recorder is given; a no-op otherwise.

    With ``keep_rows`` every event is also appended to :attr:`rows` (tuples in ``FIELDS``
    order), the in-memory stream online forecasters read as ``obs.live.rows`` just as they
    read the simulator's.
    """

    def __init__(
        self,
        recorder: Recorder | None,
        clock: Callable[[], float] | None,
        *,
        keep_rows: bool = False,
        run_id: str | None = None,
    ) -> None:
        self.recorder = recorder
        self.clock = clock or monotonic_clock()
        self.run_id = run_id or (recorder.run_id if recorder is not None else "run")
        self.rows: list[tuple] | None = [] if keep_rows else None

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
        if self.recorder is None and self.rows is None:
            return
        self._append(
            (
                at,
                self.run_id,
                trajectory_id,
                group_id,
                task,
                turn,
                str(kind),
                engine_id,
                max(0, context_tokens),
                max(0, new_tokens),
                max(0, cached_tokens),
                max(0, output_tokens),
                detail_json(**detail),
            )
        )

    def cluster(self, kind: EventKind, engine_id: int, **detail: Any) -> None:
        """One cluster event (role switch, allocation); not tied to a trajectory."""
        if self.recorder is None and self.rows is None:
            return
        row = (self.now(), self.run_id, "", "", "", 0, str(kind), engine_id, 0, 0, 0, 0)
        self._append((*row, detail_json(**detail)))

    def _append(self, row: tuple) -> None:
        # The recorder validates first, so an invalid event reaches neither sink.
        if self.recorder is not None:
            self.recorder.append_row(row)
        if self.rows is not None:
            self.rows.append(row)
