"""``prorsa rollout``: a real multi-turn rollout on Ray + vLLM engines with real tools."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from prorsa.cli.common import console, err_console, friendly_errors, print_json
from prorsa.cli.simulate import parse_params
from prorsa.errors import ConfigError

BACKENDS = ("ray-vllm",)


@friendly_errors
def rollout_cmd(
    model: Path = typer.Option(..., help="model folder (`prorsa models make-tiny` makes one)"),
    backend: str = typer.Option("ray-vllm", help="engine backend: ray-vllm"),
    engines: int = typer.Option(3, help="vLLM engines (one slot each)"),
    policy: str = typer.Option("colocate", help="allocation policy (see `prorsa policies`)"),
    policy_param: list[str] = typer.Option([], "--param", help="policy parameter key=value"),
    forecaster: str | None = typer.Option(None, help="forecaster for predictive / mpc"),
    scenario: str = typer.Option("math-tool", help="swe, search, math-tool, mixed, tau2"),
    trajectories: int = typer.Option(8, help="sync: one step of K; async: K in total"),
    mode: str = typer.Option("sync", help="sync | async"),
    group_size: int = typer.Option(4, help="GRPO samples per prompt (they share it)"),
    in_flight: int = typer.Option(8, help="async: trajectories kept running"),
    max_tokens: int = typer.Option(64, help="cap on output tokens per turn"),
    max_turns: int | None = typer.Option(None, help="cap on turns per trajectory"),
    max_model_len: int = typer.Option(1024, help="engine context length in tokens"),
    tool_time_scale: float = typer.Option(0.1, help="multiply the scenario's tool latencies"),
    tools: str = typer.Option("python,search,latency", help="tools the agent may call"),
    interval_s: float = typer.Option(0.5, help="control interval"),
    min_dwell_s: float = typer.Option(5.0, help="minimum time between switches of an engine"),
    drain_timeout_s: float = typer.Option(5.0, help="drain time of a switch before aborts"),
    switch_latency_s: float = typer.Option(0.1, help="switch latency policies assume"),
    local_prefill_threshold: int = typer.Option(0, help="prefill smaller turns on decode"),
    profile: str | None = typer.Option(None, help="cost profile for policy throughput numbers"),
    seed: int = typer.Option(0),
    out: Path = typer.Option(Path("out/rollout"), help="output directory"),
    as_json: bool = typer.Option(False, "--json", help="print metrics as JSON"),
) -> None:
    """Run agent trajectories on real engines; writes telemetry and metrics.json to --out.

    The engines, KV handoffs, role switches, tools and timings are real; with a random
    tiny model the tool choice and turn lengths come from the scenario's specs.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}", hint=f"choose one of {BACKENDS}")
    if not model.is_dir():
        raise ConfigError(
            f"model folder {model} does not exist",
            hint="make one with `prorsa models make-tiny --out DIR`",
        )
    from prorsa.runtime.ray.rollout import run_rollout
    from prorsa.runtime.ray.rollout_config import RolloutConfig

    config = RolloutConfig(
        model=str(model.resolve()),
        engines=engines,
        policy=policy,
        policy_params=parse_params(policy_param),
        forecaster=forecaster,
        scenario=scenario,
        trajectories=trajectories,
        group_size=group_size,
        mode=mode,
        max_in_flight=in_flight,
        max_tokens=max_tokens,
        max_turns=max_turns,
        max_model_len=max_model_len,
        tool_time_scale=tool_time_scale,
        tools=tuple(t.strip() for t in tools.split(",") if t.strip()),
        interval_s=interval_s,
        min_dwell_s=min_dwell_s,
        drain_timeout_s=drain_timeout_s,
        switch_latency_s=switch_latency_s,
        local_prefill_threshold=local_prefill_threshold,
        profile=profile,
        seed=seed,
    )
    config.validate()
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=as_json,
    ) as bar:
        task = bar.add_task(f"starting {engines} engines", total=trajectories)

        def progress(completed: int, total: int) -> None:
            bar.update(task, description="rolling out", completed=completed, total=total)

        result = run_rollout(config, out, progress=progress)
    if as_json:
        print_json(result.metrics)
    else:
        console.print(summary_table(result.metrics, f"{policy} on {scenario} ({engines} engines)"))
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
    table.add_row("engines started in", f"{m.get('engine_start_s') or 0:.1f} s")
    return table
