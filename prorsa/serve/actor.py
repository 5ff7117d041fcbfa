"""A :class:`~prorsa.serve.service.RolloutService` as a Ray actor.

Trainers built on Ray (verl, SkyRL's in-cluster mode) can hold a handle and call the
service's coroutines remotely; the actor runs them concurrently on its event loop, so
many sessions are served at once. Engines are started from inside the actor.
"""

from __future__ import annotations

import contextlib
from typing import Any

from prorsa.runtime.gc_heap import startup_heap_frozen
from prorsa.runtime.ray.control_group import (
    CONTROL_CONCURRENCY,
    CONTROL_GROUP,
    LoopBound,
    with_control_group,
)
from prorsa.serve.config import ServeConfig

#: Run in their own Ray concurrency group: turns waiting at a paused service's gate hold
#: request slots, and a ``resume`` queued behind them would never run.
CONTROL_METHODS: tuple[str, ...] = (
    "end_session", "pause", "resume", "update_weights_from_path", "begin_weight_update",
    "finish_weight_update", "cancel_weight_update", "collective_rpc", "reset_prefix_cache",
    "sleep", "wake_up", "status", "shutdown",
)  # fmt: skip


class RolloutServiceActor(LoopBound):
    """The actor body: :meth:`start` once, then the service's API by name."""

    def __init__(self, config: ServeConfig, fleet: Any = None) -> None:
        from prorsa.serve.service import RolloutService

        self.service = RolloutService(config, fleet=fleet)
        self._heap = contextlib.ExitStack()

    async def start(self) -> dict[str, Any]:
        self.bind_main_loop()  # the service's gate and locks live on this loop
        await self.service.start()
        # The actor's process serves from here on, as `prorsa serve`'s does.
        self._heap.enter_context(startup_heap_frozen(self.service.config.freeze_startup_heap))
        return self.service.status()

    async def generate(
        self, session_id: str | None, prompt_ids: list[int], sampling: dict[str, Any] | None = None,
        routing: dict[str, Any] | None = None,
    ) -> Any:  # fmt: skip
        return await self.service.generate(session_id, prompt_ids, sampling, routing=routing)

    async def end_session(self, session_id: str) -> bool:
        return await self.service.end_session(session_id)

    async def pause(self, mode: str = "keep") -> None:
        await self.service.pause(mode)

    async def resume(self) -> None:
        await self.service.resume()

    async def update_weights_from_path(self, path: str, version: int | None = None) -> dict:
        return await self.service.update_weights_from_path(path, version)

    async def begin_weight_update(self) -> dict[str, Any]:
        """Open a window for weights the trainer pushes itself (``collective_rpc``)."""
        return await self.service.begin_weight_update()

    async def finish_weight_update(self, version: int | None = None) -> dict[str, Any]:
        return await self.service.finish_weight_update(version)

    async def cancel_weight_update(self) -> None:
        await self.service.cancel_weight_update()

    async def reset_prefix_cache(self) -> dict[int, bool]:
        return await self.service.reset_prefix_cache()

    async def collective_rpc(
        self, method: str, args: list | None = None, kwargs: dict | None = None,
        timeout_s: float | None = None,
    ) -> dict[int, list]:  # fmt: skip
        return await self.service.collective_rpc(method, args or (), kwargs, timeout_s)

    async def sleep(self, level: int = 1, mode: str = "abort") -> dict:
        return await self.service.sleep(level, mode)

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        return await self.service.wake_up(tags)

    async def status(self) -> dict[str, Any]:
        return self.service.status()

    async def shutdown(self) -> None:
        try:
            await self.service.shutdown()
        finally:
            self._heap.close()


def rollout_service_actor(config: ServeConfig, *, fleet: Any = None, **ray_options: Any) -> Any:
    """Create (not start) the actor; ``ray.get(handle.start.remote())`` starts engines.

    ``fleet``: an engine fleet to adopt instead of starting one. ``ray_options`` go to
    ``.options()`` (e.g. ``name``, ``num_cpus``).
    """
    import ray

    cls = ray.remote(
        max_concurrency=1000, num_cpus=0, concurrency_groups={CONTROL_GROUP: CONTROL_CONCURRENCY}
    )(with_control_group(RolloutServiceActor, CONTROL_METHODS))
    return cls.options(**ray_options).remote(config, fleet)
