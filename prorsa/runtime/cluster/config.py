"""Configuration of the cluster model both runtimes share. Field help drives the CLI."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields

from prorsa.errors import ConfigError
from prorsa.runtime.cluster.switching import SWITCH_MODES

#: How a prefill engine reuses a trajectory's earlier context it does not cache itself:
#: ``reprefill`` recomputes it (stock vLLM + NIXL: KV moves prefill -> decode only),
#: ``pull`` copies it from the trajectory's decode engine (needs a decode -> prefill
#: connector stock vLLM lacks), ``kv-store`` reads it from a host-DRAM KV store.
REUSE_MODES = ("reprefill", "pull", "kv-store")
ROLE_NAMES = ("prefill", "decode", "colocated")
KV_STORE_SCOPES = ("node", "cluster")


def _help(text: str, **kw: object) -> dict:
    return {"metadata": {"help": text}, **kw}


@dataclass
class ClusterConfig:
    """Cluster shape, engine limits, KV transfer links and role switching."""

    profile: str = field(
        **_help("cost profile name (see `prorsa profile list`)"), default="h200-qwen2.5-7b-tp1"
    )
    num_slots: int = field(
        default=8,
        metadata={
            "help": "GPU groups that switch roles as a unit ('engines' at TP1)",
            "cli": "engines",
        },
    )
    role_tp: dict[str, int] = field(
        default_factory=lambda: {"prefill": 1, "decode": 1, "colocated": 1},
        metadata={
            "help": "tensor-parallel degree per role, e.g. decode=2; a slot has max(role_tp) GPUs"
        },
    )
    max_batch: int | None = field(
        **_help("max running sequences per engine (profile default)"), default=None
    )
    max_step_tokens: int | None = field(
        **_help("token budget per engine step (profile default)"), default=None
    )
    kv_capacity_tokens: int | None = field(
        **_help("KV tokens per engine, per data-parallel rank (profile default)"), default=None
    )
    layouts: dict[str, str] = field(
        default_factory=dict,
        metadata={
            "help": "parallel layout per role from the model's layout tables, e.g. "
            "decode=tp1-dp8-ep8 (`prorsa profile layouts`); engines are then priced per "
            "data-parallel rank; unset roles run tp<role_tp>"
        },
    )
    dp_semantics: str = field(
        **_help("data-parallel attention semantics of layout engines: vllm | sglang"),
        default="vllm",
    )
    moe_routing: str = field(
        **_help("expert load of layout engines: balanced | power_law_1.01 | power_law_1.2"),
        default="balanced",
    )
    dp_attention_ranks: int = field(
        **_help(
            "without layouts: data-parallel ranks of a colocated engine, from one TP "
            "profile scaled per rank (a coarse shortcut; prefer layouts)"
        ),
        default=1,
    )
    request_overhead_s: float = field(
        **_help("front-end latency per request leg (router, RPC, API server)"), default=0.0
    )
    transfer_base_s: float = field(**_help("fixed cost of one KV transfer"), default=0.002)
    transfer_bandwidth_gbytes_per_s: float = field(
        **_help("KV link bandwidth per engine, GB/s"), default=25.0
    )
    link_contention: bool = field(
        **_help("transfers out of one engine share its link (FIFO)"), default=True
    )
    reuse_mode: str = field(
        **_help(
            "earlier context a prefill engine lacks: reprefill (stock vLLM + NIXL) | "
            "pull (copy from the decode engine; non-stock) | kv-store (host-DRAM KV store)"
        ),
        default="reprefill",
    )
    kv_store_gbytes_per_node: float = field(
        **_help("kv-store: host DRAM per node given to the KV store, GB"), default=1000.0
    )
    kv_store_bandwidth_gbytes_per_s: float = field(
        **_help("kv-store: read bandwidth from the store into one engine, GB/s"), default=50.0
    )
    kv_store_scope: str = field(
        **_help("kv-store: node (per-node pools, LMCache-style) | cluster (one shared pool)"),
        default="node",
    )
    local_prefill_threshold: int = field(
        **_help("prefill turns with fewer new tokens on their decode engine"), default=0
    )
    switch_mode: str = field(
        **_help("in-flight work of a switching engine: drain | migrate"), default="drain"
    )
    switch_latency_s: float = field(**_help("role switch latency once drained"), default=2.0)
    reshard_latency_s: float = field(
        **_help("extra latency when the roles' TP differ"), default=20.0
    )
    drain_timeout_s: float = field(
        **_help("drain at most this long, then migrate the rest"), default=60.0
    )
    switch_drops_prefix_cache: bool = field(
        **_help("a switch empties the engine's prefix cache"), default=True
    )

    def __post_init__(self) -> None:
        if self.layouts:
            from prorsa.runtime.sim.cost.layout import Layout

            # Engine GPUs per role follow the layouts (a slot is the largest engine).
            tp = dict(self.role_tp)
            for role, name in self.layouts.items():
                if role in ROLE_NAMES:
                    tp[role] = Layout.parse(name).gpus
            self.role_tp = tp

    @property
    def role_layouts(self) -> dict[str, str]:
        """Layout name per role (``tp<N>`` for roles the layouts leave to ``role_tp``);
        two roles with different names need a reshard to switch between."""
        return {r: self.layouts.get(r, f"tp{self.role_tp.get(r, 1)}") for r in ROLE_NAMES}

    @property
    def model_prefix(self) -> str:
        """``h200-qwen3-30b-a3b`` of profile ``h200-qwen3-30b-a3b-tp1``: what layout
        names are appended to."""
        return re.sub(r"-tp\d+.*$", "", self.profile)

    def validate(self) -> None:
        if self.num_slots < 1:
            raise ConfigError("num_slots must be >= 1 (a cluster needs at least one engine)")
        for role, tp in self.role_tp.items():
            if role not in ("prefill", "decode", "colocated"):
                raise ConfigError(f"role_tp: unknown role '{role}'")
            if tp < 1 or self.slot_gpus % tp:
                raise ConfigError(f"role_tp[{role}]={tp} must be >= 1 and divide {self.slot_gpus}")
        if self.reuse_mode not in REUSE_MODES:
            raise ConfigError(f"reuse_mode must be one of {REUSE_MODES}")
        if self.kv_store_scope not in KV_STORE_SCOPES:
            raise ConfigError(f"kv_store_scope must be one of {KV_STORE_SCOPES}")
        if self.kv_store_gbytes_per_node <= 0 or self.kv_store_bandwidth_gbytes_per_s <= 0:
            raise ConfigError("kv_store_gbytes_per_node and its bandwidth must be > 0")
        if self.switch_mode not in SWITCH_MODES:
            raise ConfigError(f"switch_mode must be one of {SWITCH_MODES}")
        for name in (
            "request_overhead_s",
            "transfer_base_s",
            "switch_latency_s",
            "reshard_latency_s",
            "drain_timeout_s",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0")
        if self.transfer_bandwidth_gbytes_per_s <= 0:
            raise ConfigError("transfer_bandwidth_gbytes_per_s must be > 0")
        if self.dp_attention_ranks < 1:
            raise ConfigError("dp_attention_ranks must be >= 1")
        if self.layouts:
            unknown = set(self.layouts) - set(ROLE_NAMES)
            if unknown:
                raise ConfigError(
                    f"layouts: unknown role(s) {sorted(unknown)}",
                    hint="give layouts for prefill, decode or colocated",
                )
            if self.dp_attention_ranks > 1:
                raise ConfigError(
                    "dp_attention_ranks is the shortcut for TP profiles; with layouts, "
                    "give the colocated layout's data-parallel ranks (e.g. tp1-dp8-ep8)"
                )
        if self.dp_semantics not in ("vllm", "sglang"):
            raise ConfigError("dp_semantics must be vllm or sglang")
        for name in ("max_batch", "max_step_tokens", "kv_capacity_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1")
        if self.local_prefill_threshold < 0:
            raise ConfigError("local_prefill_threshold must be >= 0")

    @property
    def slot_gpus(self) -> int:
        return max(self.role_tp.values())

    @property
    def total_gpus(self) -> int:
        return self.num_slots * self.slot_gpus


def config_help(cls: type) -> dict[str, str]:
    """Field name -> help text of a config dataclass."""
    return {f.name: f.metadata.get("help", "") for f in fields(cls)}
