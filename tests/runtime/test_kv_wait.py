"""A decode leg whose prefill engine never sends its KV is given up and served again.

The watch's rule is tested on its own; the engine actor's glue runs in-process over a
stand-in for vLLM's ``AsyncLLM`` whose KV loads can hang; the router's re-serving over
fake engines.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace
from typing import Any

import pytest

from prorsa.runtime.ray.config import EngineConfig
from prorsa.runtime.ray.engine import EngineServer
from prorsa.runtime.ray.kv_watch import KVWaitWatch
from prorsa.runtime.ray.pools import RolePools
from prorsa.runtime.ray.router import PDRouter
from prorsa.runtime.ray.sampling import sampling_params
from prorsa.runtime.ray.turns import RouterConfig, RoutingError, TurnRequest
from prorsa.telemetry import Recorder, read_telemetry
from tests.runtime.fakes import VOCAB, FakeEngine, expected_tokens


def test_a_wait_is_overdue_only_after_its_unexplained_timeout():
    watch = KVWaitWatch(10.0)
    watch.add("a", now=0.0)
    watch.add("b", now=4.0)
    assert watch.overdue(9.9) == []
    assert watch.overdue(10.0) == ["a"]
    assert watch.overdue(20.0) == ["a", "b"]  # oldest first
    watch.done("a")
    watch.done("never-added")
    assert watch.overdue(20.0) == ["b"] and len(watch) == 1


def test_a_queue_or_a_pause_restarts_every_clock():
    watch = KVWaitWatch(10.0)
    watch.add("a", now=0.0)
    watch.queued(8.0)  # requests waited for admission at t=8: "a" may be one of them
    assert watch.overdue(17.9) == []
    assert watch.overdue(18.0) == ["a"]
    watch.hold(12.0)  # paused at t=12
    assert watch.overdue(21.9) == [] and watch.overdue(22.0) == ["a"]
    watch.queued(3.0)  # an older wait never moves a clock back
    assert watch.overdue(22.0) == ["a"]
    with pytest.raises(ValueError, match="timeout_s"):
        KVWaitWatch(0.0)


def test_requests_scheduled_past_a_leg_prove_it_still_loads():
    watch = KVWaitWatch(10.0)
    watch.add("a", now=0.0)
    watch.add("b", now=3.0)
    for t in range(0, 40):  # requests queue throughout: the first clock never runs out
        watch.queued(float(t))
    watch.scheduled(arrived=3.5, at=4.0)  # after "a"; too soon after "b" to tell the order
    watch.scheduled(arrived=1.0, at=2.0)  # reported later, scheduled earlier
    watch.scheduled(arrived=5.0, at=11.9)
    assert watch.overdue(30.0) == []  # "a": proofs span 2 -> 11.9
    watch.scheduled(arrived=6.0, at=12.0)
    assert watch.overdue(30.0) == ["a"]  # ten seconds certainly loading
    watch.scheduled(arrived=20.0, at=22.0)
    assert watch.overdue(30.0) == ["a", "b"]  # "b": 11.9 -> 22; oldest first
    watch.done("a")
    assert watch.overdue(30.0) == ["b"] and len(watch) == 1


def test_a_pause_restarts_the_proofs():
    watch = KVWaitWatch(10.0)
    watch.add("a", now=0.0)
    watch.scheduled(arrived=2.0, at=2.0)
    watch.hold(5.0)  # paused (a weight update): the prefill engine may have been too
    watch.scheduled(arrived=8.0, at=13.0)
    watch.queued(30.0)
    assert watch.overdue(30.0) == []  # the span 2 -> 13 crosses the pause
    watch.scheduled(arrived=20.0, at=23.0)
    assert watch.overdue(30.0) == ["a"]  # 13 -> 23 after it


class _HangingLLM:
    """``AsyncLLM`` enough for ``EngineServer.generate_stream``: a request presenting
    remote KV never gets it (the load hangs) until aborted; others decode at once."""

    def __init__(self, kv_arrives: bool = False, step_s: float = 0.0) -> None:
        self.kv_arrives = kv_arrives
        self.step_s = step_s
        self.aborted: list[str] = []
        self._abort_events: dict[str, asyncio.Event] = {}

    async def generate(self, prompt: dict, params: Any, request_id: str):
        kv = (params.extra_args or {}).get("kv_transfer_params") or {}
        if kv.get("do_remote_prefill") and not self.kv_arrives:
            event = self._abort_events.setdefault(request_id, asyncio.Event())
            await event.wait()
            yield _output([], finished=True, reason="abort")
            return
        scheduled = time.monotonic()
        tokens = expected_tokens(prompt["prompt_token_ids"], params.max_tokens)
        for i, token in enumerate(tokens):
            if request_id in self.aborted:
                yield _output([], finished=True, reason="abort")
                return
            last = i == len(tokens) - 1
            yield _output([token], finished=last, reason="length", scheduled_ts=scheduled)
            await asyncio.sleep(self.step_s)

    async def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)
        for request_id in request_ids:
            self._abort_events.setdefault(request_id, asyncio.Event()).set()


def _output(tokens: list[int], *, finished: bool, reason: str, scheduled_ts: float = 0.0) -> Any:
    completion = SimpleNamespace(
        token_ids=tokens, logprobs=None, finish_reason=reason if finished else None
    )
    return SimpleNamespace(
        outputs=[completion],
        finished=finished,
        num_cached_tokens=0,
        kv_transfer_params=None,
        # vLLM's engine core stamps a request's first step (time.monotonic there).
        metrics=SimpleNamespace(
            queued_ts=0.0, scheduled_ts=scheduled_ts, first_token_ts=0.0, last_token_ts=0.0
        ),
        prompt_logprobs=None,
        prompt_token_ids=None,
    )


@pytest.fixture(scope="module")
def vllm_imported():
    """Building SamplingParams imports vLLM (seconds) inside the first leg; do it first,
    so the legs' clocks measure only what the tests do."""
    pytest.importorskip("vllm")
    sampling_params(4, 0.0, None, {})


def _server(timeout_s: float, **llm_kw: Any) -> tuple[EngineServer, _HangingLLM]:
    config = EngineConfig(model="tiny", connector=None, kv_wait_timeout_s=timeout_s)
    server = EngineServer(0, config)
    llm = _HangingLLM(**llm_kw)
    server._llm = llm
    return server, llm


async def _collect(server: EngineServer, request_id: str, kv: dict | None) -> dict:
    result: dict = {}
    async for item in server.generate_stream(request_id, [1, 2, 3], 4, 0.0, kv):
        result = item
    return result


REMOTE_KV = {"do_remote_prefill": True, "remote_engine_id": "p0"}


def test_the_engine_gives_up_a_kv_wait_nothing_explains(vllm_imported):
    async def go():
        server, llm = _server(timeout_s=0.2)
        result = await asyncio.wait_for(_collect(server, "d-1", REMOTE_KV), 60)
        assert result["finish_reason"] == "abort" and result["kv_wait_given_up"] is True
        assert llm.aborted == ["d-1"]
        plain = await _collect(server, "t-1", None)  # legs without remote KV are not watched
        assert plain["finish_reason"] == "length" and "kv_wait_given_up" not in plain
        assert server._kv_watcher is None and len(server._kv_watch) == 0

    asyncio.run(go())


@pytest.mark.parametrize("held_by", ["queue", "_paused", "_sleeping", "_busy"])
def test_the_engine_waits_while_requests_queue_or_it_is_held(vllm_imported, held_by):
    async def go():
        server, llm = _server(timeout_s=2.0)
        leg = asyncio.ensure_future(_collect(server, "d-1", REMOTE_KV))
        loop = asyncio.get_running_loop()
        stop = loop.time() + 5.0
        while loop.time() < stop:  # 2.5 timeouts with the wait explained throughout
            if held_by == "queue":  # what the stat logger records while requests queue
                server._load.queued_s = time.monotonic()
            else:  # paused by a trainer, asleep, or inside a reload or NCCL broadcast
                setattr(server, held_by, ["collective_rpc"] if held_by == "_busy" else True)
            await asyncio.sleep(0.1)
        assert not leg.done() and llm.aborted == []
        setattr(server, held_by, [] if held_by == "_busy" else False)
        result = await asyncio.wait_for(leg, 60)  # nothing explains the wait any more
        assert result["kv_wait_given_up"] is True and llm.aborted == ["d-1"]

    asyncio.run(go())


async def _later_requests_while_queued(server: EngineServer, leg, seconds: float) -> float:
    """Requests keep waiting for admission on the engine while later ones are scheduled
    and decode, until the leg ends or ``seconds`` pass; returns how long it ran."""
    began = time.monotonic()
    n = 0
    while not leg.done() and time.monotonic() - began < seconds:
        server._load.queued_s = time.monotonic()
        await _collect(server, f"t-{n}", None)
        n += 1
        await asyncio.sleep(0.1)
    return time.monotonic() - began


def test_requests_scheduled_after_a_leg_prove_its_wait_while_others_queue(vllm_imported):
    async def go():
        server, llm = _server(timeout_s=2.0)
        server._kv_watch.overtake_margin_s = 0.3
        leg = asyncio.ensure_future(_collect(server, "d-1", REMOTE_KV))
        await asyncio.sleep(0.05)
        ran = await _later_requests_while_queued(server, leg, 30.0)
        result = await asyncio.wait_for(leg, 5)
        assert result["kv_wait_given_up"] is True and llm.aborted == ["d-1"]
        # The proofs began with the first request 0.3 s after the leg and spanned 2 s.
        assert 2.3 <= ran < 10.0

    asyncio.run(go())


@pytest.mark.parametrize("engine_kwargs", [{"data_parallel_size": 2}, {"renderer_num_workers": 4}])
def test_no_proofs_where_requests_may_reach_the_scheduler_out_of_order(
    vllm_imported, engine_kwargs
):
    async def go():
        config = EngineConfig(
            model="tiny", connector=None, kv_wait_timeout_s=2.0, engine_kwargs=engine_kwargs
        )
        server = EngineServer(0, config)
        server._llm = llm = _HangingLLM()
        server._kv_watch.overtake_margin_s = 0.3
        leg = asyncio.ensure_future(_collect(server, "d-1", REMOTE_KV))
        await asyncio.sleep(0.05)
        await _later_requests_while_queued(server, leg, 6.0)
        assert not leg.done() and llm.aborted == []  # the counts alone: the queue explains it
        await llm.abort(["d-1"])  # end the hanging load
        await asyncio.wait_for(leg, 60)

    asyncio.run(go())


def test_a_leg_whose_kv_arrived_may_decode_past_the_timeout(vllm_imported):
    async def go():
        server, llm = _server(timeout_s=0.2, kv_arrives=True, step_s=0.15)
        result = await asyncio.wait_for(_collect(server, "d-1", REMOTE_KV), 60)
        assert result["finish_reason"] == "length" and len(result["output_token_ids"]) == 4
        assert llm.aborted == [] and "kv_wait_given_up" not in result

    asyncio.run(go())


def test_the_stat_logger_marks_waits_other_than_a_kv_load():
    pytest.importorskip("vllm")
    from prorsa.runtime.ray.load import EngineLoad, load_logger_factory

    load = EngineLoad()
    config = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=4, block_size=16))
    logger = load_logger_factory(load)(config)

    def stats(waiting: int, **stages: int) -> Any:
        return SimpleNamespace(
            kv_cache_usage=0.5,
            num_running_reqs=1,
            num_waiting_reqs=waiting,
            num_kv_fetch_reqs_by_stage={"in_progress": 1, **stages},
        )

    logger.record(stats(0), None)  # only a load in progress: the clocks run
    assert load.steps == 1 and load.queued_s == 0.0
    for waiting, stages in ((1, {}), (0, {"waiting_to_start": 1}), (0, {"completed_waiting": 1})):
        load.queued_s = 0.0
        logger.record(stats(waiting, **stages), None)
        assert load.queued_s == load.updated_s > 0


def test_off_means_no_watch(vllm_imported):
    async def go():
        server, llm = _server(timeout_s=0.0)
        leg = asyncio.ensure_future(_collect(server, "d-1", REMOTE_KV))
        await asyncio.sleep(0.5)
        assert not leg.done() and server._kv_watch is None
        await llm.abort(["d-1"])
        assert "kv_wait_given_up" not in await leg

    asyncio.run(go())


class _KVLostEngine(FakeEngine):
    """A decode engine whose remote-KV legs end as the engine actor's watch ends them."""

    async def generate_stream(self, request_id, prompt_token_ids, max_tokens,
                              temperature=0.0, kv_transfer_params=None, **sampling):  # fmt: skip
        if (kv_transfer_params or {}).get("do_remote_prefill"):
            self.calls.append(("decode", request_id))
            yield {
                "event": "done",
                "request_id": request_id,
                "output_token_ids": [],
                "finish_reason": "abort",
                "kv_transfer_params": None,
                "num_cached_tokens": 0,
                "kv_wait_given_up": True,
                "timings": {"first_token_s": 0.0},
            }
            return
        async for item in super().generate_stream(
            request_id, prompt_token_ids, max_tokens, temperature, kv_transfer_params, **sampling
        ):
            yield item


def test_the_router_prefills_a_turn_on_its_decode_engine_after_a_lost_handoff(tmp_path):
    recorder = Recorder(tmp_path / "tel", run_id="kv")
    prefill, decode = FakeEngine(0), _KVLostEngine(1)
    limits = {"max_model_len": 1024, "vocab_size": VOCAB}
    pools = RolePools([prefill, decode], {0: "prefill", 1: "decode"}, {0: limits, 1: limits})
    router = PDRouter(pools, RouterConfig(route_timeout_s=5), recorder=recorder)
    prompt = list(range(1, 40))

    async def go():
        result = await router.generate(TurnRequest("t", prompt, 5))
        await asyncio.sleep(0.05)  # the stale KV's release runs in the background
        return result

    result = asyncio.run(go())
    recorder.close()
    assert result.output_token_ids == expected_tokens(prompt, 5)
    assert result.path == "local_prefill" and result.decode_engine_id == 1
    assert result.reroutes == 1 and router.kv_handoffs_lost_total == 1
    # One prefill leg only: the second attempt prefilled on the decode engine, and the
    # lost leg's KV was released on the prefill engine's behalf.
    assert [kind for kind, _ in prefill.calls] == ["prefill"]
    assert [kind for kind, _ in decode.calls] == ["decode", "full"]
    assert decode.released
    table, _ = read_telemetry(tmp_path / "tel", validate=True)
    kinds = table.column("kind").to_pylist()
    details = table.column("detail").to_pylist()
    starts = [json.loads(d) for k, d in zip(kinds, details, strict=True) if k == "prefill_start"]
    assert starts[0]["path"] == "disaggregated" and "kv_lost_on" not in starts[0]
    assert starts[1] == {**starts[1], "path": "local_prefill", "reroute": 1, "kv_lost_on": 1}
    assert kinds.count("decode_end") == 1


class _ErringEngine(FakeEngine):
    """Ends its first ``errors`` legs with finish reason ``error``, as vLLM does when a
    request fails inside the engine."""

    def __init__(self, engine_id: int, errors: int) -> None:
        super().__init__(engine_id)
        self.errors = errors

    async def generate_stream(self, request_id, prompt_token_ids, max_tokens,
                              temperature=0.0, kv_transfer_params=None, **sampling):  # fmt: skip
        if self.errors:
            self.errors -= 1
            self.calls.append(("error", request_id))
            yield {"event": "done", "request_id": request_id, "output_token_ids": [],
                   "finish_reason": "error", "kv_transfer_params": None,
                   "num_cached_tokens": 0, "timings": {"first_token_s": 0.0}}  # fmt: skip
            return
        async for item in super().generate_stream(
            request_id, prompt_token_ids, max_tokens, temperature, kv_transfer_params, **sampling
        ):
            yield item


@pytest.mark.parametrize("errors", [1, 2])
def test_a_leg_the_engine_fails_is_served_once_more_then_reported(errors):
    limits = {"max_model_len": 1024, "vocab_size": VOCAB}
    engine = _ErringEngine(0, errors)
    router = PDRouter(RolePools([engine], {0: "colocated"}, {0: limits}), RouterConfig())
    prompt = list(range(1, 20))
    if errors == 1:
        result = asyncio.run(router.generate(TurnRequest("t", prompt, 3)))
        assert result.output_token_ids == expected_tokens(prompt, 3) and result.reroutes == 1
    else:
        with pytest.raises(RoutingError, match="failed in the engine twice"):
            asyncio.run(router.generate(TurnRequest("t", prompt, 3)))


def test_after_a_lost_handoff_the_next_turn_chooses_its_prefill_engine_afresh():
    limits = {"max_model_len": 1024, "vocab_size": VOCAB}
    engines = [FakeEngine(0), FakeEngine(1), _KVLostEngine(2)]
    roles = {0: "prefill", 1: "prefill", 2: "decode"}
    router = PDRouter(RolePools(engines, roles, {i: limits for i in roles}), RouterConfig())
    prompt = list(range(1, 40))

    async def go():
        await router.generate(TurnRequest("t", prompt, 3))
        return router._sticky["t"].get("prefill")

    assert asyncio.run(go()) is None
