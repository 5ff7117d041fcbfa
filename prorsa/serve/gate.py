"""Admission of new turns, and a count of the turns in flight.

The service closes the gate for a reason (``paused``, ``sleeping``, ``weight_sync``); a
turn that arrives while any reason holds waits at the gate (it is not refused: trainers
expect requests sent during a pause to be served after ``resume``). Closing never
touches turns already admitted; :meth:`AdmissionGate.drained` waits for them to leave.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class AdmissionGate:
    """Open unless some reason closes it; counts admitted turns. One asyncio loop."""

    def __init__(self) -> None:
        self._reasons: set[str] = set()
        self._changed = asyncio.Condition()
        self.in_flight = 0
        self.waiting = 0

    @property
    def is_open(self) -> bool:
        return not self._reasons

    @property
    def reasons(self) -> list[str]:
        return sorted(self._reasons)

    async def close(self, reason: str) -> None:
        async with self._changed:
            self._reasons.add(reason)
            self._changed.notify_all()

    async def open(self, reason: str) -> None:
        async with self._changed:
            self._reasons.discard(reason)
            self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def admitted(self) -> AsyncIterator[None]:
        """Wait until the gate is open, then count the caller in flight until it exits."""
        async with self._changed:
            self.waiting += 1
            try:
                await self._changed.wait_for(lambda: not self._reasons)
            finally:
                self.waiting -= 1
            self.in_flight += 1
        try:
            yield
        finally:
            async with self._changed:
                self.in_flight -= 1
                self._changed.notify_all()

    async def drained(self, timeout_s: float | None) -> bool:
        """Wait until no admitted turn is in flight; False after ``timeout_s``."""
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self.in_flight == 0), timeout_s
                )
            except TimeoutError:
                return self.in_flight == 0
        return True
