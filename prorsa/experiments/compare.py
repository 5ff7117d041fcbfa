"""`prorsa compare`: run workloads x policies x seeds x modes and summarise speedups.

Speedup is paired by seed: ``colocate objective / policy objective`` on the same workload
sample, then averaged over seeds with a Student-t 95% interval. ``best-static`` is
resolved first by searching the static split of each workload and mode on a seed of its
own, one past the evaluated seeds (:func:`search_seed`): the split is chosen out of
sample, so the evaluated seeds score it as they score every other policy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from scipy import stats

from prorsa.errors import ConfigError
from prorsa.experiments import DEFAULT_FORECASTER
from prorsa.experiments.cells import Cell, cell_of
from prorsa.experiments.sweep import BACKENDS, Sweep
from prorsa.policy import POLICIES
from prorsa.policy.best_static import search_best_static
from prorsa.policy.params import (
    check_count,
    check_interval_s,
    check_policy_param_groups,
    check_storage_url,
)
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.cluster.control import ControlConfig
from prorsa.workload.config import MODES, WorkloadConfig

logger = logging.getLogger(__name__)

FORECAST_POLICIES = ("predictive", "mpc")
EXHAUSTIVE_UP_TO = 12  # the static search tries every split up to this many candidates


@dataclass
class CompareConfig:
    """The matrix to run: workloads x modes x policies x seeds on one cluster.

    ``work``, ``cluster`` and ``control`` are the run configurations every entry point
    shares (one set of defaults). A cell takes its scenario or trace, mode and seed from
    the matrix (``work``'s own are not used), its policy from ``policies`` and that
    policy's parameters from ``policy_params``; ``control.forecaster`` (default
    :data:`~prorsa.experiments.cells.DEFAULT_FORECASTER`) serves predictive and mpc.
    """

    workloads: list[tuple[str | None, str | None]]  # (scenario, trace) pairs
    policies: list[str]
    modes: list[str] = field(default_factory=lambda: ["sync"])
    seeds: int = 3
    work: WorkloadConfig = field(default_factory=WorkloadConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    policy_params: dict[str, dict] = field(default_factory=dict)  # policy -> parameters
    workers: int = 0  # 0: one per CPU (or the Ray cluster's CPUs with an address)
    address: str | None = None  # Ray cluster to join; None starts a local Ray instance
    cells_path: Path | None = None  # JSONL streaming finished cells (resumable)
    resume: bool = True  # skip cells already in cells_path
    backend: str = "auto"  # auto | ray | process | inline (see prorsa.experiments.sweep)
    tuned_storage: str | None = None  # Optuna storage whose best parameters to use
    tuned_studies: list[str] = field(default_factory=list)  # pick these studies there

    def validate(self) -> None:
        """Raise :class:`ConfigError` for a matrix that cannot run, before any cell does."""
        if not self.workloads or not self.policies or not self.modes:
            raise ConfigError("compare needs at least one workload, policy and mode")
        for name in self.policies:
            POLICIES.get(name)
        if "colocate" not in self.policies:
            raise ConfigError(
                "compare needs 'colocate' among the policies (speedups are against it)"
            )
        check_count(self.seeds, "seeds")
        if self.cluster.num_slots < 2:
            raise ConfigError(
                f"compare needs engines >= 2 (a split needs both roles), got "
                f"{self.cluster.num_slots}"
            )
        for mode in self.modes:
            if mode not in MODES:
                raise ConfigError(f"unknown mode '{mode}'", hint="sync, async or sync,async")
        check_policy_param_groups(self.policy_params, policies=self.policies)
        if self.policy_params.get("best-static"):
            # Its split is what compare searches for: one given would be replaced.
            raise ConfigError(
                f"best-static's {sorted(self.policy_params['best-static'])} are searched "
                "per workload and mode, not given",
                hint="use the static policy for a split of your choice "
                "(--param static.prefill_gpus=N)",
            )
        if self.control.policy_params:
            raise ConfigError(
                "compare takes policy parameters per policy, not in control.policy_params",
                hint="use policy_params={policy: {key: value}} (--param policy.key=value)",
            )
        check_count(self.workers, "workers", minimum=0)
        if self.backend not in BACKENDS:
            raise ConfigError(f"unknown backend '{self.backend}'", hint=f"one of {BACKENDS}")
        check_interval_s(self.control.interval_s)
        for workload in self.workloads:
            _cell(self, workload, self.modes[0], "colocate", 0).work.validate()
            trace = workload[1]
            if trace is not None and not Path(trace).is_file():
                raise ConfigError(f"trace not found: {trace}", hint="give an imported .parquet")
        self.cluster.validate()
        self.control.validate()
        if self.tuned_storage:
            check_storage_url(self.tuned_storage, "--tuned storage")


def _cell(
    cfg: CompareConfig, workload, mode: str, policy: str, seed: int, params: dict | None = None
) -> Cell:
    """One cell of the matrix; ``params`` are laid over the policy's configured ones."""
    scenario, trace = workload
    forecaster = forecaster_for(policy, cfg.control.forecaster)
    return Cell(
        work=replace(cfg.work, scenario=scenario, trace=trace, mode=mode, seed=seed),
        cluster=cfg.cluster,
        control=replace(
            cfg.control,
            policy=policy,
            policy_params={**cfg.policy_params.get(policy, {}), **(params or {})},
            forecaster=forecaster,
        ),
    )


def forecaster_for(policy: str, named: str | None) -> str | None:
    """The forecaster a cell of ``policy`` runs with: ``named`` (else the default) for the
    policies that need one, none for the others (the oracle brings its own)."""
    if policy not in FORECAST_POLICIES:
        return None
    return named or DEFAULT_FORECASTER


def run_compare(cfg: CompareConfig, *, progress: Callable[[int, int], None] | None = None) -> dict:
    """Run the whole matrix; returns ``{"runs": [...], "summary": [...], "best_static": {...}}``
    (plus ``"tuned"``: where tuned parameters came from, when ``cfg.tuned_storage`` is set).

    Cells run through one :class:`~prorsa.experiments.sweep.Sweep` in three batches: every
    policy but best-static together with the coarse static grids, then the refinement of
    each grid, then best-static at the split found. With ``cfg.cells_path`` each finished
    cell is streamed to that JSONL file and a re-run skips it.
    """
    cfg.validate()
    cfg, tuned = _with_tuned(cfg)
    counter = _PhasedProgress(progress)
    plan = [
        (workload, mode, policy, seed)
        for workload in cfg.workloads
        for mode in cfg.modes
        for policy in cfg.policies
        for seed in range(cfg.seeds)
    ]
    fixed = [p for p in plan if p[2] != "best-static"]
    searched = [p for p in plan if p[2] == "best-static"]
    searches = [(w, m) for w in cfg.workloads for m in cfg.modes] if searched else []
    grids = {key: _coarse_grid(cfg.cluster.num_slots) for key in searches}
    with Sweep(
        workers=cfg.workers,
        address=cfg.address,
        results_path=cfg.cells_path,
        resume=cfg.resume,
        backend=cfg.backend,
    ) as sweep:
        grid_cells = [_static_cell(cfg, *key, x) for key, xs in grids.items() for x in xs]
        batch = counter.map(sweep, [_cell(cfg, *p) for p in fixed] + grid_cells)
        results = dict(zip(fixed, batch[: len(fixed)], strict=True))
        best_static = _finish_searches(cfg, sweep, counter, grids, batch[len(fixed) :])
        cells = [
            _cell(
                cfg,
                *p,
                params={"prefill_gpus": best_static[_key(p[0], p[1])]["prefill_gpus"]},
            )
            for p in searched
        ]
        results.update(zip(searched, counter.map(sweep, cells), strict=True))
    if sweep.reused:
        logger.info("%d cells reused from %s", sweep.reused, cfg.cells_path)
    runs = [results[p] for p in plan]
    out = {
        "runs": runs,
        "summary": summarise(runs),
        "best_static": best_static,
        "cells": {
            "run": sweep.ran,
            "reused": sweep.reused,
            "path": str(cfg.cells_path) if cfg.cells_path else None,
        },
    }
    if tuned:
        out["tuned"] = tuned
    return out


def _with_tuned(cfg: CompareConfig) -> tuple[CompareConfig, dict]:
    """``cfg`` with the best parameters found by tuning merged into its policy parameters
    (parameters given explicitly win), and where each policy's parameters came from."""
    if not cfg.tuned_storage:
        return cfg, {}
    from prorsa.tune import tuned_params

    tunable = [p for p in cfg.policies if p not in ("colocate", "best-static")]
    found = tuned_params(cfg.tuned_storage, tunable, studies=cfg.tuned_studies)
    params = dict(cfg.policy_params)
    for policy, origin in found.items():
        params[policy] = {**origin["params"], **cfg.policy_params.get(policy, {})}
        logger.info("%s: tuned parameters from study %s", policy, origin["study"])
    return replace(cfg, policy_params=params), found


class _PhasedProgress:
    """One running count over the sweep's batches (the total grows as batches are planned)."""

    def __init__(self, progress: Callable[[int, int], None] | None) -> None:
        self.progress = progress
        self.done = 0
        self.total = 0

    def map(self, sweep: Sweep, cells: list[Cell]) -> list[dict]:
        base_done, base_total = self.done, self.total

        def report(done: int, total: int) -> None:
            self.done, self.total = base_done + done, base_total + total
            if self.progress is not None:
                self.progress(self.done, self.total)

        return sweep.map(cells, report)


def search_seed(cfg: CompareConfig) -> int:
    """The seed the best-static search runs on: one past the evaluated seeds (choosing the
    split on a seed it is then scored on would flatter it and narrow its interval)."""
    return cfg.seeds


def _static_cell(cfg: CompareConfig, workload, mode: str, prefill_slots: int) -> Cell:
    """A static split of ``prefill_slots`` on the search seed (the best-static search's
    cell)."""
    gpus = prefill_slots * _slot_gpus(cfg)
    return replace(
        _cell(cfg, workload, mode, "static", search_seed(cfg), params={"prefill_gpus": gpus}),
        series=False,
    )


def _coarse_grid(slots: int) -> list[int]:
    """The first splits :func:`search_best_static` evaluates (run in parallel up front)."""
    candidates = range(1, slots)
    if len(candidates) <= EXHAUSTIVE_UP_TO:
        return list(candidates)
    stride = max(len(candidates) // 8, 1)
    return sorted({*candidates[::stride], 1, slots - 1})


def _refinement(seen: dict[int, float], slots: int) -> list[int]:
    """Splits between the best grid point's neighbours not yet evaluated (the search's
    second stage, run in parallel; the search itself then finds them cached)."""
    if slots - 1 <= EXHAUSTIVE_UP_TO:
        return []
    grid = sorted(seen)
    i = grid.index(min(grid, key=lambda x: (seen[x], x)))
    low, high = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    return [x for x in range(low, high + 1) if x not in seen]


def _finish_searches(
    cfg: CompareConfig, sweep: Sweep, counter, grids: dict, grid_runs: list[dict]
) -> dict[str, dict]:
    """Finish every static-split search (on the search seed) from its coarse grid's runs: the
    refinements of all searches run as one batch, then :func:`search_best_static` picks
    from the splits evaluated."""
    seen: dict[tuple, dict[int, float]] = {}
    runs = iter(grid_runs)
    for key, xs in grids.items():
        seen[key] = {x: next(runs)["objective"] for x in xs}
    refine = [(key, x) for key in grids for x in _refinement(seen[key], cfg.cluster.num_slots)]
    refined = counter.map(sweep, [_static_cell(cfg, *key, x) for key, x in refine])
    for (key, x), run in zip(refine, refined, strict=True):
        seen[key][x] = run["objective"]
    found = {}
    for key in grids:
        workload, mode = key

        def evaluate(x: int, key=key) -> float:
            if x not in seen[key]:  # only if the batches missed a split the search wants
                cell = _static_cell(cfg, *key, x)
                seen[key][x] = counter.map(sweep, [cell])[0]["objective"]
            return seen[key][x]

        best, objective = search_best_static(
            evaluate, cfg.cluster.num_slots, exhaustive_up_to=EXHAUSTIVE_UP_TO
        )
        logger.info("best static for %s: %dP%dD", _key(*key), best, cfg.cluster.num_slots - best)
        found[_key(workload, mode)] = {
            "prefill_slots": best,
            "prefill_gpus": best * _slot_gpus(cfg),
            "objective_by_prefill_slots": objective,
        }
    return found


def _slot_gpus(cfg: CompareConfig) -> int:
    """GPUs per slot: the largest engine of any role."""
    return cfg.cluster.slot_gpus


def _key(workload, mode: str) -> str:
    scenario, trace = workload
    return f"{scenario or trace}/{mode}"


def summarise(runs: list[dict]) -> list[dict]:
    """One row per (workload, mode, policy): objective, speedup with a 95% CI, tails."""
    by_key: dict[tuple, dict[int, dict]] = {}
    for run in runs:
        cell = cell_of(run)
        key = (cell.workload, cell.mode, cell.policy)
        by_key.setdefault(key, {})[cell.seed] = run
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
