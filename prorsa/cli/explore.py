"""``prorsa explore``: the regime map (where disaggregation pays) and the seed's mechanisms."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from prorsa.cli.common import console, counted_progress, friendly_errors, print_json
from prorsa.errors import ConfigError
from prorsa.experiments import DEFAULT_FORECASTER


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(t) for t in _split(text)]
    except ValueError:
        raise ConfigError(f"{flag} must be integers, got '{text}'") from None


def run_map_with_progress(cfg, *, quiet: bool = False) -> dict:
    """``run_map`` behind a progress bar."""
    from prorsa.experiments.regimes import run_map

    with counted_progress("simulating", quiet=quiet) as progress:
        return run_map(cfg, progress=progress)


def headline_table(summaries: list[dict]) -> Table:
    from prorsa.experiments.regime_report import HEADLINE_POLICIES, headline

    table = Table(title="speedup over colocation at its best layout (min / median / max)")
    for col in ("model", "GPUs", "cells", "split pays", *HEADLINE_POLICIES):
        table.add_column(col, justify="left" if col == "model" else "right")
    for e in headline(summaries):
        cells = [
            f"{e[p]['min']:.2f} / {e[p]['median']:.2f} / {e[p]['max']:.2f}" if p in e else "-"
            for p in HEADLINE_POLICIES
        ]
        table.add_row(
            e["model"], str(e["gpus"]), str(e["cells"]), str(e["split_pays_cells"]), *cells
        )
    return table


def regimes_table(summaries: list[dict]) -> Table:
    from prorsa.experiments.regime_report import with_interval

    table = Table(title="regimes: speedup over colocation@best on held-out seeds (95% CI)")
    for col in ("regime", "colocation@best", "best-static", "predictive", "mpc", "oracle"):
        table.add_column(col, justify="left" if col == "regime" else "right")
    for s in summaries:
        sp = s["speedup"]
        table.add_row(
            s["label"],
            s["colocate_best"]["layout"],
            *(
                with_interval(s, p) if p == "predictive" else (f"{sp[p]:.3f}x" if p in sp else "-")
                for p in ("best-static", "predictive", "mpc", "oracle")
            ),
        )
    return table


@friendly_errors
def explore_cmd(
    grid: str = typer.Option("quick", help="regime grid: quick | demo | full"),
    quick: bool = typer.Option(False, "--quick", help="the quick grid (same as --grid quick)"),
    models: str = typer.Option("", help="only these models, comma-separated"),
    workloads: str = typer.Option("", help="only these workloads (e.g. search,swe)"),
    modes: str = typer.Option("", help="only sync or async"),
    loads: str = typer.Option("", help="only these trajectories per GPU (e.g. 16,64)"),
    mechanism: str = typer.Option(
        "", help="run one mechanism experiment instead of the map: a | b | c"
    ),
    forecaster: str = typer.Option(
        DEFAULT_FORECASTER, help="forecaster of predictive and mpc (the oracle has its own)"
    ),
    workers: int = typer.Option(
        0, help="cells run at once (0: one per CPU; 1: in this process, without Ray)"
    ),
    address: str | None = typer.Option(
        None, help="Ray cluster to run cells on (default: a local Ray instance)"
    ),
    resume: bool = typer.Option(
        True, "--resume/--fresh", help="skip cells already finished in OUT/cells.jsonl"
    ),
    eval_seeds: str = typer.Option(
        "",
        help="seeds every plan is scored on, two or more (default 9,10,11: each regime's "
        "plans are chosen on seed 0, the shipped forecasters trained on 0-8)",
    ),
    confirm_seeds: str = typer.Option(
        "",
        help="seeds that confirm a close choice of plan beside seed 0 (default 1,2; "
        "'none': seed 0 alone decides)",
    ),
    plan_by: str = typer.Option(
        "simulation",
        help="dynamic policies' layouts and start: simulation (from colocation's and "
        "best-static's searches) | analytic (the cost-model planner alone)",
    ),
    out: Path = typer.Option(Path("out/explore"), help="output directory"),
    as_json: bool = typer.Option(False, "--json", help="print the summary as JSON"),
) -> None:
    """Map where prefill/decode disaggregation pays: per regime (model, workload, sync or
    async, load, knobs) the speedup of best-static, predictive, MPC and the oracle over
    colocation at its best layout. Writes results.json, report.md and a heatmap per model.

    Cells run as Ray tasks and stream to OUT/cells.jsonl; running again skips finished
    ones. With --mechanism a|b|c, runs that experiment and writes its JSON and plot."""
    from dataclasses import asdict

    from prorsa.experiments.grids import get_grid, select
    from prorsa.experiments.regime_report import write_map_report
    from prorsa.experiments.regimes import MapConfig
    from prorsa.io import check_output

    if mechanism:
        # The mechanism experiments fix their own regimes, seeds and workers: say so
        # rather than drop a map option given with them.
        given = {
            "--grid": grid != "quick", "--quick": quick, "--models": models,
            "--workloads": workloads, "--modes": modes, "--loads": loads,
            "--workers": workers != 0, "--address": address, "--fresh": not resume,
            "--eval-seeds": eval_seeds, "--confirm-seeds": confirm_seeds,
            "--plan-by": plan_by != "simulation",
        }  # fmt: skip
        ignored = [name for name, value in given.items() if value]
        if ignored:
            raise ConfigError(
                f"{', '.join(ignored)} apply to the map, not to --mechanism {mechanism}",
                hint="a mechanism runs its own regimes, seeds and workers; drop those options",
            )
    out = check_output(out, kind="dir")
    if mechanism:
        _mechanism(mechanism, out, forecaster, as_json)
        return
    regimes = select(
        get_grid("quick" if quick else grid),
        models=_split(models),
        workloads=_split(workloads),
        modes=_split(modes),
        loads=_ints(loads, "--loads"),
    )
    cfg = MapConfig(
        regimes=regimes,
        forecaster=forecaster,
        workers=workers,
        address=address,
        cells_path=out / "cells.jsonl",
        resume=resume,
        plan_by=plan_by,
    )
    if eval_seeds:
        cfg.eval_seeds = tuple(_ints(eval_seeds, "--eval-seeds"))
    if confirm_seeds:
        none = confirm_seeds.strip().lower() == "none"
        cfg.confirm_seeds = () if none else tuple(_ints(confirm_seeds, "--confirm-seeds"))
    cfg.validate()  # before anything is printed or planned
    if not as_json:
        console.print(f"[bold]prorsa explore[/]: {len(regimes)} regimes")
    result = run_map_with_progress(cfg, quiet=as_json)
    config = {k: v for k, v in asdict(cfg).items() if k != "regimes"}
    config["grid"] = "quick" if quick else grid
    report = write_map_report(result, out, title="prorsa explore: regime map", config=config)
    if as_json:
        from prorsa.experiments.regime_report import headline
        from prorsa.experiments.regimes import goals

        print_json({"headline": headline(result["regimes"]), "goals": goals(result["regimes"])})
        return
    console.print(regimes_table(result["regimes"]))
    console.print(headline_table(result["regimes"]))
    cells = result["cells"]
    if cells.get("reused"):
        console.print(f"{cells['reused']} finished cells reused from {cells['path']} (--fresh)")
    console.print(f"report: {report}")


def _mechanism(name: str, out: Path, forecaster: str, as_json: bool) -> None:
    from prorsa.experiments import mechanisms

    if name not in mechanisms.MECHANISMS:
        raise ConfigError(
            f"unknown mechanism '{name}'", hint=f"one of {', '.join(mechanisms.MECHANISMS)}"
        )
    if name == "a":
        result = mechanisms.interference(out)
    elif name == "b":
        result = mechanisms.stage_layouts(out)
    else:
        from prorsa.experiments.regimes import MapConfig, Regime

        cfg = MapConfig(
            regimes=[Regime("qwen3-30b-a3b", "mixed", "sync", 16)],
            forecaster=forecaster,
            workers=1,
            cells_path=out / "cells.jsonl",
        )
        summary = run_map_with_progress(cfg, quiet=as_json)["regimes"][0]
        result = mechanisms.completion_tail(out, summary, cfg)
    if as_json:
        print_json(mechanisms.brief(result))
    else:
        console.print_json(data=mechanisms.brief(result))
        console.print(f"plot: {result['plot']}")
