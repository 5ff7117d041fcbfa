"""``prorsa demo``: where disaggregation pays next to where it does not, in a few minutes.

Two regimes of the map at 16 trajectories per GPU, sync and async: Qwen3-30B-A3B on
search (an MoE model whose colocated layouts run data-parallel attention: a prefill on one
rank stalls every rank) and Qwen2.5-7B on swe (dense, prefix-cached turns: colocation
is hard to beat). Every speedup is against colocation at its best layout. Then the
completion-time tail of the first (mechanism c).
"""

from __future__ import annotations

from pathlib import Path

import typer

from prorsa.cli.common import console, friendly_errors
from prorsa.cli.explore import regimes_table, run_map_with_progress
from prorsa.experiments import DEFAULT_FORECASTER


def verdict(summary: dict) -> str:
    """One line on whether the split pays in this regime, and why (on the held-out
    seeds, with the 95% interval of the speedup): predictive's or best-static's,
    whichever pays (predictive first), else the faster of the two."""
    from prorsa.experiments.regime_report import PAYS, pays, with_interval

    sp = summary["speedup"]
    coloc = summary["colocate_best"]["layout"]
    seeds = len(summary.get("eval_seeds", [])) or 1
    paying = [p for p in ("predictive", "best-static") if pays(summary, p)]
    if paying:
        static = summary.get("best_static") or {}
        return (
            f"the split pays: {paying[0]} {with_interval(summary, paying[0])} over "
            f"colocation at {coloc} on {seeds} held-out seeds (prefill "
            f"{static.get('prefill_layout', '?')} on {static.get('prefill_gpus', '?')} GPUs, "
            f"decode {static.get('decode_layout', '?')})"
        )
    name = max(("predictive", "best-static"), key=lambda p: sp.get(p, 0.0))
    best = sp.get(name, 0.0)
    if best > PAYS:
        return (
            f"the split is not shown to pay: {name} {with_interval(summary, name)} over "
            f"colocation at {coloc}, an interval that reaches 1x on {seeds} held-out seeds"
        )
    return f"colocation at {coloc} is as good as any split ({best:.2f}x at most)"


@friendly_errors
def demo_cmd(
    out: Path = typer.Option(Path("out/demo"), help="output directory"),
    forecaster: str = typer.Option(DEFAULT_FORECASTER, help="forecaster of predictive and mpc"),
    workers: int = typer.Option(0, help="cells run at once (0: one per CPU)"),
) -> None:
    """Where prefill/decode disaggregation pays and where it does not: an MoE model with
    data-parallel attention on search next to a dense 7B model on swe, against colocation
    at its best layout. Writes report.md, plots and results.json."""
    from dataclasses import asdict

    from prorsa.experiments import mechanisms
    from prorsa.experiments.grids import demo_grid
    from prorsa.experiments.regime_report import speedup_bars, write_map_report
    from prorsa.experiments.regimes import MapConfig
    from prorsa.io import atomic_write_text, check_output

    out = check_output(out, kind="dir")
    cfg = MapConfig(
        regimes=demo_grid(),
        forecaster=forecaster,
        workers=workers,
        cells_path=out / "cells.jsonl",
    )
    cfg.validate()  # before anything is printed or planned
    console.print(
        "[bold]prorsa demo[/]: Qwen3-30B-A3B on search (32 H200s) next to Qwen2.5-7B on swe "
        "(16 H200s), 16 trajectories per GPU, sync and async"
    )
    result = run_map_with_progress(cfg)
    summaries = result["regimes"]
    config = {k: v for k, v in asdict(cfg).items() if k != "regimes"}
    report = write_map_report(result, out, title="prorsa demo: where the split pays", config=config)
    bars = speedup_bars(summaries, out / "demo-speedup.png")
    paying = next((s for s in summaries if s["regime"]["mode"] == "sync"), summaries[0])
    tail = mechanisms.completion_tail(out, paying, cfg)
    lines = report.read_text().splitlines()
    lines[1:1] = [
        "",
        f"![speedup by regime]({bars.name})",
        "",
        *[f"* **{s['label']}**: {verdict(s)}" for s in summaries],
        "",
        f"![completion times]({Path(tail['plot']).name})",
    ]
    atomic_write_text(report, "\n".join(lines) + "\n")
    console.print(regimes_table(summaries))
    for s in summaries:
        console.print(f"[bold]{s['label']}[/]: {verdict(s)}")
    console.print(f"report: {report}")
