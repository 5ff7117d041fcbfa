"""Fake engines with weights: the rollout service's protocol tested in milliseconds.

:class:`WeightedFakeEngine` generates tokens that depend on the prompt *and* its weight
version, stamps the version of every token it emits (so a request that straddles an
update shows two versions, as vLLM's ``weight_versions`` spans would), tags prefill KV
with the version and refuses stale KV on a decode leg (as ``EngineServer`` does), and
records a violation whenever weights change while it holds a request. :class:`FakeFleet`
is the slice of ``EngineFleet`` the service uses.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from prorsa.errors import InputError
from prorsa.runtime.ray.engine import KV_WEIGHT_VERSION_KEY
from prorsa.runtime.ray.pools import RolePools

VOCAB = 512


def tokens_for(prompt: list[int], max_tokens: int, version: int) -> list[int]:
    """What a fake engine with weights ``version`` generates for ``prompt`` (greedy)."""
    base = sum(prompt) * 31 + len(prompt) + 1000 * version
    return [(base + 7 * i) % VOCAB for i in range(max_tokens)]


class WeightedFakeEngine:
    """An engine actor stand-in with weight versions, pause modes and sleep."""

    def __init__(self, engine_id: int, step_s: float = 0.002) -> None:
        self.engine_id = engine_id
        self.step_s = step_s
        self.version = 0
        self.paused = False
        self.sleeping = False
        self.asleep: set[str] = set()  # the memory a sleep released (vLLM's tags)
        self.requests: set[str] = set()
        self.aborted: set[str] = set()
        self.violations: list[str] = []
        self.updates: list[tuple[str, int]] = []
        self.stale_refused = 0
        self.rpc_calls: list[str] = []
        self.rpc_kwargs: list[dict[str, Any]] = []  # each call's kwargs, as rpc_calls
        self.failing_rpcs: set[str] = set()
        self.transit_s = 0.0  # a call's time on its way before the engine registers it
        self.reload_s = 0.0
        self.hanging: set[str] = set()  # control calls that never answer (a stuck engine)
        self.gates: dict[str, asyncio.Event] = {}  # control calls that answer once set
        self.calls: list[str] = []  # control calls received, in order
        self.reply: list[int] | None = None  # a scripted reply that ends in a stop
        self.stalled = False  # steps no more, answering all the while (a hung GPU)
        self.busy: list[str] = []  # long control calls it reports running
        self.refusing: set[str] = set()  # control calls that raise (not a dead engine)
        self.steps = 0

    async def _answer(self, call: str) -> None:
        self.calls.append(call)
        if call in self.hanging:
            await asyncio.Event().wait()
        if call in self.gates:
            await self.gates[call].wait()

    # ------------------------------------------------------------------ serving
    async def generate_stream(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        temperature: float = 0.0,
        kv_transfer_params: dict[str, Any] | None = None,
        **sampling: Any,
    ) -> AsyncIterator[dict[str, Any]]:
        if not prompt_token_ids:
            raise InputError("prompt is empty", field="prompt_token_ids")
        if sampling.get("min_tokens", 0) > max_tokens:  # as vLLM's SamplingParams
            raise InputError(f"min_tokens must be <= max_tokens={max_tokens}", field="min_tokens")
        if self.transit_s:
            await asyncio.sleep(self.transit_s)
        await self._answer("generate")
        kv = dict(kv_transfer_params or {})
        stale = kv.pop(KV_WEIGHT_VERSION_KEY, None)
        if stale is not None and stale != self.version:
            self.stale_refused += 1
            yield self._done(request_id, prompt_token_ids, [], [], "abort", None)
            return
        self.requests.add(request_id)
        out: list[int] = []
        stamps: list[int] = []
        finish = "length"
        script = self.reply
        try:
            for i in range(max_tokens if script is None else min(max_tokens, len(script))):
                while (
                    self.paused or self.sleeping or self.stalled
                ) and request_id not in self.aborted:
                    await asyncio.sleep(0.001)
                if request_id in self.aborted:
                    finish = "abort"
                    break
                if script is None:
                    out.append(tokens_for(prompt_token_ids, max_tokens, self.version)[i])
                else:
                    out.append(script[i])
                    finish = "stop" if i == len(script) - 1 else finish
                stamps.append(self.version)
                self.steps += 1
                if i == 0 and max_tokens > 1:
                    yield {"event": "first_token", "first_token_s": 0.0, "num_cached_tokens": 0}
                await asyncio.sleep(self.step_s)
        finally:
            self.requests.discard(request_id)
            self.aborted.discard(request_id)
        params = None
        if kv.get("do_remote_decode") and finish != "abort":
            params = {"do_remote_prefill": True, KV_WEIGHT_VERSION_KEY: self.version}
        logprobs = (
            [-1.0 - 0.1 * v for v in stamps] if sampling.get("logprobs") is not None else None
        )
        yield self._done(request_id, prompt_token_ids, out, stamps, finish, params, logprobs)

    def _done(self, request_id, prompt, out, stamps, finish, params, logprobs=None) -> dict:
        spans: list[list[Any]] = []
        for i, v in enumerate(stamps):
            if spans and spans[-1][0] == str(v):
                spans[-1][2] = i + 1
            else:
                spans.append([str(v), i, i + 1])
        versions = {s[0] for s in spans}
        return {
            "event": "done",
            "request_id": request_id,
            "engine_id": self.engine_id,
            "prompt_tokens": len(prompt),
            "output_token_ids": out,
            "output_logprobs": logprobs,
            "finish_reason": finish,
            "kv_transfer_params": params,
            "num_cached_tokens": 0,
            "weight_versions": spans,
            "weight_version": versions.pop() if len(versions) == 1 else None,
            "timings": {"first_token_s": 0.0, "total_s": self.step_s * len(out)},
        }

    async def generate(self, request_id, prompt_token_ids, max_tokens, temperature=0.0,
                       kv_transfer_params=None, **sampling) -> dict[str, Any]:  # fmt: skip
        result: dict[str, Any] = {}
        async for item in self.generate_stream(
            request_id, prompt_token_ids, max_tokens, temperature, kv_transfer_params, **sampling
        ):
            result = item
        return result

    # ------------------------------------------------------------------ control
    async def abort(self, request_ids: list[str]) -> None:
        await self._answer("abort")
        self.aborted.update(r for r in request_ids if r in self.requests)

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None:
        await self._answer("pause")
        if mode == "abort":
            self.aborted.update(self.requests)
        elif mode == "wait":
            while self.requests:
                await asyncio.sleep(0.001)
        self.paused = True

    async def resume(self) -> None:
        await self._answer("resume")
        if self.asleep:  # vLLM would step onto memory that is not there
            self.violations.append(f"resumed while {sorted(self.asleep)} sleep")
        self.paused = False

    async def is_paused(self) -> bool:
        return self.paused

    async def reset_prefix_cache(self) -> bool:
        if "reset_prefix_cache" in self.refusing:
            raise RuntimeError("the engine refused the reset")  # as a RayTaskError would
        return True

    async def release_kv(self, request_id: str, kv_transfer_params: dict[str, Any]) -> None:
        return None

    async def in_flight(self) -> list[str]:
        await self._answer("in_flight")
        return sorted(self.requests)

    async def update_weights_from_path(self, path: str, version: int) -> dict[str, Any]:
        if self.requests:
            self.violations.append(f"weights changed while holding {sorted(self.requests)}")
        if not self.paused:
            self.violations.append("weights changed while not paused")
        if "weights" in self.asleep:
            self.violations.append("weights written while they sleep")
        if self.reload_s:
            await asyncio.sleep(self.reload_s)
            if self.requests:
                self.violations.append(f"requests arrived mid-reload: {sorted(self.requests)}")
        self.version = version
        self.updates.append((path, version))
        return {"engine_id": self.engine_id, "weight_version": version, "reload_s": 0.0}

    async def set_weight_version(self, version: int) -> None:
        self.version = version

    async def collective_rpc(self, method, args=(), kwargs=None, timeout_s=None) -> list[Any]:
        self.rpc_calls.append(method)
        if "weights" in self.asleep:
            self.violations.append(f"{method} while the weights sleep")
        self.rpc_kwargs.append(kwargs or {})
        if (
            method in self.failing_rpcs
            or (method, (kwargs or {}).get("bucket")) in self.failing_rpcs
        ):
            raise RuntimeError(f"worker has no method {method!r}")
        return [f"{method} on engine {self.engine_id}"]

    async def sleep(self, level: int = 1, mode: str = "abort") -> dict[str, Any]:
        if mode == "abort":
            self.aborted.update(self.requests)
        elif mode == "wait":  # as vLLM: until the requests in flight finish
            while self.requests:
                await asyncio.sleep(0.001)
        self.sleeping = self.paused = True
        if level:  # level 0 pauses the scheduler only: what slept before still sleeps
            self.asleep = self.asleep | {"weights", "kv_cache"}
        return {"engine_id": self.engine_id, "level": level, "freed": []}

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        # As vLLM's executor: a partial wake naming a tag already awake wakes nothing;
        # once no memory sleeps the scheduler resumes, whatever paused it meanwhile.
        asleep = self.asleep
        if not tags:
            asleep = set()
        elif set(tags) <= asleep:
            asleep = asleep - set(tags)
        self.asleep = asleep
        if not asleep:
            self.sleeping = self.paused = False
        return not asleep

    async def health(self) -> dict[str, Any]:
        return {"engine_id": self.engine_id, "ready": True}

    async def load(self) -> dict[str, Any]:
        # No KV numbers: the load monitor falls back to the router's estimate.
        await self._answer("load")
        return {
            "engine_id": self.engine_id,
            "in_flight": len(self.requests),
            "paused": self.paused,
            "sleeping": self.sleeping,
            "busy": self.busy,
            "steps": self.steps,
            "kv_capacity_tokens": 0,
        }

    async def shutdown(self) -> None:
        return None


class _Spec:
    class engine:
        tensor_parallel_size = 1


class FakeFleet:
    """What ``RolloutService`` reads of an ``EngineFleet``."""

    def __init__(self, engines: list[WeightedFakeEngine], roles: list[str]) -> None:
        self.engines = engines
        self.clients = {e.engine_id: e for e in engines}
        self.roles = dict(enumerate(roles))
        self.spec = _Spec()

    def pools(self) -> RolePools:
        limits = {e.engine_id: {"max_model_len": 1024, "vocab_size": VOCAB} for e in self.engines}
        return RolePools(self.engines, self.roles, limits)
