"""Control calls of a Ray actor run beside requests that fill every request slot."""

from __future__ import annotations

import asyncio
import threading

import pytest

from prorsa.runtime.ray.control_group import CONTROL_GROUP, LoopBound, with_control_group

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]


def _actor_class(max_concurrency: int, control_group: bool):
    import ray

    class Frozen(LoopBound):
        """Requests that wait until ``release``, like legs frozen by a ``keep`` pause."""

        def __init__(self) -> None:
            self.gate: asyncio.Event | None = None

        async def start(self) -> int:
            self.bind_main_loop()
            self.gate = asyncio.Event()  # belongs to the main loop
            return threading.get_ident()

        async def request(self) -> str:
            await self.gate.wait()
            return "served"

        async def release(self) -> int:
            self.gate.set()
            return threading.get_ident()

    cls = with_control_group(Frozen, ["release"]) if control_group else Frozen
    groups = {CONTROL_GROUP: 2} if control_group else None
    return ray.remote(num_cpus=0, max_concurrency=max_concurrency, concurrency_groups=groups)(cls)


@pytest.mark.parametrize("control_group", [True, False])
def test_a_control_call_is_not_queued_behind_requests_filling_every_slot(
    ray_session, control_group
):
    import ray

    actor = _actor_class(max_concurrency=2, control_group=control_group).remote()
    try:
        main_thread = ray.get(actor.start.remote())
        requests = [actor.request.remote() for _ in range(2)]  # both request slots held
        released = actor.release.remote()
        ready, _ = ray.wait([released], timeout=10 if control_group else 2)
        if control_group:
            # Answered at once, and ran on the main loop (the event is the main loop's).
            assert ready and ray.get(released) == main_thread
            assert ray.get(requests, timeout=10) == ["served", "served"]
        else:
            assert not ready  # the deadlock the control group removes
    finally:
        ray.kill(actor)


def test_the_engine_actor_runs_every_control_call_in_the_control_group():
    """A drift guard: each engine client call except the two request legs is a control
    method, and the built actor class puts exactly those in the control group."""
    from prorsa.runtime.ray.client import RayEngineClient
    from prorsa.runtime.ray.engine import CONTROL_METHODS, engine_actor_class

    calls = {
        name
        for name in vars(RayEngineClient)
        if not name.startswith("_") and callable(getattr(RayEngineClient, name))
    }
    assert calls - {"generate", "generate_stream"} == set(CONTROL_METHODS)
    groups = engine_actor_class().__ray_metadata__.method_meta.concurrency_group_for_methods
    assert {name for name, group in groups.items() if group == CONTROL_GROUP} == set(
        CONTROL_METHODS
    )


def test_only_coroutine_methods_can_hop():
    class Plain(LoopBound):
        def sync(self) -> int:
            return 1

    with pytest.raises(TypeError, match=r"Plain\.sync must be a coroutine function"):
        with_control_group(Plain, ["sync"])
