"""Adapter that lets the controller drive a live :class:`PDRouter` on the wall clock.

:class:`RayActuator` implements ``prorsa.runtime.controller.Actuator`` (``observe``,
``switch``, ``set_local_prefill_threshold``, ``note_allocation``) plus ``apply`` for a whole
target map. Switches run as background tasks on the router's event loop, so the controller
tick never blocks; an engine already switching is left alone (a switch in progress is never
interrupted). :class:`AsyncioClock` is the matching ``Clock``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from prorsa.errors import ConfigError
from prorsa.policy.types import ClusterObservation, SlotView
from prorsa.runtime.ray.monitor import LoadMonitor, estimate
from prorsa.runtime.ray.pools import Role, parse_role
from prorsa.runtime.ray.router import PDRouter
from prorsa.telemetry.schema import EventKind

logger = logging.getLogger(__name__)


class AsyncioClock:
    """Wall-clock ``Clock`` on the running asyncio loop (seconds since construction)."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop or asyncio.get_running_loop()
        self.origin = self.loop.time()

    def now(self) -> float:
        return self.loop.time() - self.origin

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> None:
        self.loop.call_later(delay_s, callback)


class RayActuator:
    """Turns controller orders into live role switches on a router.

    Args:
        router: the router whose engines switch.
        drain_timeout_s: drain time per switch; the router's default when None.
        gpus_per_engine: GPUs one engine (one controller slot) holds.
        prefill_tokens_per_s: measured prefill throughput per role (per GPU), if known.
        decode_tokens_per_s: measured decode throughput per role (per GPU), if known.
        monitor: polls vLLM's scheduler load; without one KV use is the router's estimate.
        total_trajectories: trajectories in the run, if known (observation field).
    """

    def __init__(
        self,
        router: PDRouter,
        *,
        drain_timeout_s: float | None = None,
        gpus_per_engine: int = 1,
        prefill_tokens_per_s: Mapping[str, float] | None = None,
        decode_tokens_per_s: Mapping[str, float] | None = None,
        monitor: LoadMonitor | None = None,
        total_trajectories: int | None = None,
    ) -> None:
        self.router = router
        self.monitor = monitor
        self.total_trajectories = total_trajectories
        rows = router.events.rows
        self.live = LiveEvents(rows) if rows is not None else None
        self.kv_sources: dict[int, str] = {}
        self.drain_timeout_s = drain_timeout_s
        self.gpus_per_engine = gpus_per_engine
        self.prefill_tokens_per_s = dict(prefill_tokens_per_s or {})
        self.decode_tokens_per_s = dict(decode_tokens_per_s or {})
        self._tasks: dict[int, asyncio.Task] = {}
        self.results: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ actuation
    def apply(self, target_roles: Mapping[int, str]) -> list[int]:
        """Start a switch for every live engine whose role differs from its target.

        Returns the engine ids whose switch started. Must run on the router's loop.
        """
        return [eid for eid, role in sorted(target_roles.items()) if self.switch(eid, role)]

    def switch(self, slot_id: int, role: str) -> bool:
        """Start switching engine ``slot_id`` to ``role``; False when nothing to do."""
        target = parse_role(role)
        engine = self.router.pools.get(slot_id)
        if not engine.alive or engine.role in (Role.SWITCHING, target):
            return False
        task = self.router.start_switch(slot_id, target, self.drain_timeout_s)
        self._tasks[slot_id] = task
        task.add_done_callback(lambda t, eid=slot_id: self._done(eid, t))
        return True

    def set_local_prefill_threshold(self, tokens: int) -> None:
        self.router.set_local_prefill_threshold(tokens)

    def note_allocation(self, gpus: dict[str, int], reason: str) -> None:
        self.router.events.cluster(EventKind.ALLOCATION, -1, gpus=gpus, reason=reason)

    async def wait(self) -> list[dict[str, Any]]:
        """Wait for every switch started so far; returns their summaries."""
        tasks = list(self._tasks.values())
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        return list(self.results)

    @property
    def pending(self) -> list[int]:
        """Engines whose switch is still running."""
        return sorted(self._tasks)

    def _done(self, engine_id: int, task: asyncio.Task) -> None:
        self._tasks.pop(engine_id, None)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            logger.error("switch of engine %d failed: %s", engine_id, exc)
            if not isinstance(exc, ConfigError):
                self.results.append({"engine_id": engine_id, "error": str(exc)})
            return
        self.results.append(task.result())

    # ------------------------------------------------------------------ observation
    def observe(self) -> ClusterObservation:
        """The cluster now, as the controller's policies see it.

        KV use per engine comes from vLLM's scheduler through the :class:`LoadMonitor`
        when one is attached and the engine has reported (``kv_sources`` says which
        engines fell back to the router's estimate). Queues, running legs and trajectory
        states come from the router; ``live.rows`` is the router's event stream.
        """
        slots = []
        sources: dict[int, str] = {}
        for engine in self.router.pools.engines():
            if not engine.alive:
                continue
            switching = engine.role is Role.SWITCHING
            prefill_leases = [x for x in engine.leases.values() if x.role is Role.PREFILL]
            kv = self.monitor.reading(engine) if self.monitor is not None else estimate(engine)
            sources[engine.engine_id] = kv.source
            slots.append(
                SlotView(
                    slot_id=engine.engine_id,
                    role=engine.role.value,
                    target_role=engine.switching_to.value if switching else None,
                    gpus=self.gpus_per_engine,
                    engines=1,
                    queued_prefill_tokens=sum(x.tokens for x in prefill_leases),
                    running_sequences=len(engine.leases) - len(prefill_leases),
                    kv_used_tokens=kv.used_tokens,
                    kv_capacity_tokens=kv.capacity_tokens,
                    busy=not engine.idle,
                    since_s=engine.since_s,
                )
            )
        self.kv_sources = sources
        counts, tokens = self.router.trajectory_states()
        return ClusterObservation(
            time_s=self.router.events.now(),
            slots=tuple(slots),
            trajectory_state=counts,
            trajectory_tokens=tokens,
            prefill_tokens_per_s=dict(self.prefill_tokens_per_s),
            decode_tokens_per_s=dict(self.decode_tokens_per_s),
            completed_trajectories=self.router.completed_trajectories,
            total_trajectories=self.total_trajectories,
            local_prefill_threshold=self.router.config.local_prefill_threshold_tokens,
            live=self.live,
        )


class LiveEvents:
    """What ``ClusterObservation.live`` carries from the real runtime.

    ``rows`` is the router's in-memory event stream (tuples in
    :data:`prorsa.telemetry.schema.FIELDS` order, appended as events happen), the same
    attribute the simulator's cluster exposes, so an online forecast provider reading
    ``obs.live.rows[seen:]`` works unchanged on both.
    """

    def __init__(self, rows: list[tuple]) -> None:
        self.rows = rows
