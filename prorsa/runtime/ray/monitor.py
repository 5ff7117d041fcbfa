"""Poll every live engine's scheduler load in the background, for synchronous observers.

The controller's ``observe()`` is synchronous and must not wait on engines, so a
:class:`LoadMonitor` task asks each engine for :meth:`EngineServer.load` every
``interval_s`` and keeps the latest answer. KV numbers then come from vLLM itself
(``source == "vllm"``). Engines that do not answer ``load`` (test fakes, an older actor) or
have not stepped yet fall back to the router's own accounting of the legs it has in
flight (``source == "router-estimate"``): prompt plus ``max_tokens`` per running decode
leg, the context per prefill leg, which over-counts shared prefixes and blocks not yet
filled.

With ``stall_timeout_s`` the monitor also takes stuck engines out of service. A hung GPU
or collective leaves the actor alive and answering while its engine never steps again,
so no call fails and turns on it would wait for ever. An engine counts as stuck when it
holds requests, is neither paused nor asleep, and either its step counter has not moved
or it has not answered a poll, for ``stall_timeout_s``. Its legs are then served
elsewhere (:meth:`RolePools.mark_dead` tells the listeners).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from prorsa.runtime.ray.client import EngineUnavailable
from prorsa.runtime.ray.pools import EngineState, RolePools

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KvReading:
    """KV use of one engine and where the numbers came from."""

    used_tokens: int
    capacity_tokens: int
    running: int | None
    waiting: int | None
    source: str  # "vllm" | "router-estimate"


class LoadMonitor:
    """Background poller of engine load over :class:`RolePools`.

    Args:
        pools: the engines to poll (dead ones are skipped).
        interval_s: time between polls.
        timeout_s: longest wait for one engine's answer.
        stall_timeout_s: take an engine out of service once it has held requests this
            long without stepping or answering (``None``: never; see the module
            docstring).
    """

    def __init__(
        self,
        pools: RolePools,
        interval_s: float = 0.25,
        timeout_s: float = 5.0,
        stall_timeout_s: float | None = None,
    ) -> None:
        self.pools = pools
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.stall_timeout_s = stall_timeout_s
        self._stuck_since: dict[int, float] = {}  # engine -> since when it holds work unmoved
        self._answered_s: dict[int, float] = {}  # engine -> when it last answered a poll
        self.latest: dict[int, dict[str, Any]] = {}
        self.peak_kv_usage: dict[int, float] = {}  # highest vLLM-reported share seen
        self.polls = 0
        self._unsupported: set[int] = set()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start polling on the running loop (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop polling and wait for the task to end."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _ask(self, client: Any) -> Any:
        # load() is called once this runs, not when the poll hands the question over: a
        # poll cancelled in between (a shutdown) then leaves no coroutine never awaited.
        return await asyncio.wait_for(client.load(), self.timeout_s)

    async def poll_once(self) -> None:
        """Ask every live engine once (concurrently)."""
        engines = [
            e
            for e in self.pools.engines()
            if e.alive and e.engine_id not in self._unsupported and hasattr(e.client, "load")
        ]
        answers = await asyncio.gather(
            *(self._ask(e.client) for e in engines), return_exceptions=True
        )
        now = time.monotonic()
        stuck: dict[int, str] = {}
        for engine, answer in zip(engines, answers, strict=True):
            if isinstance(answer, dict):
                self._answered_s[engine.engine_id] = now
                self._watch_steps(engine, answer, now, stuck)
                self.latest[engine.engine_id] = answer
                usage = float(answer.get("kv_usage") or 0.0)
                peak = self.peak_kv_usage.get(engine.engine_id, 0.0)
                self.peak_kv_usage[engine.engine_id] = max(peak, usage)
            elif isinstance(answer, AttributeError | NotImplementedError):
                self._unsupported.add(engine.engine_id)
            elif isinstance(answer, TimeoutError) or (
                isinstance(answer, EngineUnavailable) and answer.transient
            ):
                self._watch_silence(engine, now, stuck)
            elif isinstance(answer, EngineUnavailable):
                # An idle engine's death shows here first; the router finds it only when
                # it next sends work there.
                self.pools.mark_dead(engine.engine_id, cause=f"load poll failed: {answer}")
            else:
                logger.debug("load of engine %d: %r", engine.engine_id, answer)
        self._retire_stuck(stuck)
        self.polls += 1

    def _retire_stuck(self, stuck: dict[int, str]) -> None:
        if not stuck:
            return
        live = [e.engine_id for e in self.pools.engines() if e.alive]
        if set(stuck) >= set(live):
            # A fault that wide more likely lies outside the engines (a stalled host,
            # Ray); retiring them all would end the service for good.
            logger.warning("every live engine looks stuck, none retired: %s", stuck)
            return
        for eid, cause in stuck.items():
            del self._stuck_since[eid]
            self.pools.mark_dead(eid, cause=cause)

    def _watch_steps(
        self, engine: EngineState, answer: dict[str, Any], now: float, stuck: dict[int, str]
    ) -> None:
        """Find ``engine`` stuck once it has held requests for ``stall_timeout_s``
        without stepping (the clock starts when it has work and restarts at every step)."""
        eid = engine.engine_id
        before = self.latest.get(eid) or {}
        if self.stall_timeout_s is None or not _working(answer) or "steps" not in answer:
            self._stuck_since.pop(eid, None)
            return
        if eid not in self._stuck_since or answer["steps"] != before.get("steps"):
            self._stuck_since[eid] = now
            return
        self._check(eid, now, f"no engine step with {answer['in_flight']} request(s)", stuck)

    def _watch_silence(self, engine: EngineState, now: float, stuck: dict[int, str]) -> None:
        """Find ``engine`` stuck once it has not answered for ``stall_timeout_s`` while
        the router has legs on it, unless its last answer showed it held (paused, asleep
        or busy)."""
        eid = engine.engine_id
        if self.stall_timeout_s is None:
            return
        last = self.latest.get(eid)
        if not engine.leases or (last is not None and not _working(last, legs=True)):
            self._stuck_since.pop(eid, None)
            return
        # Silent since its last answer (or since it had work unmoved, if earlier).
        self._stuck_since.setdefault(eid, self._answered_s.get(eid, now))
        self._check(eid, now, "no answer to load polls with legs on it", stuck)

    def _check(self, eid: int, now: float, what: str, stuck: dict[int, str]) -> None:
        assert self.stall_timeout_s is not None
        stuck_s = now - self._stuck_since[eid]
        if stuck_s >= self.stall_timeout_s:
            stuck[eid] = f"stuck: {what} for {stuck_s:.0f} s"

    async def _run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:  # a listener's fault must not end stall detection
                logger.exception("load poll failed; polling on")
            await asyncio.sleep(self.interval_s)

    def reading(self, engine: EngineState) -> KvReading:
        """The engine's KV use: vLLM's last report, else the router's estimate."""
        answer = self.latest.get(engine.engine_id)
        if answer and answer.get("kv_capacity_tokens") and answer.get("steps"):
            return KvReading(
                used_tokens=int(answer["kv_used_tokens"]),
                capacity_tokens=int(answer["kv_capacity_tokens"]),
                running=int(answer["running"]),
                waiting=int(answer["waiting"]),
                source="vllm",
            )
        return estimate(engine, answer)


def estimate(engine: EngineState, answer: dict[str, Any] | None = None) -> KvReading:
    """KV use from the router's leases (an upper bound; see the module docstring)."""
    capacity = engine.kv_capacity_tokens or int((answer or {}).get("kv_capacity_tokens") or 0)
    used = sum(lease.tokens for lease in engine.leases.values())
    return KvReading(
        used_tokens=min(used, capacity) if capacity else used,
        capacity_tokens=capacity,
        running=None,
        waiting=None,
        source="router-estimate",
    )


def _working(answer: dict[str, Any], *, legs: bool = False) -> bool:
    """Whether a ``load`` answer shows an engine that should be stepping: it holds
    requests (or the router has ``legs`` on it) and is neither paused, asleep nor in a
    long control call. Actors that do not report those states never count."""
    if "paused" not in answer:
        return False
    held = answer["paused"] or answer.get("sleeping") or answer.get("busy")
    return not held and (legs or bool(answer.get("in_flight")))
