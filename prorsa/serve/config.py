"""What one rollout service runs. Every field's ``help`` metadata doubles as CLI help text."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from prorsa.errors import ConfigError

CONNECTORS = ("auto", "nixl", "example")


def _help(text: str, **kw: Any) -> dict[str, Any]:
    return {"metadata": {"help": text}, **kw}


@dataclass
class ServeConfig:
    """A long-lived rollout service: ``engines`` vLLM replicas behind one router."""

    model: str = field(**_help("Model folder (loaded offline; its tokenizer serves chat)."))
    engines: int = field(default=2, **_help("vLLM engines (one controller slot each)."))
    policy: str = field(default="colocate", **_help("Allocation policy (`prorsa policies`)."))
    policy_params: dict[str, Any] = field(
        default_factory=dict, **_help("Policy parameters (key=value).")
    )
    forecaster: str | None = field(
        default=None, **_help("Forecaster for predictive / mpc (name or model folder).")
    )
    served_model_name: str | None = field(
        default=None, **_help("Model name clients send; default: the model folder's name.")
    )
    host: str = field(default="127.0.0.1", **_help("Address to listen on."))
    port: int = field(default=8000, **_help("HTTP port."))
    admin_token: str | None = field(
        default=None,
        **_help("Bearer token the admin routes require (none: admin routes are open)."),
    )
    max_model_len: int = field(default=1024, **_help("Engine context length in tokens."))
    max_num_seqs: int = field(default=16, **_help("Engine max running sequences."))
    kv_cache_gib: float | None = field(
        default=None, **_help("KV cache per engine, GiB (None: 0.25 on CPU, vLLM's on GPU).")
    )
    connector: str = field(default="auto", **_help("KV connector: auto | nixl | example."))
    interval_s: float = field(default=0.5, **_help("Control loop period, seconds."))
    min_dwell_s: float = field(default=5.0, **_help("Minimum time between switches of one engine."))
    drain_timeout_s: float = field(default=5.0, **_help("Drain time of a switch before aborts."))
    local_prefill_threshold: int = field(
        default=0, **_help("Prefill turns with fewer new tokens on their decode engine.")
    )
    sync_drain_timeout_s: float = field(
        default=60.0,
        **_help(
            "Weight update: how long turns in flight may finish under the old weights; "
            "later ones are aborted and served again under the new weights."
        ),
    )
    engine_control_timeout_s: float = field(
        default=30.0,
        **_help(
            "Longest wait for an engine to answer pause, resume, abort or its request list "
            "(weight updates and the trainer's pause/resume); one that does not answer in "
            "time leaves service so the others go on."
        ),
    )
    engine_stall_timeout_s: float = field(
        default=120.0,
        **_help(
            "An engine that holds requests, is not paused or asleep, and neither steps nor "
            "answers for this long leaves service and its turns go on elsewhere (a hung GPU "
            "or collective fails no call); 0 turns this off."
        ),
    )
    kv_wait_timeout_s: float = field(
        default=60.0,
        **_help(
            "A decode leg that waits this long for its prefill engine's KV is given up and "
            "the turn prefilled on the decode engine (a hung peer or link fails no call); "
            "the wait counts while nothing on that engine waits for admission or a batch "
            "slot, or while requests that came later are scheduled first, and never while "
            "the engine is paused, asleep or busy; 0 turns this off."
        ),
    )
    session_idle_s: float = field(
        default=900.0,
        **_help("End a session (traj_end) after this long without a turn or finish_session."),
    )
    stream_legs: bool = field(
        default=False,
        **_help(
            "Stream each leg from its engine (live first-token events) instead of one call "
            "per leg (lower overhead; first-token times from the engine's own clock)."
        ),
    )
    profile: str | None = field(
        default=None, **_help("Cost profile for the policy's throughput numbers (CPU fit).")
    )
    switch_latency_s: float = field(default=0.1, **_help("Switch latency policies assume."))
    monitor_interval_s: float = field(default=0.25, **_help("Engine load polling period."))
    telemetry_dir: str | None = field(
        default=None, **_help("Record lifecycle telemetry here (none: in memory only).")
    )
    kv_storage_dir: str | None = field(
        default=None, **_help("Folder of the 'example' connector (default: a temp folder).")
    )
    workload_scenario: str | None = field(
        default=None,
        **_help(
            "Tell the policy the rollouts' expected shape: that of this scenario's reference "
            "sample (a trainer may post its own to /prorsa/workload instead)."
        ),
    )
    run_id: str = field(default="serve", **_help("Telemetry run id."))
    seed: int = field(default=0, **_help("Seeds the engines and the policy."))
    ray_address: str | None = field(
        default=None, **_help("Ray cluster to join (none: start a local one).")
    )
    tool_call_parser: str | None = field(
        default=None,
        **_help(
            "Parse chat replies into OpenAI tool_calls with this vLLM tool-call parser "
            "(hermes, qwen3_coder, llama3_json, ...; none: the text as it is)."
        ),
    )
    worker_extension_cls: str | None = field(
        default=None,
        **_help(
            "vLLM worker extension (module.Class) loaded by every engine, for a trainer "
            "that pushes weights through collective_rpc (SkyRL's WorkerWrap)."
        ),
    )
    freeze_startup_heap: bool = field(
        default=True,
        **_help(
            "Keep the objects alive after start-up out of Python's full garbage "
            "collections while serving (gc.freeze), here and in the engines it starts: "
            "those pauses stop every thread of a process, ~300 ms each at a start-up heap."
        ),
    )

    def validate(self) -> None:
        """Raise :class:`ConfigError` for settings that cannot work."""
        if not Path(self.model).expanduser().is_dir():
            raise ConfigError(
                f"model folder {self.model} does not exist",
                hint="make one with `prorsa models make-tiny --out DIR`",
            )
        if self.engines < 1:
            raise ConfigError(f"engines must be >= 1, got {self.engines}")
        if not 0 < self.port < 65536:
            raise ConfigError(f"port must be in 1..65535, got {self.port}")
        if self.connector not in CONNECTORS:
            raise ConfigError(f"unknown connector {self.connector!r}", hint=f"one of {CONNECTORS}")
        positive = (
            "interval_s",
            "session_idle_s",
            "monitor_interval_s",
            "engine_control_timeout_s",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
        for name in (
            "min_dwell_s",
            "drain_timeout_s",
            "sync_drain_timeout_s",
            "engine_stall_timeout_s",
            "kv_wait_timeout_s",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0")
        if self.workload_scenario is not None:
            from prorsa.workload import SCENARIOS

            if self.workload_scenario not in SCENARIOS:
                raise ConfigError(
                    f"unknown workload scenario {self.workload_scenario!r}",
                    hint=f"one of {sorted(SCENARIOS)}",
                )
        if self.worker_extension_cls is not None:
            _check_importable(self.worker_extension_cls)
        if self.admin_token is not None and not self.admin_token.strip():
            raise ConfigError("admin_token is empty", hint="omit it to leave admin routes open")

    @property
    def model_name(self) -> str:
        """The name clients use for the model."""
        return self.served_model_name or Path(self.model).expanduser().resolve().name

    @classmethod
    def help(cls) -> dict[str, str]:
        """Field name -> help text."""
        return {f.name: f.metadata.get("help", "") for f in fields(cls)}


def _check_importable(dotted: str) -> None:
    """ConfigError unless ``dotted`` names a class in a module this Python can find (the
    engines import it; found here, it fails there only if their environment differs)."""
    module, _, name = dotted.rpartition(".")
    try:
        found = bool(module and name) and importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(
            f"worker_extension_cls {dotted!r}: no module {module or dotted!r} here",
            hint="give module.Class of an installed package (e.g. SkyRL's WorkerWrap)",
        )
