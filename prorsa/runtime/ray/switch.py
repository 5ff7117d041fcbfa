"""Live role switch of one engine: stop new work, drain, abort stragglers, reset, resume.

Stages (each timed in the ``role_switch_end`` event's ``detail``):

1. ``stop``: mark the engine ``switching``; the router routes no new work to it.
2. ``drain``: wait up to ``drain_timeout_s`` for its legs (and, on a prefill engine, KV
   handoffs not yet pulled) to finish.
3. ``abort``: abort legs still running; the router re-routes each to another engine of the
   old role (it sees ``finish_reason == "abort"`` on a lease marked ``evicted``).
4. ``pause``: stop the engine's scheduler (anything that slipped in is aborted and re-routed).
5. ``reset``: drop the prefix cache (``reset_prefix_cache_on_switch``).
6. ``resume``: mark the new role and resume scheduling.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from prorsa.errors import ConfigError
from prorsa.runtime.ray.client import EngineUnavailable
from prorsa.runtime.ray.events import EventSink
from prorsa.runtime.ray.pools import EngineState, Role, RolePools, parse_role
from prorsa.telemetry.schema import EventKind

if TYPE_CHECKING:
    from prorsa.runtime.ray.router import RouterConfig

logger = logging.getLogger(__name__)


class RoleSwitcher:
    """Runs role switches on :class:`RolePools` (one at a time per engine)."""

    def __init__(self, pools: RolePools, events: EventSink, config: RouterConfig) -> None:
        self.pools = pools
        self.events = events
        self.config = config

    async def switch(
        self, engine_id: int, new_role: str | Role, drain_timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Switch ``engine_id`` to ``new_role``; returns a summary (also the end event detail).

        Raises:
            ConfigError: unknown engine or role, dead engine, or a switch already running.
        """
        return await self.begin(engine_id, new_role, drain_timeout_s)

    def begin(
        self, engine_id: int, new_role: str | Role, drain_timeout_s: float | None = None
    ) -> Coroutine[Any, Any, dict[str, Any]]:
        """Validate and mark the engine ``switching`` now; the returned coroutine does the rest.

        Splitting the synchronous part out lets a controller tick start several switches
        without awaiting and see them as ``switching`` at once.
        """
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
        if old is target:
            return _done({"engine_id": engine_id, **summary, "skipped": True})
        drain_timeout_s = (
            self.config.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        )
        engine.switching_from, engine.switching_to = old, target
        self.pools.set_role(engine_id, Role.SWITCHING, self.events.now())
        self.events.cluster(
            EventKind.ROLE_SWITCH_START,
            engine_id,
            **summary,
            drain_timeout_s=drain_timeout_s,
            in_flight=len(engine.leases),
            kv_pending=len(engine.kv_pending),
        )
        logger.info("engine %d: switching %s -> %s", engine_id, old, target)
        return self._complete(engine, old, target, drain_timeout_s, summary)

    async def _complete(
        self,
        engine: EngineState,
        old: Role,
        target: Role,
        drain_timeout_s: float,
        summary: dict[str, Any],
    ) -> dict[str, Any]:
        stages: dict[str, float] = {}
        error = None
        try:
            summary.update(await self._run_stages(engine, drain_timeout_s, _StageClock(stages)))
        except EngineUnavailable as exc:
            error = str(exc)
            self.pools.mark_dead(engine.engine_id)
        finally:
            final = target if error is None else old
            engine.switching_from = engine.switching_to = None
            engine.switches += error is None
            self.pools.set_role(engine.engine_id, final, self.events.now())
            summary.update(stages_s=stages, total_s=round(sum(stages.values()), 6), error=error)
            self.events.cluster(EventKind.ROLE_SWITCH_END, engine.engine_id, **summary)
        logger.info("engine %d: now %s (%s)", engine.engine_id, engine.role, summary)
        return {"engine_id": engine.engine_id, **summary}

    async def _run_stages(
        self, engine: EngineState, drain_timeout_s: float, clock: _StageClock
    ) -> dict[str, Any]:
        pools = self.pools

        with clock("drain"):
            drained = await pools.wait_until(lambda: engine.idle, drain_timeout_s)
        in_flight_at_abort = len(engine.leases)
        evicted: list[str] = []
        if not drained:
            with clock("abort"):
                for lease in engine.leases.values():
                    lease.evicted = True
                    evicted.append(lease.request_id)
                if evicted:
                    await engine.client.abort(evicted)
                await pools.wait_until(lambda: engine.idle, self.config.abort_grace_s)
        with clock("pause"):
            await engine.client.pause("abort")
        reset = None
        if self.config.reset_prefix_cache_on_switch:
            with clock("reset"):
                reset = await engine.client.reset_prefix_cache()
        with clock("resume"):
            await engine.client.resume()
        return {
            "drained": drained,
            "aborted": len(evicted),
            "in_flight_at_abort": in_flight_at_abort if evicted else 0,
            "kv_pending_left": len(engine.kv_pending),
            "prefix_cache_reset": reset,
        }


class _StageClock:
    """Context manager factory timing named stages into a dict (seconds)."""

    def __init__(self, stages: dict[str, float]) -> None:
        self.stages = stages

    def __call__(self, name: str) -> _Stage:
        return _Stage(self.stages, name)


class _Stage:
    def __init__(self, stages: dict[str, float], name: str) -> None:
        self.stages, self.name = stages, name

    def __enter__(self) -> None:
        self.started = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.stages[self.name] = round(time.perf_counter() - self.started, 6)


async def _done(summary: dict[str, Any]) -> dict[str, Any]:
    return summary
