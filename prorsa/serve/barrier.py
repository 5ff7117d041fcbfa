"""Hold legs back from the engines while their weights change.

During a weight update no request may sit inside an engine: one queued there would run
after the update, possibly on a prompt prefix or a KV handoff computed before it. The
router re-routes legs on its own (after an abort, a failure, a switch), so the service
cannot simply stop calling it; instead every engine client the router holds is wrapped in
a :class:`BarrierClient`, and a new leg waits at the :class:`DispatchBarrier` until the
update is over. Everything except starting a leg passes straight through.

The barrier also counts the legs already past it, per engine: a Ray call is on its way
before the engine registers the request, so an engine's own list of requests can be empty
while a leg is still about to arrive there.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from typing import Any


class DispatchBarrier:
    """Closed during a weight update; legs wait at it. One asyncio loop."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.held = 0
        self.passed: Counter[int] = Counter()  # legs past the barrier and not back, per engine

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    async def wait(self) -> None:
        if self._open.is_set():
            return
        self.held += 1
        try:
            await self._open.wait()
        finally:
            self.held -= 1

    def legs_past(self, engine_ids: Iterable[int]) -> dict[int, int]:
        """Legs that passed the barrier and have not returned, on these engines (only
        engines with any)."""
        return {e: self.passed[e] for e in engine_ids if self.passed[e]}


class BarrierClient:
    """An engine client whose new legs wait at a :class:`DispatchBarrier`.

    Args:
        client: the engine client the router would use.
        barrier: where new legs wait during a weight update.
        stream_legs: forward the router's streaming legs as streams. Off, a leg is one
            call: under concurrency a Ray streaming call costs two to three times a plain
            one, and the router places the first-token event from the engine's own timing
            instead (the turn's live state then changes when the leg ends).
    """

    def __init__(self, client: Any, barrier: DispatchBarrier, *, stream_legs: bool = True) -> None:
        self.inner = client
        self.engine_id = client.engine_id
        self.barrier = barrier
        self.stream_legs = stream_legs

    async def generate_stream(self, *args: Any, **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        await self.barrier.wait()
        self.barrier.passed[self.engine_id] += 1
        try:
            if not self.stream_legs:
                yield await self.inner.generate(*args, **kwargs)
                return
            async for item in self.inner.generate_stream(*args, **kwargs):
                yield item
        finally:
            self.barrier.passed[self.engine_id] -= 1

    async def generate(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        await self.barrier.wait()
        self.barrier.passed[self.engine_id] += 1
        try:
            return await self.inner.generate(*args, **kwargs)
        finally:
            self.barrier.passed[self.engine_id] -= 1

    def __getattr__(self, name: str) -> Any:
        # Control calls (abort, pause, weights, health, ...) are never held back.
        return getattr(self.inner, name)
