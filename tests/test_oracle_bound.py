"""The oracle (MPC with perfect foresight) must not be beaten beyond noise by policies
that only see the past; if it is, a bug hides in the forecaster, the policy or the
simulator."""

from __future__ import annotations

import pytest

from prorsa.experiments.cells import Cell, run_cell

NOISE = 0.03  # relative makespan difference we treat as noise


def _objective(policy: str, seed: int, forecaster: str | None = None, **params) -> float:
    cell = Cell.of(
        scenario="search",
        mode="sync",
        policy=policy,
        seed=seed,
        num_slots=8,
        profile="h200-qwen2.5-7b-tp1",
        trajectories=2048,
        forecaster=forecaster,
        policy_params=params,
        series=False,
    )
    return run_cell(cell)["objective"]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_oracle_is_not_beaten_by_predictors_of_the_past(seed):
    oracle = _objective("oracle", seed)
    rivals = {
        "mpc/ewma": _objective("mpc", seed, "ewma"),
        "predictive/ewma": _objective("predictive", seed, "ewma"),
        "threshold": _objective("threshold", seed),
        "static": _objective("static", seed, prefill_fraction=0.25),
    }
    for name, value in rivals.items():
        assert oracle <= value * (1 + NOISE), f"{name} beat the oracle: {value:.1f} < {oracle:.1f}"
