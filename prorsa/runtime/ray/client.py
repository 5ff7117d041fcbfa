"""How the router talks to an engine: a small async protocol and its Ray implementation.

The router depends only on :class:`EngineClient`, so its routing, switching and failure
handling are tested against in-process fakes; :class:`RayEngineClient` adapts an
:class:`~prorsa.runtime.ray.engine.EngineServer` actor and turns Ray's errors into
:class:`EngineUnavailable` (the engine is gone: re-route) or the original
:class:`~prorsa.errors.ProrsaError` (the request is bad: report it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Protocol, TypeVar, runtime_checkable

from prorsa.errors import ProrsaError


class EngineUnavailable(RuntimeError):
    """The engine died or stopped answering; its requests must be served elsewhere.

    ``transient``: Ray could not reach the actor this time but does not say it died
    (``ActorUnavailableError``: a restarting actor, a network blip; the call may or may
    not have run). The request goes elsewhere, but the engine stays in service: the
    stall watch retires it if it stays silent, and Ray reports a real death as such.
    """

    def __init__(self, engine_id: int, reason: str, *, transient: bool = False) -> None:
        super().__init__(f"engine {engine_id} unavailable: {reason}")
        self.engine_id = engine_id
        self.reason = reason
        self.transient = transient


T = TypeVar("T")

#: Engine calls that change nothing, so a caller may cancel them on the actor when it
#: stops waiting (cancelling a pause or a weight load half-way could leave it anywhere).
QUERIES = frozenset({"load", "in_flight", "health", "is_paused", "is_sleeping"})


async def answered_within(
    call: Awaitable[T], engine_id: int, what: str, timeout_s: float | None
) -> T:
    """``call``'s answer; an engine that gives none within ``timeout_s`` (``None``: no
    bound) is :class:`EngineUnavailable`. Control calls are bounded so that one stuck
    engine cannot hold a weight update, a pause or a switch for ever: the caller then
    takes it out of service."""
    if timeout_s is None:
        return await call
    try:
        return await asyncio.wait_for(call, timeout_s)
    except TimeoutError:
        raise EngineUnavailable(engine_id, f"no answer to {what} within {timeout_s} s") from None


@runtime_checkable
class EngineClient(Protocol):
    """Async handle on one engine. See ``EngineServer`` for each method's contract."""

    engine_id: int

    def generate_stream(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        temperature: float = 0.0,
        kv_transfer_params: dict[str, Any] | None = None,
        **sampling: Any,
    ) -> AsyncIterator[dict[str, Any]]: ...

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        temperature: float = 0.0,
        kv_transfer_params: dict[str, Any] | None = None,
        **sampling: Any,
    ) -> dict[str, Any]: ...

    async def abort(self, request_ids: list[str]) -> None: ...

    async def pause(self, mode: str = "keep") -> None: ...

    async def resume(self) -> None: ...

    async def reset_prefix_cache(self) -> bool: ...

    async def release_kv(self, request_id: str, kv_transfer_params: dict[str, Any]) -> None: ...

    async def health(self) -> dict[str, Any]: ...

    async def load(self) -> dict[str, Any]: ...

    async def shutdown(self) -> None: ...


@runtime_checkable
class EngineAdminClient(EngineClient, Protocol):
    """What a rollout service needs beyond routing: weights, sleep, worker RPCs.

    Kept apart from :class:`EngineClient` so that the router (and its test fakes) depend
    only on what routing uses. See ``EngineServer`` for each method's contract.
    """

    async def is_paused(self) -> bool: ...

    async def update_weights_from_path(self, path: str, version: int) -> dict[str, Any]: ...

    async def set_weight_version(self, version: int) -> None: ...

    async def collective_rpc(
        self,
        method: str,
        args: list[Any] | tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> list[Any]: ...

    async def sleep(self, level: int = 1, mode: str = "abort") -> dict[str, Any]: ...

    async def wake_up(self, tags: list[str] | None = None) -> bool: ...

    async def is_sleeping(self) -> bool: ...

    async def in_flight(self) -> list[str]: ...


class RayEngineClient:
    """:class:`EngineClient` over an ``EngineServer`` Ray actor handle."""

    def __init__(self, engine_id: int, actor: Any) -> None:
        self.engine_id = engine_id
        self.actor = actor

    async def generate_stream(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        temperature: float = 0.0,
        kv_transfer_params: dict[str, Any] | None = None,
        **sampling: Any,
    ) -> AsyncIterator[dict[str, Any]]:
        stream = self.actor.generate_stream.options(num_returns="streaming").remote(
            request_id, prompt_token_ids, max_tokens, temperature, kv_transfer_params, **sampling
        )
        try:
            async for ref in stream:
                yield await self._wait(ref)
        except BaseException:
            _cancel(stream)
            raise

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        temperature: float = 0.0,
        kv_transfer_params: dict[str, Any] | None = None,
        **sampling: Any,
    ) -> dict[str, Any]:
        ref = self.actor.generate.remote(
            request_id, prompt_token_ids, max_tokens, temperature, kv_transfer_params, **sampling
        )
        try:
            return await self._wait(ref)
        except BaseException:
            _cancel(ref)
            raise

    async def abort(self, request_ids: list[str]) -> None:
        await self._call("abort", list(request_ids))

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None:
        await self._call("pause", mode, clear_cache)

    async def resume(self) -> None:
        await self._call("resume")

    async def is_paused(self) -> bool:
        return bool(await self._call("is_paused"))

    async def update_weights_from_path(self, path: str, version: int) -> dict[str, Any]:
        return await self._call("update_weights_from_path", path, version)

    async def set_weight_version(self, version: int) -> None:
        await self._call("set_weight_version", version)

    async def collective_rpc(
        self,
        method: str,
        args: list[Any] | tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> list[Any]:
        return await self._call("collective_rpc", method, tuple(args), kwargs, timeout_s)

    async def sleep(self, level: int = 1, mode: str = "abort") -> dict[str, Any]:
        return await self._call("sleep", level, mode)

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        return bool(await self._call("wake_up", tags))

    async def is_sleeping(self) -> bool:
        return bool(await self._call("is_sleeping"))

    async def in_flight(self) -> list[str]:
        return list(await self._call("in_flight"))

    async def reset_prefix_cache(self) -> bool:
        return bool(await self._call("reset_prefix_cache"))

    async def release_kv(self, request_id: str, kv_transfer_params: dict[str, Any]) -> None:
        await self._call("release_kv", request_id, kv_transfer_params)

    async def health(self) -> dict[str, Any]:
        return await self._call("health")

    async def load(self) -> dict[str, Any]:
        return await self._call("load")

    async def shutdown(self) -> None:
        await self._call("shutdown")

    async def _call(self, method: str, *args: Any) -> Any:
        ref = getattr(self.actor, method).remote(*args)
        try:
            return await self._wait(ref)
        except asyncio.CancelledError:
            if method in QUERIES:
                # A caller that gave up (a poll's timeout) frees the actor's slot too: a
                # hung engine would otherwise pile up unanswered polls in its control group.
                _cancel(ref)
            raise

    async def _wait(self, ref: Any) -> Any:
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

        try:
            return await ref
        except ActorUnavailableError as exc:
            raise EngineUnavailable(
                self.engine_id, f"{type(exc).__name__}: {exc}", transient=True
            ) from exc
        except RayActorError as exc:  # died, killed, or unreachable
            raise EngineUnavailable(self.engine_id, type(exc).__name__) from exc
        except RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, ProrsaError):
                raise cause from None
            if _is_engine_dead(cause):
                raise EngineUnavailable(self.engine_id, f"vLLM engine dead: {cause}") from exc
            raise


def _is_engine_dead(exc: BaseException | None) -> bool:
    return exc is not None and type(exc).__name__ == "EngineDeadError"


def _cancel(ref: Any) -> None:
    """Cancel a Ray task or stream, ignoring a task that already finished."""
    import ray

    # Best effort: the task may be done or the actor gone.
    with contextlib.suppress(Exception):
        ray.cancel(ref)
