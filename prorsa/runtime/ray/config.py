"""Configuration of one vLLM engine hosted in a Ray actor, and the KV-connector choice."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from prorsa.errors import ConfigError

ConnectorName = Literal["auto", "nixl", "example"]
CONNECTORS: tuple[str, ...] = ("auto", "nixl", "example")


@dataclass
class EngineConfig:
    """One model replica. Every field's ``help`` metadata doubles as CLI help text."""

    model: str = field(metadata={"help": "Model folder or name (loaded offline)."})
    device: str | None = field(
        default=None,
        metadata={
            "help": "Device type the engine runs on (vLLM detects its platform itself; this "
            "only selects CPU-only settings and the NIXL buffer); None detects it."
        },
    )
    dtype: str = field(
        default="auto",
        metadata={"help": "Weight/activation dtype; 'float32' on CPU (bf16 crashes there)."},
    )
    max_model_len: int = field(default=1024, metadata={"help": "Longest context in tokens."})
    max_num_seqs: int = field(default=8, metadata={"help": "Most sequences per batch."})
    max_num_batched_tokens: int | None = field(
        default=None, metadata={"help": "Token budget per step; None uses vLLM's default."}
    )
    block_size: int | None = field(
        default=None, metadata={"help": "KV block size in tokens; None uses vLLM's default."}
    )
    enforce_eager: bool = field(
        default=True, metadata={"help": "Skip graph capture (faster start, slower steps)."}
    )
    enable_prefix_caching: bool = field(
        default=True, metadata={"help": "Keep prompt prefixes for later turns."}
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata={"help": "Share of GPU memory vLLM may use (GPU only)."}
    )
    tensor_parallel_size: int = field(default=1, metadata={"help": "GPUs per engine."})
    connector: ConnectorName | None = field(
        default="auto",
        metadata={
            "help": "KV connector for prefill->decode handoff: 'nixl' (NixlConnector), "
            "'example' (ExampleConnector via a shared folder), 'auto' (nixl when importable), "
            "or None (no handoff; colocated only)."
        },
    )
    kv_buffer_device: str | None = field(
        default=None,
        metadata={"help": "NIXL buffer device; None means 'cpu' on CPU, the device otherwise."},
    )
    kv_storage_dir: str | None = field(
        default=None, metadata={"help": "Shared folder for the 'example' connector."}
    )
    side_channel_host: str = field(
        default="127.0.0.1", metadata={"help": "Host NIXL peers reach this engine's side channel."}
    )
    side_channel_port: int | None = field(
        default=None, metadata={"help": "NIXL side-channel port; None picks a free one."}
    )
    kv_wait_timeout_s: float = field(
        default=60.0,
        metadata={
            "help": "Give up a decode leg's wait for its prefill engine's KV after this many "
            "seconds in which nothing else explains it (no request on this engine waits for "
            "admission or a batch slot; not paused, asleep or busy), or across which "
            "requests that came later were scheduled first; the router then prefills the "
            "turn on this engine. 0: off."
        },
    )
    kv_cache_gib: float | None = field(
        default=None,
        metadata={
            "help": "KV cache per engine in GiB (kv_cache_memory_bytes); None uses "
            "gpu_memory_utilization on GPU and 1 GiB on CPU."
        },
    )
    cpu_threads_bind: str = field(
        default="nobind",
        metadata={"help": "VLLM_CPU_OMP_THREADS_BIND; 'nobind' lets engines share cores."},
    )
    cpu_threads: int = field(
        default=1, metadata={"help": "OpenMP threads per engine on CPU (OMP_NUM_THREADS)."}
    )
    inline_worker: bool | None = field(
        default=None,
        metadata={
            "help": "Run the model worker inside the EngineCore process "
            "(VLLM_ENABLE_V1_MULTIPROCESSING=0): one process fewer per engine. "
            "None: on CPU only (vLLM does this by itself on GPU at tensor_parallel_size 1)."
        },
    )
    seed: int = field(default=0, metadata={"help": "Engine sampling seed."})
    freeze_startup_heap: bool = field(
        default=True,
        metadata={
            "help": "Keep the actor's start-up heap out of Python's full garbage collections "
            "once the engine runs (prorsa.runtime.gc_heap)."
        },
    )
    env: dict[str, str] = field(
        default_factory=dict, metadata={"help": "Extra environment variables for the engine."}
    )
    engine_kwargs: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "Extra AsyncEngineArgs keyword arguments."}
    )

    def validate(self) -> None:
        """Raise :class:`ConfigError` for an inconsistent configuration."""
        if self.connector is not None and self.connector not in CONNECTORS:
            raise ConfigError(
                f"unknown connector {self.connector!r}",
                hint=f"choose one of: {', '.join(CONNECTORS)} or None",
            )
        looks_like_path = self.model.startswith(("/", ".", "~"))
        if looks_like_path and not Path(self.model).expanduser().is_dir():
            raise ConfigError(
                f"model folder {self.model} does not exist",
                hint="make one with `prorsa models make-tiny --out DIR`",
            )
        if self.max_model_len <= 0 or self.max_num_seqs <= 0:
            raise ConfigError("max_model_len and max_num_seqs must be > 0")
        if not self.kv_wait_timeout_s >= 0:
            raise ConfigError(f"kv_wait_timeout_s must be >= 0, got {self.kv_wait_timeout_s}")
        if self.resolved_connector() == "example" and not self.kv_storage_dir:
            raise ConfigError(
                "the 'example' connector needs kv_storage_dir",
                hint="give every engine the same shared folder",
            )

    def resolved_connector(self) -> str | None:
        """The connector this engine will use after resolving ``'auto'``."""
        if self.connector == "auto":
            return "nixl" if nixl_available() else "example"
        return self.connector

    @classmethod
    def help(cls) -> dict[str, str]:
        """Field name -> help text."""
        return {f.name: f.metadata.get("help", "") for f in fields(cls)}


def nixl_available() -> bool:
    """Whether the NIXL Python bindings can be imported here."""
    return importlib.util.find_spec("nixl") is not None


def engine_environment(
    config: EngineConfig, side_channel_port: int | None, on_cpu: bool
) -> dict[str, str]:
    """Environment variables the engine (and its spawned EngineCore) must see before start.

    CPU-only settings are left out on GPU so that plain ``vllm`` runs unchanged there.
    """
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if on_cpu:
        env["VLLM_CPU_OMP_THREADS_BIND"] = config.cpu_threads_bind
        env["OMP_NUM_THREADS"] = str(config.cpu_threads)
    if config.inline_worker if config.inline_worker is not None else on_cpu:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if side_channel_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = config.side_channel_host
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    env.update(config.env)
    return env


def kv_transfer_config(config: EngineConfig, device_type: str) -> dict[str, Any] | None:
    """The ``kv_transfer_config`` dict for ``AsyncEngineArgs`` (None without a connector)."""
    connector = config.resolved_connector()
    if connector is None:
        return None
    # A KV load that fails (its prefill engine died, a block could not be read) is
    # recomputed on the decode engine; vLLM's default ends the request with "error".
    common = {"kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
    if connector == "nixl":
        buffer = config.kv_buffer_device or ("cpu" if device_type == "cpu" else device_type)
        return {"kv_connector": "NixlConnector", "kv_buffer_device": buffer, **common}
    return {
        "kv_connector": "ExampleConnector",
        "kv_connector_extra_config": {"shared_storage_path": config.kv_storage_dir},
        **common,
    }
