"""A KV handoff that hangs, on real engines: the decode leg is given up and the turn served.

The prefill engine's processes are stopped (SIGSTOP) right after its prefill leg, as a hung
GPU or host would be: its actor still answers, the NIXL transfer the decode engine started
never completes, and vLLM puts no deadline on it (with the watch off, the same turn was
still waiting after 90 s). The decode engine runs with a 5 s ``kv_wait_timeout_s``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from prorsa.runtime.ray.config import nixl_available
from prorsa.runtime.ray.router import PDRouter, RouterConfig, TurnRequest
from tests.runtime.fleets import start_tiny_fleet

pytestmark = [
    pytest.mark.ray,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not nixl_available(), reason="a hung transfer needs the NIXL connector"),
]

TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def fleet(ray_session, tiny_model_dir, tmp_path_factory):
    fleet = start_tiny_fleet(
        tiny_model_dir,
        tmp_path_factory.mktemp("kv"),
        ["prefill", "decode"],
        max_num_seqs=8,
        overrides={1: {"kv_wait_timeout_s": TIMEOUT_S}},
    )
    yield fleet
    fleet.shutdown()


class _HangsAfterPrefill:
    """The prefill engine's client; after its first prefill leg the engine's processes
    stop (the actor keeps answering, as on a hung GPU)."""

    def __init__(self, client, pids: list[int]) -> None:
        self._client, self._pids = client, pids
        self.stopped = False
        self.armed = False  # stop after the next prefill leg

    def __getattr__(self, name):
        return getattr(self._client, name)

    async def generate(self, *args, **kwargs):
        result = await self._client.generate(*args, **kwargs)
        if self.armed and not self.stopped:
            for pid in self._pids:
                os.kill(pid, signal.SIGSTOP)
            self.stopped = True
        return result

    def resume(self) -> None:
        for pid in self._pids:
            os.kill(pid, signal.SIGCONT)


PROMPT = [(7 + 13 * i) % 500 + 5 for i in range(64)]


def _router_with_a_hanging_peer(fleet) -> tuple[PDRouter, _HangsAfterPrefill, list[int]]:
    """A router whose next prefill leg hangs its engine, after one good handoff (so the
    decode engine already knows its peer: a first handshake with a stopped peer fails by
    itself within 5 s, and vLLM recomputes the prompt); and the greedy tokens of
    :data:`PROMPT` on the decode engine alone (the turn's local prefill may then reuse
    this prompt's cached prefix, which changes no token)."""
    prefill, decode = fleet.clients[0], fleet.clients[1]
    expected = asyncio.run(decode.generate("ref", PROMPT, 6, 0.0, ignore_eos=True))
    pids = asyncio.run(prefill.health())["child_pids"]
    assert pids
    hanging = _HangsAfterPrefill(prefill, pids)
    pools = fleet.pools()
    pools.get(0).client = hanging  # the router reaches the prefill engine through it
    router = PDRouter(pools, RouterConfig(route_timeout_s=60))
    warm = TurnRequest("w", [t + 1 for t in PROMPT], 2, mode="disaggregated", ignore_eos=True)
    assert asyncio.run(router.generate(warm)).path == "disaggregated"
    hanging.armed = True
    return router, hanging, expected["output_token_ids"]


def test_a_hung_handoff_is_given_up_and_the_turn_prefilled_on_the_decode_engine(fleet):
    router, hanging, expected = _router_with_a_hanging_peer(fleet)
    request = TurnRequest("t", PROMPT, 6, mode="disaggregated", ignore_eos=True)
    started = time.perf_counter()
    try:
        result = asyncio.run(asyncio.wait_for(router.generate(request), 120))
    finally:
        hanging.resume()
    waited = time.perf_counter() - started
    assert hanging.stopped and router.kv_handoffs_lost_total == 1
    assert result.path == "local_prefill" and result.decode_engine_id == 1
    assert result.output_token_ids == expected
    assert TIMEOUT_S <= waited < TIMEOUT_S + 30


def test_a_hung_handoff_is_given_up_while_the_decode_engine_has_a_queue(fleet):
    # More local requests than the engine's 8 sequences, resubmitted as they end: vLLM
    # reports waiting requests at nearly every step, which alone would restart the leg's
    # clock for ever. The requests that reach the engine after the leg and decode first
    # show that the leg waits for its KV alone.
    router, hanging, expected = _router_with_a_hanging_peer(fleet)
    decode = fleet.clients[1]
    request = TurnRequest("q", PROMPT, 6, mode="disaggregated", ignore_eos=True)
    queued_polls: list[int] = []

    async def load(stop: asyncio.Event) -> None:
        async def one(i: int) -> None:
            prompt = [(11 * i + 3 * j) % 500 + 5 for j in range(48)]
            while not stop.is_set():
                await decode.generate(f"load-{i}-{time.monotonic()}", prompt, 32, 0.0,
                                      ignore_eos=True)  # fmt: skip

        async def poll() -> None:
            while not stop.is_set():
                queued_polls.append(int((await decode.load())["waiting"]))
                await asyncio.sleep(0.5)

        await asyncio.gather(*(one(i) for i in range(14)), poll())

    async def go():
        stop = asyncio.Event()
        background = asyncio.ensure_future(load(stop))
        await asyncio.sleep(1.0)  # the queue first
        started = time.perf_counter()
        try:
            result = await asyncio.wait_for(router.generate(request), 120)
        finally:
            stop.set()
            await background
        return result, time.perf_counter() - started

    try:
        result, waited = asyncio.run(go())
    finally:
        hanging.resume()
    assert hanging.stopped and router.kv_handoffs_lost_total == 1
    assert result.path == "local_prefill" and result.output_token_ids == expected
    assert TIMEOUT_S <= waited < TIMEOUT_S + 40
    assert sum(n > 0 for n in queued_polls) >= 0.8 * len(queued_polls)  # a queue throughout
