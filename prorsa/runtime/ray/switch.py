"""Live role switch of one engine: the cluster model's state machine run on asyncio.

Stages (:class:`~prorsa.runtime.cluster.switching.SwitchStage`), as in the simulator:

1. ``stop_new_work``: mark the engine ``switching``; the router routes no new work to it.
2. ``draining``: a prefill engine's legs still waiting in its queue are aborted and served
   elsewhere at once; then wait up to ``drain_timeout_s`` for its legs (and, on a prefill
   engine, KV handoffs not yet pulled) to finish; then ``migrating``: abort legs still running —
   the router re-serves each on another engine of the old role (it sees
   ``finish_reason == "abort"`` on a lease marked ``evicted``).
3. ``reconfiguring``: pause the scheduler (anything that slipped in is aborted and
   re-routed), drop the prefix cache (``reset_prefix_cache_on_switch``), resume.
4. ``serving``: the engine takes work of its new role.

A switch between decode and colocated is a relabel (the same ``kv_both`` engine, used
differently by the router): no drain, no pause. A switch that would leave no decode-side
engine is refused, and a switch in progress is never interrupted. Telemetry marks
``stop_new_work``, ``drained`` and ``serving`` through the shared emitter; the ``serving``
event's detail also carries each stage's wall time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from prorsa.errors import ConfigError
from prorsa.runtime.cluster.switching import (
    RoleSwitch,
    SwitchKind,
    classify_switch,
    strands_decode,
)
from prorsa.runtime.cluster.telemetry import ClusterTelemetry
from prorsa.runtime.ray.client import EngineUnavailable, answered_within
from prorsa.runtime.ray.pools import EngineState, Lease, Role, RolePools, parse_role

if TYPE_CHECKING:
    from prorsa.runtime.ray.turns import RouterConfig

logger = logging.getLogger(__name__)


class RoleSwitcher:
    """Runs role switches on :class:`RolePools` (one at a time per engine)."""

    def __init__(
        self,
        pools: RolePools,
        telemetry: ClusterTelemetry,
        clock: Callable[[], float],
        config: RouterConfig,
        on_cache_reset: Callable[[int], None] | None = None,
    ) -> None:
        self.pools = pools
        self.telemetry = telemetry
        self.clock = clock
        self.config = config
        self.on_cache_reset = on_cache_reset
        # Reasons switches are refused now (a weight update, sleeping engines): a switch
        # reloads or relabels an engine, which must not race a change of its weights.
        self.holds: set[str] = set()
        self.completed = 0  # switches that ran to the end (relabels included, skips not)
        # Resumes after a failed switch, still running (a second cancel stopped the wait).
        self._resuming: dict[int, asyncio.Future[Any]] = {}

    def hold(self, reason: str) -> None:
        """Refuse new switches until :meth:`release` of the same ``reason``."""
        self.holds.add(reason)

    def release(self, reason: str) -> None:
        self.holds.discard(reason)

    async def switch(
        self, engine_id: int, new_role: str | Role, drain_timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Switch ``engine_id`` to ``new_role``; returns a summary (also the end event detail).

        Raises:
            ConfigError: unknown engine or role, dead engine, a switch already running, or
                a switch that would leave no decode-side engine.
        """
        return await self.begin(engine_id, new_role, drain_timeout_s)

    def begin(
        self, engine_id: int, new_role: str | Role, drain_timeout_s: float | None = None
    ) -> Coroutine[Any, Any, dict[str, Any]]:
        """Validate and mark the engine ``switching`` now; the returned coroutine does the rest.

        Splitting the synchronous part out lets a controller tick start several switches
        without awaiting and see them as ``switching`` at once.
        """
        if self.holds:
            raise ConfigError(
                f"role switches are held ({', '.join(sorted(self.holds))})",
                hint="retry after the weight update or wake-up",
            )
        engine = self.pools.get(engine_id)
        target = parse_role(new_role)
        if not engine.alive:
            raise ConfigError(f"engine {engine_id} is dead; it cannot switch roles")
        if engine.role is Role.SWITCHING:
            raise ConfigError(
                f"engine {engine_id} is already switching "
                f"({engine.switching_from} -> {engine.switching_to})",
                hint="a switch in progress is never interrupted; retry after it ends",
            )
        old = engine.role
        summary: dict[str, Any] = {"from": old.value, "to": target.value}
        roles = dict.fromkeys(("prefill", "decode", "colocated"), 1)  # one layout per engine
        kind = classify_switch(old.value, target.value, roles)
        if kind is SwitchKind.NONE:
            return _done({"engine_id": engine_id, **summary, "skipped": True})
        now = self.clock()
        switch = RoleSwitch(engine_id, old.value, target.value, "drain", now)
        if kind is SwitchKind.RELABEL:
            return _done(self._relabel(engine, switch, summary))
        left = sum(
            1
            for e in self.pools.engines()
            if e.engine_id != engine_id and e.accepting and e.role in (Role.DECODE, Role.COLOCATED)
        )
        if strands_decode(old.value, left):
            raise ConfigError(
                f"switching engine {engine_id} would leave no decode or colocated engine",
                hint="switch another engine to decode first",
            )
        drain_timeout_s = (
            self.config.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        )
        engine.switch = switch
        self.pools.set_role(engine_id, Role.SWITCHING, now)
        self.telemetry.switch_event(
            now,
            switch,
            "stop_new_work",
            engine_id,
            drain_timeout_s=drain_timeout_s,
            in_flight=len(engine.leases),
            kv_pending=len(engine.kv_pending),
        )
        logger.info("engine %d: switching %s -> %s", engine_id, old, target)
        return self._complete(engine, switch, drain_timeout_s, summary)

    def abandon_unstarted(self, engine_id: int, switch: RoleSwitch | None) -> None:
        """End ``switch`` if its task was cancelled before its first step: ``begin``
        marked the engine ``switching``, and the body whose ``finally`` gives it a role
        back never ran. The engine returns to its old role; the switch ends with that
        error. Nothing to do for a switch that ran (or another since)."""
        engine = self.pools.get(engine_id)
        if switch is None or engine.switch is not switch:
            return
        now = self.clock()
        engine.switch = None
        self.pools.set_role(engine_id, parse_role(switch.from_role), now)
        switch.mark_drained(now)
        switch.mark_serving(now)
        self.telemetry.switch_event(
            now, switch, "serving", engine_id, error="cancelled before it started"
        )
        logger.warning("engine %d: switch cancelled before it started; back to %s", engine_id,
                       switch.from_role)  # fmt: skip

    def _relabel(
        self, engine: EngineState, switch: RoleSwitch, summary: dict[str, Any]
    ) -> dict[str, Any]:
        switch.relabel = True
        for stage in ("stop_new_work", "drained"):
            self.telemetry.switch_event(switch.started_s, switch, stage, engine.engine_id)
        engine.switches += 1
        self.completed += 1
        self.pools.set_role(engine.engine_id, parse_role(switch.to_role), switch.started_s)
        switch.mark_drained(switch.started_s)
        switch.mark_serving(switch.started_s)
        self.telemetry.switch_event(switch.started_s, switch, "serving", engine.engine_id)
        logger.info("engine %d: relabelled %s -> %s", engine.engine_id, switch.from_role,
                    switch.to_role)  # fmt: skip
        return {"engine_id": engine.engine_id, **summary, "relabel": True, "error": None}

    async def _complete(
        self,
        engine: EngineState,
        switch: RoleSwitch,
        drain_timeout_s: float,
        summary: dict[str, Any],
    ) -> dict[str, Any]:
        stages: dict[str, float] = {}
        error = None
        try:
            summary.update(await self._run_stages(engine, switch, drain_timeout_s, stages))
        except EngineUnavailable as exc:
            error = str(exc)
            self.pools.mark_dead(engine.engine_id, cause=f"role switch failed: {exc}")
        except BaseException as exc:  # e.g. vLLM refused the reset, or the task was cancelled
            error = f"{type(exc).__name__}: {exc}"
            await self._recover(engine, error)
            raise
        finally:
            final = parse_role(switch.to_role if error is None else switch.from_role)
            engine.switch = None
            engine.switches += error is None
            self.completed += error is None
            now = self.clock()
            resuming = self._resuming.get(engine.engine_id)
            if resuming is None or resuming.done():
                self.pools.set_role(engine.engine_id, final, now)
            # else: still paused; the resume's end gives it back its role (_recover)
            if switch.drained_s is None:
                switch.mark_drained(now)
            switch.mark_serving(now)
            summary.update(stages_s=stages, total_s=round(sum(stages.values()), 6), error=error)
            self.telemetry.switch_event(now, switch, "serving", engine.engine_id, **summary)
        logger.info("engine %d: now %s (%s)", engine.engine_id, engine.role, summary)
        return {"engine_id": engine.engine_id, **summary}

    async def _recover(self, engine: EngineState, error: str) -> None:
        """Resume an engine whose switch failed part-way (it may be paused) so it serves
        in its old role; one that will not resume leaves service. A paused engine left in
        service would hold every leg routed to it.

        The resume runs as its own task, shielded: a second cancellation (a shutdown
        after a cancelled switch) stops the wait, not the resume, and only the resume's
        own failure takes a healthy engine out of service."""
        resume = asyncio.ensure_future(
            answered_within(
                engine.client.resume(),
                engine.engine_id,
                "the resume after a failed switch",
                self.config.control_timeout_s,
            )
        )
        self._resuming[engine.engine_id] = resume
        old_role = parse_role(engine.switch.from_role) if engine.switch else None

        def settle(task: asyncio.Future[Any]) -> None:
            self._resuming.pop(engine.engine_id, None)
            failure = "cancelled" if task.cancelled() else task.exception()
            if failure is not None:
                self.pools.mark_dead(
                    engine.engine_id, cause=f"role switch failed ({error}), then resume: {failure}"
                )
            elif engine.role is Role.SWITCHING and engine.switch is None and old_role:
                # The switch ended (a second cancel) while this resume ran: routable now.
                self.pools.set_role(engine.engine_id, old_role, self.clock())

        resume.add_done_callback(settle)
        with contextlib.suppress(Exception):  # settled above: the engine left service
            await asyncio.shield(resume)

    async def _run_stages(
        self,
        engine: EngineState,
        switch: RoleSwitch,
        drain_timeout_s: float,
        stages: dict[str, float],
    ) -> dict[str, Any]:
        pools = self.pools

        def answered(what: str, call: Awaitable[Any]) -> Awaitable[Any]:
            # A stuck engine fails the switch and leaves service (its legs re-served).
            return answered_within(
                call, engine.engine_id, f"the switch's {what}", self.config.control_timeout_s
            )

        switch.begin_moving_work()
        evicted: list[str] = []
        if switch.from_role == Role.PREFILL.value:
            with _Stage(stages, "requeue"):
                evicted += await self._requeue_waiting(engine, answered)
        with _Stage(stages, "drain"):
            drained = await pools.wait_until(lambda: engine.idle, drain_timeout_s)
        in_flight_at_abort = len(engine.leases)
        requeued = len(evicted)
        if not drained:
            switch.migrate_rest()
            with _Stage(stages, "abort"):
                evicted += await _evict(engine, list(engine.leases.values()), answered)
                await pools.wait_until(lambda: engine.idle, self.config.abort_grace_s)
        switch.mark_drained(self.clock())
        self.telemetry.switch_event(switch.drained_s, switch, "drained", engine.engine_id)
        with _Stage(stages, "pause"):
            await answered("pause", engine.client.pause("abort"))
        reset = None
        if self.config.reset_prefix_cache_on_switch:
            with _Stage(stages, "reset"):
                reset = await answered("cache reset", engine.client.reset_prefix_cache())
            if self.on_cache_reset is not None:
                self.on_cache_reset(engine.engine_id)
        with _Stage(stages, "resume"):
            await answered("resume", engine.client.resume())
        return {
            "drained": drained,
            "requeued": requeued,
            "aborted": len(evicted) - requeued,
            "in_flight_at_abort": in_flight_at_abort if evicted else 0,
            "kv_pending_left": len(engine.kv_pending),
            "prefix_cache_reset": reset,
        }

    async def _requeue_waiting(
        self, engine: EngineState, answered: Callable[[str, Awaitable[Any]], Awaitable[Any]]
    ) -> list[str]:
        """Abort the prefill legs still waiting in the engine's queue, so the router serves
        them on another prefill engine now; only those running are drained (as the
        simulator re-routes a switching engine's queue and drains its running chunk).

        vLLM reports how many requests wait, not which: its queue is first come, first
        served, so they are the newest legs the router sent (its leases keep that order).
        Without a ``load`` call the engine's legs all drain."""
        if not hasattr(engine.client, "load"):
            return []
        try:
            load = await answered("load", engine.client.load())
        except (EngineUnavailable, AttributeError, NotImplementedError) as exc:
            # Optional: without an answer the switch drains every leg, as before.
            logger.info("engine %d gave no load before its switch: %s", engine.engine_id, exc)
            return []
        waiting = int(load.get("waiting") or 0) if isinstance(load, dict) else 0
        legs = [x for x in engine.leases.values() if x.role is Role.PREFILL]
        return await _evict(engine, legs[len(legs) - min(waiting, len(legs)) :], answered)


async def _evict(
    engine: EngineState,
    leases: list[Lease],
    answered: Callable[[str, Awaitable[Any]], Awaitable[Any]],
) -> list[str]:
    """Mark ``leases`` evicted (the router serves them elsewhere) and abort them on the
    engine; their request ids."""
    ids = []
    for lease in leases:
        lease.evicted = True
        ids.append(lease.request_id)
    if ids:
        await answered("abort", engine.client.abort(ids))
    return ids


class _Stage:
    """Times one named stage into ``stages`` (seconds)."""

    def __init__(self, stages: dict[str, float], name: str) -> None:
        self.stages, self.name = stages, name

    def __enter__(self) -> None:
        self.started = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.stages[self.name] = round(time.perf_counter() - self.started, 6)


async def _done(summary: dict[str, Any]) -> dict[str, Any]:
    return summary
