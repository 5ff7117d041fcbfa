"""An in-process stand-in for an engine actor: deterministic tokens, real asyncio timing.

It honours the :class:`~prorsa.runtime.ray.client.EngineClient` contract closely enough to
test routing, role switches and failure handling in milliseconds: greedy output depends
only on the prompt, a prefill leg returns KV params a decode leg must present, aborts end
a stream with ``finish_reason == "abort"``, and :meth:`FakeEngine.kill` makes every call
(including streams in flight) raise :class:`EngineUnavailable`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from prorsa.errors import InputError
from prorsa.runtime.ray.client import EngineUnavailable

VOCAB = 512
BLOCK = 16


def expected_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    """What every fake engine generates for ``prompt`` (greedy)."""
    base = sum(prompt) * 31 + len(prompt)
    return [(base + 7 * i) % VOCAB for i in range(max_tokens)]


class FakeEngine:
    """A fake engine; ``step_s`` per decoded token, ``prefill_s_per_token`` per new token."""

    def __init__(self, engine_id: int, step_s: float = 0.002, prefill_s_per_token: float = 0.0):
        self.engine_id = engine_id
        self.step_s = step_s
        self.prefill_s_per_token = prefill_s_per_token
        self.alive = True
        self.paused = False
        self.calls: list[tuple[str, str]] = []  # (leg kind, request id)
        self.aborted: set[str] = set()
        self.in_flight: set[str] = set()
        self.cache: list[list[int]] = []
        self.resets = 0
        self.pauses = 0
        self.kv_issued: dict[str, list[int]] = {}
        self.released: list[str] = []

    def kill(self) -> None:
        self.alive = False

    def unreachable_for(self, calls: int) -> None:
        """The next ``calls`` calls fail as Ray's ActorUnavailableError does (transient)."""
        self.unreachable = calls

    def _check(self) -> None:
        if not self.alive:
            raise EngineUnavailable(self.engine_id, "killed")
        if getattr(self, "unreachable", 0) > 0:
            self.unreachable -= 1
            raise EngineUnavailable(self.engine_id, "ActorUnavailableError", transient=True)

    def _cached(self, prompt: list[int]) -> int:
        best = 0
        for seen in self.cache:
            n = 0
            for a, b in zip(seen, prompt, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, len(prompt) - 1) // BLOCK * BLOCK

    async def generate_stream(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        temperature: float = 0.0,
        kv_transfer_params: dict[str, Any] | None = None,
        **sampling: Any,
    ) -> AsyncIterator[dict[str, Any]]:
        self._check()
        if not prompt_token_ids:
            raise InputError("prompt is empty", field="prompt_token_ids")
        kv = kv_transfer_params or {}
        kind = "prefill" if kv.get("do_remote_decode") else "decode" if kv else "full"
        self.calls.append((kind, request_id))
        self.in_flight.add(request_id)
        try:
            cached = self._cached(prompt_token_ids)
            if kv.get("do_remote_prefill"):
                cached = len(prompt_token_ids) // BLOCK * BLOCK  # KV came from the prefill side
            new = len(prompt_token_ids) - cached
            await asyncio.sleep(self.prefill_s_per_token * new)
            tokens = expected_tokens(prompt_token_ids, max_tokens)
            out: list[int] = []
            finish = "length"
            for i, token in enumerate(tokens):
                self._check()
                while self.paused and request_id not in self.aborted:
                    await asyncio.sleep(0.001)
                if request_id in self.aborted:
                    finish = "abort"
                    break
                out.append(token)
                if i == 0 and max_tokens > 1:
                    yield {
                        "event": "first_token",
                        "first_token_s": 0.0,
                        "num_cached_tokens": cached,
                    }
                await asyncio.sleep(self.step_s)
            self._check()
            self.cache.append(list(prompt_token_ids) + out)
            params = None
            if kind == "prefill":
                params = {"do_remote_prefill": True, "remote_engine_id": self.engine_id}
                self.kv_issued[request_id] = list(prompt_token_ids)
            yield {
                "event": "done",
                "request_id": request_id,
                "engine_id": self.engine_id,
                "prompt_tokens": len(prompt_token_ids),
                "output_token_ids": out,
                "finish_reason": finish,
                "kv_transfer_params": params,
                "num_cached_tokens": cached,
                "timings": {"queue_s": 0.0, "prefill_s": 0.0, "first_token_s": 0.0, "total_s": 0.0},
            }
        finally:
            self.in_flight.discard(request_id)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        temperature: float = 0.0,
        kv_transfer_params: dict | None = None,
        **sampling: Any,
    ) -> dict[str, Any]:
        result: dict[str, Any] = {}
        async for item in self.generate_stream(
            request_id, prompt_token_ids, max_tokens, temperature, kv_transfer_params, **sampling
        ):
            result = item
        return result

    async def abort(self, request_ids: list[str]) -> None:
        self._check()
        self.aborted.update(request_ids)

    async def pause(self, mode: str = "keep") -> None:
        self._check()
        self.pauses += 1
        if mode == "abort":
            self.aborted.update(self.in_flight)
        self.paused = True

    async def resume(self) -> None:
        self._check()
        self.paused = False

    async def reset_prefix_cache(self) -> bool:
        self._check()
        self.cache.clear()
        self.resets += 1
        return True

    async def release_kv(self, request_id: str, kv_transfer_params: dict[str, Any]) -> None:
        self._check()
        self.released.append(request_id)

    async def health(self) -> dict[str, Any]:
        self._check()
        return {"engine_id": self.engine_id, "ready": True}

    async def shutdown(self) -> None:
        self.alive = False
