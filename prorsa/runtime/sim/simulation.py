"""Assemble and run one simulation: cluster + driver + policy (+ controller, forecaster)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa

from prorsa.errors import ConfigError
from prorsa.policy.base import ClusterSpec, Policy
from prorsa.policy.types import ClusterObservation, WorkloadShape
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.cluster.spec import cluster_spec, load_profiles
from prorsa.runtime.cluster.startup import (
    first_allocation,
    idle_observation,
    make_controller,
    note_start,
)
from prorsa.runtime.controller import ForecastSource
from prorsa.runtime.sim.cluster import SimCluster
from prorsa.runtime.sim.core import PRIORITY_CONTROL, Environment
from prorsa.runtime.sim.drivers import Driver, DriverResult
from prorsa.runtime.sim.metrics import compute_metrics
from prorsa.runtime.sim.topology import Slot, build_engines, check_fits
from prorsa.telemetry.columns import EventLog

logger = logging.getLogger(__name__)


class SimClock:
    """The controller's clock inside a simulation."""

    def __init__(self, env: Environment) -> None:
        self.env = env

    def now(self) -> float:
        return self.env.now

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> None:
        self.env.schedule(self.env.now + delay_s, callback, priority=PRIORITY_CONTROL)


class SimActuator:
    """Applies controller orders to a :class:`SimCluster` (the controller's ``Actuator``)."""

    def __init__(
        self,
        cluster: SimCluster,
        spec: ClusterSpec,
        total: int | None,
        workload: WorkloadShape | None = None,
    ) -> None:
        self.cluster = cluster
        self.spec = spec
        self.total = total
        self.workload = workload
        self.events = cluster.telemetry.log
        self.truth = cluster.truth

    def observe(self) -> ClusterObservation:
        return self.cluster.observe(self.spec, self.total, self.workload)

    def switch(self, slot_id: int, role: str) -> bool:
        return self.cluster.switch_slot(slot_id, role)

    def set_local_prefill_threshold(self, tokens: int) -> None:
        self.cluster.set_local_prefill_threshold(tokens)

    def note_allocation(self, gpus: dict[str, int], reason: str) -> None:
        self.cluster.telemetry.allocation(self.cluster.env.now, gpus, reason)


@dataclass
class SimulationResult:
    """Telemetry, metrics and the controller's decisions of one run.

    ``events`` is the run's event log (None when the run recorded nothing);
    :attr:`telemetry` turns it into the canonical Arrow table on first access. The table
    repeats the run, trajectory, group and task strings on every row (~85 bytes an event
    against the log's 37), so runs whose callers read only the metrics, as sweeps do,
    never build it.
    """

    metrics: dict[str, object]
    driver: DriverResult
    decisions: list = field(default_factory=list)
    cluster: SimCluster | None = field(default=None, repr=False)
    events: EventLog | None = field(default=None, repr=False)
    #: Events of the run in ``events`` (a log may grow after the run is assembled).
    event_count: int = 0
    _table: pa.Table | None = field(default=None, init=False, repr=False)

    @property
    def telemetry(self) -> pa.Table | None:
        """The run's lifecycle events as a table of the canonical schema, marked as
        simulated (None when the run recorded nothing)."""
        if self._table is None and self.events is not None:
            self._table = simulated_table(self.events, self.event_count)
        return self._table


def simulated_table(log: EventLog, count: int) -> pa.Table:
    """The first ``count`` events of ``log`` as a canonical table, marked as simulated
    (the oracle forecaster refuses anything else)."""
    table = log.to_table(0, count)
    meta = {**(table.schema.metadata or {}), b"prorsa.source": b"simulator"}
    return table.replace_schema_metadata(meta)


class Simulation:
    """One simulated rollout.

    Args:
        config: cluster shape and behaviour.
        policy: allocation policy (its first decision sets the initial roles for free).
        driver: :class:`SyncDriver` or :class:`AsyncDriver`.
        forecaster: feeds forecasts to policies that need them.
        interval_s / min_dwell_s: control loop period and minimum time between switches of
            one slot.
        profiles: cost profile per TP (default: looked up from ``config.profile``).
        record: keep full lifecycle telemetry (turn off for the fastest sweeps).
    """

    def __init__(
        self,
        config: ClusterConfig,
        policy: Policy,
        driver: Driver,
        *,
        forecaster: ForecastSource | None = None,
        interval_s: float = 1.0,
        min_dwell_s: float = 10.0,
        seed: int = 0,
        run_id: str = "sim",
        record: bool = True,
        profiles: dict[int, object] | None = None,
        keep_forecasts: bool = False,
    ) -> None:
        config.validate()
        self.config = config
        self.policy = policy
        self.driver = driver
        self.forecaster = forecaster
        self.interval_s = interval_s
        self.min_dwell_s = min_dwell_s
        self.seed = seed
        self.run_id = run_id
        self.record = record
        self.profiles = profiles or load_profiles(config)
        needed = config.role_layouts.values() if config.layouts else config.role_tp.values()
        missing = set(needed) - set(self.profiles)
        if missing:
            raise ConfigError(f"no cost model for {sorted(missing)}")
        self.keep_forecasts = keep_forecasts

    def run(
        self,
        *,
        max_time_s: float | None = None,
        progress: Callable[[float, int], None] | None = None,
    ) -> SimulationResult:
        """Run to completion (or ``max_time_s``); ``progress(sim_time, completed)`` is called
        every simulated 10 seconds when given."""
        self.start(progress=progress)
        self.advance(max_time_s)
        return self.finish()

    def start(self, *, progress: Callable[[float, int], None] | None = None) -> None:
        """Build the cluster, apply the policy's first allocation, launch the driver.

        With :meth:`advance` and :meth:`finish` this lets a caller (the Gymnasium
        environment) step the simulation between control ticks.
        """
        env = self.env = Environment(self.seed)
        spec = self.spec = cluster_spec(self.config, self.profiles, self.min_dwell_s)
        self.policy.reset(spec, self.seed)
        total = self.driver.total
        # An idle colocated slot's shape (engines, KV) as the first observation shows it.
        probe = build_engines(
            Slot(0, spec.slot_gpus, "colocated"), self.config, self.profiles, env, None
        )
        idle = idle_observation(
            spec,
            engines_per_slot=len(probe),
            kv_capacity_per_slot=sum(e.kv_capacity for e in probe),
            total_trajectories=total,
            local_prefill_threshold=self.config.local_prefill_threshold,
            workload=self.driver.shape,
        )
        roles, first = first_allocation(self.policy, spec, idle)
        cluster = self.cluster = SimCluster(
            env,
            self.config,
            self.profiles,
            run_id=self.run_id,
            record=self.record,
            initial_roles=roles,
        )
        if first.local_prefill_threshold is not None:
            cluster.set_local_prefill_threshold(first.local_prefill_threshold)
        self._check_fits(cluster)
        self.actuator = SimActuator(cluster, spec, total, self.driver.shape)
        note_start(self.actuator, roles, spec.slot_gpus)
        if self.forecaster is not None and not self.record:
            raise ConfigError(
                "this run records no telemetry, so the forecaster has nothing to read",
                hint="simulate with record=True (the default) when using a forecaster",
            )
        self.controller = make_controller(
            self.policy,
            self.actuator,
            SimClock(env),
            interval_s=self.interval_s,
            min_dwell_s=self.min_dwell_s,
            forecaster=self.forecaster,
            keep_forecasts=self.keep_forecasts,
        )
        if self.controller is not None:
            self.controller.start()
        cluster.on_trajectory_done = self.driver.on_done
        if progress is not None:
            self._schedule_progress(env, cluster, progress)
        self.driver.start(env, cluster.start_trajectory)

    def advance(self, until: float | None = None) -> bool:
        """Simulate up to ``until`` (or the end); returns True once the driver is done."""
        self.env.run(until=until)
        return self.done

    @property
    def done(self) -> bool:
        result = self.driver.result
        return result.started > 0 and result.completed >= self.driver.total > 0

    def telemetry_so_far(self) -> pa.Table | None:
        """The events recorded up to now (None before :meth:`start` built the cluster, or
        without recording): what a run that stops part-way leaves."""
        cluster = getattr(self, "cluster", None)
        if cluster is None or not self.record:
            return None
        log = cluster.telemetry.log
        return simulated_table(log, len(log))

    def finish(self) -> SimulationResult:
        """Stop the controller and assemble telemetry and metrics."""
        cluster, controller = self.cluster, self.controller
        if controller is not None:
            controller.stop()
        log = cluster.telemetry.log
        return SimulationResult(
            metrics=compute_metrics(cluster, self.driver.result),
            driver=self.driver.result,
            decisions=controller.decisions if controller else [],
            cluster=cluster,
            events=log if self.record else None,
            event_count=len(log),
        )

    def _check_fits(self, cluster: SimCluster) -> None:
        for batch in self.driver.known_specs():
            for spec in batch:
                check_fits(spec, cluster.sequence_kv_capacity_tokens)

    @staticmethod
    def _schedule_progress(
        env: Environment, cluster: SimCluster, progress: Callable[[float, int], None]
    ) -> None:
        def tick() -> None:
            progress(env.now, cluster.completed)
            env.schedule(env.now + 10.0, tick, priority=PRIORITY_CONTROL)

        env.schedule(0.0, tick, priority=PRIORITY_CONTROL)
