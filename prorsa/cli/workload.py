"""``prorsa workload``: fit task profiles to traces, inspect and sample them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import typer
from rich.table import Table

from prorsa.cli.common import console, friendly_errors, print_json
from prorsa.errors import ConfigError

app = typer.Typer(no_args_is_help=True)


@app.command("fit")
@friendly_errors
def fit(
    trace: Path = typer.Argument(..., help="imported trace (.parquet) or telemetry directory"),
    out: Path = typer.Option(..., "--out", "-o", help="profile JSON to write"),
    name: str | None = typer.Option(None, help="profile name (default: the output file's stem)"),
    group_rho: float | None = typer.Option(None, help="override the GRPO-group correlation"),
    allow_partial: bool = typer.Option(
        False,
        "--allow-partial",
        help="Fit to a run that did not complete (its cut-short trajectories bias the fit).",
    ),
) -> None:
    """Fit a task profile (turns, context growth, outputs, tool time) to a trace."""
    from prorsa.io import check_output
    from prorsa.workload import profile_from_trace

    if group_rho is not None and not 0.0 <= group_rho <= 1.0:
        raise ConfigError(f"--group-rho must be in [0, 1], got {group_rho}")
    check_output(out, inputs=[trace])
    overrides = {} if group_rho is None else {"group_rho": group_rho}
    profile = profile_from_trace(name or out.stem, trace, allow_partial=allow_partial, **overrides)
    profile.sources["trace"] = str(trace)
    profile.save(out)
    console.print(f"wrote {out}: {profile.sources['fit']}")


@app.command("show")
@friendly_errors
def show(
    name: str = typer.Argument(..., help="scenario name or profile JSON path"),
    n: int = typer.Option(2000, min=1, help="trajectories to sample for the summary"),
    seed: int = typer.Option(0),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Summarise a profile by sampling it: turns, context, output and tool time."""
    profile = _load(name)
    specs = profile.sample(n, seed, group_size=8)
    turns = np.array([s.num_turns for s in specs])
    ctx = np.concatenate([s.context_by_turn for s in specs])
    out = np.concatenate([s.output_tokens for s in specs])
    tool = np.concatenate([s.tool_latency_s[:-1] for s in specs])
    summary = {
        "profile": profile.name,
        "trajectories": n,
        "turns": _q(turns, (50, 90, 100)),
        "context_tokens": _q(ctx, (50, 90, 99)),
        "output_tokens": _q(out, (50, 90, 99)),
        "tool_latency_s": _q(tool, (50, 90, 99)),
    }
    if as_json:
        print_json(summary)
        return
    table = Table(title=f"profile {profile.name} ({n} sampled trajectories)")
    table.add_column("quantity")
    table.add_column("p50", justify="right")
    table.add_column("p90", justify="right")
    table.add_column("p99 / max", justify="right")
    for key in ("turns", "context_tokens", "output_tokens", "tool_latency_s"):
        values = list(summary[key].values())
        table.add_row(key, *(f"{v:,.1f}" for v in values))
    console.print(table)


@app.command("sample")
@friendly_errors
def sample(
    name: str = typer.Argument(..., help="scenario name or profile JSON path"),
    n: int = typer.Option(..., "-n", min=0, help="number of trajectories"),
    out: Path = typer.Option(..., "--out", "-o", help="JSON-lines file of trajectory specs"),
    seed: int = typer.Option(0),
    group_size: int = typer.Option(8, min=1, help="GRPO group size (samples per prompt)"),
) -> None:
    """Write ``n`` sampled trajectory specs as JSON lines."""
    from prorsa.io import atomic_open, check_output

    check_output(out, inputs=[Path(name)])
    specs = _load(name).sample(n, seed, group_size=group_size)
    with atomic_open(out) as fh:
        for spec in specs:
            fh.write(json.dumps(spec.to_dict()) + "\n")
    console.print(f"wrote {len(specs)} specs to {out}")


def _load(name: str):
    from prorsa.workload import get_scenario, load_profile

    path = Path(name)
    return load_profile(path) if path.suffix == ".json" else get_scenario(name)


def _q(values: np.ndarray, qs: tuple[int, ...]) -> dict[str, float]:
    return {f"p{q}" if q < 100 else "max": float(np.percentile(values, q)) for q in qs}
