"""The oracle's typed ground-truth port: the future of live trajectories, simulation only.

A simulation knows every trajectory's spec before it runs; the oracle forecaster is given
this port (never the observation, never the cluster object) and asks it for the specs of
the trajectories it tracks. Real runtimes have no such port.
"""

from __future__ import annotations

from typing import Protocol

from prorsa.workload.spec import TrajectorySpec


class GroundTruth(Protocol):
    """Answers what the future of a live trajectory is."""

    def spec(self, trajectory_id: str) -> TrajectorySpec | None:
        """The full spec of a live trajectory, or None when it is not live."""
        ...


class LiveSpecs:
    """The specs of the trajectories live in a simulation (the simulator keeps it current)."""

    __slots__ = ("_specs",)

    def __init__(self) -> None:
        self._specs: dict[str, TrajectorySpec] = {}

    def add(self, spec: TrajectorySpec) -> None:
        self._specs[spec.trajectory_id] = spec

    def remove(self, trajectory_id: str) -> None:
        self._specs.pop(trajectory_id, None)

    def spec(self, trajectory_id: str) -> TrajectorySpec | None:
        return self._specs.get(trajectory_id)

    def __len__(self) -> int:
        return len(self._specs)
