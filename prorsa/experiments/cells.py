"""One cell of a comparison matrix: a single simulation, run in a worker process.

Workers return small, picklable summaries (metrics and a few time series for plots),
never the full telemetry, so the matrix can run in parallel processes cheaply.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from prorsa.policy.types import ROLES, SWITCHING
from prorsa.runtime.sim.metrics import role_intervals
from prorsa.telemetry.views import trajectory_table


@dataclass(frozen=True)
class Cell:
    """Everything one simulation needs (plain values so it pickles)."""

    scenario: str | None
    trace: str | None
    mode: str
    policy: str
    seed: int
    engines: int
    profile: str
    trajectories: int
    group_size: int = 8
    max_in_flight: int = 128
    policy_params: dict = field(default_factory=dict)
    forecaster: str | None = None
    cluster_overrides: dict = field(default_factory=dict)
    interval_s: float = 1.0
    min_dwell_s: float = 10.0
    series: bool = True  # keep time series for plots
    # Workload knobs (prorsa.experiments.knobs): tool latency and per-turn growth scales.
    tool_scale: float = 1.0
    growth_scale: float = 1.0
    # Lifecycle telemetry; runs with a forecaster or time series record regardless.
    record: bool = True

    @property
    def workload(self) -> str:
        return self.scenario or self.trace or "?"


def run_cell(cell: Cell) -> dict:
    """Simulate ``cell`` and summarise it (top-level function: picklable for pools)."""
    from prorsa.experiments.knobs import WorkloadKnobs, simulate_with_knobs
    from prorsa.policy import POLICIES
    from prorsa.runtime.sim.config import ClusterConfig
    from prorsa.runtime.sim.scenario import ControlConfig, RunRequest, WorkloadConfig

    work = WorkloadConfig(
        scenario=cell.scenario,
        trace=cell.trace,
        mode=cell.mode,
        trajectories=cell.trajectories,
        group_size=cell.group_size,
        max_in_flight=cell.max_in_flight,
        seed=cell.seed,
    )
    cluster = ClusterConfig(profile=cell.profile, num_slots=cell.engines, **cell.cluster_overrides)
    control = ControlConfig(
        policy=cell.policy,
        policy_params=dict(cell.policy_params),
        forecaster=cell.forecaster,
        interval_s=cell.interval_s,
        min_dwell_s=cell.min_dwell_s,
    )
    needs_events = cell.series or cell.forecaster is not None
    needs_events = needs_events or POLICIES.get(cell.policy).needs_forecast
    request = RunRequest(
        work=work,
        cluster=cluster,
        control=control,
        record=cell.record or needs_events,
        run_id=f"{cell.workload}-{cell.mode}-{cell.policy}-s{cell.seed}",
    )
    started = time.perf_counter()
    knobs = WorkloadKnobs(tool_scale=cell.tool_scale, growth_scale=cell.growth_scale)
    result = simulate_with_knobs(request, knobs, keep_forecasts=cell.series)
    wall_s = time.perf_counter() - started
    summary = {
        "cell": asdict(cell),
        "metrics": result.metrics,
        "wall_s": wall_s,
        "objective": objective(result.metrics),
    }
    if cell.series:
        summary["series"] = _series(result)
    return summary


def objective(metrics: dict) -> float:
    """Lower is better: makespan (sync) or seconds per trajectory (async)."""
    if metrics["mode"] == "sync":
        return float(metrics["makespan_s"])
    return 3600.0 / max(float(metrics["throughput_traj_per_hour"]), 1e-9)


def _series(result) -> dict:
    """Allocation, demand and forecast over time, and completion times (for plots)."""
    cluster = result.cluster
    end = float(result.metrics["end_s"])
    grid = np.arange(0.0, end + 1.0, max(end / 400.0, 1.0))
    gpus = {role: np.zeros_like(grid) for role in (*ROLES, SWITCHING)}
    for t0, t1, role, n in role_intervals(cluster, float("inf")):
        gpus[role][(grid >= t0) & (grid < t1)] += n
    table = result.telemetry.to_pandas()
    kind = table["kind"].astype(str)
    queued = table[kind == "prefill_queued"]
    demand, _ = np.histogram(
        queued["time"], bins=np.append(grid, grid[-1] + 1.0), weights=queued["new_tokens"]
    )
    step = grid[1] - grid[0] if len(grid) > 1 else 1.0
    trajs = trajectory_table(result.telemetry)
    completion = np.sort(trajs.loc[trajs["done"], "completion_s"].to_numpy(dtype=float))
    forecasts = []
    for d in result.decisions:
        if d.forecast is not None and 5.0 in d.forecast.horizons_s:
            forecasts.append((d.time_s, d.forecast.at("prefill_tokens", 5.0) / 5.0))
    return {
        "time_s": grid.tolist(),
        "gpus": {k: v.tolist() for k, v in gpus.items()},
        "prefill_tokens_per_s": (demand / step).tolist(),
        "forecast_prefill_tokens_per_s": forecasts,
        "completion_s": completion.tolist(),
        "decisions": [
            {"time_s": d.time_s, "switches": d.switches, "reason": d.reason}
            for d in result.decisions
            if d.switches
        ][:500],
    }


def to_json(obj: object) -> str:
    return json.dumps(obj, default=float)
