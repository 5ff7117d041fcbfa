"""Prefill/decode router over role pools of vLLM engines.

Per turn the router picks a path (see :meth:`PDRouter.generate`):

* ``disaggregated``: a prefill leg (``max_tokens=1``, ``do_remote_decode``) on a prefill
  engine, then a decode leg on a decode engine that pulls the KV with the returned params;
* ``local_prefill``: the whole turn on the trajectory's decode engine, when the turn's new
  tokens are under ``local_prefill_threshold_tokens`` (or no prefill engine is left);
* ``colocated``: the whole turn on one colocated engine.

Trajectories stick to their engines on both sides (prefix-cache reuse); otherwise the
least-loaded engine of the role wins. A leg that dies with its engine is retried on a live
engine of the same role; a leg aborted by a role switch is re-routed. Every stage is
recorded as lifecycle telemetry.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prorsa.errors import ConfigError, InputError
from prorsa.runtime.ray.client import EngineUnavailable
from prorsa.runtime.ray.engine import PREFILL_FOR_REMOTE_DECODE
from prorsa.runtime.ray.events import EventSink
from prorsa.runtime.ray.pools import EngineState, Lease, Role, RolePools
from prorsa.runtime.ray.switch import RoleSwitcher
from prorsa.runtime.ray.turns import (
    MODES,
    Rerouted,
    RouterConfig,
    RoutingError,
    TurnRequest,
    TurnResult,
)
from prorsa.telemetry.recorder import Recorder
from prorsa.telemetry.schema import EventKind as K
from prorsa.telemetry.views import STATE_AFTER

logger = logging.getLogger(__name__)

__all__ = ["PDRouter", "RouterConfig", "RoutingError", "TurnRequest", "TurnResult"]


@dataclass
class _Plan:
    path: str
    decode: EngineState
    prefill: EngineState | None
    new_tokens: int


class PDRouter:
    """Route turns over :class:`RolePools`; switch engine roles live.

    Args:
        pools: the engines and their roles.
        config: routing behaviour; :class:`RouterConfig` defaults when omitted.
        recorder: where lifecycle events go (none recorded when omitted).
        clock: seconds for event times; wall-clock seconds since construction by default.
        keep_rows: also keep every event in memory (``events.rows``) for online forecasters.
    """

    def __init__(
        self,
        pools: RolePools,
        config: RouterConfig | None = None,
        *,
        recorder: Recorder | None = None,
        clock: Callable[[], float] | None = None,
        keep_rows: bool = False,
    ) -> None:
        self.pools = pools
        self.config = config or RouterConfig()
        self.config.validate()
        self.events = EventSink(recorder, clock, keep_rows=keep_rows)
        self.switcher = RoleSwitcher(pools, self.events, self.config)
        # Per trajectory: its engine per role, and per engine the (length, hash) of the
        # context that engine last held for it (to estimate the next turn's new tokens).
        self._sticky: dict[str, dict[Role, int]] = {}
        self._resident: dict[str, dict[int, tuple[int, int]]] = {}
        self._live: dict[str, tuple[str, int]] = {}  # trajectory -> (state, context tokens)
        self._last_context: dict[str, int] = {}  # trajectory -> context + output of last turn
        self._ids = itertools.count()
        self._background: set[asyncio.Task] = set()
        self.retries_total = 0
        self.reroutes_total = 0
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

        Raises :class:`ConfigError` at once for an unknown, dead or already switching engine.
        """
        coro = self.switcher.begin(engine_id, new_role, drain_timeout_s)
        return asyncio.get_running_loop().create_task(coro)

    def trajectory_states(self) -> tuple[dict[str, int], dict[str, int]]:
        """Live trajectories per lifecycle state, and their context tokens per state."""
        counts: dict[str, int] = {}
        tokens: dict[str, int] = {}
        for state, context in self._live.values():
            counts[state] = counts.get(state, 0) + 1
            tokens[state] = tokens.get(state, 0) + context
        return counts, tokens

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
        the same sink so one trajectory's events stay in order. ``traj_end`` also forgets
        the trajectory's routing state.
        """
        at = self.events.now()
        self.events.turn(
            kind,
            at,
            trajectory_id,
            turn,
            group_id=group_id,
            task=task,
            context_tokens=context_tokens,
            **fields,
        )
        if kind == K.TRAJ_END:
            self.forget(trajectory_id)
            self.completed_trajectories += 1
        else:
            self._live[trajectory_id] = (STATE_AFTER[kind], context_tokens)
        return at

    def forget(self, trajectory_id: str) -> None:
        """Drop a finished trajectory's sticky engines, cache bookkeeping and live state."""
        self._live.pop(trajectory_id, None)
        self._last_context.pop(trajectory_id, None)
        self._sticky.pop(trajectory_id, None)
        self._resident.pop(trajectory_id, None)

    async def generate(self, request: TurnRequest) -> TurnResult:
        """Serve one turn; retries on engine failure and re-routes after evictions.

        Raises:
            InputError: the request is malformed (nothing was dispatched).
            ConfigError: an unknown pinned engine id or mode.
            RoutingError: no engine of the needed role within ``route_timeout_s``, or
                ``max_retries`` engine failures.
        """
        self.validate(request)
        queued_at = self.events.now()
        context = len(request.prompt_token_ids)
        # New tokens as the simulator counts them: appended since the trajectory's last
        # turn ended (its prompt on turn 0), whatever any cache holds.
        last = self._last_context.get(request.trajectory_id, 0)
        self._event(
            K.PREFILL_QUEUED,
            queued_at,
            request,
            context_tokens=context,
            new_tokens=context - last if context >= last else context,
        )
        retries = reroutes = 0
        while True:
            plan = await self._plan(request)
            try:
                result = await self._serve(plan, request, retries, reroutes)
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
                continue
            result.retries, result.reroutes = retries, reroutes
            result.latency_s = self.events.now() - queued_at
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
    async def _plan(self, request: TurnRequest) -> _Plan:
        for pinned in (request.engine_id, request.prefill_engine_id):
            if pinned is not None and not self.pools.get(pinned).alive:
                raise RoutingError(f"pinned engine {pinned} is dead")
        plan = self._choose(request)
        if plan is None:
            ready = await self.pools.wait_until(
                lambda: self._choose(request) is not None, self.config.route_timeout_s
            )
            plan = self._choose(request) if ready else None
            if plan is None:
                raise RoutingError(
                    f"no engine can serve {request.mode} turn {request.turn} of "
                    f"{request.trajectory_id!r} within {self.config.route_timeout_s} s; "
                    f"engines per role: {self.pools.counts()}"
                )
        for engine, role in ((plan.decode, plan.decode.role), (plan.prefill, Role.PREFILL)):
            if engine is not None:
                self._stick(request.trajectory_id, role, engine)
        return plan

    def _choose(self, request: TurnRequest) -> _Plan | None:
        traj, mode = request.trajectory_id, request.mode
        if mode == "colocated" or (mode == "auto" and self._sticky_engine(traj, Role.COLOCATED)):
            engine = self._pick(Role.COLOCATED, traj, request.engine_id)
            if engine is None:
                return None
            return _Plan("colocated", engine, None, self._new_tokens(request, engine))
        decode = self._pick(Role.DECODE, traj, request.engine_id)
        if decode is None:
            if mode == "auto" and request.engine_id is None:
                colocated = self._pick(Role.COLOCATED, traj, None)
                if colocated is not None:
                    return _Plan("colocated", colocated, None, self._new_tokens(request, colocated))
            return None
        new_tokens = self._new_tokens(request, decode)
        prefill = self._pick(Role.PREFILL, traj, request.prefill_engine_id)
        if prefill is None and request.prefill_engine_id is not None:
            return None  # wait for the pinned prefill engine
        if prefill is None or new_tokens < self.config.local_prefill_threshold_tokens:
            return _Plan("local_prefill", decode, None, new_tokens)
        return _Plan("disaggregated", decode, prefill, self._new_tokens(request, prefill))

    def _sticky_engine(self, traj: str, role: Role) -> EngineState | None:
        engine_id = self._sticky.get(traj, {}).get(role)
        if engine_id is None:
            return None
        engine = self.pools.get(engine_id)
        return engine if engine.alive and engine.role is role else None

    def _pick(self, role: Role, traj: str, pinned: int | None) -> EngineState | None:
        if pinned is not None:
            engine = self.pools.get(pinned)
            return engine if engine.alive and engine.role is role else None
        return self._sticky_engine(traj, role) or self.pools.least_loaded(role)

    def _new_tokens(self, request: TurnRequest, engine: EngineState) -> int:
        """Tokens of this turn the engine has not seen (from its last turn of this trajectory)."""
        prompt = request.prompt_token_ids
        seen = self._resident.get(request.trajectory_id, {}).get(engine.engine_id)
        if (
            seen is not None
            and seen[0] <= len(prompt)
            and hash(tuple(prompt[: seen[0]])) == seen[1]
        ):
            return len(prompt) - seen[0]
        return len(prompt)

    def _remember(self, traj: str, engine: EngineState, tokens: list[int]) -> None:
        self._resident.setdefault(traj, {})[engine.engine_id] = (len(tokens), hash(tuple(tokens)))

    def _stick(self, traj: str, role: Role, engine: EngineState) -> None:
        self._sticky.setdefault(traj, {})[role] = engine.engine_id

    # ------------------------------------------------------------------ serving
    async def _serve(
        self, plan: _Plan, request: TurnRequest, retries: int, reroutes: int
    ) -> TurnResult:
        attempt = {"retry": retries or None, "reroute": reroutes or None}
        if plan.path == "disaggregated":
            return await self._serve_disaggregated(plan, request, attempt)
        return await self._serve_single(plan, request, attempt)

    async def _serve_single(self, plan: _Plan, request: TurnRequest, attempt: dict) -> TurnResult:
        engine, prompt = plan.decode, request.prompt_token_ids
        context = len(prompt)
        started = self.events.now()
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

        result = await self._stream(engine, "t", request, None, started, first_token)
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
            self.events.now(),
            request,
            prefill.engine_id,
            context_tokens=context,
            new_tokens=plan.new_tokens,
            cached_tokens=context - plan.new_tokens,
            path=plan.path,
            **attempt,
        )
        lease = self.pools.lease(prefill, prefill_id, Role.PREFILL, request.trajectory_id, context)
        self.pools.reserve(decode)  # so concurrent new trajectories spread over decode engines
        try:
            first = await prefill.client.generate(
                prefill_id,
                prompt,
                1,
                request.temperature,
                dict(PREFILL_FOR_REMOTE_DECODE),
                **request.sampling(),
            )
        finally:
            self.pools.release(lease)
            self.pools.reserve(decode, -1)
        self._check_aborted(first, lease)
        cached = first["num_cached_tokens"]
        self._event(
            K.PREFILL_END,
            self.events.now(),
            request,
            prefill.engine_id,
            context_tokens=context,
            new_tokens=context - cached,
            cached_tokens=cached,
        )
        self._remember(request.trajectory_id, prefill, prompt)
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
        started = self.events.now()
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
        except EngineUnavailable:
            if kv_params:
                self._release_stale_kv(prefill_id, kv_params)
            raise
        finally:
            self.pools.clear_kv_pending(prefill.engine_id, prefill_id)
        return self._finish(plan, request, result, first)

    async def _decode_engine(self, request: TurnRequest, planned: EngineState) -> EngineState:
        """The planned decode engine, or another one if a switch or failure took it away."""
        if planned.alive and planned.role is Role.DECODE:
            return planned
        traj, pinned = request.trajectory_id, request.engine_id
        engine = self._pick(Role.DECODE, traj, pinned)
        if engine is None:
            await self.pools.wait_until(
                lambda: self._pick(Role.DECODE, traj, pinned) is not None,
                self.config.route_timeout_s,
            )
            engine = self._pick(Role.DECODE, traj, pinned)
        if engine is None:
            raise RoutingError(
                f"no decode engine for {traj!r} turn {request.turn} within "
                f"{self.config.route_timeout_s} s; engines per role: {self.pools.counts()}"
            )
        self._stick(traj, Role.DECODE, engine)
        return engine

    async def _stream(
        self,
        engine: EngineState,
        leg: str,
        request: TurnRequest,
        kv_params: dict[str, Any] | None,
        started: float,
        on_first_token: Callable[[float, int], None],
    ) -> dict[str, Any]:
        """Run a leg that decodes; ``on_first_token`` fires once, when the first token exists."""
        request_id = self._request_id(request, leg)
        prompt = request.prompt_token_ids
        lease = self.pools.lease(
            engine, request_id, engine.role, request.trajectory_id, len(prompt) + request.max_tokens
        )
        result: dict[str, Any] = {}
        fired = False
        try:
            async for item in engine.client.generate_stream(
                request_id,
                prompt,
                request.max_tokens,
                request.temperature,
                kv_params,
                **request.sampling(),
            ):
                if item.get("event") == "first_token":
                    fired = True
                    on_first_token(self.events.now(), int(item.get("num_cached_tokens") or 0))
                else:
                    result = item
        finally:
            self.pools.release(lease)
        self._check_aborted(result, lease)
        if not fired:  # finished with its first token: place the event from engine timings
            at = min(self.events.now(), started + result["timings"]["first_token_s"])
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
            self.events.now(),
            request,
            decode.engine_id,
            context_tokens=len(request.prompt_token_ids),
            output_tokens=len(output),
            cached_tokens=result["num_cached_tokens"],
            finish_reason=result["finish_reason"],
            path=plan.path,
        )
        self._remember(request.trajectory_id, decode, list(request.prompt_token_ids) + output)
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
    def _check_aborted(self, result: dict[str, Any], lease: Lease) -> None:
        if not result or result.get("finish_reason") == "abort":
            why = "evicted by a role switch" if lease.evicted else "aborted by the engine"
            raise Rerouted(f"{lease.request_id} on engine {lease.engine_id} {why}")

    def _engine_failed(self, exc: EngineUnavailable) -> None:
        if self.pools.mark_dead(exc.engine_id):
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
        self, kind: K, at: float, request: TurnRequest, engine_id: int = -1, **fields: Any
    ) -> None:
        self._live[request.trajectory_id] = (STATE_AFTER[kind], len(request.prompt_token_ids))
        self.events.turn(
            kind,
            at,
            request.trajectory_id,
            request.turn,
            engine_id=engine_id,
            group_id=request.group_id,
            task=request.task,
            **fields,
        )
