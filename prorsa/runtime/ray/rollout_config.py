"""What one real rollout runs: engines, policy, workload, tools. Help text drives the CLI."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from prorsa.errors import ConfigError
from prorsa.runtime.ray.tools import TOOL_NAMES


def _help(text: str, **kw: object) -> dict:
    return {"metadata": {"help": text}, **kw}


@dataclass
class RolloutConfig:
    """A rollout on real engines: ``engines`` vLLM replicas driven by ``policy``."""

    model: str = field(**_help("Model folder (loaded offline)."))
    engines: int = field(default=3, **_help("Engines (one slot each)."))
    policy: str = field(default="colocate", **_help("Allocation policy (`prorsa policies`)."))
    policy_params: dict[str, object] = field(
        default_factory=dict, **_help("Policy parameters (key=value).")
    )
    forecaster: str | None = field(
        default=None, **_help("Forecast provider for predictive / mpc policies.")
    )
    scenario: str = field(default="math-tool", **_help("Workload scenario to sample specs from."))
    trajectories: int = field(default=8, **_help("Trajectories (sync: one step; async: total)."))
    group_size: int = field(default=4, **_help("GRPO samples per prompt (they share it)."))
    mode: str = field(default="sync", **_help("sync: all at once | async: keep --in-flight."))
    max_in_flight: int = field(default=8, **_help("Async: trajectories kept running."))
    max_tokens: int | None = field(default=64, **_help("Cap on output tokens per turn."))
    max_turns: int | None = field(default=None, **_help("Cap on turns per trajectory."))
    max_model_len: int = field(default=1024, **_help("Engine context length in tokens."))
    max_num_seqs: int = field(default=16, **_help("Engine max running sequences."))
    kv_cache_gib: float | None = field(
        default=None, **_help("KV cache per engine, GiB (None: 0.25 on CPU, vLLM's on GPU).")
    )
    connector: str = field(default="auto", **_help("KV connector: auto | nixl | example."))
    tool_time_scale: float = field(
        default=0.1, **_help("Multiply the scenario's tool latencies (short CPU runs).")
    )
    tools: tuple[str, ...] = field(default=TOOL_NAMES, **_help("Tools the agent may call."))
    pad_tool_latency: bool = field(
        default=True, **_help("Each tool call lasts at least its (scaled) spec latency.")
    )
    interval_s: float = field(default=0.5, **_help("Control loop period, seconds."))
    min_dwell_s: float = field(default=5.0, **_help("Minimum time between switches of one engine."))
    drain_timeout_s: float = field(default=5.0, **_help("Drain time of a switch before aborts."))
    local_prefill_threshold: int = field(
        default=0, **_help("Prefill smaller turns on their decode engine.")
    )
    profile: str | None = field(
        default=None,
        **_help("Cost profile for the policy's throughput numbers (default: the CPU fit)."),
    )
    switch_latency_s: float = field(
        default=0.1,
        **_help("Switch latency policies assume (no restart here: pause, reset, resume)."),
    )
    monitor_interval_s: float = field(default=0.25, **_help("Engine load polling period."))
    seed: int = field(default=0, **_help("Seeds the specs, tool plans and engines."))
    run_id: str = field(default="rollout", **_help("Telemetry run id."))

    def validate(self) -> None:
        """Raise :class:`ConfigError` for settings that cannot work."""
        if self.engines < 1:
            raise ConfigError("a rollout needs at least one engine")
        if self.mode not in ("sync", "async"):
            raise ConfigError(f"mode must be sync or async, not {self.mode!r}")
        if self.trajectories < 1 or self.group_size < 1 or self.max_in_flight < 1:
            raise ConfigError("trajectories, group_size and max_in_flight must be >= 1")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConfigError("max_tokens must be >= 1")
        if self.max_turns is not None and self.max_turns < 1:
            raise ConfigError("max_turns must be >= 1")
        if self.tool_time_scale < 0:
            raise ConfigError("tool_time_scale must be >= 0")
        if self.interval_s <= 0 or self.min_dwell_s < 0 or self.drain_timeout_s < 0:
            raise ConfigError("interval_s must be > 0; min_dwell_s, drain_timeout_s >= 0")
        unknown = set(self.tools) - set(TOOL_NAMES)
        if unknown or not self.tools:
            raise ConfigError(
                f"unknown or no tools: {sorted(unknown)}", hint=f"choose from {TOOL_NAMES}"
            )

    @classmethod
    def help(cls) -> dict[str, str]:
        """Field name -> help text."""
        return {f.name: f.metadata.get("help", "") for f in fields(cls)}
