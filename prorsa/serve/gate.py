"""Admission of new turns, and a count of the turns in flight.

The service closes the gate for a reason (``paused``, ``sleeping``, ``weight_sync``); a
turn that arrives while any reason holds waits at the gate (it is not refused: trainers
expect requests sent during a pause to be served after ``resume``). Closing never
touches turns already admitted; :meth:`AdmissionGate.drained` waits for them to leave.
Everything runs on one event loop, so the open path takes no lock and never suspends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class AdmissionGate:
    """Open unless some reason closes it; counts admitted turns. One asyncio loop."""

    def __init__(self) -> None:
        self._reasons: set[str] = set()
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.in_flight = 0
        self.waiting = 0

    @property
    def is_open(self) -> bool:
        return not self._reasons

    @property
    def reasons(self) -> list[str]:
        return sorted(self._reasons)

    async def close(self, reason: str) -> None:
        self._reasons.add(reason)
        self._open.clear()

    async def open(self, reason: str) -> None:
        self._reasons.discard(reason)
        if not self._reasons:
            self._open.set()

    @contextlib.asynccontextmanager
    async def admitted(self) -> AsyncIterator[None]:
        """Wait until the gate is open, then count the caller in flight until it exits."""
        while self._reasons:  # checked again after every wake: it may have closed anew
            self.waiting += 1
            try:
                await self._open.wait()
            finally:
                self.waiting -= 1
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def drained(self, timeout_s: float | None) -> bool:
        """Wait until no admitted turn is in flight; False after ``timeout_s``."""
        if self.in_flight == 0:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return self.in_flight == 0
        return True
