"""Engine load as vLLM's scheduler reports it: KV blocks in use, running and waiting requests.

vLLM calls every stat logger once per engine step with the scheduler's statistics
(``SchedulerStats.kv_cache_usage`` is the share of KV blocks held by running or pinned
requests; blocks kept only as reusable prefix cache count as free). :func:`load_logger_factory`
builds a per-engine logger that keeps the latest numbers in an :class:`EngineLoad`, which
the engine actor returns from ``load()``. vLLM is imported only inside the factory, so this
module imports without it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class EngineLoad:
    """The latest scheduler statistics of one engine.

    Attributes:
        kv_capacity_tokens: KV cache size in tokens (blocks x block size).
        kv_usage: share of KV blocks in use at the last step (0..1).
        running: requests in the running batch at the last step.
        waiting: requests waiting to be scheduled at the last step.
        steps: engine steps seen so far.
        prompt_tokens: prompt tokens computed so far (prefix-cache hits excluded).
        generation_tokens: tokens generated so far.
        updated_s: ``time.monotonic()`` of the last step (0 before the first).
        queued_s: ``time.monotonic()`` of the last step at which a request waited for
            anything but a remote KV load in progress (:func:`waits_for_more_than_kv`;
            0: none yet).
    """

    kv_capacity_tokens: int = 0
    kv_usage: float = 0.0
    running: int = 0
    waiting: int = 0
    steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    updated_s: float = 0.0
    queued_s: float = 0.0

    @property
    def kv_used_tokens(self) -> int:
        return round(self.kv_usage * self.kv_capacity_tokens)

    def snapshot(self) -> dict[str, Any]:
        """A plain dict (what crosses the Ray boundary), with ``kv_used_tokens`` and age."""
        out = asdict(self)
        out["kv_used_tokens"] = self.kv_used_tokens
        out["age_s"] = time.monotonic() - self.updated_s if self.updated_s else None
        return out


def waits_for_more_than_kv(scheduler_stats: Any) -> bool:
    """Whether a request waits for admission or a batch slot, not for a KV load.

    ``num_waiting_reqs`` leaves out requests parked on a remote KV load; vLLM's KV-fetch
    stages name those that wait to start their load and those whose KV arrived but that
    still wait for a batch slot (the scheduler only looks at them when a slot frees).
    """
    stages = getattr(scheduler_stats, "num_kv_fetch_reqs_by_stage", None) or {}
    return bool(
        scheduler_stats.num_waiting_reqs
        or stages.get("waiting_to_start")
        or stages.get("completed_waiting")
    )


def load_logger_factory(load: EngineLoad) -> Callable[[Any, int], Any]:
    """A vLLM per-engine ``StatLoggerFactory`` whose loggers write into ``load``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class LoadLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.cache_config = vllm_config.cache_config

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is not None:
                load.kv_usage = float(scheduler_stats.kv_cache_usage)
                load.running = int(scheduler_stats.num_running_reqs)
                load.waiting = int(scheduler_stats.num_waiting_reqs)
                load.steps += 1
                load.updated_s = time.monotonic()
                if waits_for_more_than_kv(scheduler_stats):
                    load.queued_s = load.updated_s
            if iteration_stats is not None:
                load.prompt_tokens += int(iteration_stats.num_prompt_tokens)
                load.generation_tokens += int(iteration_stats.num_generation_tokens)

        def log_engine_initialized(self) -> None:
            # Blocks are known once the engine has profiled its memory.
            blocks = self.cache_config.num_gpu_blocks or 0
            load.kv_capacity_tokens = int(blocks * (self.cache_config.block_size or 0))

    return LoadLogger
