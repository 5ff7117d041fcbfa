"""Prefill/decode router over role pools of vLLM engines.

Per turn the router picks a path (see :meth:`PDRouter.generate`):

* ``disaggregated``: a prefill leg (``max_tokens=1``, ``do_remote_decode``) on a prefill
  engine, then a decode leg on a decode engine that pulls the KV with the returned params;
* ``local_prefill``: the whole turn on the trajectory's decode engine, when the turn's new
  tokens are under ``local_prefill_threshold_tokens`` (or no prefill engine is left);
* ``colocated``: the whole turn on one colocated engine.

Which path and which engines follow the cluster model's routing rules
(:mod:`prorsa.runtime.cluster.routing`), the same the simulator applies: a trajectory
sticks to the decode-side engine owning fewest trajectories when it started; a turn is
prefilled locally when that engine is colocated, no prefill engine serves, or the turn
appends fewer than the threshold to a context the engine still caches; otherwise on the
prefill engine with the least queued plus uncached tokens. What an engine caches is the
router's record of the contexts it last served per trajectory. A leg that dies with its
engine is retried on a live engine of the same role; a leg aborted by a role switch is
re-routed. Every stage is recorded through the cluster model's telemetry emitter.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from prorsa.errors import ConfigError, InputError
from prorsa.runtime.cluster.observation import PrefillWork, TrajectoryStates
from prorsa.runtime.cluster.routing import DecodePlacement, choose_prefill, prefill_locally
from prorsa.runtime.cluster.telemetry import ClusterTelemetry
from prorsa.runtime.ray.client import EngineUnavailable
from prorsa.runtime.ray.engine import PREFILL_FOR_REMOTE_DECODE
from prorsa.runtime.ray.pools import EngineState, Lease, Role, RolePools
from prorsa.runtime.ray.switch import RoleSwitcher
from prorsa.runtime.ray.turns import (
    MODES,
    KVHandoffLost,
    LegFailed,
    Rerouted,
    RouterConfig,
    RoutingError,
    TurnRequest,
    TurnResult,
)
from prorsa.telemetry.columns import KIND_CODE
from prorsa.telemetry.recorder import Recorder
from prorsa.telemetry.schema import EventKind as K
from prorsa.telemetry.schema import detail_json
from prorsa.telemetry.views import STATE_AFTER

logger = logging.getLogger(__name__)

__all__ = ["PDRouter", "RouterConfig", "RoutingError", "TurnRequest", "TurnResult"]


#: Key of a trajectory's decode-side engine in the router's sticky map (decode or colocated).
DECODE_SIDE_KEY = "decode_side"


@dataclass
class _Plan:
    path: str
    decode: EngineState
    prefill: EngineState | None
    new_tokens: int


def wall_clock() -> Callable[[], float]:
    """A clock reading wall-clock seconds since it was made."""
    origin = time.monotonic()
    return lambda: time.monotonic() - origin


class PDRouter:
    """Route turns over :class:`RolePools`; switch engine roles live.

    Args:
        pools: the engines and their roles.
        config: routing behaviour; :class:`RouterConfig` defaults when omitted.
        recorder: where lifecycle events are also recorded durably (none when omitted).
        clock: seconds for event times; wall-clock seconds since construction by default.
        run_id: telemetry ``run_id`` (default: the recorder's, else ``run``).

    ``telemetry.log`` holds the run's events in memory (what online forecasters read).
    """

    def __init__(
        self,
        pools: RolePools,
        config: RouterConfig | None = None,
        *,
        recorder: Recorder | None = None,
        clock: Callable[[], float] | None = None,
        run_id: str | None = None,
    ) -> None:
        self.pools = pools
        self.config = config or RouterConfig()
        self.config.validate()
        self.now = clock or wall_clock()
        run_id = run_id or (recorder.run_id if recorder is not None else "run")
        self.telemetry = ClusterTelemetry(run_id, recorder=recorder)
        self.switcher = RoleSwitcher(
            pools, self.telemetry, self.now, self.config, on_cache_reset=self.forget_engine_cache
        )
        self.states = TrajectoryStates()
        self.prefill_work = PrefillWork()
        self.placement = DecodePlacement()
        self._placement_version = -1
        # Per trajectory: its engine per side, and per engine the (length, hash) of the
        # context that engine last held for it (what its prefix cache can serve).
        self._sticky: dict[str, dict[str, int]] = {}
        self._resident: dict[str, dict[int, tuple[int, int]]] = {}
        self._live: dict[str, tuple[str, int]] = {}  # trajectory -> (state, context tokens)
        self._last_context: dict[str, int] = {}  # trajectory -> context + output of last turn
        self._ids = itertools.count()
        self._background: set[asyncio.Task] = set()
        self._switch_tasks: set[asyncio.Task] = set()
        self.retries_total = 0
        self.reroutes_total = 0
        self.kv_handoffs_lost_total = 0  # decode legs that gave up waiting for their KV
        self.completed_trajectories = 0

    # ------------------------------------------------------------------ public API
    def set_local_prefill_threshold(self, tokens: int) -> None:
        """Change the local-prefill threshold at run time (affects turns routed next)."""
        if tokens < 0:
            raise ConfigError(f"local_prefill_threshold_tokens must be >= 0, got {tokens}")
        self.config.local_prefill_threshold_tokens = tokens

    async def switch_role(
        self, engine_id: int, new_role: str | Role, drain_timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Move an engine to ``new_role``; see :class:`RoleSwitcher` for the stages."""
        return await self.switcher.switch(engine_id, new_role, drain_timeout_s)

    def start_switch(
        self, engine_id: int, new_role: str | Role, drain_timeout_s: float | None = None
    ) -> asyncio.Task:
        """Begin a switch now (the engine is ``switching`` on return); finish in a task.

        Raises :class:`ConfigError` at once for an unknown, dead or already switching engine,
        or a switch that would leave no decode-side engine.
        """
        coro = self.switcher.begin(engine_id, new_role, drain_timeout_s)
        switch = self.pools.get(engine_id).switch  # None for a relabel or nothing to do
        task = asyncio.get_running_loop().create_task(coro)
        self._switch_tasks.add(task)
        task.add_done_callback(self._switch_tasks.discard)
        task.add_done_callback(
            lambda t: self.switcher.abandon_unstarted(engine_id, switch) if t.cancelled() else None
        )
        return task

    def hold_switches(self, reason: str) -> None:
        """Refuse new role switches (``ConfigError``) until released for ``reason``."""
        self.switcher.hold(reason)

    def release_switches(self, reason: str) -> None:
        self.switcher.release(reason)

    @property
    def switches_running(self) -> int:
        """Switches started with :meth:`start_switch` and not finished."""
        return len(self._switch_tasks)

    async def wait_for_switches(self) -> None:
        """Wait until every switch started with :meth:`start_switch` has ended."""
        while self._switch_tasks:
            # asyncio.wait, not gather: a waiter cancelled (a pause given up) must not
            # cancel the switches it waits for.
            await asyncio.wait(list(self._switch_tasks))

    def trajectory_states(self) -> tuple[dict[str, int], dict[str, int]]:
        """Live trajectories per lifecycle state, and their context tokens per state."""
        return dict(self.states.counts), dict(self.states.tokens)

    def cached_tokens_by_engine(self) -> dict[int, int]:
        """Context tokens each engine holds for live trajectories (the router's record)."""
        out: dict[int, int] = {}
        for per_engine in self._resident.values():
            for engine_id, (length, _) in per_engine.items():
                out[engine_id] = out.get(engine_id, 0) + length
        return out

    def trajectory_event(
        self,
        kind: K,
        trajectory_id: str,
        turn: int,
        *,
        group_id: str = "",
        task: str = "",
        context_tokens: int = 0,
        **fields: Any,
    ) -> float:
        """Record an agent-side event (``traj_start``, ``tool_start``, ``tool_end``,
        ``traj_end``) and update the trajectory's live state; returns the event time.

        The agent loop owns these stages, the router the ones in between; both go through
        the same emitter so one trajectory's events stay in order. ``traj_end`` also
        forgets the trajectory's routing state.
        """
        at = self.now()
        numeric = {k: fields.pop(k) for k in _TOKEN_FIELDS if k in fields}
        self._emit(
            kind, at, trajectory_id, turn, group_id, task, context_tokens=context_tokens,
            **numeric, **fields,
        )  # fmt: skip
        if kind == K.TRAJ_END:
            self.forget(trajectory_id)
            self.completed_trajectories += 1
        return at

    def forget(self, trajectory_id: str) -> None:
        """Drop a finished trajectory's sticky engines, cache bookkeeping and live state."""
        live = self._live.pop(trajectory_id, None)
        if live is not None:
            self.states.leave(*live)
        self._last_context.pop(trajectory_id, None)
        sticky = self._sticky.pop(trajectory_id, {})
        decode_id = sticky.get(DECODE_SIDE_KEY)
        if decode_id is not None:
            self.placement.move(self.pools.get(decode_id), None)
        self._resident.pop(trajectory_id, None)

    def forget_caches(self) -> None:
        """Forget what every engine caches (after a weight update or a cache reset)."""
        self._resident.clear()

    def forget_engine_cache(self, engine_id: int) -> None:
        """Forget what one engine caches (its prefix cache was reset)."""
        for per_engine in self._resident.values():
            per_engine.pop(engine_id, None)

    async def generate(self, request: TurnRequest, *, checked: bool = False) -> TurnResult:
        """Serve one turn; retries on engine failure and re-routes after evictions.

        Args:
            request: the turn.
            checked: the caller already ran :meth:`validate` on a request with this prompt
                and sampling (the check scans the whole prompt, once is enough).

        Raises:
            InputError: the request is malformed (nothing was dispatched).
            ConfigError: an unknown pinned engine id or mode.
            RoutingError: no engine of the needed role within ``route_timeout_s``, or
                ``max_retries`` engine failures.
        """
        if not checked:
            self.validate(request)
        queued_at = self.now()
        context = len(request.prompt_token_ids)
        self._event(
            K.PREFILL_QUEUED,
            queued_at,
            request,
            context_tokens=context,
            new_tokens=self._appended(request),
        )
        retries = reroutes = failed = 0
        local_on: int | None = None  # prefill here: its KV handoff was lost
        while True:
            plan = await self._plan(request, local_on)
            try:
                result = await self._serve(plan, request, retries, reroutes, local_on)
            except EngineUnavailable as exc:
                self._engine_failed(exc)
                retries += 1
                self.retries_total += 1
                if retries > self.config.max_retries:
                    raise RoutingError(
                        f"turn {request.turn} of {request.trajectory_id!r} failed on "
                        f"{retries} engines; last: {exc}"
                    ) from exc
                logger.warning(
                    "re-routing %s turn %d: %s", request.trajectory_id, request.turn, exc
                )
                continue
            except Rerouted as exc:
                reroutes += 1
                self.reroutes_total += 1
                if reroutes > self.config.max_reroutes:
                    raise RoutingError(f"turn aborted {reroutes} times: {exc}") from exc
                if isinstance(exc, LegFailed):
                    failed += 1
                    if failed > 1:  # an engine error that repeats is the request's own
                        raise RoutingError(f"turn failed in the engine twice: {exc}") from exc
                    logger.warning("serving %s turn %d again: %s", request.trajectory_id,
                                   request.turn, exc)  # fmt: skip
                local_on = exc.engine_id if isinstance(exc, KVHandoffLost) else None
                if local_on is not None:
                    self.kv_handoffs_lost_total += 1
                    # Later turns pick their prefill engine afresh, not the one that hung.
                    self._sticky.get(request.trajectory_id, {}).pop("prefill", None)
                    logger.warning("%s; prefilling it on engine %d", exc, local_on)
                continue
            result.retries, result.reroutes = retries, reroutes
            result.latency_s = self.now() - queued_at
            return result

    def validate(self, request: TurnRequest) -> None:
        """Reject a malformed request before anything is dispatched."""
        prompt = request.prompt_token_ids
        where = {"source": "router", "record": request.trajectory_id}
        if request.mode not in MODES:
            raise ConfigError(f"unknown mode {request.mode!r}", hint=f"one of: {', '.join(MODES)}")
        for pinned in (request.engine_id, request.prefill_engine_id):
            if pinned is not None:
                self.pools.get(pinned)
        if not prompt:
            raise InputError("prompt is empty", field="prompt_token_ids", **where)
        limit = self.pools.max_model_len
        if limit is not None and len(prompt) >= limit:
            raise InputError(
                f"prompt has {len(prompt)} tokens; engines accept at most {limit - 1}",
                field="prompt_token_ids",
                hint="shorten the context or raise EngineConfig.max_model_len",
                **where,
            )
        vocab = self.pools.vocab_size
        if vocab is not None and (min(prompt) < 0 or max(prompt) >= vocab):
            raise InputError(
                f"token ids must lie in [0, {vocab})", field="prompt_token_ids", **where
            )
        if request.max_tokens < 1:
            raise InputError(
                f"max_tokens must be >= 1, got {request.max_tokens}", field="max_tokens", **where
            )
        if request.temperature < 0:
            raise InputError("temperature must be >= 0", field="temperature", **where)

    # ------------------------------------------------------------------ planning
    async def _plan(self, request: TurnRequest, local_on: int | None = None) -> _Plan:
        for pinned in (request.engine_id, request.prefill_engine_id):
            if pinned is not None and not self.pools.get(pinned).alive:
                raise RoutingError(f"pinned engine {pinned} is dead")
        plan = self._choose(request, local_on)
        if plan is None:
            ready = await self.pools.wait_until(
                lambda: self._choose(request, local_on) is not None, self.config.route_timeout_s
            )
            plan = self._choose(request, local_on) if ready else None
            if plan is None:
                raise RoutingError(
                    f"no engine can serve {request.mode} turn {request.turn} of "
                    f"{request.trajectory_id!r} within {self.config.route_timeout_s} s; "
                    f"engines per role: {self.pools.counts()}"
                )
        self._stick_decode(request.trajectory_id, plan.decode)
        if plan.prefill is not None:
            self._sticky.setdefault(request.trajectory_id, {})["prefill"] = plan.prefill.engine_id
        return plan

    def _choose(self, request: TurnRequest, local_on: int | None = None) -> _Plan | None:
        """The turn's path and engines by the cluster model's rules (None: nothing serves);
        a turn whose KV handoff to engine ``local_on`` was lost is prefilled there if that
        engine is still its decode side."""
        decode = self._decode_side(request)
        if decode is None:
            return None
        traj = request.trajectory_id
        context = len(request.prompt_token_ids)
        prefill_pool = [e for e in self.pools.members(Role.PREFILL) if e.accepting]
        pinned_prefill = request.prefill_engine_id
        if pinned_prefill is not None:
            engine = self.pools.get(pinned_prefill)
            if not (engine.accepting and engine.role is Role.PREFILL):
                return None  # wait for the pinned prefill engine
            prefill_pool = [engine]
        local = prefill_locally(
            decode.role,
            bool(prefill_pool),
            self._appended(request),
            self._cached(request, decode),
            context,
            self.config.local_prefill_threshold_tokens,
        )
        if local or decode.engine_id == local_on:
            path = "colocated" if decode.role is Role.COLOCATED else "local_prefill"
            return _Plan(path, decode, None, context - self._cached(request, decode))
        sticky = self._sticky_engine(traj, "prefill")
        prefill = choose_prefill(prefill_pool, sticky, context, lambda e: self._cached(request, e))
        return _Plan("disaggregated", decode, prefill, context - self._cached(request, prefill))

    def _decode_side(self, request: TurnRequest) -> EngineState | None:
        """The turn's decode-side engine: pinned, sticky, or the one owning fewest trajectories.

        ``mode`` ``colocated`` / ``disaggregated`` restricts the side to colocated / decode
        engines (tests and callers that force a path).
        """
        if request.engine_id is not None:
            engine = self.pools.get(request.engine_id)
            return engine if engine.accepting and _fits_mode(engine, request.mode) else None
        if self.pools.roles_version != self._placement_version:
            self.placement.refresh(self.pools.engines())
            self._placement_version = self.pools.roles_version
        sticky = self._sticky_engine(request.trajectory_id, DECODE_SIDE_KEY)
        if request.mode == "auto":
            return self.placement.choose(sticky)
        if sticky is not None and sticky.accepting and _fits_mode(sticky, request.mode):
            return sticky
        fits = [e for e in self.placement.candidates if e.accepting and _fits_mode(e, request.mode)]
        return min(fits, key=lambda e: e.owned) if fits else None

    def _sticky_engine(self, traj: str, side: str) -> EngineState | None:
        engine_id = self._sticky.get(traj, {}).get(side)
        return None if engine_id is None else self.pools.get(engine_id)

    def _stick_decode(self, traj: str, engine: EngineState) -> None:
        old = self._sticky_engine(traj, DECODE_SIDE_KEY)
        if old is not engine:
            self.placement.move(old, engine)
            self._sticky.setdefault(traj, {})[DECODE_SIDE_KEY] = engine.engine_id

    def _appended(self, request: TurnRequest) -> int:
        """Tokens appended since the trajectory's last turn ended (the whole prompt at first),
        as the simulator counts a turn's new tokens."""
        context = len(request.prompt_token_ids)
        last = self._last_context.get(request.trajectory_id, 0)
        return context - last if context >= last else context

    def _cached(self, request: TurnRequest, engine: EngineState | None) -> int:
        """Tokens of this turn's context ``engine`` holds (from the last context it served)."""
        if engine is None:
            return 0
        prompt = request.prompt_token_ids
        seen = self._resident.get(request.trajectory_id, {}).get(engine.engine_id)
        if seen is not None and seen[0] <= len(prompt) and request.prefix_hash(seen[0]) == seen[1]:
            return seen[0]
        return 0

    def _remember(self, traj: str, engine: EngineState, tokens: int, digest: int) -> None:
        """``engine`` now holds ``tokens`` tokens of ``traj``'s context, of hash ``digest``."""
        self._resident.setdefault(traj, {})[engine.engine_id] = (tokens, digest)

    # ------------------------------------------------------------------ serving
    async def _serve(
        self,
        plan: _Plan,
        request: TurnRequest,
        retries: int,
        reroutes: int,
        kv_lost_on: int | None = None,
    ) -> TurnResult:
        attempt = {
            "retry": retries or None,
            "reroute": reroutes or None,
            "kv_lost_on": kv_lost_on,  # the engine whose wait for KV was given up
        }
        if plan.path == "disaggregated":
            return await self._serve_disaggregated(plan, request, attempt)
        return await self._serve_single(plan, request, attempt)

    async def _serve_single(self, plan: _Plan, request: TurnRequest, attempt: dict) -> TurnResult:
        engine, prompt = plan.decode, request.prompt_token_ids
        context = len(prompt)
        started = self.now()
        self._event(
            K.PREFILL_START,
            started,
            request,
            engine.engine_id,
            context_tokens=context,
            new_tokens=plan.new_tokens,
            cached_tokens=context - plan.new_tokens,
            path=plan.path,
            **attempt,
        )

        def first_token(at: float, cached: int) -> None:
            self._event(
                K.PREFILL_END,
                at,
                request,
                engine.engine_id,
                context_tokens=context,
                new_tokens=context - cached,
                cached_tokens=cached,
            )
            self._event(K.DECODE_START, at, request, engine.engine_id, context_tokens=context)

        result = await self._stream(
            engine, "t", request, None, started, first_token, prefill_tokens=plan.new_tokens
        )
        return self._finish(plan, request, result, None)

    async def _serve_disaggregated(
        self, plan: _Plan, request: TurnRequest, attempt: dict
    ) -> TurnResult:
        prefill, decode, prompt = plan.prefill, plan.decode, request.prompt_token_ids
        assert prefill is not None
        context = len(prompt)
        prefill_id = self._request_id(request, "p")
        self._event(
            K.PREFILL_START,
            self.now(),
            request,
            prefill.engine_id,
            context_tokens=context,
            new_tokens=plan.new_tokens,
            cached_tokens=context - plan.new_tokens,
            path=plan.path,
            **attempt,
        )
        lease = self.pools.lease(
            prefill, prefill_id, Role.PREFILL, request.trajectory_id, context, plan.new_tokens
        )
        try:
            first = await prefill.client.generate(
                prefill_id,
                prompt,
                1,
                request.temperature,
                dict(PREFILL_FOR_REMOTE_DECODE),
                **_prefill_leg_sampling(request.sampling()),
            )
        finally:
            self.pools.release(lease)
        self._check_served(first, lease)
        cached = first["num_cached_tokens"]
        self._event(
            K.PREFILL_END,
            self.now(),
            request,
            prefill.engine_id,
            context_tokens=context,
            new_tokens=context - cached,
            cached_tokens=cached,
        )
        length = len(prompt)
        self._remember(request.trajectory_id, prefill, length, request.prefix_hash(length))
        kv_params = first.get("kv_transfer_params")
        try:
            decode = await self._decode_engine(request, decode)
        except RoutingError:
            if kv_params:
                self._release_stale_kv(prefill_id, kv_params)
            raise
        plan.decode = decode
        if kv_params:
            self.pools.add_kv_pending(prefill.engine_id, prefill_id)
        started = self.now()
        self._event(
            K.KV_TRANSFER_START,
            started,
            request,
            decode.engine_id,
            context_tokens=context,
            from_engine=prefill.engine_id,
        )

        def first_token(at: float, cached: int) -> None:
            self.pools.clear_kv_pending(prefill.engine_id, prefill_id)
            self._event(
                K.KV_TRANSFER_END,
                at,
                request,
                decode.engine_id,
                context_tokens=context,
                cached_tokens=cached,
                from_engine=prefill.engine_id,
            )
            self._event(K.DECODE_START, at, request, decode.engine_id, context_tokens=context)

        try:
            result = await self._stream(decode, "d", request, kv_params, started, first_token)
        except (EngineUnavailable, KVHandoffLost):
            if kv_params:
                self._release_stale_kv(prefill_id, kv_params)
            raise
        finally:
            self.pools.clear_kv_pending(prefill.engine_id, prefill_id)
        return self._finish(plan, request, result, first)

    async def _decode_engine(self, request: TurnRequest, planned: EngineState) -> EngineState:
        """The planned decode engine, or another one if a switch or failure took it away.

        A colocated engine pulls a prefilled context as a decode engine does (both run
        the same KV connector): one relabelled colocated during the prefill leg (a move to
        colocation is instant) keeps the turn, and colocated engines stand in when no
        decode engine is left.
        """
        if planned.accepting and planned.role in (Role.DECODE, Role.COLOCATED):
            return planned

        def find() -> EngineState | None:
            for mode in ("disaggregated", "colocated"):
                engine = self._decode_side(replace(request, mode=mode))
                if engine is not None:
                    return engine
            return None

        engine = find()
        if engine is None:
            await self.pools.wait_until(lambda: find() is not None, self.config.route_timeout_s)
            engine = find()
        if engine is None:
            raise RoutingError(
                f"no decode engine for {request.trajectory_id!r} turn {request.turn} within "
                f"{self.config.route_timeout_s} s; engines per role: {self.pools.counts()}"
            )
        self._stick_decode(request.trajectory_id, engine)
        return engine

    async def _stream(
        self,
        engine: EngineState,
        leg: str,
        request: TurnRequest,
        kv_params: dict[str, Any] | None,
        started: float,
        on_first_token: Callable[[float, int], None],
        prefill_tokens: int = 0,
    ) -> dict[str, Any]:
        """Run a leg that decodes; ``on_first_token`` fires once, when the first token exists.

        ``prefill_tokens``: what the leg prefills here first (its engine's queued prefill
        until the first token, as the simulator counts a prefill run where it decodes)."""
        request_id = self._request_id(request, leg)
        prompt = request.prompt_token_ids
        lease = self.pools.lease(
            engine,
            request_id,
            engine.role,
            request.trajectory_id,
            len(prompt) + request.max_tokens,
            prefill_left=prefill_tokens,
        )
        result: dict[str, Any] = {}
        fired = False
        stream = engine.client.generate_stream(
            request_id, prompt, request.max_tokens, request.temperature, kv_params,
            **request.sampling(),
        )  # fmt: skip
        try:
            # Closed here, not by the garbage collector, if the loop ends early: the
            # stream's own cleanup (the engine client's, the service's leg accounting)
            # runs now, in this task.
            async with contextlib.aclosing(stream):
                async for item in stream:
                    if item.get("event") == "first_token":
                        fired = True
                        if lease.prefill_left:
                            lease.prefill_left = 0
                            self.pools.notify()
                        on_first_token(self.now(), int(item.get("num_cached_tokens") or 0))
                    else:
                        result = item
        finally:
            self.pools.release(lease)
        self._check_served(result, lease)
        if not fired:  # finished with its first token: place the event from engine timings
            at = min(self.now(), started + result["timings"]["first_token_s"])
            on_first_token(at, result["num_cached_tokens"])
        return result

    def _finish(
        self,
        plan: _Plan,
        request: TurnRequest,
        result: dict[str, Any],
        prefill_result: dict[str, Any] | None,
    ) -> TurnResult:
        decode = plan.decode
        output = list(result["output_token_ids"])
        self._event(
            K.DECODE_END,
            self.now(),
            request,
            decode.engine_id,
            context_tokens=len(request.prompt_token_ids),
            output_tokens=len(output),
            cached_tokens=result["num_cached_tokens"],
            finish_reason=result["finish_reason"],
            path=plan.path,
        )
        context = [*request.prompt_token_ids, *output]
        self._remember(request.trajectory_id, decode, len(context), hash(tuple(context)))
        self._last_context[request.trajectory_id] = len(request.prompt_token_ids) + len(output)
        legs = {"decode": result}
        if prefill_result is not None:
            legs["prefill"] = prefill_result
        return TurnResult(
            trajectory_id=request.trajectory_id,
            turn=request.turn,
            output_token_ids=output,
            finish_reason=result["finish_reason"],
            path=plan.path,
            decode_engine_id=decode.engine_id,
            prefill_engine_id=plan.prefill.engine_id if plan.prefill is not None else -1,
            prefill_cached_tokens=prefill_result["num_cached_tokens"] if prefill_result else 0,
            num_cached_tokens=result["num_cached_tokens"],
            legs=legs,
        )

    # ------------------------------------------------------------------ failures
    def _check_served(self, result: dict[str, Any], lease: Lease) -> None:
        """Raise :class:`Rerouted` for a leg that ended without serving its turn."""
        where = f"{lease.request_id} on engine {lease.engine_id}"
        if not result or result.get("finish_reason") == "abort":
            if lease.evicted:  # a switch's abort may also have ended a given-up wait
                raise Rerouted(f"{where} evicted by a role switch")
            if result.get("kv_wait_given_up"):
                raise KVHandoffLost(f"{where} gave up waiting for its KV", lease.engine_id)
            raise Rerouted(f"{where} aborted by the engine")
        if result.get("finish_reason") == "error":  # vLLM failed the request itself
            raise LegFailed(f"{where} failed in the engine")

    def _engine_failed(self, exc: EngineUnavailable) -> None:
        if exc.transient:
            # Unreachable this once: the engine stays, but takes no new work for a while
            # so that the turn's retries go elsewhere (the monitor's stall watch retires
            # it if it stays silent).
            logger.warning("engine %d unreachable: %s", exc.engine_id, exc.reason)
            self.pools.back_off(exc.engine_id, self.config.unreachable_backoff_s)
            return
        if self.pools.mark_dead(exc.engine_id, cause=f"request failed: {exc.reason}"):
            logger.error("engine %d marked dead: %s", exc.engine_id, exc.reason)

    def _release_stale_kv(self, request_id: str, kv_params: dict[str, Any]) -> None:
        """Ask a live decode-capable engine to free KV pinned for a decode that died."""
        peers = self.pools.members(Role.DECODE) + self.pools.members(Role.COLOCATED)
        if not peers:
            return

        async def release() -> None:
            try:
                await asyncio.wait_for(peers[0].client.release_kv(request_id, kv_params), 10)
            except Exception as exc:  # best effort: the prefill engine's lease expires anyway
                logger.info("could not release KV of %s: %s", request_id, exc)

        task = asyncio.get_running_loop().create_task(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------ helpers
    def _request_id(self, request: TurnRequest, leg: str) -> str:
        return f"{request.trajectory_id}/{request.turn}/{leg}{next(self._ids)}"

    def _event(
        self,
        kind: K,
        at: float,
        request: TurnRequest,
        engine_id: int = -1,
        **fields: Any,
    ) -> None:
        """A router-side stage event of ``request``'s turn (token counts by keyword)."""
        if kind is K.PREFILL_QUEUED:
            self.prefill_work.appended_tokens += fields.get("new_tokens", 0)
        elif kind is K.PREFILL_END:
            self.prefill_work.computed_tokens += fields.get("new_tokens", 0)
        self._emit(
            kind, at, request.trajectory_id, request.turn, request.group_id, request.task,
            engine_id=engine_id, **fields,
        )  # fmt: skip

    def _emit(
        self,
        kind: K,
        at: float,
        trajectory_id: str,
        turn: int,
        group_id: str,
        task: str,
        *,
        engine_id: int = -1,
        context_tokens: int = 0,
        new_tokens: int = 0,
        cached_tokens: int = 0,
        output_tokens: int = 0,
        **detail: Any,
    ) -> None:
        """Record one event and move the trajectory's live state (one place for both)."""
        # After a decode the context includes the new output (as the simulator counts it).
        state, tokens = STATE_AFTER[kind], context_tokens + output_tokens
        old = self._live.get(trajectory_id)
        if old is None:
            self.states.enter(state, tokens)
        else:
            self.states.move(*old, state, tokens)
        self._live[trajectory_id] = (state, tokens)
        telemetry = self.telemetry
        telemetry.turn(
            at,
            telemetry.key(trajectory_id, group_id, task),
            turn,
            KIND_CODE[kind],
            engine_id,
            max(0, context_tokens),
            max(0, new_tokens),
            max(0, cached_tokens),
            max(0, output_tokens),
            detail_json(**detail),
        )


def _fits_mode(engine: EngineState, mode: str) -> bool:
    """Whether ``engine``'s role serves a turn forced to ``mode``."""
    if mode == "colocated":
        return engine.role is Role.COLOCATED
    if mode == "disaggregated":
        return engine.role is Role.DECODE
    return engine.role in (Role.DECODE, Role.COLOCATED)


_TOKEN_FIELDS = ("new_tokens", "cached_tokens", "output_tokens")


def _prefill_leg_sampling(sampling: dict[str, Any]) -> dict[str, Any]:
    """A turn's sampling for its prefill leg, which samples one token: vLLM refuses a
    ``min_tokens`` above ``max_tokens``, and one keeps its meaning for that token (no
    end of sequence first)."""
    if sampling.get("min_tokens", 0) > 1:
        return {**sampling, "min_tokens": 1}
    return sampling
