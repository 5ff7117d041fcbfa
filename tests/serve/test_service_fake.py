"""The rollout service's protocol over fake engines: sessions, weight sync, pause, sleep.

Fake engines stamp every token with their weight version and record any weight change
while they hold a request, so "nothing served by mixed weights" is checked directly.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from prorsa.errors import ConfigError, InputError, StateConflict
from prorsa.telemetry import read_telemetry
from prorsa.telemetry.validation import validate_table
from tests.serve.fakes import tokens_for
from tests.serve.helpers import fake_service, weights_folder

PROMPT = [5, 6, 7, 8, 9]


def run(coro):
    return asyncio.run(coro)


def single_version(result) -> int:
    """The one version every output token of a turn came from (fails on a mix)."""
    versions = {span[0] for span in result.weight_versions}
    assert len(versions) == 1, result.weight_versions
    assert result.weight_version == int(versions.pop())
    return result.weight_version


def test_turns_sessions_and_telemetry(tmp_path):
    async def go():
        async with fake_service(tmp_path) as (svc, _):
            first = await svc.generate(
                "s", PROMPT, {"max_tokens": 4, "temperature": 0, "logprobs": 0}
            )
            context = PROMPT + first.output_token_ids + [11, 12]
            second = await svc.generate("s", context, {"max_tokens": 3, "temperature": 0})
            ended = await svc.end_session("s")
            again = await svc.end_session("s")
            one_shot = await svc.generate(None, PROMPT, {"max_tokens": 2})
            table = svc.router.telemetry.log.to_table()
            return first, second, ended, again, one_shot, table, svc.status()

    first, second, ended, again, one_shot, table, status = run(go())
    assert first.output_token_ids == tokens_for(PROMPT, 4, 0)
    assert first.output_logprobs == [-1.0] * 4 and first.path == "disaggregated"
    assert (first.turn, second.turn) == (0, 1) and single_version(second) == 0
    assert ended and not again and status["sessions"] == 0
    validate_table(table)
    start = table.slice(0, 1).to_pylist()[0]
    assert start["kind"] == "allocation" and '"reason":"start"' in start["detail"]
    kinds = [
        k
        for t, k in zip(table["trajectory_id"].to_pylist(), table["kind"].to_pylist(), strict=True)
        if t == "s"
    ]
    assert kinds[0] == "traj_start" and kinds[-1] == "traj_end"
    # A tool phase after every turn: the trainer holds the floor until the next turn (or
    # finish_session), so the last turn is followed by one too.
    assert kinds.count("tool_start") == kinds.count("tool_end") == 2
    assert kinds.count("decode_end") == 2
    anon = set(table["trajectory_id"].to_pylist()) - {"s", ""}
    assert len(anon) == 1 and one_shot.session_id in anon  # one-shot sessions end at once


def test_weight_update_drains_in_flight_turns_then_serves_new_weights(tmp_path):
    async def go():
        async with fake_service(tmp_path) as (svc, fakes):
            long = [
                asyncio.ensure_future(
                    svc.generate(f"long{i}", [*PROMPT, i], {"max_tokens": 60, "ignore_eos": True})
                )
                for i in range(4)
            ]
            await asyncio.sleep(0.03)
            summary = await svc.update_weights_from_path(str(weights_folder(tmp_path, "w1")))
            done = await asyncio.gather(*long)
            after = await svc.generate("next", PROMPT, {"max_tokens": 4})
            return summary, done, after, fakes

    summary, done, after, fakes = run(go())
    assert summary["drained"] and summary["version"] == 1 and summary["aborted_turns"] == 0
    assert [single_version(r) for r in done] == [0, 0, 0, 0]
    assert all(len(r.output_token_ids) == 60 for r in done)
    assert single_version(after) == 1 and after.output_token_ids == tokens_for(PROMPT, 4, 1)
    assert all(f.version == 1 and not f.violations for f in fakes)


@pytest.mark.parametrize("mode", ["auto", "disaggregated"])
def test_turns_past_the_drain_timeout_are_served_again_under_new_weights(tmp_path, mode):
    async def go():
        async with fake_service(tmp_path, sync_drain_timeout_s=0.05) as (svc, fakes):
            turns = [
                asyncio.ensure_future(
                    svc.generate(f"t{i}", [*PROMPT, i], {"max_tokens": 150}, routing={"mode": mode})
                )
                for i in range(5)
            ]
            await asyncio.sleep(0.03)
            summary = await svc.update_weights_from_path(str(weights_folder(tmp_path, "w1")))
            return summary, await asyncio.gather(*turns), fakes

    summary, results, fakes = run(go())
    assert not summary["drained"] and summary["aborted_turns"] == 5
    assert [single_version(r) for r in results] == [1] * 5  # none lost, none mixed
    for i, r in enumerate(results):
        assert r.output_token_ids == tokens_for([*PROMPT, i], 150, 1) and r.reroutes >= 1
    assert all(not f.violations for f in fakes)


def test_versions_never_go_backwards_and_bad_folders_are_refused(tmp_path):
    async def go():
        async with fake_service(tmp_path) as (svc, _):
            w = str(weights_folder(tmp_path, "w"))
            first = await svc.update_weights_from_path(w, 5)
            errors = []
            for bad in [(w, 5), (w, 3), (str(tmp_path / "missing"), None)]:
                with pytest.raises(InputError) as info:
                    await svc.update_weights_from_path(*bad)
                errors.append(str(info.value))
            second = await svc.update_weights_from_path(w)
            return first, second, errors

    first, second, errors = run(go())
    assert (first["version"], second["version"]) == (5, 6)
    assert "not above the current 5" in errors[0] and "not above" in errors[1]
    assert "weight folder does not exist" in errors[2]


def test_role_switches_are_held_during_a_weight_update(tmp_path):
    async def go():
        async with fake_service(tmp_path, step_s=0.005) as (svc, _):
            long = asyncio.ensure_future(svc.generate("l", PROMPT, {"max_tokens": 40}))
            await asyncio.sleep(0.02)
            sync = asyncio.ensure_future(
                svc.update_weights_from_path(str(weights_folder(tmp_path, "w")))
            )
            await asyncio.sleep(0.02)
            with pytest.raises(ConfigError, match="held"):
                svc.start_switch(2, "colocated")
            refused = svc.actuator.switch(2, "colocated")  # the controller's path
            await sync
            await long
            switched = await svc.switch_role(2, "colocated")
            return refused, switched, svc.status()

    refused, switched, status = run(go())
    assert refused is False
    assert switched["to"] == "colocated" and status["roles"][2] == "colocated"


def test_pause_keep_holds_new_turns_until_resume(tmp_path):
    async def go():
        async with fake_service(tmp_path) as (svc, fakes):
            await svc.pause("keep")
            waiting = asyncio.ensure_future(svc.generate("p", PROMPT, {"max_tokens": 3}))
            await asyncio.sleep(0.1)
            held = not waiting.done() and svc.gate.waiting == 1
            paused = all(f.paused for f in fakes)
            await svc.resume()
            return held, paused, await waiting

    held, paused, result = run(go())
    assert held and paused and result.output_token_ids == tokens_for(PROMPT, 3, 0)


def test_pause_abort_serves_the_aborted_turn_again_after_resume(tmp_path):
    async def go():
        async with fake_service(tmp_path) as (svc, _):
            turn = asyncio.ensure_future(svc.generate("a", PROMPT, {"max_tokens": 80}))
            await asyncio.sleep(0.03)
            await svc.pause("abort")
            await asyncio.sleep(0.05)
            pending = not turn.done()
            await svc.resume()
            return pending, await turn

    pending, result = run(go())
    assert pending and result.reroutes >= 1
    assert result.output_token_ids == tokens_for(PROMPT, 80, 0)


def test_sleep_holds_turns_and_switches_until_wake_up(tmp_path):
    async def go():
        async with fake_service(tmp_path) as (svc, fakes):
            await svc.sleep(1)
            turn = asyncio.ensure_future(svc.generate("z", PROMPT, {"max_tokens": 2}))
            await asyncio.sleep(0.05)
            asleep = not turn.done() and all(f.sleeping for f in fakes)
            with pytest.raises(ConfigError, match="sleeping"):
                svc.start_switch(2, "colocated")
            awake = await svc.wake_up()
            return asleep, awake, await turn

    asleep, awake, result = run(go())
    assert asleep and awake and len(result.output_token_ids) == 2


def test_a_wait_sleep_on_engines_the_trainer_paused_keeps_their_turns_frozen(tmp_path):
    """Frozen turns cannot drain, so a ``wait`` sleep after a ``keep`` pause would never
    fall asleep; the turns go on after wake-up and resume instead."""

    async def go():
        async with fake_service(tmp_path) as (svc, fakes):
            turn = asyncio.ensure_future(
                svc.generate("f", PROMPT, {"max_tokens": 60, "ignore_eos": True})
            )
            await asyncio.sleep(0.03)
            await svc.pause("keep")
            await asyncio.wait_for(svc.sleep(1, "wait"), 2)
            frozen = not turn.done() and all(f.sleeping for f in fakes)
            await svc.wake_up()
            await svc.resume()
            return frozen, await asyncio.wait_for(turn, 5)

    frozen, result = run(go())
    assert frozen and result.output_token_ids == tokens_for(PROMPT, 60, 0)


def test_external_weight_update_window(tmp_path):
    async def go():
        async with fake_service(tmp_path) as (svc, fakes):
            opened = await svc.begin_weight_update()
            rpc = await svc.collective_rpc("receive_weights", kwargs={"chunk": 0})
            with pytest.raises(InputError, match="already open"):
                await svc.begin_weight_update()
            summary = await svc.finish_weight_update(7)
            after = await svc.generate("e", PROMPT, {"max_tokens": 2})
            return opened, rpc, summary, after, fakes

    opened, rpc, summary, after, fakes = run(go())
    assert opened["from_version"] == 0 and summary["version"] == 7 and summary["external"]
    assert set(rpc) == {0, 1, 2} and all(f.rpc_calls == ["receive_weights"] for f in fakes)
    assert single_version(after) == 7


def test_bad_requests_fail_before_dispatch(tmp_path):
    async def go():
        async with fake_service(tmp_path) as (svc, _fakes):
            messages = []
            for prompt, sampling, routing in [
                (PROMPT, {"max_tokens": -1}, None),
                (PROMPT, {"max_tokens": 2, "top_p": 0}, None),
                (PROMPT, {"max_tokens": 2, "bogus": 1}, None),
                ([], {"max_tokens": 2}, None),
                ([600], {"max_tokens": 2}, None),
                (PROMPT, {"max_tokens": 2}, {"engine": 1}),
            ]:
                with pytest.raises(InputError) as info:
                    await svc.generate("bad", prompt, sampling, routing=routing)
                messages.append(str(info.value))
            return messages, svc.status()

    messages, status = run(go())
    assert "max_tokens must be >= 1" in messages[0] and "top_p" in messages[1]
    assert "bogus" in messages[2] and "prompt is empty" in messages[3]
    assert "[0, 512)" in messages[4] and "routing" in messages[5]
    assert status["in_flight"] == 0


def test_concurrent_updates_each_get_their_own_version_and_refusals_retire_nobody(tmp_path):
    async def go():
        async with fake_service(tmp_path) as (svc, fakes):
            w = str(weights_folder(tmp_path, "w"))
            both = await asyncio.gather(
                svc.update_weights_from_path(w), svc.update_weights_from_path(w)
            )
            # Two explicit versions race: the first under the lock wins, the other is
            # refused without taking any engine out of service.
            outcomes = await asyncio.gather(
                svc.update_weights_from_path(w, 9),
                svc.update_weights_from_path(w, 5),
                return_exceptions=True,
            )
            return both, outcomes, svc.weight_version, svc.live_engines(), fakes

    both, outcomes, version, live, fakes = run(go())
    assert sorted(s["version"] for s in both) == [1, 2]
    assert outcomes[0]["version"] == 9 and isinstance(outcomes[1], InputError)
    assert version == 9 and live == [0, 1, 2]
    assert all(f.version == 9 for f in fakes)


def test_a_refused_finish_leaves_the_window_open_and_a_second_begin_is_refused(tmp_path):
    async def go():
        async with fake_service(tmp_path) as (svc, _):
            first = asyncio.ensure_future(svc.begin_weight_update())
            await asyncio.sleep(0)  # the first begin is still waiting to open
            with pytest.raises(InputError, match="already open"):
                await asyncio.wait_for(svc.begin_weight_update(), 5)  # not waiting for ever
            await first
            with pytest.raises(InputError, match="not above"):
                await svc.finish_weight_update(0)
            still_open = svc.weight_update_open and not svc.gate.is_open
            summary = await svc.finish_weight_update(3)
            after = await svc.generate("x", PROMPT, {"max_tokens": 2})
            return still_open, summary, after

    still_open, summary, after = run(go())
    assert still_open and summary["version"] == 3
    assert single_version(after) == 3


def test_a_trainers_pause_holds_role_switches_and_an_update_waits_for_wake_up(tmp_path):
    async def go():
        async with fake_service(tmp_path) as (svc, fakes):
            await svc.pause("keep")
            with pytest.raises(ConfigError, match="held"):
                svc.start_switch(2, "prefill")
            # an operator's order is a conflict with the pause (409), not a bad request
            with pytest.raises(StateConflict, match="held \\(paused\\)"):
                await svc.switch_role(2, "prefill")
            refused = svc.actuator.switch(2, "prefill")  # the controller's path
            paused = [f.paused for f in fakes]
            await svc.resume()
            await svc.sleep(1)
            with pytest.raises(InputError, match="asleep"):
                await svc.update_weights_from_path(str(weights_folder(tmp_path, "w")))
            await svc.wake_up()
            return refused, paused

    refused, paused = run(go())
    assert refused is False and paused == [True, True, True]


def test_a_partial_wake_lets_a_trainer_push_weights_before_the_kv_cache_wakes(tmp_path):
    """SkyRL's colocated flow: sleep, wake the weights alone, update them, wake the KV
    cache. Refused before (the service counted as asleep until fully awake)."""

    async def go():
        async with fake_service(tmp_path) as (svc, fakes):
            frozen = asyncio.ensure_future(
                svc.generate("f", PROMPT, {"max_tokens": 60, "ignore_eos": True})
            )
            await asyncio.sleep(0.03)
            await svc.sleep(1, "keep")  # the turn stays frozen inside its engine
            with pytest.raises(InputError, match="unknown wake-up tag"):
                await svc.wake_up(["everything"])
            half = await svc.wake_up(["weights"])
            # a level-0 sleep now pauses only the scheduler: the KV cache still sleeps
            await svc.sleep(0)
            still = set(svc.asleep)
            # as vLLM, a wake naming a tag already awake wakes nothing
            again = await svc.wake_up(["weights", "kv_cache"])
            turn = asyncio.ensure_future(svc.generate("w", PROMPT, {"max_tokens": 2}))
            summary = await svc.update_weights_from_path(str(weights_folder(tmp_path, "w")))
            await asyncio.sleep(0.05)
            held = not turn.done() and svc.sleeping and svc.asleep == {"kv_cache"}
            whole = await svc.wake_up(["kv_cache"])
            results = [await asyncio.wait_for(t, 5) for t in (turn, frozen)]
            return half, still, again, summary, held, whole, results, svc, fakes

    half, still, again, summary, held, whole, results, svc, fakes = run(go())
    assert half is False and again is False and whole is True
    assert still == {"kv_cache"}
    assert summary["version"] == 1
    assert held  # no turn is served while the KV cache sleeps
    # the frozen turn was aborted and served again, whole, under the new weights
    assert all(single_version(r) == 1 for r in results)
    assert results[1].output_token_ids == tokens_for(PROMPT, 60, 1)
    assert not svc.sleeping and svc.asleep == set()
    assert all(not f.violations for f in fakes), [f.violations for f in fakes]


def test_an_update_is_refused_while_the_weights_sleep(tmp_path):
    async def go():
        async with fake_service(tmp_path) as (svc, fakes):
            await svc.sleep(2)
            await svc.sleep(0)  # does not bring the weights back
            with pytest.raises(InputError, match="asleep"):
                await svc.update_weights_from_path(str(weights_folder(tmp_path, "w")))
            with pytest.raises(InputError, match="asleep"):
                await svc.begin_weight_update()
            return await svc.wake_up(), fakes

    awake, fakes = run(go())
    assert awake and all(not f.violations for f in fakes)


def test_an_update_cancelled_mid_reload_finishes_the_reload_before_serving_again(tmp_path):
    async def go():
        async with fake_service(tmp_path) as (svc, fakes):
            for fake in fakes:
                reload = fake.update_weights_from_path

                async def slow(path, version, reload=reload):
                    await asyncio.sleep(0.2)
                    return await reload(path, version)

                fake.update_weights_from_path = slow
            update = asyncio.ensure_future(
                svc.update_weights_from_path(str(weights_folder(tmp_path, "w")))
            )
            await asyncio.sleep(0.1)  # the engines are reloading
            update.cancel()
            with pytest.raises(asyncio.CancelledError):
                await update
            after = await svc.generate("c", PROMPT, {"max_tokens": 2})
            return svc.weight_version, after, fakes

    version, after, fakes = run(go())
    assert version == 1 and single_version(after) == 1
    assert all(f.version == 1 and not f.paused and not f.violations for f in fakes)


def test_pause_wait_after_keep_returns_and_a_resume_during_a_wait_drain_wins(tmp_path):
    async def go():
        async with fake_service(tmp_path, step_s=0.005) as (svc, fakes):
            frozen = asyncio.ensure_future(svc.generate("k", PROMPT, {"max_tokens": 60}))
            await asyncio.sleep(0.05)
            await svc.pause("keep")
            # The frozen turn cannot drain: `wait` must not wait for it.
            await asyncio.wait_for(svc.pause("wait"), 2)
            await svc.resume()
            first = await frozen
            # A resume while a `wait` pause drains undoes it: nothing stays paused.
            long = asyncio.ensure_future(svc.generate("w", PROMPT, {"max_tokens": 60}))
            await asyncio.sleep(0.05)
            pausing = asyncio.ensure_future(svc.pause("wait"))
            await asyncio.sleep(0.02)
            await svc.resume()
            # ... and the pause says so (a 409 over HTTP), not "paused" (found by review)
            with pytest.raises(StateConflict, match="undone"):
                await asyncio.wait_for(pausing, 5)
            await long
            after = await asyncio.wait_for(svc.generate("a", PROMPT, {"max_tokens": 2}), 5)
            return first, [f.paused for f in fakes], svc.gate.is_open, after

    first, paused, gate_open, after = run(go())
    assert first.output_token_ids == tokens_for(PROMPT, 60, 0)
    assert paused == [False, False, False] and gate_open
    assert after.output_token_ids == tokens_for(PROMPT, 2, 0)


def test_a_failed_update_records_its_end_with_the_error_and_serving_reopens(tmp_path):
    async def go():
        async with fake_service(tmp_path) as (svc, fakes):

            async def broken(path, version):
                raise RuntimeError("disk full")

            for fake in fakes:
                fake.update_weights_from_path = broken
            with pytest.raises(RuntimeError, match="every engine"):
                await svc.update_weights_from_path(str(weights_folder(tmp_path, "w")))
            table = svc.router.telemetry.log.to_table()
            return table, svc.gate.is_open, svc.weight_version

    table, gate_open, version = run(go())
    ends = [
        json.loads(d)
        for k, d in zip(table["kind"].to_pylist(), table["detail"].to_pylist(), strict=True)
        if k == "weight_sync" and json.loads(d)["stage"] == "end"
    ]
    assert len(ends) == 1 and "disk full" in ends[0]["error"] and ends[0]["version"] == 0
    assert gate_open and version == 0


def test_legs_still_on_their_way_to_an_engine_are_not_let_in_mid_update(tmp_path):
    """A leg past the dispatch barrier reaches its engine's request list only when its call
    arrives; the update must wait for it (and abort it) rather than reload under it."""

    async def go():
        async with fake_service(tmp_path, sync_drain_timeout_s=0.0) as (svc, fakes):
            for fake in fakes:
                fake.transit_s, fake.reload_s = 0.2, 0.3
            turns = [
                asyncio.ensure_future(svc.generate(f"t{i}", [*PROMPT, i], {"max_tokens": 5}))
                for i in range(3)
            ]
            await asyncio.sleep(0.05)  # every leg is past the barrier, none has arrived
            assert not await svc.engine_requests() and svc.barrier.legs_past(range(3))
            summary = await svc.update_weights_from_path(str(weights_folder(tmp_path, "w1")))
            for fake in fakes:
                fake.transit_s = 0.0
            return summary, await asyncio.gather(*turns), fakes

    summary, results, fakes = run(go())
    assert not summary["drained"] and summary["version"] == 1
    assert [single_version(r) for r in results] == [1, 1, 1]  # none lost, none mixed
    assert all(r.output_token_ids == tokens_for([*PROMPT, i], 5, 1) for i, r in enumerate(results))
    assert [f.violations for f in fakes] == [[], [], []]


@pytest.mark.parametrize("stuck_call", ["pause", "resume", "in_flight"])
def test_an_engine_that_stops_answering_leaves_service_and_the_update_goes_on(tmp_path, stuck_call):
    async def go():
        async with fake_service(tmp_path, engine_control_timeout_s=0.2) as (svc, fakes):
            fakes[2].hanging.add(stuck_call)
            summary = await svc.update_weights_from_path(str(weights_folder(tmp_path, "w1")))
            after = await svc.generate("s", PROMPT, {"max_tokens": 3})
            return summary, after, svc.live_engines(), svc.gate.is_open, fakes

    summary, after, live, gate_open, fakes = run(go())
    assert summary["version"] == 1 and gate_open and summary["left_service"] == [2]
    if stuck_call == "resume":  # paused and reloaded with the rest; lost on the way out
        assert summary["engines"] == [0, 1, 2] and fakes[2].version == 1
    else:
        assert summary["engines"] == [0, 1] and fakes[2].version == 0
    assert live == [0, 1] and [f.version for f in fakes[:2]] == [1, 1]
    assert single_version(after) == 1 and after.decode_engine_id == 1


def test_a_trainers_pause_and_resume_do_not_wait_for_a_stuck_engine(tmp_path):
    async def go():
        async with fake_service(tmp_path, engine_control_timeout_s=0.2) as (svc, fakes):
            first = await svc.generate("s", PROMPT, {"max_tokens": 3})
            fakes[2].hanging.add("pause")
            await asyncio.wait_for(svc.pause("keep"), 2)
            paused = [f.paused for f in fakes]
            fakes[1].hanging.add("resume")
            await asyncio.wait_for(svc.resume(), 2)
            # Both stuck engines gone: engine 0 serves alone (colocated, as the policy
            # re-plans), and the next turn is served.
            return first, paused, svc.live_engines(), svc.gate.is_open

    first, paused, live, gate_open = run(go())
    assert first.output_token_ids == tokens_for(PROMPT, 3, 0)
    assert paused == [True, True, False] and live == [0] and gate_open


def test_control_calls_retire_the_engines_that_fail_unless_none_answers(tmp_path):
    async def go():
        async with fake_service(tmp_path, engine_control_timeout_s=0.2) as (svc, fakes):
            fakes[2].hanging.add("abort")
            # Asked of the busy engines only: the one that does not answer leaves.
            some = await svc.control_engines(lambda c: c.abort([]), "abort", engine_ids=[1, 2])
            left = svc.live_engines()
            for fake in fakes:
                fake.hanging.add("in_flight")
            with pytest.raises(RuntimeError, match="no engine answered the request list"):
                await svc.control_engines(lambda c: c.in_flight(), "request list")
            return some, left, svc.live_engines()

    some, left, after = run(go())
    assert some == {1: None} and left == [0, 1]
    assert after == [0, 1]  # nobody answered: nobody is retired


def test_a_role_switch_on_an_engine_that_stops_answering_fails_and_retires_it(tmp_path):
    async def go():
        async with fake_service(tmp_path, engine_control_timeout_s=0.2) as (svc, fakes):
            fakes[2].hanging.add("pause")
            summary = await asyncio.wait_for(svc.switch_role(2, "prefill"), 5)
            after = await svc.generate("s", PROMPT, {"max_tokens": 3})
            return summary, svc.live_engines(), after

    summary, live, after = run(go())
    assert "no answer to the switch's pause" in summary["error"] and live == [0, 1]
    assert after.output_token_ids == tokens_for(PROMPT, 3, 0)


@pytest.mark.parametrize("stream_legs", [False, True])
def test_turns_inside_an_engine_that_stops_answering_are_served_elsewhere(tmp_path, stream_legs):
    """An engine stuck without dying never fails its calls: once it leaves service (here
    in a weight update's pause) its legs end and the router serves them on another."""

    async def go():
        async with fake_service(
            tmp_path,
            sync_drain_timeout_s=0.0,
            engine_control_timeout_s=0.2,
            stream_legs=stream_legs,
        ) as (svc, fakes):
            fakes[2].hanging.update({"generate", "pause", "abort", "in_flight", "resume"})
            turns = [
                asyncio.ensure_future(svc.generate(f"t{i}", [*PROMPT, i], {"max_tokens": 5}))
                for i in range(6)
            ]
            await asyncio.sleep(0.1)
            stuck = svc.barrier.legs_past([2]).get(2, 0)
            summary = await svc.update_weights_from_path(str(weights_folder(tmp_path, "w1")))
            results = await asyncio.wait_for(asyncio.gather(*turns), 10)
            return stuck, summary, results, svc.live_engines()

    stuck, summary, results, live = run(go())
    assert stuck > 0  # some decode legs went to the stuck engine
    assert summary["engines"] == [0, 1] and live == [0, 1]
    # The turns on the live engines finished before the update; the stuck ones after it.
    versions = [single_version(r) for r in results]
    assert versions.count(1) == stuck == sum(r.retries for r in results)
    assert all(r.decode_engine_id == 1 for r in results)
    assert all(
        r.output_token_ids == tokens_for([*PROMPT, i], 5, versions[i])
        for i, r in enumerate(results)
    )


@pytest.mark.parametrize("how", ["stops stepping", "stops answering"])
def test_turns_on_an_engine_stuck_without_failing_a_call_go_on_elsewhere(tmp_path, how):
    """A hung GPU leaves the actor alive: nothing fails, and outside an update or a
    pause nothing asked it a bounded question. The load monitor sees it hold requests
    without stepping (or without answering) and takes it out of service."""

    async def go():
        async with fake_service(tmp_path, engine_stall_timeout_s=0.3, stream_legs=True) as (
            svc,
            fakes,
        ):
            if how == "stops stepping":
                fakes[2].stalled = True
            else:
                fakes[2].hanging.update({"generate", "load"})
            turns = [
                asyncio.ensure_future(svc.generate(f"t{i}", [*PROMPT, i], {"max_tokens": 5}))
                for i in range(6)
            ]
            results = await asyncio.wait_for(asyncio.gather(*turns), 10)
            engine = svc.router.pools.get(2)
            return results, svc.live_engines(), engine.lost_cause

    results, live, cause = run(go())
    assert live == [0, 1] and cause.startswith("stuck: ")
    assert ("no engine step" if how == "stops stepping" else "no answer") in cause
    assert sum(r.retries for r in results) > 0  # some turns had a leg on engine 2
    assert all(r.decode_engine_id == 1 for r in results)
    assert all(r.output_token_ids == tokens_for([*PROMPT, i], 5, 0) for i, r in enumerate(results))


def test_engines_paused_with_their_turns_are_not_taken_for_stuck(tmp_path):
    async def go():
        async with fake_service(tmp_path, engine_stall_timeout_s=0.2) as (svc, fakes):
            turns = [
                asyncio.ensure_future(svc.generate(f"t{i}", [*PROMPT, i], {"max_tokens": 300}))
                for i in range(4)
            ]
            await asyncio.sleep(0.1)
            await svc.pause("keep")
            held = sum(len(f.requests) for f in fakes)
            await asyncio.sleep(0.6)  # three stall timeouts without a step
            live = svc.live_engines()
            await svc.resume()
            return held, live, await asyncio.wait_for(asyncio.gather(*turns), 10)

    held, live, results = run(go())
    assert held > 0 and live == [0, 1, 2]
    assert all(len(r.output_token_ids) == 300 and r.retries == 0 for r in results)


def test_engines_in_a_long_control_call_or_all_stuck_at_once_stay_in_service(tmp_path):
    """When every engine stops at once the fault more likely lies outside them, and a
    worker RPC (a trainer's NCCL broadcast) may hold an engine's steps for minutes:
    neither retires an engine. Once the RPC ends, an engine that still does not step
    leaves."""

    def launch(svc, tag):
        return [
            asyncio.ensure_future(svc.generate(f"{tag}{i}", [*PROMPT, i], {"max_tokens": 5}))
            for i in range(6)
        ]

    async def go():
        async with fake_service(tmp_path, engine_stall_timeout_s=0.2, policy="colocate") as (
            svc,
            fakes,
        ):
            for fake in fakes:  # every engine holds turns, none steps
                fake.stalled = True
            turns = launch(svc, "a")
            await asyncio.sleep(0.6)
            all_stuck = svc.live_engines()
            for fake in fakes:
                fake.stalled = False
            first = await asyncio.wait_for(asyncio.gather(*turns), 10)
            fakes[2].stalled, fakes[2].busy = True, ["collective_rpc"]
            turns = launch(svc, "b")
            await asyncio.sleep(0.6)
            in_rpc = svc.live_engines()
            fakes[2].busy = []
            second = await asyncio.wait_for(asyncio.gather(*turns), 10)
            return all_stuck, in_rpc, svc.live_engines(), first + second

    all_stuck, in_rpc, after, results = run(go())
    assert all_stuck == [0, 1, 2] and in_rpc == [0, 1, 2] and after == [0, 1]
    assert all(
        r.output_token_ids == tokens_for([*PROMPT, i % 6], 5, 0) for i, r in enumerate(results)
    )


@pytest.mark.parametrize("forecaster", [None, "last-value"])
def test_the_service_lets_go_of_the_events_its_forecaster_has_read(tmp_path, forecaster):
    # A service that runs for a whole training job held every event it served (~1 KB a
    # turn); the sweeper now drops what the forecaster has read (everything without one).
    config = {"policy": "predictive", "forecaster": forecaster} if forecaster else {}

    async def go():
        async with fake_service(tmp_path, interval_s=0.05, **config) as (svc, _):
            for i in range(4):
                await svc.generate(f"s{i}", PROMPT, {"max_tokens": 3})
            log = svc.router.telemetry.log
            await asyncio.sleep(0.15)  # the controller ticks: its forecaster reads them
            read = getattr(svc.forecaster, "rows_read", len(log))
            unread = len(log) - read
            svc._let_go_of_read_events()
            kept = (log.first_row, len(log))
            later = await svc.generate("later", PROMPT, {"max_tokens": 3})
            await asyncio.sleep(0.15)
            return read, unread, kept, later, svc.status()

    read, unread, (first, length), later, status = run(go())
    assert read > 0 and first == read and length == read + unread
    assert later.output_token_ids == tokens_for(PROMPT, 3, 0)
    assert status["control_ticks_failed"] == 0


def test_turns_a_trainer_s_abort_pause_stopped_wait_for_the_new_weights(tmp_path):
    # Found by review: AReaL pauses with abort before each update; the update resumed
    # the engines to drain, so the aborted turns were generated again from the start
    # under the old weights, delaying the update by a whole generation.
    async def go():
        async with fake_service(tmp_path, step_s=0.01) as (svc, fakes):
            turn = asyncio.ensure_future(svc.generate("a", PROMPT, {"max_tokens": 60}))
            while not any(f.steps for f in fakes):  # decoding
                await asyncio.sleep(0.005)
            await svc.pause("abort")
            steps = sum(f.steps for f in fakes)
            sync = await svc.update_weights_from_path(str(weights_folder(tmp_path, "w1")))
            regenerated = sum(f.steps for f in fakes) - steps
            await svc.resume()
            return sync, regenerated, await turn

    sync, regenerated, result = run(go())
    assert regenerated == 0  # nothing generated again under the old weights first
    assert sync["version"] == 1 and sync["aborted_turns"] == 1
    assert single_version(result) == 1 and result.output_token_ids == tokens_for(PROMPT, 60, 1)


@pytest.mark.parametrize("failing", [[2], [0, 1, 2]])
def test_a_push_start_that_fails_part_way_keeps_the_window_for_the_finish(tmp_path, failing):
    # Found by review: a start failing on one engine cancelled the window while the
    # others were part-way into the push (vLLM's start readies their layers for new
    # weights); only a start that reached no engine closes it again.
    async def go():
        async with fake_service(tmp_path) as (svc, fakes):
            for i in failing:
                fakes[i].failing_rpcs.add("skyrl_start_weight_update")
            with pytest.raises(RuntimeError, match="no method"):
                await svc.collective_rpc("skyrl_start_weight_update")
            still_open = svc.weight_update_open
            if still_open:
                await svc.collective_rpc("update_weights_ipc", kwargs={"update_info": {}})
                await svc.collective_rpc("skyrl_finish_weight_update")
            return still_open, svc.weight_version, svc.live_engines()

    still_open, version, live = run(go())
    if failing == [2]:
        assert still_open and version == 1 and live == [0, 1]  # the failed one left
    else:
        assert not still_open and version == 0 and live == [0, 1, 2]  # nothing changed


def test_a_finish_that_fails_on_one_engine_retires_it_and_a_refused_one_calls_nothing(tmp_path):
    async def go():
        async with fake_service(tmp_path) as (svc, fakes):
            await svc.begin_weight_update_with("start_weight_update")
            fakes[1].failing_rpcs.add("finish_weight_update")
            _, summary = await svc.finish_weight_update_with("finish_weight_update", 3)
            live_after = svc.live_engines()
            # A push that failed everywhere: the finish is refused before its call.
            await svc.begin_weight_update_with("start_weight_update")
            for fake in fakes:
                fake.failing_rpcs.add("update_weights_ipc")
            with pytest.raises(RuntimeError):
                await svc.collective_rpc("update_weights_ipc")
            calls_before = [f.rpc_calls.count("finish_weight_update") for f in fakes]
            with pytest.raises(StateConflict, match="every engine"):
                await svc.finish_weight_update_with("finish_weight_update", 4)
            calls_after = [f.rpc_calls.count("finish_weight_update") for f in fakes]
            await svc.cancel_weight_update()
            return summary, live_after, calls_before, calls_after, svc.weight_version

    summary, live_after, calls_before, calls_after, version = run(go())
    assert summary["version"] == 3 and live_after == [0, 2] and version == 3
    assert calls_before == calls_after


def test_a_session_id_used_again_after_its_end_is_a_new_trajectory_in_telemetry(tmp_path):
    # Found by review: a session that idled out mid-tool-call (a short --session-idle-s)
    # and came back restarted its turns under the same trajectory id, after that
    # trajectory's end: its turns went backwards within one trajectory.
    async def go():
        async with fake_service(tmp_path, telemetry_dir=str(tmp_path / "tel")) as (svc, _):
            for _ in range(2):
                await svc.generate("s", PROMPT, {"max_tokens": 2})
            svc._sessions().finish("s")  # as an idle expiry does
            again = await svc.generate("s", PROMPT, {"max_tokens": 2})
            await svc.generate(None, PROMPT, {"max_tokens": 2})  # anonymous: not remembered
            return again, dict(svc._sessions()._ended)

    again, ended = run(go())
    assert again.turn == 0 and again.session_id == "s" and list(ended) == ["s"]
    assert ended["s"][0] == 1
    table, _ = read_telemetry(tmp_path / "tel", validate=True)
    ids = set(table.column("trajectory_id").to_pylist()) - {""}
    assert {"s", "s#1"} <= ids


def test_a_bucket_that_failed_is_not_forgiven_by_another_bucket_and_a_retry_clears_it(tmp_path):
    # Found by review: a failure was cleared by any later success of the same method,
    # so an engine that missed bucket 0 and took bucket 1 stayed in service, mixed.
    async def go():
        async with fake_service(tmp_path) as (svc, fakes):
            await svc.begin_weight_update()
            fakes[1].failing_rpcs.add(("update_weights", 0))
            with pytest.raises(RuntimeError):
                await svc.collective_rpc("update_weights", kwargs={"bucket": 0})
            await svc.collective_rpc("update_weights", kwargs={"bucket": 1})
            await svc.finish_weight_update(2)
            missed_a_bucket = svc.live_engines()
            # The same bucket retried and taken: the engine stays.
            await svc.begin_weight_update()
            fakes[2].failing_rpcs.add(("update_weights", 0))
            with pytest.raises(RuntimeError):
                await svc.collective_rpc("update_weights", kwargs={"bucket": 0})
            fakes[2].failing_rpcs.clear()
            await svc.collective_rpc("update_weights", kwargs={"bucket": 0})
            await svc.finish_weight_update(3)
            return missed_a_bucket, svc.live_engines(), svc.weight_version

    missed_a_bucket, retried, version = run(go())
    assert missed_a_bucket == [0, 2] and retried == [0, 2] and version == 3


def test_a_cancel_retires_the_live_engines_a_push_failed_on_even_if_another_died(tmp_path):
    # Found by review: failures on engines {1, 2} with engine 1 dead since did not count
    # as "some engines", so engine 2 kept serving half a push.
    async def go():
        async with fake_service(tmp_path) as (svc, fakes):
            await svc.begin_weight_update()
            for i in (1, 2):
                fakes[i].failing_rpcs.add("update_weights")
            with pytest.raises(RuntimeError):
                await svc.collective_rpc("update_weights")
            svc.router.pools.mark_dead(1, cause="test")
            await svc.cancel_weight_update()
            return svc.live_engines()

    assert run(go()) == [0]


def test_status_names_the_engines_out_of_service_and_why(tmp_path):
    async def go():
        async with fake_service(tmp_path) as (svc, fakes):
            before = svc.status()["out_of_service"]
            await svc.begin_weight_update()
            fakes[1].failing_rpcs.add("update_weights")
            with pytest.raises(RuntimeError):
                await svc.collective_rpc("update_weights")
            await svc.cancel_weight_update()
            return before, svc.status()

    before, status = run(go())
    assert before == {}
    assert list(status["out_of_service"]) == [1] and status["engines_per_role"]["dead"] == 1
    assert "update_weights" in status["out_of_service"][1] and 1 not in status["roles"]


def test_ended_session_ids_are_forgotten_after_an_hour():
    from prorsa.serve.sessions import ENDED_KEPT_S, Sessions

    class Router:
        def trajectory_event(self, *args, **kwargs):
            pass

    now = [0.0]
    sessions = Sessions(Router(), lambda: now[0], idle_s=60.0)
    for name in ("a", "b"):
        sessions.get_or_start(name)
        sessions.finish(name)
    now[0] = ENDED_KEPT_S / 2
    sessions.get_or_start("b")
    sessions.finish("b")  # b ended again, later
    now[0] = ENDED_KEPT_S + 1.0
    sessions.expire()
    assert list(sessions._ended) == ["b"]  # a's end is an hour old; b's is not
    assert sessions.get_or_start("b").trajectory_id == "b#2"
    assert sessions.get_or_start("a").trajectory_id == "a"


def test_session_and_trajectory_names_never_collide():
    # Found by review: a trainer's session "anon-0" took in a one-shot request (which then
    # ended it), and a reused "x" ran as trajectory "x#1" beside a session named "x#1".
    from prorsa.serve.sessions import ANONYMOUS_PREFIX, Sessions

    class Router:
        def trajectory_event(self, *args, **kwargs):
            pass

    sessions = Sessions(Router(), lambda: 0.0, idle_s=60.0)
    sessions.get_or_start("x")
    sessions.finish("x")
    assert sessions.get_or_start("x#1").trajectory_id == "x#1"
    assert sessions.get_or_start("x").trajectory_id == "x#2"  # x#1 is taken
    sessions.finish("x#1")
    sessions.finish("x")
    # every name used so far (x, x#1, x#2) has ended: none is given again
    assert sessions.get_or_start("x").trajectory_id == "x#3"
    assert sessions.get_or_start("x#1").trajectory_id == "x#1#1"
    anonymous = sessions.anonymous_id()
    assert anonymous.startswith(ANONYMOUS_PREFIX)
    with pytest.raises(InputError, match="reserved"):
        sessions.get_or_start(anonymous)
    assert sessions.get_or_start(anonymous, one_shot=True).trajectory_id == anonymous


def test_wake_up_while_awake_leaves_a_trainer_pause_alone(tmp_path):
    # Found by review: vLLM's wake-up resumes the scheduler of an engine that never slept.
    async def go():
        async with fake_service(tmp_path) as (svc, fakes):
            await svc.pause("keep")
            woke = await svc.wake_up()
            # never resumed meanwhile: no second pause was needed to hold them
            paused = [(f.paused, f.calls.count("pause")) for f in fakes]
            await svc.resume()
            return woke, paused

    assert run(go()) == (True, [(True, 1)] * 3)


def test_no_update_window_opens_under_a_pause_still_draining(tmp_path):
    # Found by review: the window took the update lock the pause was waiting for, and the
    # pause waited on it until the window ended.
    async def go():
        async with fake_service(tmp_path, step_s=0.005) as (svc, _fakes):
            long = asyncio.ensure_future(svc.generate("w", PROMPT, {"max_tokens": 60}))
            await asyncio.sleep(0.05)
            pausing = asyncio.ensure_future(svc.pause("wait"))
            await asyncio.sleep(0.02)
            with pytest.raises(StateConflict, match="under way"):
                await svc.begin_weight_update()
            await asyncio.wait_for(pausing, 5)
            await long
            window = await svc.begin_weight_update()  # once the pause returned
            await svc.cancel_weight_update()
            await svc.resume()
            return window

    assert run(go())["engines"]


def test_an_engine_that_never_empties_fails_the_update_with_a_503(tmp_path, monkeypatch):
    # Found by review: a plain TimeoutError, answered as a 500.
    from prorsa.runtime.ray.turns import NoEngineAvailable
    from prorsa.serve import weight_sync

    monkeypatch.setattr(weight_sync, "ENGINE_IDLE_TIMEOUT_S", 0.2)

    async def go():
        async with fake_service(tmp_path) as (svc, fakes):
            fakes[0].requests.add("stuck")  # held, and no abort ever lets it go
            fakes[0].abort = lambda ids: asyncio.sleep(0)
            with pytest.raises(NoEngineAvailable, match="still hold requests"):
                await svc.update_weights_from_path(str(weights_folder(tmp_path, "w")))
            fakes[0].requests.discard("stuck")
            return svc.gate.is_open, svc.weight_version

    assert run(go()) == (True, 0)


def test_a_cancel_during_a_finish_is_refused_and_the_weights_get_their_version(tmp_path):
    # Found by review: the cancel closed the window while the finish call committed the
    # weights on the workers; the finish then failed and they served under the old number.
    async def go():
        async with fake_service(tmp_path) as (svc, fakes):
            await svc.begin_weight_update_with("start_weight_update")
            slow = fakes[0].collective_rpc

            async def committing(method, *args, **kwargs):
                await asyncio.sleep(0.1)
                return await slow(method, *args, **kwargs)

            fakes[0].collective_rpc = committing
            finish = asyncio.ensure_future(svc.finish_weight_update_with("finish_weight_update", 3))
            await asyncio.sleep(0.02)
            with pytest.raises(StateConflict, match="finishing"):
                await svc.cancel_weight_update()
            _, summary = await finish
            return summary["version"], svc.weight_version, [f.version for f in fakes]

    assert run(go()) == (3, 3, [3, 3, 3])


def test_shutdown_runs_every_stage_when_one_fails(tmp_path):
    # Found by review: a failing stage skipped the rest (telemetry, engines, Ray).
    async def go():
        async with fake_service(tmp_path, telemetry_dir=str(tmp_path / "tel")) as (svc, _):
            await svc.generate("s", PROMPT, {"max_tokens": 2})
            stop = svc.monitor.stop

            async def broken():
                raise RuntimeError("monitor stuck")

            svc.monitor.stop = broken
            with pytest.raises(RuntimeError, match="monitor stuck"):
                await svc.shutdown()
            closed = svc.recorder is None and len(svc.sessions) == 0
            svc.monitor.stop = stop
            return closed

    assert run(go())
