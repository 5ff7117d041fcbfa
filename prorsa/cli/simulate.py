"""``prorsa simulate``: one simulated rollout, its telemetry and metrics."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from prorsa.cli.common import console, friendly_errors, print_json
from prorsa.cli.options import config_command, parse_params  # noqa: F401  (shared by commands)
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.cluster.control import ControlConfig
from prorsa.workload.config import WorkloadConfig


@friendly_errors
@config_command(work=WorkloadConfig, cluster=ClusterConfig, control=ControlConfig)
def simulate_cmd(
    work: WorkloadConfig,
    cluster: ClusterConfig,
    control: ControlConfig,
    out: Path = typer.Option(Path("out/simulate"), help="output directory"),
    as_json: bool = typer.Option(False, "--json", help="print metrics as JSON"),
) -> None:
    """Simulate one rollout; writes telemetry.parquet and metrics.json to --out."""
    from prorsa.runtime.sim.scenario import RunRequest, simulate
    from prorsa.telemetry.reader import write_parquet

    if work.trace is not None:
        work.scenario = None  # a trace replaces the default scenario
    request = RunRequest(work, cluster, control)
    request.validate()
    total = work.trajectories * (work.steps if work.mode == "sync" else 1)
    with Progress(
        TextColumn("[bold]simulating"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[sim]}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=as_json,
    ) as bar:
        task = bar.add_task("sim", total=total, sim="")

        def progress(sim_time: float, completed: int) -> None:
            bar.update(task, completed=completed, sim=f"t={sim_time:,.0f}s")

        result = simulate(request, progress=progress)
    out.mkdir(parents=True, exist_ok=True)
    if result.telemetry is not None:
        write_parquet(result.telemetry, out / "telemetry.parquet")
    metrics = {"request": _describe(request), **result.metrics}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, default=float) + "\n")
    if as_json:
        print_json(metrics)
        return
    console.print(metrics_table(result.metrics, title=f"{control.policy} on {work.label}"))
    console.print(f"wrote {out / 'telemetry.parquet'} and {out / 'metrics.json'}")


def _describe(request) -> dict:
    from dataclasses import asdict

    return {
        "work": asdict(request.work),
        "cluster": asdict(request.cluster),
        "control": asdict(request.control),
    }


def metrics_table(m: dict, title: str) -> Table:
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    if m["mode"] == "sync":
        table.add_row("makespan", f"{m['makespan_s']:,.1f} s")
    else:
        table.add_row("throughput", f"{m['throughput_traj_per_hour']:,.0f} trajectories/h")
    table.add_row(
        "trajectories", f"{m['trajectories_completed']:,} / {m['trajectories_started']:,}"
    )
    for key, unit in (("completion_s", "s"), ("ttft_s", "s"), ("tpot_s", "s")):
        if m.get(f"{key}_p50") is not None:
            table.add_row(
                f"{key[:-2]} p50 / p99", f"{m[f'{key}_p50']:.3f} / {m[f'{key}_p99']:.3f} {unit}"
            )
    busy = ", ".join(f"{r} {v:.0%}" for r, v in m["busy_fraction"].items() if v is not None)
    table.add_row("busy fraction", busy)
    table.add_row("switches", str(m["switches_completed"]))
    table.add_row(
        "preemptions / recompute tokens", f"{m['preemptions']:,} / {m['recompute_tokens']:,}"
    )
    return table
