"""``prorsa tune``: Optuna search over a policy's parameters on simulated rollouts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import typer

from prorsa.cli.common import console, counted_progress, friendly_errors, print_json
from prorsa.cli.options import config_command
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.cluster.control import ControlConfig
from prorsa.tracking import resolve_uri
from prorsa.workload.config import WorkloadConfig


@friendly_errors
@config_command(
    work=WorkloadConfig,
    cluster=ClusterConfig,
    control=ControlConfig,
    # The policy is the argument; each trial sets the seeds (--seeds from SEED_OFFSET).
    exclude=("work.seed", "control.policy"),
)
def tune_cmd(
    work: WorkloadConfig,
    cluster: ClusterConfig,
    control: ControlConfig,
    policy: str = typer.Argument(..., help="policy to tune (see `prorsa policies`)"),
    trials: int = typer.Option(20, help="trial budget of the whole study (all runs and workers)"),
    seeds: int = typer.Option(2, help="workload seeds per trial"),
    switches: bool = typer.Option(
        False, "--switches", help="two objectives, makespan x switches: plots the Pareto front"
    ),
    workers: int = typer.Option(1, help="trials at once (1: in this process; more: Ray tasks)"),
    address: str | None = typer.Option(
        None, help="Ray cluster to run trials on (default: a local Ray instance)"
    ),
    storage: str = typer.Option("sqlite:///out/tune/optuna.db", help="Optuna storage URL"),
    study: str | None = typer.Option(
        None, help="study name (default: policy, workload, mode, engines, settings hash)"
    ),
    sampler_seed: int = typer.Option(0, help="trial n samples with seed SAMPLER_SEED + n"),
    out: Path = typer.Option(Path("out/tune"), help="folder for STUDY/study.json and plots"),
    mlflow: str | None = typer.Option(
        None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI)"
    ),
    track: bool = typer.Option(
        False, "--track", help="log to MLflow; without --mlflow to the local store out/mlruns"
    ),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Tune POLICY. The study resumes when run again with the same settings; several
    workers (or several commands) may share one storage. Workload, cluster and
    control-loop options are those of `prorsa simulate` (--param: fixed parameters);
    predictive and mpc use per-target unless --forecaster names another."""
    from prorsa.experiments.cells import Cell
    from prorsa.experiments.compare import forecaster_for
    from prorsa.io import check_output
    from prorsa.tracking import Tracker
    from prorsa.tune import TuneConfig, default_study_name, study_summary, tune

    if work.trace is not None:
        work.scenario = None  # a trace replaces the default scenario
    forecaster = forecaster_for(policy, control.forecaster)
    control = replace(control, policy=policy, forecaster=forecaster)
    base = Cell(work=work, cluster=cluster, control=control)
    cfg = TuneConfig(
        policy=policy,
        base=base,
        trials=trials,
        seeds=seeds,
        storage=storage,
        study_name=study,
        sampler_seed=sampler_seed,
        objectives=("objective", "switches") if switches else ("objective",),
        workers=workers,
        address=address,
    )
    cfg.validate()
    import optuna

    # The progress bar and the summary say what Optuna's per-trial INFO lines would.
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    name = study or default_study_name(cfg)
    check_output(out / name, kind="dir", inputs=[work.trace])
    with counted_progress("trials", trials, quiet=as_json) as progress:
        result = tune(
            cfg,
            progress=progress,
            tracker=Tracker(resolve_uri(mlflow, track=track)),
            out=out / name,
        )
    summary = study_summary(result)
    if as_json:
        print_json(summary)
        return
    counts = summary["trials"]
    console.print(
        f"study {name} in {storage}: {counts['complete']} complete, {counts['pruned']} pruned, "
        f"{counts['fail']} failed"
    )
    if "best" in summary:
        best = summary["best"]
        values = ", ".join(f"{k} {v:,.2f}" for k, v in best["values"].items())
        console.print(f"best (trial {best['trial']}): {values} with {best['policy_params']}")
    if "pareto_front" in summary:
        console.print(
            f"Pareto front: {len(summary['pareto_front'])} trials, plot {out / name / 'pareto.png'}"
        )
    console.print(f"use it: prorsa compare --tuned {storage} --policies colocate,{policy} ...")
