"""Tune a policy's parameters on simulated rollouts with Optuna.

Studies live in SQLite (``load_if_exists``), so an interrupted study resumes where it
stopped. Each trial runs the policy on ``seeds`` workload samples; after each seed the
running mean objective is reported so hopeless trials are pruned early.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from prorsa.errors import ConfigError
from prorsa.experiments.cells import Cell, run_cell
from prorsa.policy import POLICIES

logger = logging.getLogger(__name__)


@dataclass
class TuneConfig:
    """What to tune and on which workload."""

    policy: str
    base: Cell  # workload, cluster and policy defaults; seed is replaced per evaluation
    trials: int = 20
    seeds: int = 2
    storage: str = "sqlite:///out/tune/optuna.db"
    study_name: str | None = None
    sampler_seed: int = 0

    def validate(self) -> None:
        POLICIES.get(self.policy)
        if self.trials < 1 or self.seeds < 1:
            raise ConfigError("tune needs trials >= 1 and seeds >= 1")


def tune(cfg: TuneConfig):
    """Run (or resume) the study; returns it. Lower objective (makespan, s/traj) is better."""
    import optuna

    cfg.validate()
    policy_cls = POLICIES.get(cfg.policy)
    if cfg.storage.startswith("sqlite:///"):
        Path(cfg.storage.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    name = cfg.study_name or f"{cfg.policy}-{cfg.base.workload}-{cfg.base.mode}-{cfg.base.engines}"
    study = optuna.create_study(
        study_name=name,
        storage=cfg.storage,
        load_if_exists=True,
        direction="minimize",
        sampler=optuna.samplers.TPESampler(seed=cfg.sampler_seed),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=3),
    )

    def objective(trial) -> float:
        params = {**cfg.base.policy_params, **policy_cls.search_space(trial)}
        total = 0.0
        for seed in range(cfg.seeds):
            cell = replace(
                cfg.base, policy=cfg.policy, policy_params=params, seed=seed, series=False
            )
            total += run_cell(cell)["objective"]
            trial.report(total / (seed + 1), step=seed)
            if trial.should_prune():
                raise optuna.TrialPruned()
        return total / cfg.seeds

    remaining = cfg.trials - len([t for t in study.trials if t.state.is_finished()])
    if remaining > 0:
        study.optimize(objective, n_trials=remaining)
    return study
