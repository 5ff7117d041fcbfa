"""Start-up both runtimes share: the policy's first allocation and the control loop.

A run starts with every slot idle; the policy's first decision on that idle cluster sets
the slots' roles for free (no switch), then a :class:`~prorsa.runtime.controller.Controller`
takes over for dynamic policies. The simulator and the Ray runtime both start this way.
"""

from __future__ import annotations

from collections.abc import Sequence

from prorsa.policy.base import ClusterSpec, Policy
from prorsa.policy.types import ROLES, Allocation, ClusterObservation, SlotView, WorkloadShape
from prorsa.runtime.cluster.observation import TrajectoryStates, build_observation
from prorsa.runtime.controller import (
    Actuator,
    Clock,
    Controller,
    ForecastSource,
    roles_for_allocation,
)


def idle_observation(
    spec: ClusterSpec,
    *,
    engines_per_slot: int,
    kv_capacity_per_slot: int,
    total_trajectories: int | None,
    local_prefill_threshold: int = 0,
    workload: WorkloadShape | None = None,
) -> ClusterObservation:
    """An all-colocated cluster with nothing running, at time 0 (``workload``: the run's
    expected shape, when known)."""
    slots = [
        SlotView(
            slot_id=i,
            role="colocated",
            target_role=None,
            gpus=spec.slot_gpus,
            engines=engines_per_slot,
            queued_prefill_tokens=0,
            running_sequences=0,
            kv_used_tokens=0,
            kv_capacity_tokens=kv_capacity_per_slot,
            busy=False,
            since_s=0.0,
        )
        for i in range(spec.num_slots)
    ]
    return build_observation(
        0.0,
        slots,
        TrajectoryStates(),
        spec,
        completed=0,
        total=total_trajectories,
        local_prefill_threshold=local_prefill_threshold,
        workload=workload,
    )


def first_allocation(
    policy: Policy, spec: ClusterSpec, idle: ClusterObservation
) -> tuple[list[str], Allocation]:
    """Roles per slot from the policy's first decision on the idle cluster (and the decision)."""
    first = policy.decide(idle, None)
    return roles_for_allocation(first, spec.num_slots, spec.slot_gpus), first


def note_start(actuator: Actuator, roles: Sequence[str], slot_gpus: int) -> None:
    """Record the starting allocation (GPUs by role, reason ``start``) in the run's telemetry.

    Both runtimes do this once, before any work: it makes a saved table say how many GPUs
    served it, which the forecasters' per-GPU load features read.
    """
    gpus = dict.fromkeys(ROLES, 0)
    for role in roles:
        gpus[role] = gpus.get(role, 0) + slot_gpus
    actuator.note_allocation(gpus, "start")


def make_controller(
    policy: Policy,
    actuator: Actuator,
    clock: Clock,
    *,
    interval_s: float,
    min_dwell_s: float,
    forecaster: ForecastSource | None = None,
    keep_forecasts: bool = False,
    keep_running: bool = False,
) -> Controller | None:
    """The control loop for a dynamic policy (None for a fixed allocation: it never ticks;
    ``keep_running``: see :class:`Controller`)."""
    if not policy.dynamic:
        return None
    return Controller(
        policy,
        actuator,
        clock,
        interval_s=interval_s,
        min_dwell_s=min_dwell_s,
        forecaster=forecaster,
        keep_forecasts=keep_forecasts,
        keep_running=keep_running,
    )
