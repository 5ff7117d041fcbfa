"""Starting a rollout service's parts: the policy's view of the cluster, engines, tokenizer.

The engine settings mirror ``prorsa rollout``'s (float32 and a small KV cache on CPU;
vLLM's own choices on GPU), so a served run and a batch rollout are comparable.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from typing import Any

from prorsa.serve.config import ServeConfig

logger = logging.getLogger(__name__)


def start_fleet(config: ServeConfig, roles: list[str]) -> tuple[Any, bool]:
    """Start Ray (if needed) and the engines with ``roles``; blocking (run it in a thread).

    Returns:
        The fleet, and whether Ray was started here (then the caller shuts it down).
    """
    import ray

    from prorsa.runtime.ray.cluster import EngineFleet, FleetSpec
    from prorsa.runtime.ray.engine import _default_device

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    on_cpu = _default_device() == "cpu"
    owns_ray = False
    if not ray.is_initialized():
        if config.ray_address:
            ray.init(address=config.ray_address, log_to_driver=False)
        else:
            # Logical CPUs: several engines share a small machine's cores.
            cpus = max(os.cpu_count() or 1, config.engines + 2) if on_cpu else None
            ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
        owns_ray = True
    engine = engine_config_for(config, on_cpu=on_cpu)
    try:
        return EngineFleet.start(FleetSpec(engine, roles=roles)), owns_ray
    except BaseException:
        if owns_ray:
            ray.shutdown()
        raise


def engine_config_for(config: ServeConfig, *, on_cpu: bool) -> Any:
    """The :class:`~prorsa.runtime.ray.config.EngineConfig` of every engine of the service."""
    from prorsa.runtime.ray.config import EngineConfig

    extra = {}
    if config.worker_extension_cls:
        extra["worker_extension_cls"] = config.worker_extension_cls
    engine = EngineConfig(
        model=config.model,
        dtype="float32" if on_cpu else "auto",
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        kv_cache_gib=config.kv_cache_gib if config.kv_cache_gib or not on_cpu else 0.25,
        connector=config.connector,  # type: ignore[arg-type]
        kv_storage_dir=config.kv_storage_dir,
        kv_wait_timeout_s=config.kv_wait_timeout_s,
        seed=config.seed,
        engine_kwargs=extra,
        freeze_startup_heap=config.freeze_startup_heap,
    )
    if engine.resolved_connector() == "example" and not engine.kv_storage_dir:
        # Only the file-backed connector keeps KV on disk: a folder of its own otherwise
        # (made on every start, whatever the connector, it piled up in /tmp).
        engine = dataclasses.replace(engine, kv_storage_dir=tempfile.mkdtemp(prefix="prorsa-kv-"))
    return engine


def cluster_spec_for(config: ServeConfig) -> Any:
    from prorsa.runtime.cluster.config import ClusterConfig
    from prorsa.runtime.cluster.spec import cluster_spec, load_profiles
    from prorsa.runtime.ray.cpu_profile import CPU_PROFILE

    cluster = ClusterConfig(
        profile=config.profile or CPU_PROFILE,
        num_slots=config.engines,
        switch_latency_s=config.switch_latency_s,
    )
    return cluster_spec(cluster, load_profiles(cluster), config.min_dwell_s)


def make_policy_for(config: ServeConfig) -> Any:
    from prorsa.policy import make_policy

    return make_policy(config.policy, **config.policy_params)


def load_tokenizer(model: str) -> Any:
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model, local_files_only=True)
    except Exception as exc:  # token-in/token-out routes work without one
        logger.warning("no tokenizer in %s (%s): text routes are off", model, exc)
        return None
