"""Adapter that lets the controller drive a live :class:`PDRouter` on the wall clock.

:class:`RayActuator` implements ``prorsa.runtime.controller.Actuator`` (``observe``,
``switch``, ``set_local_prefill_threshold``, ``note_allocation``) plus ``apply`` for a whole
target map. Switches run as background tasks on the router's event loop, so the controller
tick never blocks; an engine already switching is left alone (a switch in progress is never
interrupted). An engine that dies is recorded as an ``allocation`` event (``reason:
engine_lost``, the live GPUs per role after the loss) and listed in ``engines_lost``.
:class:`AsyncioClock` is the matching ``Clock``. The observation is built by
the cluster model's :func:`~prorsa.runtime.cluster.observation.build_observation`, as in
the simulator; one engine is one slot.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from prorsa.errors import ConfigError
from prorsa.policy.base import ClusterSpec
from prorsa.policy.types import ClusterObservation, SlotView, WorkloadShape
from prorsa.runtime.cluster.observation import build_observation
from prorsa.runtime.cluster.telemetry import ALLOCATION
from prorsa.runtime.ray.monitor import LoadMonitor, estimate
from prorsa.runtime.ray.pools import EngineState, Role, parse_role
from prorsa.runtime.ray.router import PDRouter

logger = logging.getLogger(__name__)

SERVING_ROLES = (Role.PREFILL, Role.DECODE, Role.COLOCATED)


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
        spec: the static cluster facts the policy was reset with (GPUs per engine,
            per-role throughput).
        drain_timeout_s: drain time per switch; the router's default when None.
        monitor: polls vLLM's scheduler load; without one KV use is the router's estimate.
        total_trajectories: trajectories in the run, if known (observation field).
        workload: the run's expected shape, if known (observation field).
    """

    def __init__(
        self,
        router: PDRouter,
        spec: ClusterSpec,
        *,
        drain_timeout_s: float | None = None,
        monitor: LoadMonitor | None = None,
        total_trajectories: int | None = None,
        workload: WorkloadShape | None = None,
    ) -> None:
        self.router = router
        self.spec = spec
        self.events = router.telemetry.log
        self.truth = None  # real engines have no ground truth
        self.monitor = monitor
        self.total_trajectories = total_trajectories
        self.workload = workload
        self.kv_sources: dict[int, str] = {}
        self.drain_timeout_s = drain_timeout_s
        self._tasks: dict[int, asyncio.Task] = {}
        self.results: list[dict[str, Any]] = []
        #: Engines found dead during the run, in the order they were lost.
        self.engines_lost: list[int] = []
        router.pools.on_engine_lost(self._engine_lost)

    # ------------------------------------------------------------------ actuation
    def apply(self, target_roles: Mapping[int, str]) -> list[int]:
        """Start a switch for every live engine whose role differs from its target.

        Returns the engine ids whose switch started. Must run on the router's loop.
        """
        return [eid for eid, role in sorted(target_roles.items()) if self.switch(eid, role)]

    def switch(self, slot_id: int, role: str) -> bool:
        """Start switching engine ``slot_id`` to ``role``; False when nothing to do or refused."""
        target = parse_role(role)
        engine = self.router.pools.get(slot_id)
        if not engine.alive or engine.role in (Role.SWITCHING, target):
            return False
        try:
            task = self.router.start_switch(slot_id, target, self.drain_timeout_s)
        except ConfigError as exc:  # e.g. it would leave no decode-side engine
            logger.info("switch of engine %d refused: %s", slot_id, exc)
            return False
        self._tasks[slot_id] = task
        task.add_done_callback(lambda t, eid=slot_id: self._done(eid, t))
        return True

    def set_local_prefill_threshold(self, tokens: int) -> None:
        self.router.set_local_prefill_threshold(tokens)

    def note_allocation(self, gpus: dict[str, int], reason: str) -> None:
        self.router.telemetry.allocation(self.router.now(), gpus, reason)

    def _engine_lost(self, engine: EngineState) -> None:
        """Record a lost engine: the cluster's allocation changed without an order."""
        self.engines_lost.append(engine.engine_id)
        counts = self.router.pools.counts()
        gpus = {r.value: counts[r.value] * self.spec.slot_gpus for r in SERVING_ROLES}
        role = engine.switching_from if engine.role is Role.SWITCHING else engine.role
        self.router.telemetry.cluster(
            self.router.now(),
            ALLOCATION,
            engine.engine_id,
            gpus=gpus,
            reason="engine_lost",
            role=role.value if role is not None else None,
            cause=engine.lost_cause,
        )
        logger.warning(
            "engine %d lost (%s); live GPUs per role now %s",
            engine.engine_id,
            engine.lost_cause,
            gpus,
        )

    async def wait(self) -> list[dict[str, Any]]:
        """Wait for every switch started so far; returns their summaries."""
        tasks = list(self._tasks.values())
        if tasks:
            await asyncio.wait(tasks)  # a cancelled waiter leaves the switches running
        return list(self.results)

    @property
    def pending(self) -> list[int]:
        """Engines whose switch is still running."""
        return sorted(self._tasks)

    def _done(self, engine_id: int, task: asyncio.Task) -> None:
        if self._tasks.get(engine_id) is task:  # not a newer switch of the same engine
            del self._tasks[engine_id]
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
    def slot_views(self) -> list[SlotView]:
        """Every live engine as a slot, as the controller sees it.

        KV use per engine comes from vLLM's scheduler through the :class:`LoadMonitor`
        when one is attached and the engine has reported (``kv_sources`` says which
        engines fell back to the router's estimate); queues, running legs and cached
        contexts come from the router.
        """
        views = []
        sources: dict[int, str] = {}
        cached = self.router.cached_tokens_by_engine()
        for engine in self.router.pools.engines():
            if not engine.alive:
                continue
            switching = engine.role is Role.SWITCHING
            prefill_legs = sum(1 for x in engine.leases.values() if x.role is Role.PREFILL)
            kv = self.monitor.reading(engine) if self.monitor is not None else estimate(engine)
            sources[engine.engine_id] = kv.source
            views.append(
                SlotView(
                    slot_id=engine.engine_id,
                    role=engine.role.value,
                    target_role=engine.switching_to.value if switching else None,
                    gpus=self.spec.slot_gpus,
                    engines=1,
                    queued_prefill_tokens=engine.queued_prefill_tokens,
                    running_sequences=len(engine.leases) - prefill_legs,
                    kv_used_tokens=kv.used_tokens,
                    kv_capacity_tokens=kv.capacity_tokens,
                    busy=not engine.idle,
                    since_s=engine.since_s,
                    cached_tokens=cached.get(engine.engine_id, 0),
                    source_role=engine.switching_from.value if switching else None,
                    drained_s=engine.switch.drained_s if engine.switch is not None else None,
                )
            )
        self.kv_sources = sources
        return views

    def observe(self) -> ClusterObservation:
        """The cluster now, as the controller's policies see it."""
        return build_observation(
            self.router.now(),
            self.slot_views(),
            self.router.states,
            self.spec,
            completed=self.router.completed_trajectories,
            total=self.total_trajectories,
            local_prefill_threshold=self.router.config.local_prefill_threshold_tokens,
            work=self.router.prefill_work,
            workload=self.workload,
        )
