"""A vLLM ``AsyncLLM`` engine hosted in one Ray actor, with token-in/token-out generation.

The class below is plain Python; :func:`engine_actor_class` wraps it with ``ray.remote`` so
that the module imports without Ray, and tests can drive it in-process too. All public
methods are coroutines run on the actor's event loop, so one engine serves many requests at
once; control methods (:data:`CONTROL_METHODS`) take their Ray slot from a group of their
own and hop to that loop (:mod:`prorsa.runtime.ray.control_group`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import random
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from prorsa.errors import ConfigError, InputError
from prorsa.runtime.gc_heap import startup_heap_frozen
from prorsa.runtime.ray.config import EngineConfig, engine_environment, kv_transfer_config
from prorsa.runtime.ray.control_group import (
    CONTROL_CONCURRENCY,
    CONTROL_GROUP,
    LoopBound,
    with_control_group,
)
from prorsa.runtime.ray.engine_control import EngineControl
from prorsa.runtime.ray.kv_watch import KVWaitWatch
from prorsa.runtime.ray.load import EngineLoad, load_logger_factory
from prorsa.runtime.ray.sampling import OutputCollector, request_errors, sampling_params

logger = logging.getLogger(__name__)

#: Key a prefill leg adds to the ``kv_transfer_params`` it returns: the weight version that
#: computed the KV. A decode leg whose engine has other weights refuses to pull it.
KV_WEIGHT_VERSION_KEY = "prorsa_weight_version"

#: Ids aborted before their request arrived that an engine remembers (the oldest go first).
ABORTED_EARLY_KEPT = 4096

#: ``kv_transfer_params`` for a prefill leg whose KV a remote decode engine will pull.
PREFILL_FOR_REMOTE_DECODE: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


#: Where side-channel ports are drawn from: above Ray's worker ports (10002-19999 by
#: default) and below the kernel's ephemeral range.
SIDE_CHANNEL_PORTS_FROM = 20000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def side_channel_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports, free now, for NIXL side channels.

    vLLM binds the side channel only after the model loads, seconds to minutes after the
    port is chosen. A port from the kernel's ephemeral range (what :func:`free_port`
    gives) can be taken meanwhile by any process's outgoing connection or ``bind(0)``
    (Ray's and vLLM's own among them); the listener thread then dies and the engine's
    start-up waits forever. Ports below that range are only ever taken by an explicit
    bind.
    """
    low, high = SIDE_CHANNEL_PORTS_FROM, _ephemeral_low()
    candidates = list(range(low, high))
    random.SystemRandom().shuffle(candidates)  # concurrent fleets rarely try the same
    ports: list[int] = []
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise ConfigError(f"no {count} free side-channel ports in {low}-{high - 1} on {host}")


#: Methods that run in the actor's control concurrency group: never behind requests.
CONTROL_METHODS: tuple[str, ...] = (
    "abort", "pause", "resume", "is_paused", "in_flight", "reset_prefix_cache",
    "set_weight_version", "update_weights_from_path", "collective_rpc", "sleep",
    "wake_up", "is_sleeping", "health", "load", "release_kv", "shutdown",
)  # fmt: skip


class EngineServer(EngineControl, LoopBound):
    """Host one vLLM engine; the body of the Ray actor.

    Args:
        engine_id: cluster-wide engine number (telemetry ``engine_id``).
        config: engine configuration; validated here.
    """

    def __init__(self, engine_id: int, config: EngineConfig) -> None:
        config.validate()
        self.engine_id = engine_id
        self.config = config
        self.connector = config.resolved_connector()
        self.side_channel_port: int | None = None
        if self.connector == "nixl":
            self.side_channel_port = (
                config.side_channel_port or side_channel_ports(1, config.side_channel_host)[0]
            )
        self.on_cpu = (config.device or _default_device()) == "cpu"
        os.environ.update(engine_environment(config, self.side_channel_port, self.on_cpu))
        self._llm: Any = None
        self._in_flight: dict[str, float] = {}
        # Aborted before their leg arrived (an abort may overtake the request it names:
        # Ray orders nothing across concurrency groups); the leg is refused on arrival.
        self._aborted_early: dict[str, None] = {}
        self._paused = False
        self._sleeping = False
        self._busy: list[str] = []
        self._load = EngineLoad()
        # Decode legs waiting for remote KV (kv_watch explains when a wait is given up).
        timeout = config.kv_wait_timeout_s
        self._kv_watch = KVWaitWatch(timeout) if timeout > 0 else None
        # The watch's proofs need one scheduler that sees requests in arrival order.
        extra = config.engine_kwargs
        self._kv_ordered = (
            int(extra.get("data_parallel_size", 1) or 1) <= 1
            and int(extra.get("renderer_num_workers", 1) or 1) <= 1
        )
        self._kv_watcher: asyncio.Task | None = None
        self._kv_given_up: set[str] = set()
        self.start_s: float | None = None
        self._heap = contextlib.ExitStack()  # the start-up heap's freeze, undone at shutdown
        # Weight version: 0 is the folder the engine started from; updates raise it.
        self.weight_version = 0
        self.weights_path = config.model

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> dict[str, Any]:
        """Build the engine (idempotent). Returns :meth:`health`."""
        self.bind_main_loop()  # the engine lives on this loop; control calls hop to it
        if self._llm is None:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.platforms import current_platform
            from vllm.v1.engine.async_llm import AsyncLLM

            cfg = self.config
            device_type = cfg.device or current_platform.device_type
            args: dict[str, Any] = {
                "model": cfg.model,
                "dtype": cfg.dtype,
                "max_model_len": cfg.max_model_len,
                "max_num_seqs": cfg.max_num_seqs,
                "enforce_eager": cfg.enforce_eager,
                "enable_prefix_caching": cfg.enable_prefix_caching,
                "gpu_memory_utilization": cfg.gpu_memory_utilization,
                "tensor_parallel_size": cfg.tensor_parallel_size,
                "seed": cfg.seed,
                "kv_transfer_config": kv_transfer_config(cfg, device_type),
            }
            kv_cache_gib = cfg.kv_cache_gib
            if kv_cache_gib is None and device_type == "cpu":
                kv_cache_gib = 1.0
            if kv_cache_gib is not None:
                args["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
            if cfg.max_num_batched_tokens is not None:
                args["max_num_batched_tokens"] = cfg.max_num_batched_tokens
            if cfg.block_size is not None:
                args["block_size"] = cfg.block_size
            args.update(cfg.engine_kwargs)
            started = time.perf_counter()
            try:
                self._llm = AsyncLLM.from_engine_args(
                    AsyncEngineArgs(**args), stat_loggers=[load_logger_factory(self._load)]
                )
            except Exception as exc:  # surface one clear line; the log has the traceback
                logger.exception("engine %d failed to start", self.engine_id)
                raise ConfigError(
                    f"engine {self.engine_id} failed to start: {type(exc).__name__}: {exc}",
                    hint="check EngineConfig (model, max_model_len, memory) and the engine log",
                ) from None
            # vLLM labels the initial weights "default"; prorsa versions are integers.
            await self._llm.update_weight_version(str(self.weight_version))
            self.start_s = time.perf_counter() - started
            cache = self._llm.vllm_config.cache_config
            self._load.kv_capacity_tokens = int((cache.num_gpu_blocks or 0) * cache.block_size)
            logger.info("engine %d ready in %.1f s", self.engine_id, self.start_s)
            # This process serves from here on (prorsa.runtime.gc_heap: full collections
            # over its start-up heap stalled every request in flight for ~380 ms).
            self._heap.enter_context(startup_heap_frozen(cfg.freeze_startup_heap))
        return await self.health()

    async def health(self) -> dict[str, Any]:
        """Liveness and load: raises if the engine died; cheap enough to poll."""
        if self._llm is None:
            return {"engine_id": self.engine_id, "ready": False}
        await self._llm.check_health()
        scheduler = self._llm.vllm_config.scheduler_config
        return {
            "engine_id": self.engine_id,
            "ready": True,
            "pid": os.getpid(),
            "child_pids": _child_pids(),
            # Objects kept out of full collections since the engine started (gc_heap).
            "gc_frozen_objects": gc.get_freeze_count(),
            "connector": self.connector,
            "side_channel_port": self.side_channel_port,
            "in_flight": len(self._in_flight),
            "paused": self._paused,
            "sleeping": self._sleeping,
            "weight_version": self.weight_version,
            "weights_path": self.weights_path,
            "start_s": self.start_s,
            "max_model_len": self._llm.model_config.max_model_len,
            "vocab_size": self._llm.model_config.get_vocab_size(),
            "kv_capacity_tokens": self._load.kv_capacity_tokens,
            "block_size": self._llm.vllm_config.cache_config.block_size,
            "max_num_seqs": scheduler.max_num_seqs,
            "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        }

    async def load(self) -> dict[str, Any]:
        """KV use and queue lengths from vLLM's scheduler at its last step.

        See :class:`~prorsa.runtime.ray.load.EngineLoad` for the fields; ``in_flight`` counts
        this actor's open ``generate`` calls; ``paused``, ``sleeping`` and ``busy`` (the
        control calls running that may hold its steps) say why an engine holding
        requests may not step (see :class:`~prorsa.runtime.ray.monitor.LoadMonitor`).
        """
        return {
            "engine_id": self.engine_id,
            "in_flight": len(self._in_flight),
            "paused": self._paused,
            "sleeping": self._sleeping,
            "busy": sorted(set(self._busy)),
            **self._load.snapshot(),
        }

    async def reset_prefix_cache(self) -> bool:
        """Drop cached prefixes (e.g. after a role switch). True when the reset happened."""
        return bool(await self._engine().reset_prefix_cache())

    async def abort(self, request_ids: list[str]) -> None:
        """Abort requests; their ``generate`` calls return with finish_reason ``abort``,
        also when the abort arrives before the request does."""
        for request_id in request_ids:
            if request_id not in self._in_flight:
                self._aborted_early[request_id] = None
        while len(self._aborted_early) > ABORTED_EARLY_KEPT:  # oldest first
            del self._aborted_early[next(iter(self._aborted_early))]
        await self._engine().abort(list(request_ids))

    async def release_kv(self, request_id: str, kv_transfer_params: dict[str, Any]) -> None:
        """Free KV a prefill leg pinned for a decode that will never pull it."""
        params = {k: v for k, v in kv_transfer_params.items() if k != KV_WEIGHT_VERSION_KEY}
        await self._engine().notify_kv_transfer_request_rejected(request_id, params)

    async def in_flight(self) -> list[str]:
        """Ids of requests this engine is serving now."""
        return list(self._in_flight)

    async def shutdown(self) -> None:
        """Stop the engine and its EngineCore process (idempotent)."""
        if self._kv_watcher is not None:
            self._kv_watcher.cancel()
        if self._llm is not None:
            llm, self._llm = self._llm, None
            await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
        self._heap.close()

    # ------------------------------------------------------------------ serving
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        temperature: float = 0.0,
        kv_transfer_params: dict[str, Any] | None = None,
        **sampling: Any,
    ) -> dict[str, Any]:
        """Generate from token ids; returns tokens, logprobs, weight version, KV params,
        finish reason and timings.

        Args:
            request_id: unique among this engine's in-flight requests.
            prompt_token_ids: the full context.
            max_tokens: tokens to generate (1 for a prefill leg).
            temperature: 0 is greedy.
            kv_transfer_params: connector parameters (``PREFILL_FOR_REMOTE_DECODE`` on a
                prefill leg, the prefill leg's returned params on a decode leg).
            **sampling: ``top_p``, ``top_k``, ``min_p``, ``seed``, ``ignore_eos``,
                ``stop_token_ids``, ``logprobs`` (k: the sampled token's logprob plus the
                top k), ``prompt_logprobs`` (k, likewise per prompt token); see
                :mod:`prorsa.runtime.ray.sampling`.

        Returns:
            ``output_token_ids``, ``output_logprobs`` (None unless ``logprobs`` was
            given), ``top_logprobs``, ``prompt_logprobs``, ``weight_version`` (the
            version string vLLM stamped on every output token; None if they differ) and
            ``weight_versions`` (spans), ``kv_transfer_params`` (None unless a connector
            set them), ``finish_reason`` (``abort`` when aborted), ``num_cached_tokens``,
            ``prompt_tokens``, ``engine_id`` and ``timings`` with ``queue_s``/``prefill_s``
            and ``decode_s`` (engine-core clock: first to last token; None when not
            reported), ``first_token_s`` and ``total_s`` (wall clock inside the actor).
        """
        result: dict[str, Any] = {}
        async for item in self.generate_stream(
            request_id, prompt_token_ids, max_tokens, temperature, kv_transfer_params, **sampling
        ):
            result = item
        return result

    async def generate_stream(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        temperature: float = 0.0,
        kv_transfer_params: dict[str, Any] | None = None,
        **sampling: Any,
    ) -> AsyncIterator[dict[str, Any]]:
        """Like :meth:`generate`, but first yields ``{"event": "first_token", ...}`` as soon as
        the first token exists (the KV handoff is over by then), then the result with
        ``"event": "done"``. Use with ``num_returns="streaming"``."""
        self.check_request(prompt_token_ids, max_tokens)
        if request_id in self._in_flight:
            raise InputError(f"request id {request_id!r} is already in flight", field="request_id")
        kv_params = dict(kv_transfer_params) if kv_transfer_params else None
        if request_id in self._aborted_early:  # its abort overtook it
            del self._aborted_early[request_id]
            if kv_params and kv_params.get("do_remote_prefill"):
                # A decode leg: free the KV its prefill engine holds for it.
                kv_params.pop(KV_WEIGHT_VERSION_KEY, None)
                await self._release_stale_kv(request_id, kv_params)
            yield {"event": "done", **self._aborted(request_id, prompt_token_ids)}
            return
        kv_version = kv_params.pop(KV_WEIGHT_VERSION_KEY, None) if kv_params else None
        if kv_version is not None and kv_version != self.weight_version:
            # The prompt's KV was computed with other weights: never decode from it. The
            # router serves the turn again from a fresh prefill (finish reason "abort").
            await self._release_stale_kv(request_id, kv_params)
            yield {"event": "done", **self._aborted(request_id, prompt_token_ids)}
            return
        params = sampling_params(max_tokens, temperature, kv_params, sampling, record=request_id)
        collector = OutputCollector(params.logprobs, params.prompt_logprobs)
        started = time.perf_counter()
        arrived = time.monotonic()  # the KV wait watch's clock
        self._in_flight[request_id] = started
        if kv_params and kv_params.get("do_remote_prefill"):
            self._watch_kv_wait(request_id, arrived)
        first_token_s = None
        final: Any = None
        prompt: dict[str, Any] = {"prompt_token_ids": list(prompt_token_ids)}
        if self.config.enable_prefix_caching:
            # Prefix-cache entries are keyed by weight version too: a request admitted
            # under version v can never reuse KV computed under another version.
            prompt["cache_salt"] = f"prorsa-w{self.weight_version}"
        try:
            stream = self._engine().generate(prompt, params, request_id)
            async for out in stream:
                collector.add(out)
                final = out
                if collector.token_ids and first_token_s is None:
                    first_token_s = time.perf_counter() - started
                    self._kv_wait_over(request_id)
                    self._kv_scheduled(arrived, out)
                    if not out.finished:
                        yield {
                            "event": "first_token",
                            "first_token_s": first_token_s,
                            "num_cached_tokens": int(out.num_cached_tokens or 0),
                        }
        except request_errors() as exc:
            raise InputError(str(exc), record=request_id) from None
        finally:
            self._in_flight.pop(request_id, None)
            self._kv_wait_over(request_id)
            # A leg whose first token raced the abort was served, not given up.
            given_up = request_id in self._kv_given_up and first_token_s is None
            self._kv_given_up.discard(request_id)
        result = self._result(
            request_id, prompt_token_ids, collector.token_ids, final, started, first_token_s
        )
        if given_up and result["finish_reason"] == "abort":  # not if it finished meanwhile
            result["kv_wait_given_up"] = True
        if result["kv_transfer_params"] and kv_params and kv_params.get("do_remote_decode"):
            # Tag the handoff with the weights that computed it (checked by the decode leg).
            result["kv_transfer_params"] = {
                **result["kv_transfer_params"],
                KV_WEIGHT_VERSION_KEY: self.weight_version,
            }
        yield {"event": "done", **result, **collector.fields()}

    def _watch_kv_wait(self, request_id: str, arrived: float) -> None:
        if self._kv_watch is None:
            return
        self._kv_watch.add(request_id, arrived)
        if self._kv_watcher is None:
            self._kv_watcher = asyncio.get_running_loop().create_task(self._watch_kv_waits())

    def _kv_wait_over(self, request_id: str) -> None:
        if self._kv_watch is not None:
            self._kv_watch.done(request_id)

    def _kv_scheduled(self, arrived: float, out: Any) -> None:
        """Tell the KV wait watch when a request's first step ran (kv_watch: a proof that
        legs ahead of it still load); vLLM's engine core stamps it on the same clock."""
        if not (self._kv_ordered and self._kv_watch is not None and len(self._kv_watch)):
            return
        scheduled_ts = float(getattr(getattr(out, "metrics", None), "scheduled_ts", 0.0) or 0.0)
        if scheduled_ts > 0.0:
            self._kv_watch.scheduled(arrived, scheduled_ts)

    async def _watch_kv_waits(self) -> None:
        """Abort decode legs whose wait for remote KV nothing explains (see kv_watch);
        their results say ``kv_wait_given_up`` and the router prefills them here."""
        watch = self._kv_watch
        assert watch is not None
        try:
            while len(watch):
                await asyncio.sleep(min(1.0, watch.timeout_s / 4))
                now = time.monotonic()
                if self._paused or self._sleeping or self._busy:
                    watch.hold(now)
                watch.queued(self._load.queued_s)
                # No staleness rule: a parked request keeps the engine core stepping
                # (and reporting), so silence means a step in progress, which never
                # lasts anywhere near timeout_s; the stall watch handles engines that do.
                late = watch.overdue(now)
                for request_id in late:
                    watch.done(request_id)
                    self._kv_given_up.add(request_id)
                    logger.warning(
                        "engine %d: %s waited %.0f s for its KV with nothing else to "
                        "explain it; aborting it",
                        self.engine_id, request_id, watch.timeout_s,
                    )  # fmt: skip
                if late:
                    try:
                        await self._engine().abort(late)
                    except Exception as exc:  # the engine died: its legs fail on their own
                        logger.warning(
                            "engine %d: abort of %s failed: %s", self.engine_id, late, exc
                        )
        except asyncio.CancelledError:
            raise
        except Exception:  # never silently: the next remote-KV leg starts a new watcher
            logger.exception("engine %d: the KV wait watcher failed", self.engine_id)
        finally:
            self._kv_watcher = None

    async def _release_stale_kv(self, request_id: str, kv_params: dict[str, Any]) -> None:
        try:
            await self._engine().notify_kv_transfer_request_rejected(request_id, kv_params)
        except Exception as exc:  # best effort: the prefill side frees it on its timeout
            logger.info(
                "engine %d: could not release stale KV of %s: %s", self.engine_id, request_id, exc
            )

    def _aborted(self, request_id: str, prompt_token_ids: list[int]) -> dict[str, Any]:
        """The result of a request refused before it ran."""
        return {
            "request_id": request_id,
            "engine_id": self.engine_id,
            "prompt_tokens": len(prompt_token_ids),
            "output_token_ids": [],
            "finish_reason": "abort",
            "kv_transfer_params": None,
            "num_cached_tokens": 0,
            "timings": {
                "queue_s": None,
                "prefill_s": None,
                "decode_s": None,
                "first_token_s": 0.0,
                "total_s": 0.0,
            },
            **OutputCollector(None, None).fields(),
        }

    def check_request(self, prompt_token_ids: list[int], max_tokens: int) -> None:
        """Raise :class:`InputError` for a request this engine can never serve."""
        if not prompt_token_ids:
            raise InputError("prompt is empty", field="prompt_token_ids")
        if len(prompt_token_ids) >= self.config.max_model_len:
            raise InputError(
                f"prompt has {len(prompt_token_ids)} tokens; engine max_model_len is "
                f"{self.config.max_model_len}",
                field="prompt_token_ids",
                hint="shorten the context or raise EngineConfig.max_model_len",
            )
        if max_tokens < 1:
            raise InputError(f"max_tokens must be >= 1, got {max_tokens}", field="max_tokens")

    def _result(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        tokens: list[int],
        final: Any,
        started: float,
        first_token_s: float | None,
    ) -> dict[str, Any]:
        total_s = time.perf_counter() - started
        completion = final.outputs[0] if final is not None else None
        metrics = getattr(final, "metrics", None)
        queue_s = prefill_s = decode_s = None
        if metrics is not None and metrics.scheduled_ts and metrics.first_token_ts:
            queue_s = max(0.0, metrics.scheduled_ts - metrics.queued_ts)
            prefill_s = max(0.0, metrics.first_token_ts - metrics.scheduled_ts)
            if metrics.last_token_ts:
                decode_s = max(0.0, metrics.last_token_ts - metrics.first_token_ts)
        return {
            "request_id": request_id,
            "engine_id": self.engine_id,
            "prompt_tokens": len(prompt_token_ids),
            "output_token_ids": tokens,
            "finish_reason": completion.finish_reason if completion is not None else "abort",
            "kv_transfer_params": getattr(final, "kv_transfer_params", None),
            "num_cached_tokens": int(getattr(final, "num_cached_tokens", 0) or 0),
            "timings": {
                "queue_s": queue_s,
                "prefill_s": prefill_s,
                "decode_s": decode_s,
                "first_token_s": first_token_s if first_token_s is not None else total_s,
                "total_s": total_s,
            },
        }

    def _engine(self) -> Any:
        if self._llm is None:
            raise ConfigError(f"engine {self.engine_id} is not started", hint="call start() first")
        return self._llm


def _default_device() -> str:
    """What vLLM will run on here, decided before vLLM is imported (it reads env at import)."""
    try:
        import torch
    except ImportError:
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    xpu = getattr(torch, "xpu", None)
    return "xpu" if xpu is not None and xpu.is_available() else "cpu"


def _child_pids() -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process().children(recursive=True)]


def engine_actor_class(
    num_cpus: float = 1, num_gpus: float = 0, max_concurrency: int = 1000
) -> Any:
    """``EngineServer`` as a Ray actor class with the given resources: up to
    ``max_concurrency`` requests at once, and :data:`CONTROL_METHODS` in a concurrency
    group of their own (see :mod:`prorsa.runtime.ray.control_group`)."""
    import ray

    return ray.remote(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        max_concurrency=max_concurrency,
        concurrency_groups={CONTROL_GROUP: CONTROL_CONCURRENCY},
    )(with_control_group(EngineServer, CONTROL_METHODS))
