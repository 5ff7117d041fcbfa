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
    watch.hold(8.0)  # paused at t=8, or a request whose KV arrived waited for a slot
    assert watch.overdue(17.9) == []
    assert watch.overdue(18.0) == ["a"]
    watch.hold(3.0)  # an older hold never moves a clock back
    assert watch.overdue(18.0) == ["a"]
    with pytest.raises(ValueError, match="timeout_s"):
        KVWaitWatch(0.0)


def test_a_leg_overtaken_by_a_later_request_is_not_explained_by_a_queue():
    watch = KVWaitWatch(10.0)
    watch.add("a", now=0.0)
    watch.add("b", now=3.0)
    watch.first_token(arrived=1.0, now=2.0)  # a request after "a", before "b", decodes
    for t in range(0, 30):  # requests queue throughout
        watch.queued(float(t))
    assert watch.overdue(11.9) == []
    assert watch.overdue(12.0) == ["a"]  # ten seconds after it was overtaken
    assert watch.overdue(29.0) == ["a"]  # "b" was not overtaken: the queue explains it
    watch.first_token(arrived=3.5, now=15.0)  # too close after "b" to tell the order
    assert watch.overdue(29.0) == ["a"]
    watch.first_token(arrived=4.0, now=20.0)
    assert watch.overdue(30.0) == ["a", "b"]
    watch.hold(25.0)  # a pause restarts every clock, overtaken or not
    assert watch.overdue(34.9) == [] and watch.overdue(35.0) == ["a", "b"]
    watch.done("a")
    watch.first_token(arrived=0.5, now=40.0)  # an earlier request overtakes nothing new
    assert watch._overtaken == {"b": 20.0}


def test_an_overtaken_leg_may_wait_for_a_batch_slot_once_its_kv_arrived():
    watch = KVWaitWatch(10.0)
    watch.add("a", now=0.0)
    watch.first_token(arrived=2.0, now=3.0)
    watch.queued(2.0)  # before it was overtaken: still counts
    for t in range(3, 30):  # loaded requests wait for a slot ("a" may be one of them)
        watch.hold(float(t))
    assert watch.overdue(38.9) == [] and watch.overdue(39.0) == ["a"]


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
        tokens = expected_tokens(prompt["prompt_token_ids"], params.max_tokens)
        for i, token in enumerate(tokens):
            if request_id in self.aborted:
                yield _output([], finished=True, reason="abort")
                return
            yield _output([token], finished=i == len(tokens) - 1, reason="length")
            await asyncio.sleep(self.step_s)

    async def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)
        for request_id in request_ids:
            self._abort_events.setdefault(request_id, asyncio.Event()).set()


def _output(tokens: list[int], *, finished: bool, reason: str) -> Any:
    completion = SimpleNamespace(
        token_ids=tokens, logprobs=None, finish_reason=reason if finished else None
    )
    return SimpleNamespace(
        outputs=[completion],
        finished=finished,
        num_cached_tokens=0,
        kv_transfer_params=None,
        metrics=None,
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
        server, llm = _server(timeout_s=1.0)
        leg = asyncio.ensure_future(_collect(server, "d-1", REMOTE_KV))
        loop = asyncio.get_running_loop()
        stop = loop.time() + 3.0
        while loop.time() < stop:  # three timeouts with the wait explained throughout
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


def test_a_queue_does_not_explain_a_wait_once_a_later_request_decoded(vllm_imported):
    async def go():
        server, llm = _server(timeout_s=1.0)
        leg = asyncio.ensure_future(_collect(server, "d-1", REMOTE_KV))
        await asyncio.sleep(server._kv_watch.overtake_margin_s + 0.1)
        later = await _collect(server, "t-1", None)  # reached the engine after d-1
        assert later["finish_reason"] == "length"
        began = time.monotonic()
        while not leg.done():  # requests queue on the engine throughout
            server._load.queued_s = time.monotonic()
            await asyncio.sleep(0.05)
            assert time.monotonic() - began < 30
        result = leg.result()
        assert result["kv_wait_given_up"] is True and llm.aborted == ["d-1"]

    asyncio.run(go())


def test_an_overtaken_leg_is_held_while_loaded_requests_wait_for_slots(vllm_imported):
    async def go():
        server, llm = _server(timeout_s=1.0)
        server._kv_watch.overtake_margin_s = 0.0
        leg = asyncio.ensure_future(_collect(server, "d-1", REMOTE_KV))
        await asyncio.sleep(0.05)
        await _collect(server, "t-1", None)  # overtakes d-1
        loop = asyncio.get_running_loop()
        stop = loop.time() + 3.0
        while loop.time() < stop:  # d-1's KV may have arrived: it may wait for a slot
            server._load.queued_s = server._load.slot_wait_s = time.monotonic()
            await asyncio.sleep(0.1)
        assert not leg.done() and llm.aborted == []
        result = await asyncio.wait_for(leg, 60)
        assert result["kv_wait_given_up"] is True

    asyncio.run(go())


@pytest.mark.parametrize("engine_kwargs", [{"data_parallel_size": 2}, {"renderer_num_workers": 4}])
def test_no_overtaking_where_requests_may_reach_the_scheduler_out_of_order(
    vllm_imported, engine_kwargs
):
    async def go():
        config = EngineConfig(
            model="tiny", connector=None, kv_wait_timeout_s=1.0, engine_kwargs=engine_kwargs
        )
        server = EngineServer(0, config)
        server._llm = llm = _HangingLLM()
        server._kv_watch.overtake_margin_s = 0.0
        leg = asyncio.ensure_future(_collect(server, "d-1", REMOTE_KV))
        await asyncio.sleep(0.05)
        await _collect(server, "t-1", None)  # would overtake d-1 on one ordered scheduler
        loop = asyncio.get_running_loop()
        stop = loop.time() + 3.0
        while loop.time() < stop:  # requests wait for admission throughout
            server._load.queued_s = time.monotonic()
            await asyncio.sleep(0.1)
        assert not leg.done() and llm.aborted == []
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
        load.queued_s = load.slot_wait_s = 0.0
        logger.record(stats(waiting, **stages), None)
        assert load.queued_s == load.updated_s > 0
        # Only a request whose KV arrived and waits for a slot holds overtaken legs too.
        assert (load.slot_wait_s > 0) == ("completed_waiting" in stages)
    load.slot_wait_s = 0.0
    iteration = SimpleNamespace(num_prompt_tokens=0, num_generation_tokens=3, num_preempted_reqs=1)
    logger.record(None, iteration)  # a preempted request may be a leg whose KV arrived
    assert load.slot_wait_s > 0 and load.generation_tokens == 3


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
