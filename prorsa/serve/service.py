"""A long-lived rollout service: engines, router, controller and telemetry behind one API.

:class:`RolloutService` is what an RL trainer talks to, in process, as a Ray actor
(:func:`~prorsa.serve.actor.rollout_service_actor`) or over HTTP (``prorsa serve``). It
starts (or adopts) an :class:`~prorsa.runtime.ray.cluster.EngineFleet`, gives the engines
the roles of the policy's first allocation, routes every turn through one
:class:`~prorsa.runtime.ray.router.PDRouter`, and — for dynamic policies — runs the
controller that switches roles as demand moves. Trainers name sessions; each is one
trajectory in the telemetry (:mod:`prorsa.serve.sessions`).

Control: ``pause``/``resume`` (vLLM's keep/abort/wait), ``sleep``/``wake_up``,
``update_weights_from_path`` (the cross-role protocol of :mod:`prorsa.serve.weight_sync`),
``collective_rpc`` for trainers that move weights themselves (wrapped in
``begin_weight_update``/``finish_weight_update`` so nothing is served mixed:
:mod:`prorsa.serve.trainer_push`), and role
switches. Every role switch, the controller's (its actuator calls the router) and an
operator's (:meth:`RolloutService.switch_role`), passes the router's switch holds, which
refuse while weights change, engines sleep or a trainer holds them paused.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from prorsa.errors import ConfigError, InputError, StateConflict
from prorsa.policy.types import WorkloadShape
from prorsa.runtime.ray.barrier import BarrierClient, DispatchBarrier
from prorsa.runtime.ray.client import answered_within
from prorsa.runtime.ray.engine_control import PAUSE_MODES, SLEEP_TAGS
from prorsa.runtime.ray.turns import NoEngineAvailable
from prorsa.runtime.ray.weights import check_weight_dir
from prorsa.serve.config import ServeConfig
from prorsa.serve.gate import AdmissionGate
from prorsa.serve.results import ServeTurnResult, served_result
from prorsa.serve.sampling import Sampling, ServeTurnRequest, parse_sampling
from prorsa.serve.sessions import Sessions
from prorsa.serve.shielded import wait_uncancelled
from prorsa.serve.startup import cluster_spec_for, load_tokenizer, make_policy_for, start_fleet
from prorsa.serve.trainer_push import TrainerPushWindow
from prorsa.serve.weight_labels import WeightLabels
from prorsa.serve.weight_sync import WeightSync

logger = logging.getLogger(__name__)

#: Control decisions a service keeps (with their forecasts): one an interval, the rest are
#: dropped (an unbounded list grows for the life of the service).
_DECISIONS_KEPT = 3600

ROUTING_KEYS = ("mode", "engine_id", "prefill_engine_id")
SESSION_SWEEP_S = 5.0


class RolloutService(TrainerPushWindow):
    """Engines + router + controller + telemetry, long-lived.

    Args:
        config: what to run; validated in :meth:`start`.
        fleet: an already started ``EngineFleet`` to adopt (left running on shutdown);
            None starts one (and Ray, if needed) and stops it on :meth:`shutdown`.
        policy: a policy object instead of ``config.policy``.
        forecaster: a forecast source instead of ``config.forecaster``.

    Use ``await RolloutService(config).start()``; every method runs on the event loop
    that started it.
    """

    def __init__(
        self,
        config: ServeConfig,
        *,
        fleet: Any = None,
        policy: Any = None,
        forecaster: Any = None,
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.policy = policy
        self.forecaster = forecaster
        self._owns_fleet = fleet is None
        self._owns_ray = False
        self.gate = AdmissionGate()
        self.barrier = DispatchBarrier()
        self.sync = WeightSync(self)
        self.weight_version = 0
        self.weight_labels = WeightLabels()  # trainers' names for the versions
        self.engines_paused_by_trainer = False
        self._resumes = 0  # resume() calls: a `wait` pause undone while it drained ends there
        #: The mode of the trainer's pause in force (None when not paused by the trainer).
        self.trainer_pause_mode: str | None = None
        self.sleeping = False
        #: The memory sleep released and no wake-up has brought back (vLLM's tags): a
        #: trainer wakes ``weights`` alone, pushes new ones, then wakes ``kv_cache``.
        self.asleep: set[str] = set()
        self.router: Any = None
        self.sessions: Sessions | None = None
        self.controller: Any = None
        self.actuator: Any = None
        self.monitor: Any = None
        self.recorder: Any = None
        self.tokenizer: Any = None
        self.tool_parser: Any = None  # a ToolCallParser with --tool-call-parser
        #: Drop events the forecaster has read at each session sweep (off: keep the whole
        #: in-memory log, for tests and debugging that read it from the start).
        self.let_go_of_read_events = True
        self.metrics: Any = None  # a ServiceMetrics, set by the HTTP app
        self._external_update: Any = None
        self._control_calls = 0  # pauses, resumes, sleeps, wake-ups running now
        self._finishing = False  # a finish_weight_update_with is committing the push
        #: engines calls failed on inside the open window (id -> {call: what failed})
        self._window_failed: dict[int, dict[str, str]] = {}
        self._sweeper: asyncio.Task | None = None
        self.started_s: float | None = None
        # The coming rollouts' expected shape, when the trainer or the config gives it.
        self.workload: WorkloadShape | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> RolloutService:
        """Start engines (unless adopted), set roles, router, monitor and controller."""
        from prorsa.runtime.cluster.startup import (
            first_allocation,
            idle_observation,
            make_controller,
            note_start,
        )
        from prorsa.runtime.ray.actuator import AsyncioClock, RayActuator
        from prorsa.runtime.ray.monitor import LoadMonitor
        from prorsa.runtime.ray.pools import parse_role
        from prorsa.runtime.ray.router import PDRouter, RouterConfig

        config = self.config
        config.validate()
        started = time.perf_counter()
        if config.tool_call_parser:  # checked before any engine starts
            from prorsa.serve.tool_calls import ToolCallParser

            tokenizer = load_tokenizer(config.model)
            if tokenizer is None:
                raise ConfigError(
                    "a tool-call parser needs the model folder's tokenizer; it has none"
                )
            self.tool_parser = ToolCallParser(config.tool_call_parser, tokenizer)
        spec = cluster_spec_for(config)
        policy = self.policy or make_policy_for(config)
        policy.reset(spec, config.seed)
        self.policy = policy
        if self.forecaster is None and policy.needs_forecast:
            if not config.forecaster:
                raise ConfigError(
                    f"policy {config.policy} needs a forecaster", hint="pass --forecaster NAME"
                )
            from prorsa.runtime.forecast_provider import make_provider

            self.forecaster = make_provider(config.forecaster)
        if config.workload_scenario is not None and self.workload is None:
            from prorsa.workload.shape import scenario_shape

            self.workload = scenario_shape(config.workload_scenario)
        idle = idle_observation(
            spec,
            engines_per_slot=1,
            kv_capacity_per_slot=0,
            total_trajectories=None,
            workload=self.workload,
        )
        roles, _ = first_allocation(policy, spec, idle)
        if self.fleet is None:
            starting = asyncio.ensure_future(asyncio.to_thread(start_fleet, config, roles))
            try:
                self.fleet, self._owns_ray = await asyncio.shield(starting)
            except asyncio.CancelledError:
                # Interrupted while engines start: let them come up, then stop them, so
                # no engine outlives the service.
                self.fleet, self._owns_ray = await starting
                raise
        elif len(self.fleet.clients) != config.engines:
            raise ConfigError(
                f"the fleet has {len(self.fleet.clients)} engines; the config asks for "
                f"{config.engines}"
            )
        pools = self.fleet.pools()
        for engine in pools.engines():
            engine.client = BarrierClient(
                engine.client, self.barrier, stream_legs=config.stream_legs
            )
            pools.set_role(engine.engine_id, parse_role(roles[engine.engine_id]), at=0.0)
        # An engine that leaves service may never answer its legs: they are served again.
        pools.on_engine_lost(lambda e: self.barrier.drop_engine(e.engine_id, e.lost_cause))
        if config.telemetry_dir:
            from prorsa.telemetry import Recorder

            self.recorder = Recorder(config.telemetry_dir, run_id=config.run_id)
        self.router = PDRouter(
            pools,
            RouterConfig(
                local_prefill_threshold_tokens=config.local_prefill_threshold,
                drain_timeout_s=config.drain_timeout_s,
                control_timeout_s=config.engine_control_timeout_s,
            ),
            recorder=self.recorder,
            run_id=config.run_id,
        )
        self.sessions = Sessions(self.router, self.router.now, config.session_idle_s)
        self.monitor = LoadMonitor(
            pools,
            interval_s=config.monitor_interval_s,
            stall_timeout_s=config.engine_stall_timeout_s or None,
        )
        self.monitor.start()
        await self.monitor.poll_once()
        self.actuator = RayActuator(
            self.router,
            spec,
            drain_timeout_s=config.drain_timeout_s,
            monitor=self.monitor,
            workload=self.workload,
        )
        note_start(self.actuator, roles, spec.slot_gpus)
        self.controller = make_controller(
            policy,
            self.actuator,
            AsyncioClock(),
            interval_s=config.interval_s,
            min_dwell_s=config.min_dwell_s,
            forecaster=self.forecaster,
            keep_forecasts=True,
            keep_running=True,
        )
        if self.controller is not None:
            # A long-lived service reads only the latest decision: keep the last 3,600
            # (half an hour at the default 0.5 s interval).
            self.controller.decisions = collections.deque(maxlen=_DECISIONS_KEPT)
            self.controller.start()
        self.tokenizer = load_tokenizer(config.model)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_sessions())
        self.started_s = time.perf_counter() - started
        logger.info(
            "rollout service ready in %.1f s: %d engines %s, policy %s",
            self.started_s,
            config.engines,
            roles,
            config.policy,
        )
        return self

    async def shutdown(self) -> None:
        """Stop the controller, end sessions, flush telemetry, stop owned engines and Ray.
        Every stage runs even if one before it fails (the first error is raised after):
        a telemetry flush that fails must not leave the engines and Ray running."""
        errors: list[BaseException] = []

        async def stage(step: Callable[[], Awaitable[None] | None]) -> None:
            try:
                result = step()
                if result is not None:
                    await result
            except Exception as exc:
                logger.exception("shutdown stage failed; stopping the rest")
                errors.append(exc)

        await stage(self._stop_sweeper)
        if self.controller is not None:
            await stage(self.controller.stop)
        if self.actuator is not None:
            await stage(self.actuator.wait)
        if self.monitor is not None:
            await stage(self.monitor.stop)
        if self.sessions is not None:
            await stage(self.sessions.finish_all)
        if self.recorder is not None:
            recorder, self.recorder = self.recorder, None
            await stage(recorder.aclose)
        if self._owns_fleet and self.fleet is not None:
            fleet, self.fleet = self.fleet, None
            await stage(lambda: asyncio.to_thread(fleet.shutdown))
        if self._owns_ray:
            import ray

            self._owns_ray = False
            await stage(lambda: asyncio.to_thread(ray.shutdown))
        if errors:
            raise errors[0]

    async def _stop_sweeper(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None

    # ------------------------------------------------------------------ data plane
    async def generate(
        self,
        session_id: str | None,
        prompt_ids: list[int],
        sampling: Sampling | dict[str, Any] | None = None,
        *,
        routing: dict[str, Any] | None = None,
        group_id: str = "",
        task: str = "",
    ) -> ServeTurnResult:
        """Serve one turn of a session.

        Args:
            session_id: the trajectory this turn belongs to (sticky engines, telemetry);
                None serves a one-shot session that ends with the turn.
            prompt_ids: the full context (earlier turns, tool output, new prompt).
            sampling: a :class:`Sampling` or a vLLM-style dict (checked).
            routing: optional ``mode`` (auto | disaggregated | colocated), ``engine_id``
                and ``prefill_engine_id`` pins (tests, debugging).
            group_id: GRPO group (telemetry).
            task: task name (telemetry).

        Raises:
            InputError: a malformed request (nothing dispatched; other sessions unaffected).
            RoutingError: no engine could serve the turn.
        """
        sessions = self._sessions()
        if not isinstance(sampling, Sampling):
            sampling = parse_sampling(sampling)
        routing = _routing(routing)
        one_shot = session_id is None
        session_id = sessions.anonymous_id() if one_shot else session_id
        request = ServeTurnRequest.build(
            session_id, prompt_ids, sampling, turn=0, group_id=group_id, task=task, **routing
        )
        self.router.validate(request)  # fail fast, before waiting at a closed gate
        session = sessions.get_or_start(session_id, group_id=group_id, task=task, one_shot=one_shot)
        request.trajectory_id = session.trajectory_id
        try:
            async with session.lock, self.gate.admitted():
                sessions.check_open(session)
                request.turn = sessions.before_turn(session, len(prompt_ids))
                result = await self.router.generate(request, checked=True)
                served = served_result(result, session_id, len(prompt_ids), self.weight_labels)
                sessions.after_turn(
                    session, request.turn, len(prompt_ids) + len(result.output_token_ids)
                )
        finally:
            try:
                sessions.turn_returned(session)
            except Exception:  # e.g. the recorder closed at shutdown: keep the turn's own
                logger.exception("could not end session %r", session_id)
            if one_shot:
                sessions.finish(session_id)
        if self.metrics is not None:
            self.metrics.observe_turn(served)
        return served

    async def end_session(self, session_id: str) -> bool:
        """End a session (``traj_end``); False when it is unknown or already ended."""
        return self._sessions().finish(session_id)

    # ------------------------------------------------------------------ pause / sleep
    async def pause(self, mode: str = "keep") -> None:
        """Stop serving: new turns wait at the gate until :meth:`resume`.

        ``keep`` freezes turns in flight inside the engines (they go on after resume),
        ``wait`` returns once they have finished, ``abort`` stops them at once — each is
        served again after resume (from a fresh prefill), so none is lost.
        """
        if mode not in PAUSE_MODES:
            raise InputError(
                f"unknown pause mode {mode!r}", field="mode", hint=f"one of {PAUSE_MODES}"
            )
        with self._control_call("pause"):
            await self._pause(mode)

    async def _pause(self, mode: str) -> None:
        await self.gate.close("paused")
        # A role switch ends by resuming its engine: none may start or be under way while
        # the trainer holds the engines paused (it may be pushing weights meanwhile).
        self.hold_switches("paused")
        await self.wait_for_switches()
        if mode == "wait" and not self.engines_paused_by_trainer:
            # (engines the trainer already paused hold their turns frozen: none drains)
            resumes = self._resumes
            await self.gate.drained(None)
            if self._resumes != resumes:
                raise StateConflict(
                    "resumed while the turns in flight drained: this pause was undone",
                    field="mode",
                    hint="pause again if generation should stop",
                )
        async with self.sync.lock:  # not in the middle of a weight update
            self.engines_paused_by_trainer = True
            self.trainer_pause_mode = mode
            if not self.sleeping:
                await self.control_engines(
                    lambda c: c.pause("keep" if mode == "wait" else mode), "pause"
                )

    async def resume(self) -> None:
        """Undo :meth:`pause` (engines asleep stay asleep until :meth:`wake_up`)."""
        with self._control_call("resume"):
            self._resumes += 1
            async with self.sync.lock:
                if self.engines_paused_by_trainer and not self.sleeping:
                    await self.control_engines(lambda c: c.resume(), "resume")
                self.engines_paused_by_trainer = False
                self.trainer_pause_mode = None
            self.release_switches("paused")
            await self.gate.open("paused")

    async def sleep(self, level: int = 1, mode: str = "abort") -> dict[int, Any]:
        """Put every engine to sleep (see ``EngineServer.sleep`` for what is freed where);
        new turns wait until :meth:`wake_up`; no role switch starts meanwhile.

        ``mode`` treats turns in flight as :meth:`pause` does; on engines the trainer
        paused with ``keep``, ``wait`` keeps them frozen instead (they cannot drain: the
        engines would never fall asleep), and they go on after wake-up and resume.
        """
        if level not in (0, 1, 2):
            raise InputError(f"sleep level must be 0, 1 or 2, got {level!r}", field="level")
        if mode not in PAUSE_MODES:
            raise InputError(
                f"unknown pause mode {mode!r}", field="mode", hint=f"one of {PAUSE_MODES}"
            )
        with self._control_call("sleep"):
            if mode == "wait" and self.engines_paused_by_trainer:
                mode = "keep"
            await self.gate.close("sleeping")
            self.hold_switches("sleeping")
            await self.wait_for_switches()
            async with self.sync.lock:
                self.sleeping = True
                if level:  # level 0 pauses the scheduler only: what slept before still sleeps
                    self.asleep |= {"weights", "kv_cache"}
                return await self.for_each_engine(lambda c: c.sleep(level, mode))

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Wake every engine (``tags``: only ``weights`` or ``kv_cache``, vLLM's partial
        wake); serving resumes once all are fully awake. With the weights awake and the
        KV cache still asleep, weights can be updated (SkyRL's colocated flow: wake the
        weights, push, wake the KV cache)."""
        unknown = set(tags or ()) - set(SLEEP_TAGS)
        if unknown:
            raise InputError(
                f"unknown wake-up tag(s) {sorted(unknown)}", field="tags", hint=f"{SLEEP_TAGS}"
            )
        with self._control_call("wake_up"):
            return await self._wake_up(tags)

    async def _wake_up(self, tags: list[str] | None) -> bool:
        async with self.sync.lock:
            if not self.sleeping:
                # Nothing sleeps: vLLM's wake-up would resume schedulers a trainer's pause
                # holds (it reports awake and resumes even an engine that never slept).
                return True
            awake = await self.for_each_engine(lambda c: c.wake_up(tags), tolerate=True)
            if not all(answer is True for answer in awake.values()):
                # As vLLM's executor: a partial wake naming a tag already awake wakes
                # nothing. An engine that came back fully awake has resumed its scheduler:
                # paused again, it serves nothing while the service still sleeps.
                if tags and set(tags) <= self.asleep:
                    self.asleep -= set(tags)
                woke = [eid for eid, answer in awake.items() if answer is True]
                if woke:
                    await self.control_engines(lambda c: c.pause("keep"), "pause", woke)
                failed = [a for a in awake.values() if isinstance(a, BaseException)]
                if failed:
                    raise failed[0]
                return False
            self.sleeping = False
            self.asleep = set()
            if self.engines_paused_by_trainer:  # the trainer's pause outlives the sleep
                await self.control_engines(lambda c: c.pause("keep"), "pause")
        self.release_switches("sleeping")
        await self.gate.open("sleeping")
        return True

    async def reset_prefix_cache(self) -> dict[int, bool]:
        """Drop every engine's prefix cache and the router's record of it."""
        result = await self.for_each_engine(lambda c: c.reset_prefix_cache())
        self.router.forget_caches()
        return result

    # ------------------------------------------------------------------ weights
    async def update_weights_from_path(
        self,
        path: str,
        version: int | str | None = None,
        *,
        drain_timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Load a ``save_pretrained`` folder on every engine, whatever its role.

        Args:
            path: the folder, visible to every engine.
            version: the new weight version (> the current one) or a label for the next
                (:mod:`prorsa.serve.weight_labels`); None: current + 1.
            drain_timeout_s: how long turns in flight may finish under the old weights
                (later ones are served again under the new); None: the config's.

        Returns:
            The sync summary: versions, whether turns drained or were re-served, per
            stage seconds, engines updated and any that failed (taken out of service).
        """
        folder = str(check_weight_dir(path, self.config.model))
        self._refuse_in_update_window("update_weights_from_path")
        requested = version
        self._resolve_version(requested)  # a bad version is refused before anything pauses
        self._check_can_update()
        if drain_timeout_s is None:
            drain_timeout_s = self.config.sync_drain_timeout_s
        async with self.sync.paused(drain_timeout_s) as window:
            # Chosen under the update lock: concurrent updates each get their own version.
            version, label = self._resolve_version(requested)
            self._check_can_update()
            reloads = asyncio.ensure_future(
                self.for_each_engine(
                    lambda c: c.update_weights_from_path(folder, version), tolerate=True
                )
            )
            results, cancelled = await wait_uncancelled(reloads)
            failed = self._retire_failed(results, "weight update")
            self.router.forget_caches()
            self._stamp_version(version, label)
            window.detail.update(path=folder, failed=failed, reload_s=_reload_times(results))
        if self.metrics is not None:
            self.metrics.observe_sync(window.summary)
        if cancelled:
            raise asyncio.CancelledError
        return window.summary

    # ------------------------------------------------------------------ role switches
    def hold_switches(self, reason: str) -> None:
        """Refuse role switches (the controller's and operators') until released."""
        self.router.hold_switches(reason)

    def release_switches(self, reason: str) -> None:
        self.router.release_switches(reason)

    @property
    def max_model_len(self) -> int:
        """The context every engine accepts: the smaller of what they report (an adopted
        fleet may have been started with another length than this service's
        configuration) and the configured one."""
        reported = self.router.pools.max_model_len if self.router is not None else None
        return min(reported or self.config.max_model_len, self.config.max_model_len)

    @property
    def switches_done(self) -> int:
        return self.router.switcher.completed if self.router is not None else 0

    def start_switch(
        self, engine_id: int, role: Any, drain_timeout_s: float | None = None
    ) -> asyncio.Task:
        """Start a role switch; ``ConfigError`` when switches are held or refused."""
        return self.router.start_switch(engine_id, role, drain_timeout_s)

    async def switch_role(
        self, engine_id: int, role: str, drain_timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Switch one engine now (an operator's or a test's order) and wait for it;
        StateConflict (409) while switches are held (a pause, sleep or weight update)."""
        holds = self.router.switcher.holds
        if holds:
            raise StateConflict(
                f"role switches are held ({', '.join(sorted(holds))})",
                field="engine_id",
                hint="retry after the weight update, resume or wake-up",
            )
        return await self.start_switch(engine_id, role, drain_timeout_s)

    async def wait_for_switches(self) -> None:
        await self.router.wait_for_switches()

    # ------------------------------------------------------------------ engines
    def live_engines(self) -> list[int]:
        return [e.engine_id for e in self.router.pools.engines() if e.alive]

    def client(self, engine_id: int) -> Any:
        return self.router.pools.get(engine_id).client

    async def for_each_engine(
        self,
        call: Callable[[Any], Awaitable[Any]],
        *,
        tolerate: bool = False,
        timeout_s: float | None = None,
        engine_ids: Iterable[int] | None = None,
        what: str = "the call",
    ) -> dict[int, Any]:
        """``call(client)`` on every live engine (or on ``engine_ids``) at once; results
        by engine id.

        With ``tolerate`` an engine's exception is returned in its place; otherwise the
        first one is raised (after every call has finished). With ``timeout_s`` an engine
        that has not answered by then gets an ``EngineUnavailable`` naming ``what``.
        """
        ids = self.live_engines() if engine_ids is None else list(engine_ids)
        answers = await asyncio.gather(
            *(answered_within(call(self.client(eid)), eid, what, timeout_s) for eid in ids),
            return_exceptions=True,
        )
        results = dict(zip(ids, answers, strict=True))
        if not tolerate:
            for answer in answers:
                if isinstance(answer, BaseException):
                    raise answer
        return results

    async def control_engines(
        self,
        call: Callable[[Any], Awaitable[Any]],
        what: str,
        engine_ids: Iterable[int] | None = None,
    ) -> dict[int, Any]:
        """A quick control call (pause, resume, abort, request list) on every live engine,
        each bounded by ``engine_control_timeout_s``; answers of the engines that gave one.

        An engine that fails or does not answer in time leaves service (its requests and
        weights can no longer be vouched for), so one stuck engine cannot hold the others
        paused. When no live engine answered, none leaves and ``NoEngineAvailable`` is raised:
        a fault that wide more likely lies outside the engines (a stalled host, Ray), and
        retiring them all would end the service for good.
        """
        results = await self.for_each_engine(
            call,
            tolerate=True,
            timeout_s=self.config.engine_control_timeout_s,
            engine_ids=engine_ids,
            what=f"the {what}",
        )
        failed = {eid: r for eid, r in results.items() if isinstance(r, BaseException)}
        if failed and failed.keys() >= set(self.live_engines()):
            raise NoEngineAvailable(f"no engine answered the {what}: {failed}")
        self._retire({eid: repr(error) for eid, error in failed.items()}, what)
        return {eid: answer for eid, answer in results.items() if eid not in failed}

    async def engine_requests(self) -> dict[int, list[str]]:
        """Requests each live engine holds now (only engines holding any)."""
        held = await self.control_engines(lambda c: c.in_flight(), "request list")
        return {eid: ids for eid, ids in held.items() if ids}

    def emit(self, kind: int, engine_id: int = -1, **detail: Any) -> None:
        """Record a cluster event (e.g. ``weight_sync``) in the run's telemetry."""
        self.router.telemetry.cluster(self.router.now(), kind, engine_id, **detail)

    # ------------------------------------------------------------------ state
    def set_workload(self, shape: WorkloadShape | None) -> None:
        """Tell the policy what the coming rollouts look like (None: unknown). It reads the
        shape from the next control tick on (``ClusterObservation.workload``)."""
        self.workload = shape
        if self.actuator is not None:
            self.actuator.workload = shape

    def status(self) -> dict[str, Any]:
        """What an operator (and ``/metrics``) wants to know, cheaply."""
        pools = self.router.pools
        counts, tokens = self.router.trajectory_states()
        return {
            "model": self.config.model_name,
            "weight_version": self.weight_version,
            "weight_version_label": self.weight_labels.label(self.weight_version),
            "roles": {eid: role.value for eid, role in pools.roles().items()},
            "engines_per_role": pools.counts(),
            "out_of_service": pools.out_of_service(),
            "sessions": len(self._sessions()),
            "sessions_started": self._sessions().started_total,
            "in_flight": self.gate.in_flight,
            "waiting": self.gate.waiting,
            "held_legs": self.barrier.held,
            "gate_closed": self.gate.reasons,
            "paused": self.engines_paused_by_trainer,
            "sleeping": self.sleeping,
            "asleep": sorted(self.asleep),
            "weight_sync": self.sync.window is not None,
            "switches_running": self.router.switches_running,
            "switches_done": self.switches_done,
            "control_ticks_failed": self.controller.failed_ticks if self.controller else 0,
            "control_last_error": self.controller.last_error if self.controller else None,
            "trajectory_states": counts,
            "trajectory_tokens": tokens,
            "policy": self.config.policy,
            "workload": dataclasses.asdict(self.workload) if self.workload else None,
        }

    def latest_forecast(self) -> Any:
        """The controller's most recent forecast (None without one)."""
        if self.controller is None or not self.controller.decisions:
            return None
        return self.controller.decisions[-1].forecast

    def _sessions(self) -> Sessions:
        if self.sessions is None:
            raise ConfigError("the rollout service is not started", hint="await start() first")
        return self.sessions

    async def _sweep_sessions(self) -> None:
        while True:
            await asyncio.sleep(min(SESSION_SWEEP_S, self.config.session_idle_s))
            try:
                self._sessions().expire()
                if self.let_go_of_read_events:
                    self._let_go_of_read_events()
            except Exception:  # never let the sweeper die silently
                logger.exception("session sweep failed")

    def _let_go_of_read_events(self) -> None:
        """Drop the in-memory events the forecaster has read (all of them without one):
        the log is its input, not the record (``--telemetry-dir`` keeps that on disk),
        and kept whole it grows by about 1 KB a turn for the life of the service. A
        forecaster source that does not say how far it read keeps everything."""
        log = self.router.telemetry.log
        read = len(log) if self.forecaster is None else getattr(self.forecaster, "rows_read", 0)
        log.forget_before(read)


def _routing(routing: dict[str, Any] | None) -> dict[str, Any]:
    if routing is not None and not isinstance(routing, dict):
        raise InputError(f"routing must be an object, got {routing!r:.40}", field="routing")
    routing = dict(routing or {})
    unknown = sorted(set(routing) - set(ROUTING_KEYS))
    if unknown:
        raise InputError(
            f"unknown routing key(s) {unknown}", field="routing", hint=f"one of {ROUTING_KEYS}"
        )
    for key in ("engine_id", "prefill_engine_id"):
        value = routing.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise InputError(f"{key} must be an integer engine id", field=key)
    return {k: v for k, v in routing.items() if v is not None}


def _reload_times(results: dict[int, Any]) -> dict[int, float]:
    return {
        eid: round(r["reload_s"], 6)
        for eid, r in results.items()
        if isinstance(r, dict) and "reload_s" in r
    }
