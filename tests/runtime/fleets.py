"""Starting a fleet of tiny-model engines the way the runtime tests need it."""

from __future__ import annotations

from pathlib import Path


def start_tiny_fleet(
    model_dir: Path,
    kv_dir: Path,
    roles: list[str],
    *,
    max_num_seqs: int,
    connector: str = "auto",
    overrides: dict | None = None,
):
    """An EngineFleet of float32 tiny-model engines with a small KV cache each."""
    from prorsa.runtime.ray.cluster import EngineFleet, FleetSpec
    from prorsa.runtime.ray.config import EngineConfig

    config = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=max_num_seqs,
        kv_cache_gib=0.125,
        connector=connector,
        kv_storage_dir=str(kv_dir),
    )
    return EngineFleet.start(FleetSpec(config, roles=roles, overrides=overrides or {}))
