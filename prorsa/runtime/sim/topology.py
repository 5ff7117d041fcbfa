"""Slots of GPUs and the engines they host in the simulated cluster.

A *slot* is the unit of role switching: ``max(role_tp)`` GPUs that change role together
and host ``gpus // tp`` engines of the role's tensor-parallel degree (one engine of
``ranks x tp`` GPUs when colocated engines use data-parallel attention).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prorsa.errors import CapacityError, ConfigError
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.sim.core import Environment
from prorsa.runtime.sim.dp_engine import DpSimEngine, LayoutStepCosts
from prorsa.runtime.sim.engine import EngineEvents, SimEngine, StepCosts

if TYPE_CHECKING:
    from prorsa.workload.spec import TrajectorySpec


class Slot:
    """``gpus`` GPUs that change role together, hosting ``gpus // tp`` engines."""

    __slots__ = (
        "engines",
        "gpus",
        "history",
        "role",
        "since_s",
        "slot_id",
        "switch",
        "target_role",
    )

    def __init__(self, slot_id: int, gpus: int, role: str) -> None:
        self.slot_id = slot_id
        self.gpus = gpus
        self.role = role
        self.target_role: str | None = None
        self.since_s = 0.0
        self.engines: list[SimEngine] = []
        self.switch = None  # the RoleSwitch in progress, if any
        self.history: list[tuple[float, str]] = [(0.0, role)]


def sequence_kv_capacity(config: ClusterConfig, profiles: dict) -> int:
    """The most KV one sequence may hold on any engine the cluster may build, in any
    role (a role switch builds the others later): one data-parallel rank's share, as a
    sequence lives on one rank. A trajectory over it cannot run on this cluster."""
    if config.layouts:
        costs = [profiles[name] for name in config.role_layouts.values()]
    else:
        costs = [profiles[tp] for tp in config.role_tp.values() if tp in profiles]
    return min(config.kv_capacity_tokens or cost.kv_capacity_tokens for cost in costs)


CAPACITY_HINT = "use a profile with more memory per engine, a higher TP, or shorter contexts"


def check_fits(spec: TrajectorySpec, capacity_tokens: int) -> None:
    """CapacityError if ``spec``'s context outgrows ``capacity_tokens``, the most one
    sequence may hold (:func:`sequence_kv_capacity`)."""
    need = spec.final_context_tokens
    if need > capacity_tokens:
        raise CapacityError(
            f"trajectory {spec.trajectory_id} reaches {need} tokens of context but an "
            f"engine holds only {capacity_tokens} KV tokens for one sequence",
            hint=CAPACITY_HINT,
        )


def build_engines(
    slot: Slot,
    config: ClusterConfig,
    profiles: dict[int, object],
    env: Environment,
    events: EngineEvents,
) -> list[SimEngine]:
    """The engines ``slot`` hosts in its current role (fresh: empty caches, no work)."""
    if config.layouts:
        return _layout_engines(slot, config, profiles, env, events)
    tp = config.role_tp[slot.role]
    profile = profiles[tp]
    ranks = 1
    if slot.role == "colocated" and config.dp_attention_ranks > 1:
        ranks = config.dp_attention_ranks
        if slot.gpus != ranks * tp:
            raise ConfigError(
                f"dp_attention_ranks={ranks} needs slots of ranks x tp = {ranks * tp} GPUs "
                f"(slots have {slot.gpus}); set role_tp so max(role_tp) matches"
            )
    costs = StepCosts(profile, ranks)
    kv = (config.kv_capacity_tokens or profile.kv_capacity_tokens) * ranks
    batch = (config.max_batch or profile.max_batch) * ranks
    budget = config.max_step_tokens or profile.max_step_tokens
    engines = [
        SimEngine(
            env,
            events,
            slot.slot_id * slot.gpus + i * tp * ranks,
            slot.slot_id,
            slot.role,
            tp * ranks,
            costs,
            kv,
            batch,
            budget,
        )
        for i in range(slot.gpus // (tp * ranks))
    ]
    for engine in engines:
        engine.kv_bytes_per_token = profile.kv_bytes_per_token
        engine.seq_kv_capacity = kv // ranks  # a sequence lives on one rank
    return engines


def _layout_engines(
    slot: Slot,
    config: ClusterConfig,
    costs: dict[str, object],
    env: Environment,
    events: EngineEvents,
) -> list[SimEngine]:
    """Engines of the role's layout, priced per data-parallel rank."""
    cost = costs[config.role_layouts[slot.role]]
    step_costs = LayoutStepCosts(cost)
    ranks = cost.dp_ranks
    kv = (config.kv_capacity_tokens or cost.kv_capacity_tokens) * ranks
    engines = [
        DpSimEngine(
            env,
            events,
            slot.slot_id * slot.gpus + i * cost.gpus,
            slot.slot_id,
            slot.role,
            cost.gpus,
            step_costs,
            kv,
        )
        for i in range(slot.gpus // cost.gpus)
    ]
    for engine in engines:
        # A sequence's KV lives on one rank, sharded over its tp GPUs.
        engine.kv_bytes_per_token = cost.kv_bytes_per_token * cost.tp
    return engines
