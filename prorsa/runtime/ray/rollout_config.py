"""What one real rollout runs: the shared workload, cluster and control configurations plus
the settings only real engines have (model folder, backend, connector, tools...).

The workload (:class:`~prorsa.workload.config.WorkloadConfig`), the cluster
(:class:`~prorsa.runtime.cluster.config.ClusterConfig`) and the control loop
(:class:`~prorsa.runtime.cluster.control.ControlConfig`) are the simulator's own classes
with their own defaults, so a rollout and a simulation given the same options describe
the same run. Field help drives the CLI.

Not every simulator setting exists on real engines: one engine is one slot (TP1 engines,
no data-parallel layouts), a switch drains and then re-routes what is left (no
migration), prefill engines re-prefill earlier context (stock vLLM + NIXL), and specs are
sampled from a scenario in one sync step or one async stream. :meth:`RolloutConfig.validate`
refuses the others instead of ignoring them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from prorsa.errors import ConfigError
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.cluster.control import ControlConfig
from prorsa.runtime.ray.tools import TOOL_NAMES
from prorsa.workload.config import WorkloadConfig

BACKENDS = ("ray-vllm",)
CONNECTORS = ("auto", "nixl", "example")
#: The sub-configurations a rollout composes, by attribute name.
PARTS = ("work", "cluster", "control")

#: Fields of the shared configs the real runtime cannot honour; left out of `prorsa
#: rollout`'s options and refused by :meth:`RolloutConfig.validate` when changed.
SIMULATOR_ONLY: tuple[str, ...] = (
    "work.trace",
    "work.steps",
    "work.max_staleness",
    "work.train_step_s",
    "cluster.role_tp",
    "cluster.layouts",
    "cluster.dp_semantics",
    "cluster.moe_routing",
    "cluster.dp_attention_ranks",
    "cluster.max_step_tokens",
    "cluster.kv_capacity_tokens",
    "cluster.request_overhead_s",
    "cluster.transfer_base_s",
    "cluster.transfer_bandwidth_gbytes_per_s",
    "cluster.link_contention",
    "cluster.reuse_mode",
    "cluster.kv_store_gbytes_per_node",
    "cluster.kv_store_bandwidth_gbytes_per_s",
    "cluster.kv_store_scope",
    "cluster.switch_mode",
    "cluster.reshard_latency_s",
    "cluster.switch_drops_prefix_cache",
)


def _help(text: str, **kw: object) -> dict:
    return {"metadata": {"help": text}, **kw}


@dataclass
class RolloutConfig:
    """A rollout on real engines: ``cluster.num_slots`` vLLM replicas driven by
    ``control.policy`` through the workload ``work``."""

    model: str = field(**_help("model folder, loaded offline (`prorsa models make-tiny`)"))
    work: WorkloadConfig = field(
        default_factory=WorkloadConfig, **_help("what to roll out (scenario, mode, counts)")
    )
    cluster: ClusterConfig = field(
        default_factory=ClusterConfig,
        **_help("engines, the cost profile the policy sizes with, switch settings"),
    )
    control: ControlConfig = field(
        default_factory=ControlConfig, **_help("policy, forecaster and control timing")
    )
    backend: str = field(default="ray-vllm", **_help("engine backend: ray-vllm"))
    max_tokens: int | None = field(default=64, **_help("cap on output tokens per turn"))
    max_turns: int | None = field(default=None, **_help("cap on turns per trajectory"))
    max_model_len: int = field(default=1024, **_help("engine context length in tokens"))
    kv_cache_gib: float | None = field(
        default=None, **_help("KV cache per engine, GiB (default: 0.25 on CPU, vLLM's on GPU)")
    )
    connector: str = field(default="auto", **_help("KV connector: auto | nixl | example"))
    tool_time_scale: float = field(
        default=0.1, **_help("multiply the scenario's tool latencies (short CPU runs)")
    )
    tools: tuple[str, ...] = field(default=TOOL_NAMES, **_help("tools the agent may call"))
    pad_tool_latency: bool = field(
        default=True, **_help("each tool call lasts at least its (scaled) spec latency")
    )
    monitor_interval_s: float = field(default=0.25, **_help("engine load polling period, s"))
    engine_stall_timeout_s: float = field(
        default=120.0,
        **_help(
            "an engine that holds requests and takes no step, or answers no load poll, for "
            "this long leaves service and its turns go on elsewhere (a hung GPU fails no "
            "call); 0: off"
        ),
    )
    run_id: str = field(default="rollout", **_help("telemetry run id"))
    freeze_startup_heap: bool = field(
        default=True,
        **_help(
            "keep the start-up heaps of the driver and the engine actors out of Python's full "
            "garbage collections while trajectories run (prorsa.runtime.gc_heap)"
        ),
    )

    # ------------------------------------------------------------------ derived
    @property
    def engines(self) -> int:
        """Engines to run: one per slot."""
        return self.cluster.num_slots

    @property
    def max_num_seqs(self) -> int:
        """vLLM's ``max_num_seqs`` per engine: ``cluster.max_batch``, else the cost
        profile's batch limit (what the policy's throughput numbers assume)."""
        if self.cluster.max_batch is not None:
            return self.cluster.max_batch
        from prorsa.runtime.ray import cpu_profile  # noqa: F401  (registers the CPU fit)
        from prorsa.runtime.sim.cost import get_profile

        return int(get_profile(self.cluster.profile).max_batch)

    # ------------------------------------------------------------------ changes
    @classmethod
    def of(cls, model: str, **settings: Any) -> RolloutConfig:
        """A config from flat field names (``engines=3, policy="static", interval_s=0.1``),
        each set on the part that owns it (see :meth:`with_changes`)."""
        return cls(model=model).with_changes(**settings)

    def with_changes(self, **settings: Any) -> RolloutConfig:
        """A copy with fields changed by flat name: a field of this class, of ``work``,
        ``cluster`` or ``control`` (or its CLI name, e.g. ``engines`` for
        ``cluster.num_slots``). Raises :class:`ConfigError` for an unknown name."""
        owners = _flat_fields()
        own: dict[str, Any] = {}
        parts: dict[str, dict[str, Any]] = {part: {} for part in PARTS}
        for name, value in settings.items():
            if name in {f.name for f in dataclasses.fields(self)}:
                own[name] = value
            elif name in owners:
                part, field_name = owners[name]
                parts[part][field_name] = value
            else:
                raise ConfigError(
                    f"a rollout has no setting '{name}'",
                    hint="settings are the fields of RolloutConfig, WorkloadConfig, "
                    "ClusterConfig and ControlConfig",
                )
        for part, changes in parts.items():
            if changes and part not in own:
                own[part] = dataclasses.replace(getattr(self, part), **changes)
            elif changes:
                own[part] = dataclasses.replace(own[part], **changes)
        return dataclasses.replace(self, **own)

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise :class:`ConfigError` for settings that cannot work on real engines.

        Policy parameters are checked against the policy's declared parameters and
        replaced by their checked values (ints widened to floats where declared).
        """
        from prorsa.policy.params import (
            check_count,
            check_interval_s,
            check_policy_params,
            check_positive,
        )

        if not self.model:
            raise ConfigError("a rollout needs a model folder", hint="pass --model DIR")
        if self.backend not in BACKENDS:
            raise ConfigError(f"unknown backend {self.backend!r}", hint=f"choose from {BACKENDS}")
        if self.work.scenario is None:
            raise ConfigError(
                "a real rollout samples a scenario; trace replay runs in the simulator",
                hint="pass --scenario NAME, or replay the trace with `prorsa simulate --trace`",
            )
        self.work.validate()
        self.cluster.validate()
        self.control.validate()
        self._check_simulator_only()
        self.control.policy_params = check_policy_params(
            self.control.policy, self.control.policy_params
        )
        check_interval_s(self.control.interval_s, "interval_s")
        check_interval_s(self.monitor_interval_s, "monitor_interval_s")
        check_positive(self.engine_stall_timeout_s, "engine_stall_timeout_s", allow_zero=True)
        check_positive(self.control.min_dwell_s, "min_dwell_s", allow_zero=True)
        check_positive(self.cluster.drain_timeout_s, "drain_timeout_s", allow_zero=True)
        check_positive(self.cluster.switch_latency_s, "switch_latency_s", allow_zero=True)
        check_positive(self.tool_time_scale, "tool_time_scale", allow_zero=True)
        for name in ("trajectories", "group_size", "max_in_flight"):
            check_count(getattr(self.work, name), name)
        check_count(self.max_model_len, "max_model_len", minimum=16)
        for name in ("max_tokens", "max_turns"):
            if getattr(self, name) is not None:
                check_count(getattr(self, name), name)
        if self.kv_cache_gib is not None:
            check_positive(self.kv_cache_gib, "kv_cache_gib")
        if self.connector not in CONNECTORS:
            raise ConfigError(
                f"unknown connector {self.connector!r}", hint=f"choose from {CONNECTORS}"
            )
        unknown = set(self.tools) - set(TOOL_NAMES)
        if unknown or not self.tools:
            raise ConfigError(
                f"unknown or no tools: {sorted(unknown)}", hint=f"choose from {TOOL_NAMES}"
            )

    def _check_simulator_only(self) -> None:
        defaults = {"work": WorkloadConfig(), "cluster": ClusterConfig()}
        for dotted in SIMULATOR_ONLY:
            part, name = dotted.split(".")
            if getattr(getattr(self, part), name) != getattr(defaults[part], name):
                raise ConfigError(
                    f"{dotted} is a simulator setting the real runtime does not have",
                    hint="one engine is one TP1 slot; switches drain then re-route; "
                    "leave it at its default or run `prorsa simulate`",
                )


def _flat_fields() -> dict[str, tuple[str, str]]:
    """Flat name (field name or CLI name) -> (part, field name) over the composed configs."""
    owners: dict[str, tuple[str, str]] = {}
    for part, cls in zip(PARTS, (WorkloadConfig, ClusterConfig, ControlConfig), strict=True):
        for f in dataclasses.fields(cls):
            owners[f.name] = (part, f.name)
            cli = f.metadata.get("cli")
            if cli:
                owners[cli.replace("-", "_")] = (part, f.name)
    return owners
