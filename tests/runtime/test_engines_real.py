"""Real vLLM engines in Ray actors: KV handoff, prefix reuse, live role switch, failures.

One fleet for the whole module (engine 0 prefill, 1 and 2 decode, 3 colocated). The tests
run in file order; the last two kill an engine and shut the fleet down.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from prorsa.errors import ConfigError, InputError
from prorsa.runtime.ray.config import nixl_available
from prorsa.runtime.ray.router import PDRouter, RouterConfig, TurnRequest
from prorsa.telemetry import Recorder, read_telemetry
from tests.runtime.fleets import start_tiny_fleet

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

ROLES = ["prefill", "decode", "decode", "colocated"]
COLOCATED = 3
VOCAB = 512


def tokens(n: int, start: int = 7) -> list[int]:
    return [(start + 13 * i) % (VOCAB - 10) + 5 for i in range(n)]


@pytest.fixture(scope="module")
def fleet(ray_session, tiny_model_dir, tmp_path_factory):
    fleet = start_tiny_fleet(tiny_model_dir, tmp_path_factory.mktemp("kv"), ROLES, max_num_seqs=8)
    yield fleet
    fleet.shutdown()


@pytest.fixture(scope="module")
def reference(fleet):
    """Greedy tokens from the colocated engine alone, memoised per (prompt, max_tokens)."""
    memo: dict[tuple, list[int]] = {}

    def get(prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in memo:
            prefetch([prompt], max_tokens)
        return memo[key]

    def prefetch(prompts: list[list[int]], max_tokens: int) -> None:
        """Compute the missing ones in one batch (one decode pass for all, not one each)."""
        missing = list({tuple(p) for p in prompts if (tuple(p), max_tokens) not in memo})
        client = fleet.clients[COLOCATED]

        async def all_at_once():
            return await asyncio.gather(*(
                client.generate(f"ref{len(memo)}-{i}", list(p), max_tokens, 0.0, ignore_eos=True)
                for i, p in enumerate(missing)
            ))  # fmt: skip

        for prompt, out in zip(missing, asyncio.run(all_at_once()), strict=True):
            memo[(prompt, max_tokens)] = out["output_token_ids"]

    get.prefetch = prefetch  # type: ignore[attr-defined]
    return get


def make_router(fleet, recorder=None, **config) -> PDRouter:
    return PDRouter(fleet.pools(), RouterConfig(route_timeout_s=60, **config), recorder=recorder)


def test_fleet_is_healthy(fleet):
    expected = "nixl" if nixl_available() else "example"
    assert sorted(fleet.health) == [0, 1, 2, 3]
    for health in fleet.health.values():
        assert health["ready"] and health["connector"] == expected
        assert health["max_model_len"] == 1024 and health["vocab_size"] == VOCAB
    print(
        f"\nfleet of 4 started in {fleet.start_s:.1f} s; per-engine AsyncLLM build:",
        {eid: round(h["start_s"], 1) for eid, h in fleet.health.items()},
    )


def test_disaggregated_matches_colocated(fleet, reference):
    router = make_router(fleet)
    prompts = [tokens(3), tokens(60, 1), tokens(300, 2), tokens(700, 3)]  # 700 = 6 KV blocks

    async def run():
        return [
            await router.generate(
                TurnRequest(f"eq{i}", p, 24, mode="disaggregated", ignore_eos=True)
            )
            for i, p in enumerate(prompts)
        ]

    results = asyncio.run(run())
    for prompt, result in zip(prompts, results, strict=True):
        assert result.path == "disaggregated" and result.prefill_engine_id == 0
        assert result.output_token_ids == reference(prompt, 24), len(prompt)
        assert result.legs["prefill"]["kv_transfer_params"] or not nixl_available()


def test_multi_turn_sticky_routing_reuses_prefix_cache(fleet, tmp_path):
    recorder = Recorder(tmp_path / "tel", run_id="multi-turn")
    router = make_router(fleet, recorder, local_prefill_threshold_tokens=32)
    context = tokens(300, 11)

    async def run():
        results = []
        for turn, observation in enumerate([tokens(60, 21), tokens(12, 31), None]):
            result = await router.generate(
                TurnRequest("mt", list(context), 16, turn=turn, mode="disaggregated", task="t")
            )
            results.append(result)
            if observation is not None:
                context.extend(result.output_token_ids + observation)
        return results

    results = asyncio.run(run())
    recorder.close()
    assert [r.path for r in results] == ["disaggregated", "disaggregated", "local_prefill"]
    assert len({r.decode_engine_id for r in results}) == 1
    assert results[1].prefill_cached_tokens > 0 and results[1].num_cached_tokens > 0
    assert results[2].num_cached_tokens > 0  # the decode engine kept turn 1's context
    table, report = read_telemetry(tmp_path / "tel", validate=True)
    assert report.clean
    rows = table.to_pylist()
    turn1 = [r["kind"] for r in rows if r["turn"] == 1]
    assert turn1 == [
        "prefill_queued",
        "prefill_start",
        "prefill_end",
        "kv_transfer_start",
        "kv_transfer_end",
        "decode_start",
        "decode_end",
    ]
    end = [r for r in rows if r["kind"] == "decode_end"]
    assert [r["output_tokens"] for r in end] == [16, 16, 16]
    assert all(r["engine_id"] == results[0].decode_engine_id for r in end)


def test_bad_requests_get_clear_errors_while_good_request_completes(fleet, reference):
    router = make_router(fleet)
    good_prompt = tokens(50, 41)

    async def run():
        good = asyncio.ensure_future(
            router.generate(TurnRequest("good", good_prompt, 64, ignore_eos=True))
        )
        await asyncio.sleep(0.05)
        messages = []
        for request in [
            TurnRequest("empty", [], 8),
            TurnRequest("too-long", tokens(1024), 8),
            TurnRequest("vocab", [VOCAB + 1], 8),
            TurnRequest("pin", tokens(8), 8, engine_id=99),
        ]:
            with pytest.raises((InputError, ConfigError)) as info:
                await router.generate(request)
            messages.append(str(info.value))
        with pytest.raises(InputError, match="prompt is empty"):  # the engine checks too
            await fleet.clients[1].generate("direct-empty", [], 4)
        return await good, messages

    good, messages = asyncio.run(run())
    assert good.output_token_ids == reference(good_prompt, 64)
    assert "prompt is empty" in messages[0] and "1024 tokens" in messages[1]
    assert "[0, 512)" in messages[2] and "unknown engine id 99" in messages[3]


def run_many(router, prompts, max_tokens, trigger):
    """Start one turn per prompt, call ``trigger`` once they are in flight, gather."""

    async def run():
        tasks = [
            asyncio.ensure_future(
                router.generate(TurnRequest(f"r{i}", p, max_tokens, ignore_eos=True))
            )
            for i, p in enumerate(prompts)
        ]
        side = await trigger()
        return await asyncio.gather(*tasks), side

    return asyncio.run(run())


def test_role_switch_in_flight_loses_and_duplicates_nothing(fleet, reference, tmp_path):
    recorder = Recorder(tmp_path / "tel", run_id="switch")
    router = make_router(fleet, recorder)
    prompts = [tokens(40 + i, 50 + i) for i in range(6)]
    max_tokens = 800  # a long decode keeps the abort inside every leg, even on a loaded machine

    async def switch():
        await router.pools.wait_until(lambda: len(router.pools.get(1).leases) >= 2, 60)
        return await router.switch_role(1, "prefill", drain_timeout_s=0.02)

    results, summary = run_many(router, prompts, max_tokens, switch)
    back = asyncio.run(router.switch_role(1, "decode", drain_timeout_s=10))
    reference.prefetch(prompts, max_tokens)
    recorder.close()
    assert summary["aborted"] >= 1 and summary["error"] is None, summary
    assert summary["prefix_cache_reset"] is True
    assert back["drained"] and back["to"] == "decode"
    assert sorted(r.trajectory_id for r in results) == [f"r{i}" for i in range(6)]
    for prompt, result in zip(prompts, results, strict=True):
        assert result.output_token_ids == reference(prompt, max_tokens)
    # A leg told to abort may finish first (then it is not served again): at most one
    # re-route per aborted leg, and at least one.
    assert 1 <= sum(r.reroutes for r in results) <= summary["aborted"]
    rerouted = [r for r in results if r.reroutes]
    # Re-served on another decode-side engine (the decode engine 2 or the colocated 3).
    assert all(r.decode_engine_id in (2, COLOCATED) for r in rerouted)
    table, _ = read_telemetry(tmp_path / "tel", validate=True)
    kinds = table.column("kind").to_pylist()
    assert kinds.count("decode_end") == len(prompts)
    details = [
        json.loads(d)
        for d, k in zip(table.column("detail").to_pylist(), kinds, strict=True)
        if k == "role_switch_end"
    ]
    assert [d["to"] for d in details] == ["prefill", "decode"]
    print(f"\nrole switch with {summary['aborted']} aborted: {summary['stages_s']}")


def test_logprobs_and_sampling_parameters(fleet, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    client = fleet.clients[COLOCATED]
    prompt = tokens(20, 61)
    out = asyncio.run(
        client.generate("lp", prompt, 6, 0.0, logprobs=2, prompt_logprobs=0, ignore_eos=True)
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True).float()
    with torch.no_grad():
        x = torch.tensor([prompt + out["output_token_ids"]])
        rows = torch.log_softmax(model(x).logits[0, :-1], -1)
    expected = rows.gather(1, x[0, 1:, None])[:, 0].tolist()
    n = len(prompt) - 1
    assert max(abs(a - b) for a, b in zip(out["output_logprobs"], expected[n:], strict=True)) < 2e-3
    assert out["prompt_logprobs"][0] is None
    assert (
        max(abs(a - b) for a, b in zip(out["prompt_logprobs"][1:], expected[:n], strict=True))
        < 2e-3
    )
    assert [len(top) for top in out["top_logprobs"]] == [2] * 6
    assert out["weight_version"] == "0" and out["weight_versions"] == [["0", 0, 6]]
    seeded = [
        asyncio.run(client.generate(f"seed{i}", prompt, 8, 1.0, seed=7, top_k=50, min_p=0.001))
        for i in range(2)
    ]
    assert seeded[0]["output_token_ids"] == seeded[1]["output_token_ids"]
    stop = out["output_token_ids"][2]
    stopped = asyncio.run(client.generate("stop", prompt, 6, 0.0, stop_token_ids=[stop]))
    assert stopped["output_token_ids"][-1] == stop and stopped["finish_reason"] == "stop"
    for bad, field in [({"top_k": -5}, "top_k"), ({"min_p": 2.0}, "min_p"), ({"bogus": 1}, "bogus"),
                       ({"logprobs": 99}, "logprobs")]:  # fmt: skip
        with pytest.raises(InputError, match=field):
            asyncio.run(client.generate("bad", prompt, 2, 1.0, **bad))


def test_pause_modes(fleet, reference):
    client = fleet.clients[COLOCATED]
    prompt = tokens(30, 71)

    async def run(mode, max_tokens=120):
        turn = asyncio.ensure_future(
            client.generate(f"pause-{mode}", prompt, max_tokens, 0.0, ignore_eos=True)
        )
        await asyncio.sleep(0.3)
        await client.pause(mode)
        paused_done = turn.done()
        loads = [await client.load()]
        await asyncio.sleep(0.3)
        loads.append(await client.load())
        await client.resume()
        return paused_done, await turn, loads

    # Long enough to be surely in flight when paused (120 tokens can finish in 0.3 s).
    frozen_done, kept, loads = asyncio.run(run("keep", max_tokens=400))
    waited_done, waited, _ = asyncio.run(run("wait"))
    _, aborted, _ = asyncio.run(run("abort", max_tokens=900))
    assert not frozen_done and kept["output_token_ids"] == reference(prompt, 400)
    # A frozen request does not step, and the engine says why (the load monitor must
    # not take it for stuck).
    assert all(load["paused"] and load["in_flight"] == 1 for load in loads)
    assert loads[0]["steps"] == loads[1]["steps"]
    assert waited_done and waited["output_token_ids"] == reference(prompt, 120)
    assert aborted["finish_reason"] == "abort" and len(aborted["output_token_ids"]) < 900
    with pytest.raises(InputError, match="pause mode"):
        asyncio.run(client.pause("later"))


def test_weight_update_changes_outputs_in_place(fleet, reference, tmp_path):
    from prorsa.runtime.ray.tiny_model import make_tiny_model

    client = fleet.clients[COLOCATED]
    prompt = tokens(40, 81)
    other = make_tiny_model(tmp_path / "seed1", seed=1)
    pid = fleet.health[COLOCATED]["pid"]
    update = asyncio.run(client.update_weights_from_path(str(other), 1))
    try:
        changed = asyncio.run(client.generate("w1", prompt, 16, 0.0, ignore_eos=True))
        with pytest.raises(InputError, match="below the engine's 1"):
            asyncio.run(client.update_weights_from_path(str(other), 0))
        with pytest.raises(InputError, match="does not exist"):
            asyncio.run(client.update_weights_from_path(str(tmp_path / "missing"), 2))
    finally:  # later tests compare every engine with this one's original weights
        restored = asyncio.run(client.update_weights_from_path(fleet.spec.engine.model, 2))
    back = asyncio.run(client.generate("w2", prompt, 16, 0.0, ignore_eos=True))
    health = asyncio.run(client.health())
    assert update["weight_version"] == 1 and update["prefix_cache_reset"] is True
    assert changed["output_token_ids"] != reference(prompt, 16) and changed["weight_version"] == "1"
    assert restored["weight_version"] == 2 and back["weight_version"] == "2"
    assert back["output_token_ids"] == reference(prompt, 16)
    assert health["pid"] == pid and health["weight_version"] == 2  # no restart
    assert health["gc_frozen_objects"] > 0  # its start-up heap stays out of full collections
    rpc = asyncio.run(client.collective_rpc("compute_weight_checksums"))
    assert isinstance(rpc, list) and len(rpc) == 1


def test_decode_refuses_kv_computed_under_other_weights(fleet):
    from prorsa.runtime.ray.engine import KV_WEIGHT_VERSION_KEY, PREFILL_FOR_REMOTE_DECODE

    prompt = tokens(64, 91)
    prefill, decode = fleet.clients[0], fleet.clients[1]
    first = asyncio.run(prefill.generate("kv-p", prompt, 1, 0.0, dict(PREFILL_FOR_REMOTE_DECODE)))
    params = first["kv_transfer_params"]
    assert params[KV_WEIGHT_VERSION_KEY] == 0
    asyncio.run(decode.set_weight_version(9))
    try:
        refused = asyncio.run(decode.generate("kv-d", prompt, 8, 0.0, params))
    finally:
        asyncio.run(decode.set_weight_version(0))
    assert refused["finish_reason"] == "abort" and refused["output_token_ids"] == []


@pytest.mark.skipif(not nixl_available(), reason="needs the NIXL connector")
def test_a_kv_load_from_an_unreachable_prefill_engine_is_recomputed(fleet, reference):
    """vLLM's default ends such a request with finish reason "error" and no tokens; the
    engines run with kv_load_failure_policy="recompute" (config.kv_transfer_config)."""
    from prorsa.runtime.ray.engine import PREFILL_FOR_REMOTE_DECODE, free_port

    prompt = tokens(64, 97)
    prefill, decode = fleet.clients[0], fleet.clients[1]
    first = asyncio.run(prefill.generate("gone-p", prompt, 1, 0.0, dict(PREFILL_FOR_REMOTE_DECODE)))
    # The same handoff, from an engine the decode engine has never met, at a port where
    # nothing listens: its handshake fails (vLLM gives it 5 s) and the load with it.
    params = {
        **first["kv_transfer_params"],
        "remote_engine_id": "prorsa-test-gone",
        "remote_port": free_port(),
    }
    result = asyncio.run(decode.generate("gone-d", prompt, 8, 0.0, params, ignore_eos=True))
    assert result["finish_reason"] == "length"
    assert result["output_token_ids"] == reference(prompt, 8)
    asyncio.run(decode.release_kv("gone-p", first["kv_transfer_params"]))


def test_an_abort_that_overtakes_its_request_still_aborts_it(fleet, reference):
    """Control calls run in their own Ray concurrency group, so an abort can reach the
    engine before the leg it names; the leg is refused when it arrives."""
    client = fleet.clients[COLOCATED]
    prompt = tokens(20, 17)

    async def run():
        await client.abort(["early-1"])
        refused = await client.generate("early-1", prompt, 8, 0.0, ignore_eos=True)
        again = await client.generate("early-2", prompt, 8, 0.0, ignore_eos=True)
        return refused, again, await client.in_flight()

    refused, again, in_flight = asyncio.run(run())
    assert refused["finish_reason"] == "abort" and refused["output_token_ids"] == []
    assert again["output_token_ids"] == reference(prompt, 8) and in_flight == []


def test_sleep_stops_generation_until_wake_up(fleet, reference):
    client = fleet.clients[COLOCATED]
    prompt = tokens(12, 17)

    async def run():
        slept = await client.sleep(1)
        turn = asyncio.ensure_future(client.generate("asleep", prompt, 8, 0.0, ignore_eos=True))
        await asyncio.sleep(0.5)
        held = not turn.done() and await client.is_sleeping()
        awake = await client.wake_up()
        return slept, held, awake, await turn

    slept, held, awake, result = asyncio.run(run())
    # vLLM's CPU worker has no sleep mode: scheduling stops, memory stays (reported).
    assert slept["freed"] == [] and slept["rss_bytes"]["after"] > 0
    assert held and awake and result["output_token_ids"] == reference(prompt, 8)


def test_killed_engine_mid_decode_requests_are_rerouted(fleet, reference):
    router = make_router(fleet)
    prompts = [tokens(30 + i, 90 + i) for i in range(6)]
    max_tokens = 200

    async def kill():
        await router.pools.wait_until(lambda: len(router.pools.get(2).leases) >= 2, 60)
        await asyncio.sleep(0.05)  # let it decode a few tokens
        fleet.kill(2)

    results, _ = run_many(router, prompts, max_tokens, kill)
    reference.prefetch(prompts, max_tokens)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.output_token_ids == reference(prompt, max_tokens)
    retried = [r for r in results if r.retries]
    assert len(retried) >= 2 and all(r.decode_engine_id in (1, COLOCATED) for r in retried)
    assert router.pools.counts()["dead"] == 1
    print(
        f"\nkilled engine 2: {len(retried)} turns re-routed, "
        f"{sum(r.retries for r in results)} retries"
    )


def test_shutdown_leaves_no_orphan_processes(fleet):
    import psutil

    pids = fleet.pids()
    assert len(pids) >= 8  # 4 actors, each with an EngineCore (+ helpers)
    fleet.shutdown()
    deadline = time.monotonic() + 20
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and _running(p)]
        time.sleep(0.2)
    assert alive == [], [psutil.Process(p).cmdline() for p in alive]


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
