"""``prorsa simulate``: one simulated rollout, its telemetry and metrics."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from prorsa.cli.common import console, friendly_errors, print_json
from prorsa.errors import ConfigError


def parse_params(items: list[str]) -> dict[str, object]:
    """``key=value`` pairs; values parsed as JSON when they can be (numbers, bools)."""
    params: dict[str, object] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"policy parameter '{item}' is not key=value")
        key, value = item.split("=", 1)
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    return params


def make_request(
    *,
    scenario,
    trace,
    policy,
    policy_param,
    engines,
    profile,
    mode,
    seed,
    trajectories,
    group_size,
    steps,
    in_flight,
    tp_prefill,
    tp_decode,
    reuse_mode,
    local_prefill_threshold,
    switch_mode,
    forecaster,
    interval_s,
    min_dwell_s,
    record=True,
):
    from prorsa.runtime.sim.config import ClusterConfig
    from prorsa.runtime.sim.scenario import RunRequest, WorkloadConfig

    work = WorkloadConfig(
        scenario=None if trace else scenario,
        trace=str(trace) if trace else None,
        mode=mode,
        trajectories=trajectories,
        group_size=group_size,
        steps=steps,
        max_in_flight=in_flight,
        seed=seed,
    )
    cluster = ClusterConfig(
        profile=profile,
        num_slots=engines,
        role_tp={"prefill": tp_prefill, "decode": tp_decode, "colocated": tp_decode},
        reuse_mode=reuse_mode,
        local_prefill_threshold=local_prefill_threshold,
        switch_mode=switch_mode,
    )
    return RunRequest(
        work=work,
        cluster=cluster,
        policy=policy,
        policy_params=parse_params(policy_param),
        forecaster=forecaster,
        interval_s=interval_s,
        min_dwell_s=min_dwell_s,
        record=record,
    )


SCENARIO = typer.Option("swe", help="workload scenario: swe, search, math-tool, mixed, tau2")
TRACE = typer.Option(None, help="replay an imported trace (.parquet) instead of a scenario")


@friendly_errors
def simulate_cmd(
    scenario: str = SCENARIO,
    trace: Path | None = TRACE,
    policy: str = typer.Option("colocate", help="allocation policy (see `prorsa policies`)"),
    policy_param: list[str] = typer.Option([], "--param", help="policy parameter key=value"),
    engines: int = typer.Option(16, help="engine slots (GPUs at TP1)"),
    profile: str = typer.Option("h200-qwen2.5-7b-tp1", help="cost profile"),
    mode: str = typer.Option("sync", help="sync | async"),
    seed: int = typer.Option(0),
    trajectories: int = typer.Option(256, help="per sync step, or in total (async)"),
    group_size: int = typer.Option(8, help="GRPO samples per prompt"),
    steps: int = typer.Option(1, help="sync RL steps"),
    in_flight: int = typer.Option(128, help="async: trajectories kept in flight"),
    tp_prefill: int = typer.Option(1, help="tensor-parallel degree of prefill engines"),
    tp_decode: int = typer.Option(1, help="tensor-parallel degree of decode/colocated engines"),
    reuse_mode: str = typer.Option("pull", help="multi-turn reuse: reprefill | pull"),
    local_prefill_threshold: int = typer.Option(
        0, help="prefill smaller turns on the decode engine"
    ),
    switch_mode: str = typer.Option("drain", help="role switch: drain | migrate"),
    forecaster: str | None = typer.Option(None, help="forecaster for predictive policies"),
    interval_s: float = typer.Option(1.0, help="control interval"),
    min_dwell_s: float = typer.Option(10.0, help="minimum time between switches of a slot"),
    out: Path = typer.Option(Path("out/simulate"), help="output directory"),
    as_json: bool = typer.Option(False, "--json", help="print metrics as JSON"),
) -> None:
    """Simulate one rollout; writes telemetry.parquet and metrics.json to --out."""
    options = {k: v for k, v in locals().items() if k not in ("out", "as_json")}
    from prorsa.runtime.sim.scenario import simulate
    from prorsa.telemetry.reader import write_parquet

    request = make_request(**options)
    total = trajectories * (steps if mode == "sync" else 1)
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
    console.print(metrics_table(result.metrics, title=f"{policy} on {trace or scenario}"))
    console.print(f"wrote {out / 'telemetry.parquet'} and {out / 'metrics.json'}")


def _describe(request) -> dict:
    from dataclasses import asdict

    return {
        "work": asdict(request.work),
        "cluster": asdict(request.cluster),
        "policy": request.policy,
        "policy_params": request.policy_params,
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
