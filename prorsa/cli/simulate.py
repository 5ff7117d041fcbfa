"""``prorsa simulate``: one simulated rollout, its telemetry and metrics."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from prorsa.cli.common import console, friendly_errors, print_json
from prorsa.cli.options import config_command, parse_params  # noqa: F401  (shared by commands)
from prorsa.errors import ConfigError
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.cluster.control import ControlConfig
from prorsa.workload.config import WorkloadConfig


@friendly_errors
@config_command(work=WorkloadConfig, cluster=ClusterConfig, control=ControlConfig)
def simulate_cmd(
    work: WorkloadConfig,
    cluster: ClusterConfig,
    control: ControlConfig,
    arrivals: bool = typer.Option(
        False,
        "--arrivals",
        help="with --trace: start every trajectory of the trace at its own arrival time "
        "(open loop; --trajectories, --steps and --mode do not apply)",
    ),
    out: Path = typer.Option(Path("out/simulate"), help="output directory"),
    as_json: bool = typer.Option(False, "--json", help="print metrics as JSON"),
) -> None:
    """Simulate one rollout; writes telemetry.parquet, metrics.json and run-manifest.json
    to --out (checked before the simulation starts; each file written whole). A run that
    stops part-way (Ctrl-C, SIGTERM, an error) still writes the telemetry it recorded,
    marked interrupted or failed."""
    from prorsa.experiments.sweep import signals_interrupt
    from prorsa.io import atomic_write_text, check_output
    from prorsa.policy.params import check_policy_params
    from prorsa.runtime.sim.drivers import ArrivalDriver
    from prorsa.runtime.sim.scenario import RunRequest, build_simulation
    from prorsa.telemetry.manifest import mark_table, run_manifest
    from prorsa.telemetry.reader import write_parquet

    if work.trace is not None:
        work.scenario = None  # a trace replaces the default scenario
    out = check_output(out, kind="dir", inputs=[work.trace])
    request = RunRequest(work, cluster, control)
    request.validate()
    control.policy_params = check_policy_params(control.policy, control.policy_params)
    driver = None
    if arrivals:
        if work.trace is None:
            raise ConfigError("--arrivals replays a trace's arrival times", hint="add --trace F")
        if work.mode != "sync":
            raise ConfigError("--arrivals runs open loop; leave --mode at sync")
        driver = ArrivalDriver.from_trace(work.trace)
        total = driver.total
    else:
        total = work.trajectories * (work.steps if work.mode == "sync" else 1)
    # Built (the trace read and checked) before an earlier run's outputs are removed: a
    # bad input must leave them as they were.
    sim = build_simulation(request, driver=driver)
    out.mkdir(parents=True, exist_ok=True)
    # An earlier run's outputs (a reader prefers telemetry/, a rollout's, to the Parquet).
    for stale in ("telemetry.parquet", "metrics.json"):
        (out / stale).unlink(missing_ok=True)
    if (out / "telemetry").is_dir():
        shutil.rmtree(out / "telemetry")
    with (
        signals_interrupt(),  # SIGTERM ends the run like Ctrl-C: marked interrupted
        run_manifest(out, command="simulate", run_id=request.run_id, planned=total) as run,
        Progress(
            TextColumn("[bold]simulating"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[sim]}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            disable=as_json,
        ) as bar,
    ):
        task = bar.add_task("sim", total=total, sim="")

        def progress(sim_time: float, completed: int) -> None:
            bar.update(task, completed=completed, sim=f"t={sim_time:,.0f}s")

        try:
            result = sim.run(progress=progress)
        except BaseException as exc:
            _keep_partial(sim, run, exc, out / "telemetry.parquet")
            raise
        run.counts.update(
            trajectories_started=int(result.metrics["trajectories_started"]),
            trajectories_completed=int(result.metrics["trajectories_completed"]),
        )
        if result.telemetry is not None:
            run.counts["events"] = result.telemetry.num_rows
        # The table says the run completed only if it did (a partial one is marked so).
        done = run.counts["trajectories_completed"]
        if done < total:
            run.finish("failed", f"only {done} of {total} trajectories completed")
        else:
            run.finish("complete")
        if result.telemetry is not None:
            write_parquet(mark_table(result.telemetry, run), out / "telemetry.parquet")
        metrics = {"request": _describe(request, arrivals), **result.metrics}
        text = json.dumps(metrics, indent=2, default=float) + "\n"
        atomic_write_text(out / "metrics.json", text)
    if as_json:
        print_json(metrics)
        return
    console.print(metrics_table(result.metrics, title=f"{control.policy} on {work.label}"))
    console.print(f"wrote {out / 'telemetry.parquet'} and {out / 'metrics.json'}")


def _keep_partial(sim, run, exc: BaseException, path: Path) -> None:
    """Write what ``sim`` recorded before ``exc`` stopped it, marked as ``run`` ends
    (interrupted or failed), so the run's folder never holds telemetry of another run
    and ``traces summary --allow-partial`` can read it."""
    import asyncio

    from prorsa.telemetry.manifest import mark_table
    from prorsa.telemetry.reader import write_parquet

    try:
        table = sim.telemetry_so_far()
        if table is None:
            return
        stopped = isinstance(exc, KeyboardInterrupt | SystemExit | asyncio.CancelledError)
        run.finish("interrupted" if stopped else "failed", f"{type(exc).__name__}: {exc}")
        result = sim.driver.result
        run.counts.update(
            trajectories_started=int(result.started),
            trajectories_completed=int(result.completed),
            events=table.num_rows,
        )
        write_parquet(mark_table(table, run), path)
    except Exception as err:  # never hide the run's own error behind this one
        console.print(f"[yellow]could not save the partial telemetry: {err}[/]")


def _describe(request, arrivals: bool = False) -> dict:
    from dataclasses import asdict

    return {
        "work": asdict(request.work),
        "cluster": asdict(request.cluster),
        "control": asdict(request.control),
        "arrivals": arrivals,
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
