"""Control calls of a Ray actor run beside requests that fill every request slot."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from prorsa.runtime.ray.control_group import CONTROL_GROUP, LoopBound, with_control_group

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]


def _actor_class(max_concurrency: int, control_group: bool, arrivals: Path):
    import ray

    class Frozen(LoopBound):
        """Requests that wait until ``release``, like legs frozen by a ``keep`` pause.

        Each request appends a line to ``arrivals`` once it holds a slot: Ray does not
        order tasks on an async actor, so the test sends ``release`` only after both
        requests are known to be running."""

        def __init__(self) -> None:
            self.gate: asyncio.Event | None = None

        async def start(self) -> int:
            self.bind_main_loop()
            self.gate = asyncio.Event()  # belongs to the main loop
            return threading.get_ident()

        async def request(self) -> str:
            with open(arrivals, "a") as log:
                log.write("running\n")
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
    ray_session, control_group, tmp_path
):
    import ray

    arrivals = tmp_path / "arrivals"
    arrivals.touch()
    actor = _actor_class(2, control_group, arrivals).remote()
    try:
        main_thread = ray.get(actor.start.remote())
        requests = [actor.request.remote() for _ in range(2)]
        deadline = time.monotonic() + 30
        while len(arrivals.read_text().splitlines()) < 2:  # both request slots held
            assert time.monotonic() < deadline, "the requests never started"
            time.sleep(0.05)
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
    from prorsa.runtime.ray.client import QUERIES, RayEngineClient
    from prorsa.runtime.ray.engine import CONTROL_METHODS, engine_actor_class

    calls = {
        name
        for name in vars(RayEngineClient)
        if not name.startswith("_") and callable(getattr(RayEngineClient, name))
    }
    assert calls - {"generate", "generate_stream"} == set(CONTROL_METHODS)
    assert calls >= QUERIES  # the calls a client may cancel on the actor
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


def test_a_query_the_client_stops_waiting_for_is_cancelled_on_the_actor(ray_session):
    """Load polls of a hung engine time out; each is cancelled on the actor too, so they
    do not pile up and hold every control slot (then no resume or abort gets in)."""
    import ray

    from prorsa.runtime.ray.client import RayEngineClient

    class Hung(LoopBound):
        def __init__(self) -> None:
            self.cancelled = 0

        async def start(self) -> None:
            self.bind_main_loop()

        async def load(self) -> dict:
            try:
                await asyncio.Event().wait()  # never answers
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            return {}

        async def health(self) -> dict:
            return {"cancelled": self.cancelled}

    cls = with_control_group(Hung, ["load", "health"])
    actor = ray.remote(num_cpus=0, max_concurrency=4, concurrency_groups={CONTROL_GROUP: 2})(
        cls
    ).remote()
    client = RayEngineClient(0, actor)

    async def poll_three_times() -> dict:
        for _ in range(3):  # more polls than control slots
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.load(), 0.5)
        return await asyncio.wait_for(client.health(), 10)

    try:
        ray.get(actor.start.remote())
        answer = asyncio.run(poll_three_times())
        assert answer["cancelled"] >= 2  # the slots were freed (the last may be under way)
    finally:
        ray.kill(actor)


def test_the_service_actor_runs_every_call_but_start_and_generate_in_the_control_group():
    """A drift guard: a service call missing from CONTROL_METHODS would queue behind
    turns waiting at a paused service's gate."""
    import inspect

    from prorsa.serve.actor import CONTROL_METHODS, RolloutServiceActor

    calls = {
        name
        for name, member in vars(RolloutServiceActor).items()
        if not name.startswith("_") and inspect.iscoroutinefunction(member)
    }
    assert calls - {"start", "generate"} == set(CONTROL_METHODS)
