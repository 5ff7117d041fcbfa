"""Build drivers from a scenario (shipped profile) or a replayed trace, and run one
simulation end to end — the library behind `prorsa simulate` and `prorsa compare`."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from prorsa.errors import ConfigError
from prorsa.policy import make_policy
from prorsa.policy.types import WorkloadShape
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.cluster.control import ControlConfig
from prorsa.runtime.sim.drivers import AsyncDriver, SyncDriver
from prorsa.runtime.sim.simulation import Simulation, SimulationResult
from prorsa.workload import get_scenario, specs_from_trace
from prorsa.workload.config import WorkloadConfig
from prorsa.workload.shape import scenario_shape, shape_of, trace_shape
from prorsa.workload.spec import TrajectorySpec

__all__ = ["ControlConfig", "RunRequest", "WorkloadConfig", "build_driver", "simulate"]


def _spec_stream(work: WorkloadConfig) -> tuple[list[TrajectorySpec] | None, object]:
    if work.trace is not None:
        path = Path(work.trace)
        if not path.exists():
            raise ConfigError(f"trace not found: {path}")
        return specs_from_trace(os.fspath(path)), None
    return None, get_scenario(work.scenario)


def build_driver(work: WorkloadConfig) -> SyncDriver | AsyncDriver:
    """Sync steps of ``trajectories`` specs, or an async stream; replayed traces cycle.
    The driver carries the workload's expected shape (:func:`reference_shape`)."""
    work.validate()
    replay, profile = _spec_stream(work)
    driver = _build_driver(work, replay, profile)
    driver.shape = shape_of(replay) if replay is not None else scenario_shape(work.scenario)
    return driver


def reference_shape(work: WorkloadConfig) -> WorkloadShape:
    """What ``work``'s trajectories look like on average, known before the run: the
    scenario's reference sample (:func:`~prorsa.workload.shape.scenario_shape`, never the
    run's own batch) or the replayed trace's means."""
    if work.trace is not None:
        return trace_shape(work.trace)
    return scenario_shape(work.scenario)


def _build_driver(
    work: WorkloadConfig, replay: list[TrajectorySpec] | None, profile
) -> SyncDriver | AsyncDriver:
    if work.mode == "sync":
        batches = []
        for step in range(work.steps):
            if replay is not None:
                batches.append(_replay_batch(replay, work.trajectories, step, work.seed))
            else:
                batches.append(
                    profile.sample(
                        work.trajectories,
                        work.seed * 1000 + step,
                        group_size=work.group_size,
                        id_prefix=f"{profile.name}-s{work.seed}-step{step}",
                    )
                )
        return SyncDriver(batches)
    if replay is not None:
        stream = (
            _renamed(replay[j], i) for i, j in enumerate(_replay_stream(len(replay), work.seed))
        )
    else:
        stream = _profile_stream(profile, work)
    return AsyncDriver(
        stream,
        total=work.trajectories,
        max_in_flight=work.max_in_flight,
        batch_size=work.group_size * 4 if work.max_staleness is not None else None,
        train_step_s=work.train_step_s,
        max_staleness=work.max_staleness,
    )


def _profile_stream(profile, work: WorkloadConfig):
    chunk = max(work.group_size * 16, 64)
    for block in itertools.count():
        yield from profile.sample(
            chunk,
            work.seed * 100_003 + block,
            group_size=work.group_size,
            id_prefix=f"{profile.name}-s{work.seed}-b{block}",
        )


def _renamed(spec: TrajectorySpec, i: int) -> TrajectorySpec:
    return TrajectorySpec(
        trajectory_id=f"{spec.trajectory_id}#{i}",
        new_tokens=spec.new_tokens,
        output_tokens=spec.output_tokens,
        tool_latency_s=spec.tool_latency_s,
        group_id=spec.group_id,
        task=spec.task,
        shared_prompt_tokens=spec.shared_prompt_tokens,
    )


def _replay_batch(
    replay: list[TrajectorySpec], n: int, step: int, seed: int
) -> list[TrajectorySpec]:
    """``n`` replayed trajectories: seed 0 takes the trace in its recorded order
    (repeating it when it holds fewer); any other seed draws them with replacement, so
    that runs on other seeds are other samples of the trace's trajectories (a replay
    whose every seed were the same run would show no seed-to-seed spread at all)."""
    if seed == 0:
        picks = [i % len(replay) for i in range(n)]
    else:
        picks = np.random.default_rng([seed, step]).integers(0, len(replay), n).tolist()
    return [_renamed(replay[j], step * n + i) for i, j in enumerate(picks)]


def _replay_stream(size: int, seed: int) -> Iterator[int]:
    """Indices of an async replay: the trace in order, cycling (seed 0), or an endless
    draw with replacement (any other seed; see :func:`_replay_batch`)."""
    if seed == 0:
        yield from itertools.cycle(range(size))
        return
    rng = np.random.default_rng([seed])
    while True:
        yield from rng.integers(0, size, 1024).tolist()


@dataclass
class RunRequest:
    """One simulation: workload x cluster x control loop."""

    work: WorkloadConfig
    cluster: ClusterConfig
    control: ControlConfig = field(default_factory=ControlConfig)
    record: bool = True
    run_id: str = "sim"

    def validate(self) -> None:
        self.work.validate()
        self.cluster.validate()
        self.control.validate()


def simulate(
    request: RunRequest,
    *,
    progress=None,
    forecaster_obj=None,
    keep_forecasts: bool = False,
    driver=None,
) -> SimulationResult:
    """Run one simulation described by ``request`` (``keep_forecasts``: store each tick's
    forecast in the decisions, for plots; ``driver``: start trajectories with this driver,
    e.g. an ``ArrivalDriver`` replaying a trace's arrival times, instead of the one
    ``request.work`` describes)."""
    sim = build_simulation(
        request, forecaster_obj=forecaster_obj, keep_forecasts=keep_forecasts, driver=driver
    )
    return sim.run(progress=progress)


def build_simulation(
    request: RunRequest,
    *,
    forecaster_obj=None,
    keep_forecasts: bool = False,
    driver=None,
) -> Simulation:
    """The :class:`Simulation` :func:`simulate` runs, for callers that keep hold of it
    (to save what a run that stops part-way recorded)."""
    request.validate()
    control = request.control
    driver = driver if driver is not None else build_driver(request.work)
    policy = make_policy(control.policy, **control.policy_params)
    forecaster = forecaster_obj
    # Some policies are defined by their forecaster (the oracle policy is MPC + oracle).
    name = getattr(policy, "forecaster_name", None) or control.forecaster
    if forecaster is None and name is not None and (policy.needs_forecast or control.forecaster):
        from prorsa.runtime.forecast_provider import make_provider

        forecaster = make_provider(name)
    return Simulation(
        request.cluster,
        policy,
        driver,
        forecaster=forecaster,
        interval_s=control.interval_s,
        min_dwell_s=control.min_dwell_s,
        seed=request.work.seed,
        run_id=request.run_id,
        record=request.record,
        keep_forecasts=keep_forecasts,
    )
