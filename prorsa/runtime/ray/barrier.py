"""Hold legs back from the engines while their weights change.

During a weight update no request may sit inside an engine: one queued there would run
after the update, possibly on a prompt prefix or a KV handoff computed before it. The
router re-routes legs on its own (after an abort, a failure, a switch), so the service
cannot simply stop calling it; instead every engine client the router holds is wrapped in
a :class:`BarrierClient`, and a new leg waits at the :class:`DispatchBarrier` until the
update is over. Everything except starting a leg passes straight through.

The barrier also keeps the legs already past it, per engine: a Ray call is on its way
before the engine registers the request, so an engine's own list of requests can be empty
while a leg is still about to arrive there. And when an engine leaves service while it
stops answering (no Ray error will ever come), :meth:`DispatchBarrier.drop_engine` ends
its legs with :class:`EngineUnavailable`, so the router serves those turns elsewhere.
``prorsa serve`` uses both; ``run_rollout`` only the second (its barrier never closes).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import Any

from prorsa.runtime.ray.client import EngineUnavailable


class DispatchBarrier:
    """Closed during a weight update; legs wait at it. One asyncio loop."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.held = 0
        self.legs: dict[int, set[asyncio.Task]] = {}  # past the barrier, not back; per engine
        self.dropped: dict[tuple[asyncio.Task, int], str] = {}  # ended by drop_engine, and why
        self.lost: dict[int, str] = {}  # engines out of service, and why: no leg enters them

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
        return {e: len(self.legs[e]) for e in engine_ids if self.legs.get(e)}

    def drop_engine(self, engine_id: int, reason: str) -> int:
        """End every leg on ``engine_id`` with :class:`EngineUnavailable` (the engine left
        service), and every later one, including legs that were planned for it and wait at
        the barrier; returns how many were running. Each leg's task is interrupted where
        it waits for the engine, nowhere else."""
        self.lost[engine_id] = reason
        tasks = self.legs.get(engine_id, ())
        for task in tasks:
            self.dropped[task, engine_id] = reason
            task.cancel()
        return len(tasks)

    def leg(self, engine_id: int) -> _Leg:
        """Context of one leg on ``engine_id`` (entered after :meth:`wait`)."""
        return _Leg(self, engine_id)


class _Leg:
    """Registers the running task as a leg on its engine; turns a cancellation by
    :meth:`DispatchBarrier.drop_engine` into :class:`EngineUnavailable`."""

    __slots__ = ("barrier", "engine_id", "task")

    def __init__(self, barrier: DispatchBarrier, engine_id: int) -> None:
        self.barrier, self.engine_id = barrier, engine_id

    def __enter__(self) -> None:
        lost = self.barrier.lost.get(self.engine_id)
        if lost is not None:  # planned before the engine left, then held at the barrier
            raise EngineUnavailable(self.engine_id, f"left service: {lost}")
        self.task = asyncio.current_task()
        self.barrier.legs.setdefault(self.engine_id, set()).add(self.task)

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.barrier.legs[self.engine_id].discard(self.task)
        reason = self.barrier.dropped.pop((self.task, self.engine_id), None)
        if reason is None or exc_type is not asyncio.CancelledError:
            return
        # A cancellation of the caller's own (the turn was cancelled too) goes on.
        if self.task.uncancel() == 0:
            raise EngineUnavailable(self.engine_id, f"left service: {reason}") from None


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
        with self.barrier.leg(self.engine_id):
            if not self.stream_legs:
                yield await self.inner.generate(*args, **kwargs)
                return
            async for item in self.inner.generate_stream(*args, **kwargs):
                yield item

    async def generate(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        await self.barrier.wait()
        with self.barrier.leg(self.engine_id):
            return await self.inner.generate(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # Control calls (abort, pause, weights, health, ...) are never held back.
        return getattr(self.inner, name)
