"""``prorsa tune``: Optuna search over a policy's parameters on simulated rollouts."""

from __future__ import annotations

from pathlib import Path

import typer

from prorsa.cli.common import console, friendly_errors, print_json
from prorsa.cli.simulate import parse_params


@friendly_errors
def tune_cmd(
    policy: str = typer.Argument(..., help="policy to tune (see `prorsa policies`)"),
    scenario: str = typer.Option("swe", help="workload scenario"),
    trace: Path | None = typer.Option(None, help="replay an imported trace instead"),
    engines: int = typer.Option(16, help="engine slots"),
    profile: str = typer.Option("h200-qwen2.5-7b-tp1", help="cost profile"),
    mode: str = typer.Option("sync", help="sync | async"),
    trajectories: int = typer.Option(256, help="per sync step, or in total (async)"),
    forecaster: str = typer.Option("lightgbm-trajectory", help="forecaster for predictive/mpc"),
    param: list[str] = typer.Option([], "--param", help="fixed policy parameter key=value"),
    trials: int = typer.Option(20, help="total trials in the study (resumes if it exists)"),
    seeds: int = typer.Option(2, help="workload seeds per trial"),
    storage: str = typer.Option("sqlite:///out/tune/optuna.db", help="Optuna storage URL"),
    study: str | None = typer.Option(None, help="study name (default from policy/workload)"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Tune POLICY; the study is stored in SQLite and resumes when run again."""
    from prorsa.experiments.cells import Cell
    from prorsa.experiments.compare import FORECAST_POLICIES
    from prorsa.tune import TuneConfig, tune

    base = Cell(
        scenario=None if trace else scenario,
        trace=str(trace) if trace else None,
        mode=mode,
        policy=policy,
        seed=0,
        engines=engines,
        profile=profile,
        trajectories=trajectories,
        policy_params=parse_params(param),
        forecaster=forecaster if policy in FORECAST_POLICIES else None,
    )
    result = tune(
        TuneConfig(
            policy=policy, base=base, trials=trials, seeds=seeds, storage=storage, study_name=study
        )
    )
    best = result.best_trial
    summary = {
        "study": result.study_name,
        "trials": len(result.trials),
        "best_objective": best.value,
        "best_params": best.params,
    }
    if as_json:
        print_json(summary)
        return
    console.print(f"study {result.study_name}: {len(result.trials)} trials in {storage}")
    console.print(f"best objective {best.value:,.2f} with {best.params}")
