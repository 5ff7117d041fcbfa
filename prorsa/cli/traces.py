"""``prorsa traces``: import public agent traces into lifecycle telemetry and summarise them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from prorsa.cli.common import console, friendly_errors, print_json

app = typer.Typer(no_args_is_help=True)


@app.command("import")
@friendly_errors
def import_command(
    src: Path = typer.Argument(..., help="Trace file or folder."),
    fmt: str = typer.Option(..., "--format", "-f", help="Trace format (see `traces formats`)."),
    out: Path = typer.Option(..., "--out", "-o", help="Parquet file to write."),
    skip_bad: bool = typer.Option(
        False, "--skip-bad", help="Skip malformed records and report them instead of stopping."
    ),
    run_id: str | None = typer.Option(None, "--run-id", help="run_id of the events."),
) -> None:
    """Import a public trace as lifecycle events (Parquet)."""
    from prorsa.io import check_output
    from prorsa.telemetry.importers import IMPORTERS, import_trace
    from prorsa.telemetry.reader import write_parquet

    IMPORTERS.get(fmt)  # an unknown format fails before any output check
    check_output(out, inputs=[src])
    result = import_trace(src, fmt, run_id=run_id, skip_bad=skip_bad)
    write_parquet(result.table, out)
    console.print(
        f"[bold]{result.fmt}[/] {result.source}: {result.trajectories} trajectories, "
        f"{result.turns} turns, {result.events} events -> {out}",
        highlight=False,
        soft_wrap=True,
    )
    if result.derived:
        console.print("[bold]derived[/] (marked per event in detail.derived):")
        for quantity, how in result.derived.items():
            console.print(f"  {quantity}: {how}", highlight=False, soft_wrap=True)
    for note in result.notes:
        console.print(f"[dim]note:[/] {note}", highlight=False, soft_wrap=True)
    if result.skipped:
        console.print(f"[bold yellow]skipped {result.skipped}[/], first examples:")
        for example in result.skipped_examples:
            console.print(f"  {example}", highlight=False, soft_wrap=True, markup=False)
    else:
        console.print("skipped 0")


@app.command("summary")
@friendly_errors
def summary_command(
    file: Path = typer.Argument(..., help="Parquet file or telemetry directory."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    allow_partial: bool = typer.Option(
        False,
        "--allow-partial",
        help="Summarise a run that did not complete (interrupted, failed, unfinished "
        "trajectories) instead of refusing it; the summary then says so.",
    ),
) -> None:
    """Summarise telemetry: trajectories, turns, tokens, tool latency, span."""
    from prorsa.telemetry.manifest import check_complete
    from prorsa.telemetry.reader import read_telemetry
    from prorsa.telemetry.summary import summarize

    table, report = read_telemetry(file, validate=True)
    completeness = check_complete(table, allow_partial=allow_partial, location=file)
    summary = summarize(table)
    if not completeness.complete:
        summary["partial"] = completeness.to_dict()
    if not report.clean:
        summary["damage"] = {"lost_records": report.lost_records, "losses": report.losses}
    if as_json:
        print_json(summary)
        return
    if not completeness.complete:
        console.print(f"[bold yellow]{escape(completeness.describe())}[/]", highlight=False)
    if not report.clean:
        console.print(f"[yellow]{escape(report.describe())}[/]", highlight=False)
    console.print(_summary_table(summary, str(file)))


@app.command("formats")
def formats_command() -> None:
    """List the trace formats `traces import` reads."""
    from prorsa.telemetry.importers import IMPORTERS

    table = Table("format", "reads", "shared example (../shared/data/)")
    table.columns[2].overflow = "fold"
    for name in IMPORTERS:
        trace_format = IMPORTERS.get(name)
        table.add_row(name, trace_format.description, trace_format.shared_path)
    console.print(table)


def _summary_table(summary: dict[str, Any], title: str) -> Table:
    table = Table("metric", "value", title=title)
    for key, value in summary.items():
        if key in ("partial", "damage"):
            continue  # printed above the table
        if isinstance(value, dict):
            value = "  ".join(f"{k} {_fmt(v)}" for k, v in value.items()) or "-"
        table.add_row(key, _fmt(value) if not isinstance(value, str) else value)
    return table


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3f}".rstrip("0").rstrip(".") if value % 1 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)
