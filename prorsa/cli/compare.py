"""``prorsa compare``: which allocation policy finishes the rollout soonest, and by how
much over colocation."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from prorsa.cli.common import console, counted_progress, friendly_errors, print_json
from prorsa.cli.options import config_command, parse_params
from prorsa.errors import ConfigError
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.cluster.control import ControlConfig
from prorsa.tracking import resolve_uri
from prorsa.workload.config import WorkloadConfig

DEMO_POLICIES = "colocate,best-static,threshold,predictive,mpc,oracle"


def _policy_params(items: list[str]) -> dict[str, dict]:
    """``policy.key=value`` items grouped by policy."""
    out: dict[str, dict] = {}
    for item in items:
        head, _, value = item.partition("=")
        policy, dot, key = head.partition(".")
        if not dot or not value:
            raise ConfigError(f"--param '{item}' must look like policy.key=value")
        out.setdefault(policy, {}).update(parse_params([f"{key}={value}"]))
    return out


def run_and_report(cfg, out: Path, *, as_json: bool, mlflow_uri: str | None, title: str) -> dict:
    from dataclasses import asdict

    from prorsa.experiments.compare import run_compare
    from prorsa.experiments.report import write_report

    with counted_progress("simulating", quiet=as_json) as progress:
        result = run_compare(cfg, progress=progress)
    config = asdict(cfg)
    report = write_report(result, out, title=title, config=config)
    if mlflow_uri:
        from prorsa.tracking import log_compare

        run_id = log_compare(result, config, out, mlflow_uri)
        if not as_json:
            console.print(f"MLflow run {run_id} at {mlflow_uri}")
    if as_json:
        print_json({"summary": result["summary"], "best_static": result["best_static"]})
    else:
        for workload, mode in sorted({(r["workload"], r["mode"]) for r in result["summary"]}):
            console.print(
                _table(
                    [
                        r
                        for r in result["summary"]
                        if (r["workload"], r["mode"]) == (workload, mode)
                    ],
                    f"{workload} — {mode}",
                )
            )
        cells = result.get("cells", {})
        if cells.get("reused"):
            console.print(
                f"{cells['reused']} finished cells reused from {cells['path']} "
                "(--fresh runs them again)"
            )
        console.print(f"report: {report}")
    return result


def _table(rows: list[dict], title: str) -> Table:
    from prorsa.experiments.report import TABLE_COLUMNS, ordered, row_cells

    table = Table(title=title)
    for col in TABLE_COLUMNS:
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in ordered(rows):
        table.add_row(*row_cells(r))
    return table


@friendly_errors
@config_command(
    work=WorkloadConfig,
    cluster=ClusterConfig,
    control=ControlConfig,
    # The matrix sets these per cell (--scenario/--trace, --mode, --seeds, --policies,
    # --param policy.key=value).
    exclude=(
        "work.scenario",
        "work.trace",
        "work.mode",
        "work.seed",
        "control.policy",
        "control.policy_params",
    ),
)
def compare_cmd(
    work: WorkloadConfig,
    cluster: ClusterConfig,
    control: ControlConfig,
    scenario: str = typer.Option("mixed", help="scenario(s), comma-separated"),
    trace: list[Path] = typer.Option([], help="replay imported trace(s) instead (repeatable)"),
    policies: str = typer.Option(
        DEMO_POLICIES, help="policies, comma-separated (colocate required)"
    ),
    seeds: int = typer.Option(3, help="seeds per cell (speedup CI over seeds)"),
    mode: str = typer.Option("sync", help="sync, async, or sync,async"),
    param: list[str] = typer.Option([], "--param", help="policy.key=value (repeatable)"),
    workers: int = typer.Option(
        0, help="cells run at once (0: one per CPU; 1: in this process, without Ray)"
    ),
    address: str | None = typer.Option(
        None, help="Ray cluster to run cells on (default: a local Ray instance)"
    ),
    resume: bool = typer.Option(
        True, "--resume/--fresh", help="skip cells already finished in OUT/cells.jsonl"
    ),
    tuned: str | None = typer.Option(
        None, help="Optuna storage (e.g. sqlite:///out/tune/optuna.db): use its best parameters"
    ),
    tuned_study: list[str] = typer.Option(
        [], help="with --tuned: the study to take a policy's parameters from (repeatable)"
    ),
    out: Path = typer.Option(Path("out/compare"), help="output directory"),
    mlflow: str | None = typer.Option(
        None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI)"
    ),
    track: bool = typer.Option(
        False, "--track", help="log to MLflow; without --mlflow to the local store out/mlruns"
    ),
    as_json: bool = typer.Option(False, "--json", help="print the summary as JSON"),
) -> None:
    """Compare allocation policies on workloads; writes results.json, report.md and plots.

    Workload, cluster and control-loop options are those of `prorsa simulate`; predictive
    and mpc use per-target unless --forecaster names another. Cells run as Ray
    tasks and stream to OUT/cells.jsonl as they finish; running the same command again
    skips the finished ones."""
    from prorsa.experiments.compare import CompareConfig
    from prorsa.io import check_output

    out = check_output(out, kind="dir", inputs=trace)
    workloads = [(None, str(t)) for t in trace] or [
        (s.strip(), None) for s in scenario.split(",") if s.strip()
    ]
    cfg = CompareConfig(
        workloads=workloads,
        policies=[p.strip() for p in policies.split(",") if p.strip()],
        modes=[m.strip() for m in mode.split(",") if m.strip()],
        seeds=seeds,
        work=work,
        cluster=cluster,
        control=control,
        policy_params=_policy_params(param),
        workers=workers,
        address=address,
        cells_path=out / "cells.jsonl",
        resume=resume,
        tuned_storage=tuned,
        tuned_studies=tuned_study,
    )
    cfg.validate()  # every input checked before a cell runs
    mlflow_uri = resolve_uri(mlflow, track=track)
    run_and_report(cfg, out, as_json=as_json, mlflow_uri=mlflow_uri, title="prorsa compare")


def policies_cmd() -> None:
    """List the registered allocation policies."""
    from prorsa.policy import POLICIES

    for name in POLICIES.names():
        doc = (POLICIES.get(name).__doc__ or "").strip().splitlines()[0]
        console.print(f"[bold]{name}[/]  {doc}")
