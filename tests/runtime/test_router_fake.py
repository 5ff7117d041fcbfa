"""Router logic against in-process fake engines: paths, stickiness, switches, failures."""

from __future__ import annotations

import asyncio
import json

import pytest

from prorsa.errors import ConfigError, InputError
from prorsa.runtime.ray.client import EngineUnavailable
from prorsa.runtime.ray.pools import Role, RolePools
from prorsa.runtime.ray.router import PDRouter, RouterConfig, RoutingError, TurnRequest
from prorsa.telemetry import Recorder, read_telemetry
from tests.runtime.fakes import VOCAB, FakeEngine, expected_tokens

LIMITS = {"max_model_len": 1024, "vocab_size": VOCAB}


def make_router(roles: list[str], config: RouterConfig | None = None, recorder=None, **fake_kw):
    engines = [FakeEngine(i, **fake_kw) for i in range(len(roles))]
    pools = RolePools(engines, dict(enumerate(roles)), {i: LIMITS for i in range(len(roles))})
    return PDRouter(pools, config or RouterConfig(route_timeout_s=5), recorder=recorder), engines


def prompt(n: int, start: int = 3) -> list[int]:
    return [(start + i) % VOCAB for i in range(n)]


def test_disaggregated_turn_uses_prefill_then_decode():
    router, engines = make_router(["prefill", "decode"])
    result = asyncio.run(router.generate(TurnRequest("t", prompt(40), 8)))
    assert result.path == "disaggregated"
    assert (result.prefill_engine_id, result.decode_engine_id) == (0, 1)
    assert result.output_token_ids == expected_tokens(prompt(40), 8)
    assert [c[0] for c in engines[0].calls] == ["prefill"]
    assert [c[0] for c in engines[1].calls] == ["decode"]


def test_sticky_multi_turn_and_least_loaded_spread():
    router, _engines = make_router(["prefill", "decode", "decode"])

    async def run():
        first = await asyncio.gather(
            *(router.generate(TurnRequest(f"t{i}", prompt(30, i), 20)) for i in range(4))
        )
        ctx = prompt(30, 0) + first[0].output_token_ids + prompt(5, 99)
        second = await router.generate(TurnRequest("t0", ctx, 4, turn=1))
        return first, second

    first, second = asyncio.run(run())
    assert sorted(r.decode_engine_id for r in first) == [1, 1, 2, 2]
    assert second.decode_engine_id == first[0].decode_engine_id
    assert second.num_cached_tokens > 0


def test_local_prefill_threshold_is_live():
    router, _engines = make_router(["prefill", "decode"], RouterConfig(route_timeout_s=5))

    async def run():
        ctx = prompt(64)
        r0 = await router.generate(TurnRequest("t", ctx, 4))
        router.set_local_prefill_threshold(32)
        ctx = ctx + r0.output_token_ids + prompt(8, 200)  # 12 new tokens on the decode engine
        r1 = await router.generate(TurnRequest("t", ctx, 4, turn=1))
        router.set_local_prefill_threshold(0)
        ctx = ctx + r1.output_token_ids + prompt(8, 300)
        r2 = await router.generate(TurnRequest("t", ctx, 4, turn=2))
        return r0, r1, r2

    r0, r1, r2 = asyncio.run(run())
    assert [r.path for r in (r0, r1, r2)] == ["disaggregated", "local_prefill", "disaggregated"]
    assert r1.decode_engine_id == r0.decode_engine_id
    with pytest.raises(ConfigError):
        router.set_local_prefill_threshold(-1)


def test_colocated_mode_and_auto_fallback():
    router, _engines = make_router(["colocated", "colocated"])
    r = asyncio.run(router.generate(TurnRequest("t", prompt(20), 5)))
    assert r.path == "colocated" and r.prefill_engine_id == -1
    r2 = asyncio.run(router.generate(TurnRequest("t", prompt(25), 5, turn=1, mode="colocated")))
    assert r2.decode_engine_id == r.decode_engine_id


def test_bad_requests_raise_clear_errors_while_good_one_completes():
    router, _ = make_router(["prefill", "decode"], step_s=0.005)

    async def run():
        good = asyncio.ensure_future(router.generate(TurnRequest("good", prompt(30), 30)))
        await asyncio.sleep(0.01)
        errors = []
        bad = [
            TurnRequest("empty", [], 4),
            TurnRequest("long", prompt(1024), 4),
            TurnRequest("vocab", [VOCAB + 5], 4),
            TurnRequest("pinned", prompt(5), 4, engine_id=42),
            TurnRequest("mode", prompt(5), 4, mode="sideways"),  # type: ignore[arg-type]
            TurnRequest("zero", prompt(5), 0),
        ]
        for request in bad:
            with pytest.raises((InputError, ConfigError)) as info:
                await router.generate(request)
            errors.append(str(info.value))
        return await good, errors

    result, errors = asyncio.run(run())
    assert result.output_token_ids == expected_tokens(prompt(30), 30)
    assert "prompt is empty" in errors[0]
    assert "1024 tokens" in errors[1] and "1023" in errors[1]
    assert "unknown engine id 42" in errors[3]


def test_role_switch_in_flight_loses_and_duplicates_nothing(tmp_path):
    recorder = Recorder(tmp_path / "tel", run_id="switch")
    router, engines = make_router(
        ["prefill", "decode", "decode"], RouterConfig(route_timeout_s=5), recorder, step_s=0.004
    )
    prompts = {f"t{i}": prompt(20 + i, i) for i in range(8)}

    async def run():
        tasks = [
            asyncio.ensure_future(router.generate(TurnRequest(t, p, 40)))
            for t, p in prompts.items()
        ]
        await router.pools.wait_until(lambda: router.pools.get(1).leases, 5)
        summary = await router.switch_role(1, "prefill", drain_timeout_s=0.01)
        return await asyncio.gather(*tasks), summary

    results, summary = asyncio.run(run())
    recorder.close()
    assert summary["aborted"] > 0 and summary["to"] == "prefill" and summary["error"] is None
    assert router.pools.roles() == {0: Role.PREFILL, 1: Role.PREFILL, 2: Role.DECODE}
    assert sorted(r.trajectory_id for r in results) == sorted(prompts)
    for r in results:
        assert r.output_token_ids == expected_tokens(prompts[r.trajectory_id], 40)
    assert sum(r.reroutes for r in results) == summary["aborted"]
    assert engines[1].resets == 1 and not engines[1].paused
    table, _ = read_telemetry(tmp_path / "tel", validate=True)
    kinds = table.column("kind").to_pylist()
    stages = [
        json.loads(d)["stage"]
        for k, d in zip(kinds, table.column("detail").to_pylist(), strict=True)
        if k.startswith("role_switch")
    ]
    assert stages == ["stop_new_work", "drained", "serving"]
    end = json.loads(table.column("detail").to_pylist()[kinds.index("role_switch_end")])
    assert set(end["stages_s"]) >= {"drain", "abort", "pause", "reset", "resume"}
    assert kinds.count("decode_end") == len(prompts)


def test_switch_refusals():
    router, _engines = make_router(["prefill", "decode", "decode"], step_s=0.01)

    async def run():
        task = asyncio.ensure_future(router.generate(TurnRequest("t", prompt(10), 30)))
        await router.pools.wait_until(lambda: router.pools.get(1).leases, 5)
        switch = asyncio.ensure_future(router.switch_role(1, "prefill", drain_timeout_s=5))
        await asyncio.sleep(0.01)
        with pytest.raises(ConfigError, match="already switching"):
            await router.switch_role(1, "colocated")
        with pytest.raises(ConfigError, match="no decode or colocated engine"):
            await router.switch_role(2, "prefill")
        with pytest.raises(ConfigError, match="unknown role"):
            await router.switch_role(0, "janitor")
        with pytest.raises(ConfigError, match="unknown engine"):
            await router.switch_role(9, "decode")
        return await task, await switch

    result, summary = asyncio.run(run())
    assert summary["drained"] is True and summary["aborted"] == 0
    assert result.reroutes == 0 and result.decode_engine_id == 1


def test_decode_to_colocated_is_an_instant_relabel():
    router, engines = make_router(["prefill", "decode", "decode"], step_s=0.01)

    async def run():
        task = asyncio.ensure_future(router.generate(TurnRequest("t", prompt(10), 30)))
        await router.pools.wait_until(lambda: router.pools.get(1).leases, 5)
        summary = await router.switch_role(1, "colocated")
        return summary, router.pools.get(1).role, await task

    summary, role, result = asyncio.run(run())
    assert summary["relabel"] is True and role is Role.COLOCATED
    assert engines[1].pauses == 0 and engines[1].resets == 0  # nothing drained or reset
    assert result.reroutes == 0 and result.decode_engine_id == 1


def test_engine_death_mid_decode_reroutes_with_retry_count(tmp_path):
    recorder = Recorder(tmp_path / "tel", run_id="kill")
    router, engines = make_router(
        ["prefill", "decode", "decode"], RouterConfig(route_timeout_s=5), recorder, step_s=0.004
    )
    prompts = {f"t{i}": prompt(16 + i, 7 * i) for i in range(6)}

    async def run():
        tasks = [
            asyncio.ensure_future(router.generate(TurnRequest(t, p, 30)))
            for t, p in prompts.items()
        ]
        await router.pools.wait_until(lambda: len(router.pools.get(2).leases) >= 2, 5)
        engines[2].kill()
        return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    recorder.close()
    assert all(r.output_token_ids == expected_tokens(prompts[r.trajectory_id], 30) for r in results)
    assert all(r.decode_engine_id == 1 for r in results if r.retries)
    assert sum(r.retries for r in results) >= 2
    assert router.pools.counts()["dead"] == 1
    assert engines[1].released  # the dead decode's pinned prefill KV was released via a peer
    table, _ = read_telemetry(tmp_path / "tel", validate=True)
    details = [json.loads(d) for d in table.column("detail").to_pylist() if d]
    assert any(d.get("retry") for d in details)


def test_an_unreachable_engine_loses_the_turn_but_stays_in_service():
    # Found by review: Ray's transient ActorUnavailableError (a restarting actor, a
    # network blip) retired the engine for good, like a death; and without a back-off
    # every retry went to the same sticky engine.
    router, engines = make_router(
        ["prefill", "decode", "decode"], RouterConfig(route_timeout_s=5, unreachable_backoff_s=0.2)
    )
    engines[0].unreachable_for(10)  # the prefill engine: prefilled where it decodes
    engines[1].unreachable_for(10)  # the first decode choice: decoded on the other

    async def run():
        first = await router.generate(TurnRequest("t0", prompt(20), 6))
        backing_off = [e.accepting for e in router.pools.engines()]
        engines[0].unreachable_for(0)
        engines[1].unreachable_for(0)
        await asyncio.sleep(0.3)
        later = await router.generate(TurnRequest("t1", prompt(24, 9), 6))
        return first, backing_off, later

    first, backing_off, later = asyncio.run(run())
    assert first.output_token_ids == expected_tokens(prompt(20), 6)
    assert first.retries == 2 and first.decode_engine_id == 2 and first.prefill_engine_id == -1
    assert backing_off == [False, False, True]
    assert router.pools.counts()["dead"] == 0
    # back in service once the back-off is over
    assert later.path == "disaggregated" and later.prefill_engine_id == 0
    assert later.decode_engine_id == 1
    assert later.output_token_ids == expected_tokens(prompt(24, 9), 6)


def test_an_unreachable_load_poll_waits_for_the_stall_watch_and_a_death_retires():
    from prorsa.runtime.ray.monitor import LoadMonitor

    class Polled(FakeEngine):
        async def load(self):
            self._check()
            return {"engine_id": self.engine_id, "running": 0, "waiting": 0}

    engines = [Polled(0), Polled(1)]
    pools = RolePools(engines, {0: "prefill", 1: "decode"}, {0: LIMITS, 1: LIMITS})

    async def run():
        monitor = LoadMonitor(pools, interval_s=1, stall_timeout_s=60)
        engines[1].unreachable_for(1)
        await monitor.poll_once()
        transient_dead = pools.counts()["dead"]
        engines[1].kill()
        await monitor.poll_once()
        return transient_dead, pools.counts()["dead"]

    assert asyncio.run(run()) == (0, 1)


def test_all_decode_engines_dead_gives_routing_error():
    router, engines = make_router(["prefill", "decode"], RouterConfig(route_timeout_s=0.2))
    engines[1].kill()
    with pytest.raises(RoutingError, match=r"no .*engine"):
        asyncio.run(router.generate(TurnRequest("t", prompt(10), 4)))


def test_held_switches_are_refused_until_released_and_waited_for():
    # A weight update holds switches: neither the controller's start_switch nor an
    # operator's switch_role may move an engine until the hold is released.
    router, _engines = make_router(["prefill", "decode", "decode"], step_s=0.01)

    async def run():
        router.hold_switches("weight_sync")
        with pytest.raises(ConfigError, match="held \\(weight_sync\\)"):
            router.start_switch(2, "prefill")
        with pytest.raises(ConfigError, match="held"):
            await router.switch_role(2, "prefill")
        assert router.pools.get(2).role is Role.DECODE
        router.release_switches("weight_sync")
        task = router.start_switch(2, "prefill", drain_timeout_s=1)
        assert router.switches_running == 1
        await router.wait_for_switches()
        return task.result()

    summary = asyncio.run(run())
    assert summary["error"] is None and router.pools.get(2).role is Role.PREFILL
    assert router.switches_running == 0 and router.switcher.completed == 1


def test_a_cancelled_waiter_leaves_switches_running_and_an_unstarted_one_gives_its_role_back():
    # Found by review: waiting with gather cancelled every switch when the waiter was
    # cancelled (a pause given up), and a switch task cancelled before its first step
    # left its engine "switching" for good.
    router, _engines = make_router(["prefill", "decode", "decode", "decode"], step_s=0.01)

    async def run():
        running = router.start_switch(2, "prefill", drain_timeout_s=1)
        waiter = asyncio.ensure_future(router.wait_for_switches())
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.sleep(0.05)
        survived = not running.cancelled()
        await router.wait_for_switches()
        unstarted = router.start_switch(1, "prefill", drain_timeout_s=1)
        unstarted.cancel()  # before the loop ever runs it
        await asyncio.sleep(0.01)
        return survived, running.result(), router.pools.get(1).role, router.pools.get(1).switch

    survived, summary, role, switch = asyncio.run(run())
    assert survived and summary["error"] is None
    assert role is Role.DECODE and switch is None


def test_a_failing_load_poll_does_not_end_the_monitor():
    # Found by review: one exception in a poll (a lost-engine listener failing) ended
    # stall detection for the rest of the run, and stop() raised it.
    from prorsa.runtime.ray.monitor import LoadMonitor

    router, _engines = make_router(["prefill", "decode"])

    async def run():
        monitor = LoadMonitor(router.pools, interval_s=0.002)
        polls = []

        async def flaky():
            polls.append(1)
            if len(polls) == 1:
                raise RuntimeError("listener broke")

        monitor.poll_once = flaky
        monitor.start()
        await asyncio.sleep(0.05)
        await monitor.stop()
        return len(polls)

    assert asyncio.run(run()) > 2


def test_a_poll_cancelled_before_it_asks_leaves_no_unawaited_load_call():
    # Found in CI: a service shut down while a poll was being sent warned "coroutine
    # 'load' was never awaited": each engine's load() was called before its wait began.
    import gc
    import warnings

    from prorsa.runtime.ray.monitor import LoadMonitor

    class Polled(FakeEngine):
        async def load(self):
            return {"engine_id": self.engine_id, "running": 0, "waiting": 0}

    pools = RolePools([Polled(0), Polled(1)], {0: "prefill", 1: "decode"}, {0: LIMITS, 1: LIMITS})

    async def run():
        monitor = LoadMonitor(pools, interval_s=60)
        poll = asyncio.ensure_future(monitor.poll_once())
        await asyncio.sleep(0)  # the poll has handed its questions over, none asked yet
        poll.cancel()
        with pytest.raises(asyncio.CancelledError):
            await poll

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        asyncio.run(run())
        gc.collect()
    assert not [w for w in seen if "never awaited" in str(w.message)]


def test_queued_prefill_counts_the_tokens_a_leg_computes_not_its_cached_prefix():
    # Found by review: a prefill leg counted its whole context, cached prefix included,
    # where the simulator counts what is left to compute; routing by queued tokens and
    # the policies' prefill backlog then differed between the two runtimes.
    router, _engines = make_router(["prefill", "decode"])
    seen = []
    lease = router.pools.lease

    def watching(engine, request_id, role, trajectory_id, tokens, compute_tokens=None, **more):
        made = lease(engine, request_id, role, trajectory_id, tokens, compute_tokens, **more)
        if role is Role.PREFILL:
            seen.append((tokens, engine.queued_prefill_tokens))
        return made

    router.pools.lease = watching

    async def run():
        first = await router.generate(TurnRequest("t", prompt(300), 8))
        context = prompt(300) + first.output_token_ids + prompt(20, 99)
        return await router.generate(TurnRequest("t", context, 4, turn=1))

    second = asyncio.run(run())
    (_, first_queued), (context, queued) = seen
    assert first_queued == 300  # nothing cached on the first turn
    # the second turn computes what came after the first: its 8 outputs and 20 new tokens
    assert second.num_cached_tokens > 0 and (context, queued) == (328, 28)


@pytest.mark.parametrize(("transient", "error"), [(True, "unavailable"), (False, "died")])
def test_ray_client_tells_an_unreachable_actor_from_a_dead_one(transient, error):
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    from prorsa.runtime.ray.client import RayEngineClient

    async def failing():
        if error == "unavailable":
            raise ActorUnavailableError("connection reset", None)
        raise ActorDiedError()

    client = RayEngineClient(3, actor=None)
    with pytest.raises(EngineUnavailable) as err:
        asyncio.run(client._wait(failing()))
    assert err.value.engine_id == 3 and err.value.transient is transient


def test_a_turn_hashes_each_prompt_prefix_once_whatever_the_candidates(monkeypatch):
    # Found by review: each prefill candidate hashed the whole prompt again (about 1 ms
    # per 128k tokens, ~7 times a turn).
    from prorsa.runtime.ray import turns

    router, _engines = make_router(["prefill", "prefill", "prefill", "decode"])
    first = prompt(200)
    calls = []

    def counting(value):
        calls.append(len(value))
        return hash(value)

    async def run():
        done = await router.generate(TurnRequest("t", first, 8))
        follow = [*first, *done.output_token_ids, *prompt(30, 5)]
        monkeypatch.setattr(turns, "hash", counting, raising=False)
        again = await router.generate(TurnRequest("t", follow, 8, turn=1))
        return done, again

    _done, again = asyncio.run(run())
    assert again.path == "disaggregated" and again.prefill_cached_tokens >= 192
    # the prefix a prefill engine holds, the context the decode engine holds and the
    # whole prompt the prefill leg leaves: each hashed once, however often compared
    assert sorted(calls) == [200, 208, 238]


def test_a_prefill_run_where_it_decodes_counts_in_that_engines_queue_until_its_first_token():
    # Found by review: the simulator counts a colocated turn's (or a local prefill's)
    # tokens in its engine's queued prefill; the router counted only prefill legs.
    router, _engines = make_router(["colocated"], prefill_s_per_token=0.002, step_s=0.01)
    engine = router.pools.get(0)

    async def run():
        turn = asyncio.ensure_future(router.generate(TurnRequest("t", prompt(100), 20)))
        await router.pools.wait_until(lambda: bool(engine.leases), 5)
        during = engine.queued_prefill_tokens
        await asyncio.sleep(0.3)  # 100 tokens x 2 ms: prefilled, decoding
        after_first_token = engine.queued_prefill_tokens
        await turn
        return during, after_first_token, engine.queued_prefill_tokens

    assert asyncio.run(run()) == (100, 0, 0)


def test_a_switching_prefill_engine_hands_its_queued_legs_on_and_drains_the_rest():
    # Found by review: the router drained every leg of a switching prefill engine, those
    # still queued in vLLM included; the simulator re-routes the queue at once.
    class Queueing(FakeEngine):
        """Reports every leg past the first as waiting, as a one-request batch would."""

        async def load(self):
            self._check()
            return {"running": min(1, len(self.in_flight)), "waiting": len(self.in_flight) - 1}

    engines = [Queueing(0, prefill_s_per_token=0.004), FakeEngine(1), FakeEngine(2)]
    roles = {0: "prefill", 1: "decode", 2: "decode"}
    pools = RolePools(engines, roles, {i: LIMITS for i in range(3)})
    router = PDRouter(pools, RouterConfig(route_timeout_s=5))

    async def run():
        turns = []
        for i in range(3):
            request = TurnRequest(f"t{i}", prompt(60, 11 * i), 4)
            turns.append(asyncio.ensure_future(router.generate(request)))
            await pools.wait_until(lambda i=i: len(pools.get(0).leases) == i + 1, 5)
        summary = await router.switch_role(0, "decode", drain_timeout_s=5)
        return summary, await asyncio.gather(*turns)

    summary, results = asyncio.run(run())
    assert summary["error"] is None and summary["requeued"] == 2 and summary["aborted"] == 0
    # the oldest leg ran to its end there; the two queued were prefilled where they decode
    assert [r.prefill_engine_id for r in results] == [0, -1, -1]
    assert [r.reroutes for r in results] == [0, 1, 1]
    assert all(
        r.output_token_ids == expected_tokens(prompt(60, 11 * i), 4) for i, r in enumerate(results)
    )


def test_a_prefill_engine_that_gives_no_load_before_its_switch_drains_every_leg():
    # Found by review: the optional load call before a switch could fail the switch and
    # retire a healthy engine.
    class Silent(FakeEngine):
        async def load(self):
            raise EngineUnavailable(self.engine_id, "ActorUnavailableError", transient=True)

    engines = [Silent(0, prefill_s_per_token=0.002), FakeEngine(1)]
    pools = RolePools(engines, {0: "prefill", 1: "decode"}, {0: LIMITS, 1: LIMITS})
    router = PDRouter(pools, RouterConfig(route_timeout_s=5))

    async def run():
        turn = asyncio.ensure_future(router.generate(TurnRequest("t", prompt(60), 4)))
        await pools.wait_until(lambda: bool(pools.get(0).leases), 5)
        summary = await router.switch_role(0, "decode", drain_timeout_s=5)
        return summary, await turn

    summary, result = asyncio.run(run())
    assert summary["error"] is None and summary["requeued"] == 0 and summary["drained"]
    assert pools.get(0).alive and result.prefill_engine_id == 0
