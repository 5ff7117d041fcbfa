"""Weight updates across prefill, decode and colocated engines, with nothing served mixed.

No trainer's protocol covers disaggregated engines: a turn's prompt KV may be computed on
one engine and decoded on another, and a prefix cache may hold KV of earlier weights. The
protocol here (:meth:`WeightSync.quiesce`, then the update, then :meth:`WeightSync.release`):

1. close admission: new turns wait at the service's gate;
2. hold role switches (the controller's orders are skipped meanwhile) and wait for those
   already running, so no engine changes role mid-update;
3. let the turns in flight finish under the old weights (engines paused by the trainer
   are resumed for it, unless its pause aborted them: those wait for the new weights),
   for up to ``drain_timeout_s``;
4. close the dispatch barrier: no leg can enter an engine any more; if turns are still
   in flight, abort their legs — the router serves each again, from a fresh prefill, once
   the barrier opens (nothing is lost);
5. pause every engine and wait until none holds a request and no leg already past the
   barrier is still on its way to one;
6. (the caller) load the weights on every engine whatever its role, stamp the version,
   drop prefix caches and connector state, forget the router's cache residency;
7. resume the engines (unless the trainer paused them), open the barrier, allow
   switches, open admission, and record ``weight_sync`` events (start and end).

An engine that does not answer a pause, resume, abort or request list within
``engine_control_timeout_s`` leaves service, so one stuck engine cannot hold the update
(and every other engine) paused. Two engine-side guards close the remaining gaps:
requests are salted by weight version in the prefix cache, and a decode leg refuses KV
handed off under other weights (see ``EngineServer.generate_stream``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prorsa.runtime.ray.turns import NoEngineAvailable
from prorsa.telemetry.columns import KIND_CODE

if TYPE_CHECKING:
    from prorsa.serve.service import RolloutService

logger = logging.getLogger(__name__)

WEIGHT_SYNC = KIND_CODE["weight_sync"]
ENGINE_IDLE_TIMEOUT_S = 30.0


@dataclass
class SyncWindow:
    """What :meth:`WeightSync.quiesce` found and did."""

    started: float
    from_version: int
    drained: bool = True
    aborted_turns: int = 0
    engines: list[int] = field(default_factory=list)  # paused and empty for the update
    serving: list[int] = field(default_factory=list)  # live when the update began
    stages_s: dict[str, float] = field(default_factory=dict)
    detail: dict[str, Any] = field(default_factory=dict)  # the caller's, for the end event
    summary: dict[str, Any] = field(default_factory=dict)  # filled on release


class WeightSync:
    """Runs the protocol on one service's gate, barrier, router and engines."""

    def __init__(self, service: RolloutService) -> None:
        self.service = service
        self.lock = asyncio.Lock()  # one update at a time
        self.window: SyncWindow | None = None

    @contextlib.asynccontextmanager
    async def paused(self, drain_timeout_s: float) -> AsyncIterator[SyncWindow]:
        """One update: engines paused and empty inside the block, released after it
        (whatever happens inside); one at a time."""
        async with self.lock:
            window = SyncWindow(
                started=time.perf_counter(),
                from_version=self.service.weight_version,
                serving=self.service.live_engines(),
            )
            self.window = window
            try:
                await self.quiesce(window, drain_timeout_s)
                yield window
            except BaseException as exc:
                window.detail.setdefault("error", f"{type(exc).__name__}: {exc}")
                raise
            finally:
                await self.release(window)

    async def quiesce(self, window: SyncWindow, drain_timeout_s: float) -> None:
        """Steps 1-5; the engines are paused and empty on return."""
        svc = self.service
        svc.emit(WEIGHT_SYNC, stage="start", from_version=svc.weight_version)
        await svc.gate.close("weight_sync")
        svc.hold_switches("weight_sync")
        with _timed(window, "switches"):
            await svc.wait_for_switches()
        # Turns the trainer's abort pause stopped wait for the new weights: resumed now,
        # they would be generated again from the start under the old ones, delaying the
        # update by a whole generation (AReaL pauses this way before every update).
        aborted_by_trainer = svc.engines_paused_by_trainer and svc.trainer_pause_mode == "abort"
        if svc.engines_paused_by_trainer and not svc.sleeping and not aborted_by_trainer:
            await svc.control_engines(lambda c: c.resume(), "resume")  # let frozen turns finish
        with _timed(window, "drain"):
            window.drained = svc.gate.in_flight == 0
            if not svc.sleeping and not aborted_by_trainer:
                window.drained = await svc.gate.drained(drain_timeout_s)
        svc.barrier.close()
        with _timed(window, "pause"):
            if window.drained:
                await svc.control_engines(lambda c: c.pause("keep"), "pause")
            else:
                window.aborted_turns = svc.gate.in_flight
                if svc.sleeping:
                    # Frozen by a `keep` sleep: asleep, they cannot finish under the old
                    # weights, and kept they would go on under the new ones.
                    window.detail["aborted_because"] = "engines asleep"
                    logger.warning(
                        "weight sync: %d turns frozen in sleeping engines; aborted, they "
                        "are served again under the new weights",
                        window.aborted_turns,
                    )
                elif not aborted_by_trainer:
                    logger.warning(
                        "weight sync: %d turns still running after %.1f s; aborted, they "
                        "are served again under the new weights",
                        window.aborted_turns,
                        drain_timeout_s,
                    )
                await svc.control_engines(lambda c: c.pause("abort"), "pause")
            await self._wait_engines_empty()
        window.engines = sorted(svc.live_engines())

    async def release(self, window: SyncWindow) -> dict[str, Any]:
        """Step 7; returns the sync's summary (also the ``weight_sync`` end event's detail,
        recorded whatever happened, with an ``error`` when the update or the resume
        failed)."""
        svc = self.service
        try:
            if not svc.engines_paused_by_trainer and not svc.sleeping:
                await svc.control_engines(lambda c: c.resume(), "resume")
        except BaseException as exc:
            window.detail.setdefault("error", f"resume failed: {type(exc).__name__}: {exc}")
            raise
        finally:
            svc.barrier.open()
            svc.release_switches("weight_sync")
            await svc.gate.open("weight_sync")
            self.window = None
            window.summary = {
                "from_version": window.from_version,
                "version": svc.weight_version,
                "label": svc.weight_labels.label(svc.weight_version),
                "drained": window.drained,
                "aborted_turns": window.aborted_turns,
                "engines": window.engines,
                # Any that left during the update: failed a call, stopped answering, died.
                "left_service": sorted(set(window.serving) - set(svc.live_engines())),
                "stages_s": window.stages_s,
                "total_s": round(time.perf_counter() - window.started, 6),
                **window.detail,
            }
            svc.emit(WEIGHT_SYNC, stage="end", **window.summary)
        return window.summary

    async def _wait_engines_empty(self) -> None:
        """Until no engine holds a request and no leg is on its way to one (aborted legs
        leave within a step or two; a leg past the barrier reaches its engine's list only
        when the call arrives there)."""
        svc = self.service
        deadline = time.monotonic() + ENGINE_IDLE_TIMEOUT_S
        while True:
            busy = await svc.engine_requests()
            arriving = svc.barrier.legs_past(svc.live_engines())
            if not busy and not arriving:
                return
            if time.monotonic() > deadline:
                # The update cannot start (the window resumes every engine on the old
                # weights): the service cannot act now, a 503 the trainer may retry.
                raise NoEngineAvailable(
                    f"weight update not started: {ENGINE_IDLE_TIMEOUT_S:g} s after the abort, "
                    f"engines still hold requests {busy}; legs on their way: {arriving}"
                )
            if busy:
                await svc.control_engines(
                    lambda c, held=busy: c.abort(held[c.engine_id]), "abort", engine_ids=busy
                )
            await asyncio.sleep(0.01)


class _timed:
    def __init__(self, window: SyncWindow, stage: str) -> None:
        self.window, self.stage = window, stage

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.window.stages_s[self.stage] = round(time.perf_counter() - self.t0, 6)
