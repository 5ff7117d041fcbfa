"""RL rollout drivers: how trajectories are launched into the cluster.

* :class:`SyncDriver` — synchronous RL: each step launches ``prompts x n`` trajectories at
  once and ends when the last one finishes (step makespan is the metric).
* :class:`AsyncDriver` — asynchronous RL: keeps ``max_in_flight`` trajectories running,
  starting one whenever one ends; with a staleness bound, generation may run at most
  ``max_staleness`` trainer steps ahead of the trainer (metric: completed per hour).
* :class:`ArrivalDriver` — open loop: each trajectory starts at its own arrival time, e.g.
  a replayed request trace's (:meth:`ArrivalDriver.from_trace`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from prorsa.errors import ConfigError
from prorsa.policy.types import WorkloadShape
from prorsa.runtime.sim.core import PRIORITY_ARRIVAL, Environment
from prorsa.runtime.sim.request import TrajState
from prorsa.workload.spec import TrajectorySpec


@dataclass
class DriverResult:
    """What a driver measured."""

    mode: str
    step_makespans_s: list[float] = field(default_factory=list)
    completed: int = 0
    started: int = 0
    end_s: float = 0.0
    trainer_steps: int = 0


class Driver(ABC):
    """How trajectories enter a simulation, and when the run ends.

    ``total`` is how many trajectories the run completes (an async driver may lower it
    when its stream runs dry); ``result`` is filled as the run goes. ``shape`` is the
    workload's expected shape when known before the run (policies see it in every
    observation), else None.
    """

    mode: str
    total: int
    result: DriverResult
    shape: WorkloadShape | None = None

    @abstractmethod
    def start(self, env: Environment, launch: Callable[[TrajectorySpec], TrajState]) -> None:
        """Schedule the first launches; ``launch(spec)`` starts a trajectory now."""

    @abstractmethod
    def on_done(self, traj: TrajState) -> None:
        """A trajectory finished."""

    def known_specs(self) -> Sequence[Sequence[TrajectorySpec]]:
        """Batches of specs known before the run (for up-front capacity checks)."""
        return ()


class SyncDriver(Driver):
    """Run ``steps`` synchronous rollout steps; each takes the next batch of specs."""

    mode = "sync"

    def __init__(self, batches: Sequence[Sequence[TrajectorySpec]]) -> None:
        if not batches or any(len(b) == 0 for b in batches):
            raise ConfigError("sync driver needs at least one non-empty batch")
        self.batches = batches
        self.result = DriverResult(mode="sync")
        self.total = sum(len(b) for b in batches)

    def known_specs(self) -> Sequence[Sequence[TrajectorySpec]]:
        return self.batches

    def start(self, env: Environment, launch: Callable[[TrajectorySpec], TrajState]) -> None:
        self.env = env
        self.launch = launch
        self._step = -1
        self._next_step()

    def _next_step(self) -> None:
        self._step += 1
        if self._step == len(self.batches):
            self.result.end_s = self.env.now
            self.env.stop()
            return
        self._step_start = self.env.now
        batch = self.batches[self._step]
        self._left = len(batch)
        for spec in batch:
            self.result.started += 1
            self.launch(spec)

    def on_done(self, traj: TrajState) -> None:
        self.result.completed += 1
        self._left -= 1
        if self._left == 0:
            self.result.step_makespans_s.append(self.env.now - self._step_start)
            self.env.schedule(self.env.now, self._next_step, priority=PRIORITY_ARRIVAL)


class AsyncDriver(Driver):
    """Keep ``max_in_flight`` trajectories running until ``total`` have completed.

    ``batch_size`` and ``train_step_s`` model the trainer consuming completed
    trajectories; ``max_staleness`` (trainer steps) bounds how far generation may run ahead
    (``None``: unbounded, the trainer is never waited for).
    """

    mode = "async"

    def __init__(
        self,
        specs: Iterator[TrajectorySpec],
        *,
        total: int,
        max_in_flight: int,
        batch_size: int | None = None,
        train_step_s: float = 0.0,
        max_staleness: int | None = None,
    ) -> None:
        if total < 1 or max_in_flight < 1:
            raise ConfigError("async driver needs total >= 1 and max_in_flight >= 1")
        if max_staleness is not None and (max_staleness < 0 or not batch_size):
            raise ConfigError("a staleness bound needs batch_size and max_staleness >= 0")
        self.specs = specs
        self.total = total
        self.max_in_flight = max_in_flight
        self.batch_size = batch_size
        self.train_step_s = train_step_s
        self.max_staleness = max_staleness
        self.result = DriverResult(mode="async")
        self._in_flight = 0
        self._ready_for_training = 0
        self._training = False

    def start(self, env: Environment, launch: Callable[[TrajectorySpec], TrajState]) -> None:
        self.env = env
        self.launch = launch
        self._fill()

    def _allowed_to_start(self) -> bool:
        if self.result.started >= self.total or self._in_flight >= self.max_in_flight:
            return False
        if self.max_staleness is None:
            return True
        limit = (self.result.trainer_steps + self.max_staleness + 1) * self.batch_size
        return self.result.started < limit

    def _fill(self) -> None:
        while self._allowed_to_start():
            try:
                spec = next(self.specs)
            except StopIteration:
                self.total = self.result.started
                break
            self.result.started += 1
            self._in_flight += 1
            self.launch(spec)

    def on_done(self, traj: TrajState) -> None:
        self.result.completed += 1
        self._in_flight -= 1
        if self.batch_size:
            self._ready_for_training += 1
            self._maybe_train()
        if self.result.completed >= self.total:
            self.result.end_s = self.env.now
            self.env.stop()
            return
        self._fill()

    def _maybe_train(self) -> None:
        if self._training or self._ready_for_training < self.batch_size:
            return
        self._ready_for_training -= self.batch_size
        self._training = True
        self.env.schedule(
            self.env.now + self.train_step_s, self._trained, priority=PRIORITY_ARRIVAL
        )

    def _trained(self) -> None:
        self._training = False
        self.result.trainer_steps += 1
        self._maybe_train()
        self._fill()


class ArrivalDriver(Driver):
    """Open-loop arrivals: trajectory ``i`` starts at ``arrival_s[i]`` (e.g. a replayed
    request trace such as Azure's). The run ends when all have completed."""

    mode = "sync"

    def __init__(self, specs: Sequence[TrajectorySpec], arrival_s: Sequence[float]) -> None:
        if len(specs) != len(arrival_s) or not specs:
            raise ConfigError("arrival driver needs one arrival time per spec (and at least one)")
        if any(t < 0 for t in arrival_s):
            raise ConfigError("arrival times must be >= 0")
        self.specs = specs
        self.arrival_s = arrival_s
        self.total = len(specs)
        self.result = DriverResult(mode="sync")

    @classmethod
    def from_trace(cls, trace: Any) -> ArrivalDriver:
        """Every trajectory of ``trace`` (an event table or a telemetry path), each started
        at the time it arrived in the trace (seconds from the trace's first event)."""
        from prorsa.workload.replay import arrivals_from_trace

        replay = arrivals_from_trace(trace)
        return cls(_unique_ids(replay.specs), [float(t) for t in replay.arrival_s])

    def known_specs(self) -> Sequence[Sequence[TrajectorySpec]]:
        return [self.specs]

    def start(self, env: Environment, launch: Callable[[TrajectorySpec], TrajState]) -> None:
        self.env = env
        for spec, t in zip(self.specs, self.arrival_s, strict=True):
            env.schedule(t, self._launch, spec, launch, priority=PRIORITY_ARRIVAL)

    def _launch(self, spec: TrajectorySpec, launch: Callable[[TrajectorySpec], TrajState]) -> None:
        self.result.started += 1
        launch(spec)

    def on_done(self, traj: TrajState) -> None:
        self.result.completed += 1
        if self.result.completed == self.total:
            self.result.end_s = self.env.now
            self.result.step_makespans_s.append(self.env.now)
            self.env.stop()


def _unique_ids(specs: list[TrajectorySpec]) -> list[TrajectorySpec]:
    """``specs`` with an id two runs of one trace share qualified by its run
    (``id@run``): the cluster tracks live trajectories by id."""
    counts = Counter(s.trajectory_id for s in specs)
    if max(counts.values(), default=0) <= 1:
        return specs
    return [
        replace(s, trajectory_id=f"{s.trajectory_id}@{s.meta.get('run_id', i)}")
        if counts[s.trajectory_id] > 1
        else s
        for i, s in enumerate(specs)
    ]
