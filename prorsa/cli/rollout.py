"""``prorsa rollout``: a real multi-turn rollout on Ray + vLLM engines with real tools.

Its options are the fields of the configurations a simulation uses (workload, cluster,
control loop), with the same defaults and help, plus the settings only real engines have
(:class:`~prorsa.runtime.ray.rollout_config.RolloutConfig`). Simulator-only fields
(layouts, link model, migration...) are not offered.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from prorsa.cli.common import console, err_console, friendly_errors, print_json
from prorsa.cli.options import config_command
from prorsa.errors import ConfigError
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.cluster.control import ControlConfig
from prorsa.runtime.ray.rollout_config import PARTS, SIMULATOR_ONLY, RolloutConfig
from prorsa.workload.config import WorkloadConfig

#: Options not offered: simulator-only fields, the composed parts themselves (their
#: fields are offered one by one) and ``tools`` (a comma-separated option below).
EXCLUDED = (*SIMULATOR_ONLY, *(f"runtime.{part}" for part in PARTS), "runtime.tools")


@friendly_errors
@config_command(
    work=WorkloadConfig,
    cluster=ClusterConfig,
    control=ControlConfig,
    runtime=RolloutConfig,
    exclude=EXCLUDED,
)
def rollout_cmd(
    work: WorkloadConfig,
    cluster: ClusterConfig,
    control: ControlConfig,
    runtime: RolloutConfig,
    tools: str = typer.Option(
        ",".join(RolloutConfig.tools), help="tools the agent may call, comma-separated"
    ),
    out: Path = typer.Option(Path("out/rollout"), help="output directory"),
    as_json: bool = typer.Option(False, "--json", help="print metrics as JSON"),
) -> None:
    """Run agent trajectories on real engines; writes telemetry and metrics.json to --out.

    The engines, KV handoffs, role switches, tools and timings are real; with a random
    tiny model the tool choice and turn lengths come from the scenario's specs. On CPU
    pass --profile cpu-tiny-llama-tp1 so policies size with this machine's numbers.
    """
    from prorsa.io import check_output
    from prorsa.runtime.ray.rollout import run_rollout

    config = dataclasses.replace(
        runtime,
        work=work,
        cluster=cluster,
        control=control,
        tools=tuple(t.strip() for t in tools.split(",") if t.strip()),
    )
    model = Path(config.model)
    if not model.is_dir():
        raise ConfigError(
            f"model folder {model} does not exist",
            hint="make one with `prorsa models make-tiny --out DIR`",
        )
    config = dataclasses.replace(config, model=str(model.resolve()))
    config.validate()
    check_output(out, kind="dir", inputs=[config.model])  # before the progress bar shows
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=as_json,
    ) as bar:
        task = bar.add_task(f"starting {config.engines} engines", total=work.trajectories)

        def progress(completed: int, total: int) -> None:
            bar.update(task, description="rolling out", completed=completed, total=total)

        result = run_rollout(config, out, progress=progress)
    if as_json:
        print_json(result.metrics)
    else:
        title = f"{control.policy} on {work.scenario} ({config.engines} engines)"
        console.print(summary_table(result.metrics, title))
        console.print(f"wrote {out}/telemetry.parquet, metrics.json and specs.jsonl")
    if result.errors:
        for line in result.errors[:5]:
            err_console.print(f"[bold red]failed:[/] {line}", highlight=False)
        raise typer.Exit(1)


def summary_table(m: dict, title: str) -> Table:
    """The rollout's headline numbers."""
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    if m["mode"] == "sync":
        table.add_row("makespan", f"{m['makespan_s']:,.2f} s")
    table.add_row("throughput", f"{m['throughput_traj_per_hour']:,.0f} trajectories/h")
    table.add_row(
        "trajectories", f"{m['trajectories_completed']:,} / {m['trajectories_started']:,}"
    )
    table.add_row("turns (paths)", f"{m['turns']:,} {m['turn_paths']}")
    for key in ("ttft_s", "tpot_s", "completion_s"):
        if m.get(f"{key}_p50") is not None:
            table.add_row(
                f"{key[:-2]} p50 / p99", f"{m[f'{key}_p50']:.4f} / {m[f'{key}_p99']:.4f} s"
            )
    table.add_row("decode tokens/s", f"{m['decode_tokens_per_s']:,.0f}")
    table.add_row("switches", f"{m['switches_completed']} ({m['switch_s_total']:.2f} s)")
    table.add_row("tool calls", str(m["tool_calls"]))
    table.add_row("KV use from", ", ".join(m["kv_source"]))
    if m.get("engines_lost"):
        table.add_row("engines lost", ", ".join(str(e) for e in m["engines_lost"]))
    table.add_row("engines started in", f"{m.get('engine_start_s') or 0:.1f} s")
    return table
