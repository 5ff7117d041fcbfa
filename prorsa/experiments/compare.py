"""`prorsa compare`: run workloads x policies x seeds x modes and summarise speedups.

Speedup is paired by seed: ``colocate objective / policy objective`` on the same workload
sample, then averaged over seeds with a Student-t 95% interval. ``best-static`` is
resolved first by searching the static split on the first seed of each workload and mode.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np
from scipy import stats

from prorsa.errors import ConfigError
from prorsa.experiments.cells import Cell, run_cell
from prorsa.policy import POLICIES
from prorsa.policy.best_static import search_best_static

logger = logging.getLogger(__name__)

FORECAST_POLICIES = ("predictive", "mpc")


@dataclass
class CompareConfig:
    """The matrix to run."""

    workloads: list[tuple[str | None, str | None]]  # (scenario, trace) pairs
    policies: list[str]
    modes: list[str] = field(default_factory=lambda: ["sync"])
    seeds: int = 3
    engines: int = 16
    profile: str = "h200-qwen2.5-7b-tp1"
    trajectories: int = 512
    group_size: int = 8
    max_in_flight: int = 256
    forecaster: str = "lightgbm-trajectory"
    policy_params: dict[str, dict] = field(default_factory=dict)
    cluster_overrides: dict = field(default_factory=dict)
    interval_s: float = 1.0
    min_dwell_s: float = 10.0
    workers: int = 0  # 0: one per CPU

    def validate(self) -> None:
        if not self.workloads or not self.policies or not self.modes:
            raise ConfigError("compare needs at least one workload, policy and mode")
        for name in self.policies:
            POLICIES.get(name)
        if "colocate" not in self.policies:
            raise ConfigError(
                "compare needs 'colocate' among the policies (speedups are against it)"
            )
        if self.seeds < 1 or self.engines < 2:
            raise ConfigError("compare needs seeds >= 1 and engines >= 2")
        for mode in self.modes:
            if mode not in ("sync", "async"):
                raise ConfigError(f"unknown mode '{mode}'")


def _cell(cfg: CompareConfig, workload, mode: str, policy: str, seed: int, **extra) -> Cell:
    scenario, trace = workload
    params = dict(cfg.policy_params.get(policy, {}))
    params.update(extra.pop("policy_params", {}))
    forecaster = cfg.forecaster if policy in FORECAST_POLICIES else None
    return Cell(
        scenario=scenario,
        trace=trace,
        mode=mode,
        policy=policy,
        seed=seed,
        engines=cfg.engines,
        profile=cfg.profile,
        trajectories=cfg.trajectories,
        group_size=cfg.group_size,
        max_in_flight=cfg.max_in_flight,
        policy_params=params,
        forecaster=forecaster,
        cluster_overrides=dict(cfg.cluster_overrides),
        interval_s=cfg.interval_s,
        min_dwell_s=cfg.min_dwell_s,
        **extra,
    )


def run_compare(cfg: CompareConfig, *, progress: Callable[[int, int], None] | None = None) -> dict:
    """Run the whole matrix; returns ``{"runs": [...], "summary": [...], "best_static": {...}}``."""
    cfg.validate()
    workers = cfg.workers or os.cpu_count() or 1
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        best_static = {}
        if "best-static" in cfg.policies:
            best_static = _search_static(cfg, pool, progress)
        cells = []
        for workload in cfg.workloads:
            for mode in cfg.modes:
                for policy in cfg.policies:
                    for seed in range(cfg.seeds):
                        extra = {}
                        if policy == "best-static":
                            key = _key(workload, mode)
                            extra["policy_params"] = {
                                "prefill_gpus": best_static[key]["prefill_gpus"]
                            }
                        cells.append(_cell(cfg, workload, mode, policy, seed, **extra))
        runs = _map(pool, cells, progress)
    return {"runs": runs, "summary": summarise(runs), "best_static": best_static}


def _search_static(cfg: CompareConfig, pool, progress) -> dict:
    found = {}
    for workload in cfg.workloads:
        for mode in cfg.modes:
            best, seen = _search_one(cfg, pool, progress, workload, mode)
            found[_key(workload, mode)] = {
                "prefill_slots": best,
                "prefill_gpus": best * _slot_gpus(cfg),
                "objective_by_prefill_slots": seen,
            }
            logger.info(
                "best static for %s: %dP%dD", _key(workload, mode), best, cfg.engines - best
            )
    return found


def _search_one(cfg: CompareConfig, pool, progress, workload, mode: str) -> tuple[int, dict]:
    """Search the static split on seed 0; the coarse grid runs in parallel first."""
    cache: dict[int, float] = {}

    size = _slot_gpus(cfg)

    def evaluate_many(xs: list[int]) -> None:
        cells = [
            replace(
                _cell(cfg, workload, mode, "static", 0, policy_params={"prefill_gpus": x * size}),
                series=False,
            )
            for x in xs
        ]
        for x, run in zip(xs, _map(pool, cells, progress), strict=True):
            cache[x] = run["objective"]

    def evaluate(x: int) -> float:
        if x not in cache:
            evaluate_many([x])
        return cache[x]

    slots = cfg.engines
    evaluate_many(sorted({1, slots - 1, *range(1, slots, max((slots - 1) // 8, 1))}))
    return search_best_static(evaluate, slots)


def _slot_gpus(cfg: CompareConfig) -> int:
    """GPUs per slot: the largest tensor-parallel degree of any role."""
    return max(cfg.cluster_overrides.get("role_tp", {"prefill": 1}).values())


def _map(pool, cells: list[Cell], progress) -> list[dict]:
    results = []
    for i, result in enumerate(pool.map(run_cell, cells)):
        results.append(result)
        if progress is not None:
            progress(i + 1, len(cells))
    return results


def _key(workload, mode: str) -> str:
    scenario, trace = workload
    return f"{scenario or trace}/{mode}"


def summarise(runs: list[dict]) -> list[dict]:
    """One row per (workload, mode, policy): objective, speedup with a 95% CI, tails."""
    by_key: dict[tuple, dict[int, dict]] = {}
    for run in runs:
        c = run["cell"]
        key = (c["scenario"] or c["trace"], c["mode"], c["policy"])
        by_key.setdefault(key, {})[c["seed"]] = run
    rows = []
    for (workload, mode, policy), seeds in sorted(by_key.items()):
        base = by_key.get((workload, mode, "colocate"), {})
        paired = [base[s]["objective"] / r["objective"] for s, r in seeds.items() if s in base]
        metrics = [r["metrics"] for r in seeds.values()]
        objective = [r["objective"] for r in seeds.values()]
        busy = {
            role: _mean(
                [m["busy_fraction"][role] for m in metrics if m["busy_fraction"][role] is not None]
            )
            for role in ("prefill", "decode", "colocated")
        }
        rows.append(
            {
                "workload": workload,
                "mode": mode,
                "policy": policy,
                "seeds": len(seeds),
                "objective": _mean(objective),
                "makespan_s": _mean([m.get("makespan_s") for m in metrics]),
                "throughput_traj_per_hour": _mean(
                    [m.get("throughput_traj_per_hour") for m in metrics]
                ),
                "speedup": _mean(paired),
                "speedup_ci95": _ci(paired),
                "completion_s_p99": _mean([m.get("completion_s_p99") for m in metrics]),
                "ttft_s_p99": _mean([m.get("ttft_s_p99") for m in metrics]),
                "switches": _mean([m["switches_completed"] for m in metrics]),
                "busy_fraction": busy,
                "wall_s": _mean([r["wall_s"] for r in seeds.values()]),
            }
        )
    return rows


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def _ci(values: list[float]) -> list[float] | None:
    if len(values) < 2:
        return None
    mean = float(np.mean(values))
    half = float(
        stats.t.ppf(0.975, len(values) - 1) * np.std(values, ddof=1) / np.sqrt(len(values))
    )
    return [mean - half, mean + half]
