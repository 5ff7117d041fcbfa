"""Control calls that never wait behind requests: a Ray concurrency group of their own.

An async Ray actor runs at most ``max_concurrency`` calls at once (1,000 by default).
Every ``generate`` leg holds one of those slots until it returns, and a leg frozen by a
``keep`` pause returns only after ``resume``. With as many frozen legs as slots, the
``resume`` (or ``abort``, ``in_flight``, ``load``) queues behind them and never runs: the
engine is stuck for good. Control methods therefore run in their own concurrency group.

Ray runs each concurrency group of an async actor on its own event loop, in its own
thread, while the engine (vLLM's ``AsyncLLM``) and the actor's state live on the main
loop. A method moved to the control group hops back to the main loop
(:meth:`LoopBound.on_main_loop`), so the group only gives the call a slot; the work runs
where it always did.

Ray gives no order between concurrency groups: a control call may overtake a request sent
just before it (an ``abort`` can reach the engine before the leg it names; see
``EngineServer.abort`` for how that is handled).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any

CONTROL_GROUP = "control"
#: Control calls at once: a few per caller (service, router, monitor, switcher) suffice.
CONTROL_CONCURRENCY = 64


class LoopBound:
    """Remembers the actor's main event loop and runs coroutines there."""

    _main_loop: asyncio.AbstractEventLoop | None = None

    def bind_main_loop(self) -> None:
        """Call from the main loop (the actor's first call, ``start``)."""
        self._main_loop = asyncio.get_running_loop()

    async def on_main_loop(self, call: Coroutine[Any, Any, Any]) -> Any:
        """Await ``call`` on the main loop (directly when already there or unbound)."""
        loop = self._main_loop
        if loop is None or loop is asyncio.get_running_loop():
            return await call
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call, loop))


def with_control_group(cls: type[LoopBound], methods: Iterable[str]) -> type:
    """A subclass of ``cls`` whose ``methods`` run in the :data:`CONTROL_GROUP` and hop to
    the main loop. Give the Ray actor ``concurrency_groups={CONTROL_GROUP: n}``."""
    import ray

    namespace: dict[str, Any] = {}
    for name in methods:
        method = getattr(cls, name)
        if not inspect.iscoroutinefunction(method):
            raise TypeError(f"{cls.__name__}.{name} must be a coroutine function to hop loops")
        namespace[name] = ray.method(concurrency_group=CONTROL_GROUP)(_hopping(method))
    namespace["__doc__"] = cls.__doc__
    # A name of its own: Ray keys actor classes by module and qualified name.
    namespace["__qualname__"] = f"{cls.__qualname__}WithControlGroup"
    namespace["__module__"] = cls.__module__
    return type(cls.__name__, (cls,), namespace)


def _hopping(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def on_main_loop(self: LoopBound, *args: Any, **kwargs: Any) -> Any:
        return await self.on_main_loop(method(self, *args, **kwargs))

    # Not functools.wraps: Ray follows ``__wrapped__`` to the original function, which
    # has no concurrency group, and the call would queue behind requests again.
    on_main_loop.__name__ = method.__name__
    on_main_loop.__doc__ = method.__doc__
    on_main_loop.__signature__ = inspect.signature(method)  # Ray checks arguments on call
    return on_main_loop
