"""``prorsa forecast``: build datasets, train, backtest and list demand forecasters."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from prorsa.cli.common import console, friendly_errors, print_json, progress_bar
from prorsa.errors import ConfigError

app = typer.Typer(no_args_is_help=True, help="Forecast prefill/decode demand.")

DEFAULT_PROFILE = "h200-qwen2.5-7b-tp1"


def _list(text: str | None) -> list[str]:
    return [s.strip() for s in (text or "").split(",") if s.strip()]


def _horizons(text: str) -> tuple[float, ...]:
    from prorsa.forecast.types import check_horizons

    try:
        return check_horizons([float(h) for h in _list(text)])
    except ValueError:
        raise ConfigError(f"horizons must be comma-separated seconds, got '{text}'") from None


# --------------------------------------------------------------------- dataset
@app.command("dataset")
@friendly_errors
def dataset_cmd(
    out: Path = typer.Option(..., "--out", help="dataset file (DATA.parquet; siblings beside)"),
    from_sim: str | None = typer.Option(None, help="simulate scenarios, e.g. swe,math-tool"),
    from_trace: str | None = typer.Option(None, help="replay traces (.parquet) in the simulator"),
    telemetry: list[Path] = typer.Option([], help="existing telemetry file(s) instead"),
    seeds: int = typer.Option(2, help="seeds per scenario / trace"),
    seed_offset: int = typer.Option(0, help="first seed (held-out data: use another range)"),
    engines: int = typer.Option(8, help="engine slots of each simulation"),
    policy: str = typer.Option("static", help="allocation policy of each simulation"),
    profile: str = typer.Option(DEFAULT_PROFILE, help="cost profile of each simulation"),
    mode: str = typer.Option("sync", help="sync, async or sync,async"),
    load_per_gpu: int = typer.Option(
        16,
        help="trajectories per GPU: a sync step of load x GPUs, or async with that many in flight",
    ),
    reuse_mode: str = typer.Option("reprefill", help="multi-turn KV reuse of each simulation"),
    horizons: str = typer.Option("1,2,5,10,30", help="forecast horizons (s)"),
    tick_s: float = typer.Option(1.0, help="control interval of the replay"),
    snapshot_every: int = typer.Option(2, help="per-trajectory snapshots every N ticks"),
    allow_partial: bool = typer.Option(
        False, help="use telemetry of runs that ended early (listed in the dataset's meta)"
    ),
    as_json: bool = typer.Option(False, "--json", help="print a JSON summary"),
) -> None:
    """Replay simulated runs or telemetry tick by tick into a forecasting dataset."""
    from prorsa.forecast.dataset import build_dataset
    from prorsa.forecast.shipping import SimPlan, simulate_runs
    from prorsa.io import check_output
    from prorsa.runtime.cluster.config import ClusterConfig
    from prorsa.runtime.cluster.control import ControlConfig
    from prorsa.telemetry.reader import read_telemetry

    hs = _horizons(horizons)
    # Before any simulation: the dataset may not replace one of its inputs.
    check_output(out, inputs=[*telemetry, *(Path(t) for t in _list(from_trace))])
    if not (from_sim or from_trace or telemetry):
        raise ConfigError("give --from-sim, --from-trace or --telemetry")
    if (from_sim or from_trace) and telemetry:
        raise ConfigError("give simulations (--from-sim/--from-trace) or --telemetry, not both")
    modes = _list(mode)
    if not modes or any(m not in ("sync", "async") for m in modes):
        raise ConfigError(f"mode must be sync, async or sync,async, not '{mode}'")
    tables = []
    with progress_bar("simulating", quiet=as_json) as bar:
        if telemetry:
            from prorsa.telemetry.manifest import check_complete

            tables = [read_telemetry(p, validate=True)[0] for p in telemetry]
            for path, table in zip(telemetry, tables, strict=True):
                # The run manifest beside a file is found by its path only.
                check_complete(table, allow_partial=allow_partial, location=path)
        else:
            plan = SimPlan(
                scenarios=_list(from_sim),
                traces=_list(from_trace),
                modes=modes,
                seeds=range(seed_offset, seed_offset + seeds),
                load_per_gpu=load_per_gpu,
                cluster=ClusterConfig(profile=profile, num_slots=engines, reuse_mode=reuse_mode),
                control=ControlConfig(policy=policy),
            )
            task = bar.add_task("sim", total=len(plan.runs()))
            tables = simulate_runs(plan, lambda i, n: bar.update(task, completed=i))
    with progress_bar("replaying", quiet=as_json) as bar:
        task = bar.add_task("replay", total=None)
        data = build_dataset(
            tables,
            horizons=hs,
            tick_s=tick_s,
            snapshot_every=snapshot_every,
            progress=lambda i, n: bar.update(task, completed=i, total=n),
            allow_partial=allow_partial,
            names=[str(p) for p in telemetry] if telemetry else None,
        )
    data.save(out)
    summary = {
        "out": str(out),
        "runs": len(data.runs),
        "ticks": len(data.ticks),
        "snapshots": len(data.snapshots),
        "turns": len(data.turns),
        "horizons": list(data.horizons),
        "tasks": list(data.tasks),
        "data_hash": data.data_hash(),
    }
    if as_json:
        print_json(summary)
        return
    console.print(
        f"wrote {out}: {summary['runs']} runs, {summary['ticks']:,} ticks, "
        f"{summary['turns']:,} turns, {summary['snapshots']:,} trajectory snapshots"
    )


# ----------------------------------------------------------------------- train
def _params(items: list[str]) -> dict:
    from prorsa.cli.simulate import parse_params

    return parse_params(items)


@app.command("train")
@friendly_errors
def train_cmd(
    model: str = typer.Option(..., "--model", help="forecaster name (see `prorsa forecast list`)"),
    data: Path = typer.Option(..., "--data", help="dataset from `prorsa forecast dataset`"),
    out: Path = typer.Option(..., "--out", help="model folder to write, e.g. models/NAME"),
    seed: int = typer.Option(0, help="training seed"),
    horizons: str | None = typer.Option(None, help="horizons to fit (default: the dataset's)"),
    param: list[str] = typer.Option([], "--param", help="forecaster parameter key=value"),
    validate: list[Path] = typer.Option(
        [], help="held-out telemetry to backtest after training (scores go in the manifest)"
    ),
    select_on: list[Path] = typer.Option(
        [],
        "--select-on",
        help="validation telemetry (neither trained on nor held out) to recalibrate the "
        "quantiles and choose the point forecast on, per target and horizon (learned models)",
    ),
    mlflow: str | None = typer.Option(None, "--mlflow", help="MLflow tracking URI to log to"),
    as_json: bool = typer.Option(False, "--json", help="print a JSON summary"),
) -> None:
    """Fit a forecaster on a dataset and save it (manifest + model files)."""
    from prorsa.forecast.shipping import concat_tables, train_model
    from prorsa.io import check_output
    from prorsa.telemetry.reader import read_telemetry

    check_output(out, kind="dir", inputs=[data, *validate, *select_on])
    tables = [read_telemetry(p, validate=True)[0] for p in validate]
    choose_on = [read_telemetry(p, validate=True)[0] for p in select_on]
    with progress_bar("training / validating", quiet=as_json) as bar:
        task = bar.add_task("train", total=None)
        summary = train_model(
            model,
            data,
            out,
            seed=seed,
            horizons=_horizons(horizons) if horizons else None,
            params=_params(param),
            validate=tables,
            select_on=concat_tables(choose_on) if choose_on else None,
            mlflow=mlflow,
            progress=lambda i, n: bar.update(task, completed=i, total=n),
        )
    if as_json:
        print_json(summary)
        return
    console.print(f"saved {summary['name']} to {out} (data {summary['data_hash'][:12]})")
    if summary["metrics"]:
        console.print(_metrics_table(summary["metrics"], f"{model}: metrics"))


def _metrics_table(metrics: dict, title: str) -> Table:
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in sorted(metrics.items()):
        table.add_row(key, f"{value:.4f}")
    return table


# -------------------------------------------------------------------- backtest
@app.command("backtest")
@friendly_errors
def backtest_cmd(
    model: str = typer.Option(..., "--model", help="model folder, shipped model or data-free name"),
    telemetry: list[Path] = typer.Option(..., "--telemetry", help="held-out telemetry file(s)"),
    horizons: str | None = typer.Option(None, help="horizons to score (default: all fitted)"),
    plots: Path = typer.Option(Path("out/forecast-backtest"), help="folder for the plots"),
    plot_horizon: float = typer.Option(5.0, help="horizon (s) shown in the plots"),
    mlflow: str | None = typer.Option(None, "--mlflow", help="MLflow tracking URI to log to"),
    as_json: bool = typer.Option(False, "--json", help="print scores as JSON"),
) -> None:
    """Rolling-origin backtest on held-out telemetry: WAPE, MAE, pinball per target/horizon."""
    from prorsa.forecast.backtest import backtest, plot_backtest, score
    from prorsa.forecast.shipping import concat_tables
    from prorsa.forecast.tracking import log_run, tracking_uri
    from prorsa.runtime.forecast_provider import resolve_forecaster
    from prorsa.telemetry.reader import read_telemetry

    forecaster = resolve_forecaster(model)
    tables = [read_telemetry(p, validate=True)[0] for p in telemetry]
    table = concat_tables(tables)
    hs = _horizons(horizons) if horizons else None
    with progress_bar("backtesting", quiet=as_json) as bar:
        task = bar.add_task("bt", total=None)
        results = backtest(
            forecaster,
            table,
            horizons=hs,
            progress=lambda i, n: bar.update(task, completed=i, total=n),
        )
    scores = score(results)
    files = []
    if plot_horizon in results["horizon_s"].unique():
        files = plot_backtest(results, plots, horizon_s=plot_horizon)
    uri = tracking_uri(mlflow)
    if uri:
        metrics = {
            f"wape_{r.target}_h{r.horizon_s:g}": r.wape for r in scores.itertuples(index=False)
        }
        log_run(
            uri,
            run_name=f"backtest {forecaster.name}",
            params={"model": str(model), "telemetry": ",".join(map(str, telemetry))},
            metrics=metrics,
            artifacts=plots if files else None,
        )
    if as_json:
        print_json({"scores": scores.to_dict(orient="records"), "plots": [str(f) for f in files]})
        return
    table_out = Table(
        title=f"{forecaster.name}: rolling-origin backtest ({results['cutoff'].nunique()} cutoffs)"
    )
    columns = ("target", "horizon_s", "wape", "mae", "pinball_0.5", "coverage_0.1", "coverage_0.9")
    for col in columns:
        table_out.add_column(col, justify="right" if col != "target" else "left")

    def cell(value: float, fmt: str) -> str:
        return "-" if value != value else format(value, fmt)

    for r in scores.to_dict("records"):
        table_out.add_row(
            r["target"],
            f"{r['horizon_s']:g}",
            cell(r["wape"], ".3f"),
            cell(r["mae"], ",.1f"),
            cell(r["pinball_0.5"], ",.1f"),
            cell(r["coverage_0.1"], ".2f"),
            cell(r["coverage_0.9"], ".2f"),
        )
    console.print(table_out)
    if files:
        console.print(f"plots in {plots}/ ({len(files)} files)")


# ------------------------------------------------------------------------ list
@app.command("list")
@friendly_errors
def list_cmd(as_json: bool = typer.Option(False, "--json", help="print as JSON")) -> None:
    """Registered forecasters and the shipped models."""
    from prorsa.forecast import FORECASTERS
    from prorsa.runtime.forecast_provider import models_dir

    rows = []
    for name in FORECASTERS.names():
        klass = FORECASTERS.get(name)
        doc = (klass.__doc__ or "").strip().splitlines()[0]
        manifest = models_dir() / name / "manifest.json"
        shipped = json.loads(manifest.read_text()) if manifest.exists() else None
        rows.append(
            {
                "name": name,
                "description": doc,
                "needs_training": klass.requires_data,
                "quantiles": klass.provides_quantiles,
                "shipped_model": str(manifest.parent) if shipped else None,
                "data_hash": shipped.get("data_hash") if shipped else None,
            }
        )
    if as_json:
        print_json(rows)
        return
    table = Table(title="forecasters")
    for col in ("name", "description", "training", "p50/p90", "shipped model"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["name"],
            r["description"],
            "needs data" if r["needs_training"] else "none",
            "yes" if r["quantiles"] else "-",
            r["shipped_model"] or "-",
        )
    console.print(table)


# ------------------------------------------------------------------------ ship
@app.command("ship")
@friendly_errors
def ship_cmd(
    out: Path = typer.Option(Path("models"), help="folder of the shipped models"),
    keep_data: Path | None = typer.Option(None, help="also keep the datasets in this folder"),
    model: list[str] = typer.Option([], "--model", help="ship only these (default: all)"),
    validate_every: int = typer.Option(
        3, help="backtest every n-th held-out run for the data card (0: none)"
    ),
) -> None:
    """Regenerate the shipped models (and models/README.md) from the fixed recipe."""
    from prorsa.forecast.shipping import SHIP_MODELS, ship

    with progress_bar("shipping") as bar:
        task = bar.add_task("ship", total=None)

        def progress(stage: str, done: int, total: int) -> None:
            bar.update(task, description=stage, completed=done, total=total)

        report = ship(
            out,
            keep_data=keep_data,
            models=model or SHIP_MODELS,
            validate_every=validate_every,
            progress=progress,
        )
    console.print(
        f"shipped {', '.join(report.models)} to {out}/ from {report.train_runs} training and "
        f"{report.heldout_runs} held-out runs (simulator {report.simulator['commit']}; "
        f"data card: {out / 'README.md'})"
    )


# --------------------------------------------------------------------- compose
@app.command("compose")
@friendly_errors
def compose_cmd(
    models: Path = typer.Option(Path("models"), help="folder holding the candidate models"),
    candidates: str = typer.Option(
        "lightgbm-trajectory,lightgbm-aggregate", "--from", help="candidate model folders"
    ),
    out: Path | None = typer.Option(None, help="where to save it (default: MODELS/per-target)"),
    metric: str = typer.Option(
        "validation_wape_{target}_h5", help="manifest metric to choose by ({target} filled in)"
    ),
    as_json: bool = typer.Option(False, "--json", help="print the choice as JSON"),
) -> None:
    """Compose a per-target forecaster: each target from the candidate scoring best on it."""
    from prorsa.forecast.per_target import choice_cells, compose_shipped

    names = _list(candidates)
    if len(names) < 2:
        raise ConfigError(f"--from needs two or more candidates, got {names}")
    path, choice = compose_shipped(models, names, metric=metric, out=out)
    if as_json:
        print_json({"out": str(path), "targets": choice})
        return
    table = Table(title=f"per-target forecaster -> {path}")
    table.add_column("target")
    for name in names:
        table.add_column(name)
    for target, entry in choice.items():
        cells = choice_cells(entry, names, digits=4, mark=lambda text: f"[bold]{text}[/bold]")
        table.add_row(target, *cells)
    console.print(table)
