"""``prorsa forecast``: build datasets, train, backtest and list demand forecasters."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from prorsa.cli.common import console, friendly_errors, print_json
from prorsa.errors import ConfigError, InputError

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


def _progress(label: str, disable: bool = False) -> Progress:
    return Progress(
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=disable,
    )


# ------------------------------------------------------------------ simulation
@dataclass
class SimPlan:
    """Simulated runs for a dataset: scenarios or trace replays x modes x seeds."""

    scenarios: list[str] = field(default_factory=list)
    traces: list[str] = field(default_factory=list)
    modes: list[str] = field(default_factory=lambda: ["sync"])
    seeds: Sequence[int] = (0,)
    engines: int = 8
    policy: str = "static"
    profile: str = DEFAULT_PROFILE
    trajectories: int = 128
    in_flight: int = 64

    def runs(self) -> list[tuple[str, str | None, str, int, str]]:
        """(run id, scenario or None, trace or "", seed, mode) for every run."""
        out = []
        for mode in self.modes:
            for seed in self.seeds:
                for sc in self.scenarios:
                    rid = f"{sc}-{mode}-{self.policy}-e{self.engines}-s{seed}"
                    out.append((rid, sc, "", seed, mode))
                for trace in self.traces:
                    rid = f"replay:{Path(trace).stem}-{mode}-{self.policy}-e{self.engines}-s{seed}"
                    out.append((rid, None, trace, seed, mode))
        return out


def simulate_runs(plan: SimPlan, progress: Callable[[int, int], None] | None = None) -> list:
    """Run every simulation of ``plan``; their telemetry tables (marked as simulated)."""
    from prorsa.runtime.sim.config import ClusterConfig
    from prorsa.runtime.sim.scenario import ControlConfig, RunRequest, WorkloadConfig, simulate

    runs = plan.runs()
    tables = []
    for i, (run_id, scenario, trace, seed, mode) in enumerate(runs, 1):
        work = WorkloadConfig(
            scenario=scenario,
            trace=trace or None,
            mode=mode,
            trajectories=plan.trajectories if mode == "sync" else plan.trajectories * 2,
            max_in_flight=plan.in_flight,
            seed=seed,
        )
        cluster = ClusterConfig(profile=plan.profile, num_slots=plan.engines)
        result = simulate(
            RunRequest(work, cluster, ControlConfig(policy=plan.policy), run_id=run_id)
        )
        if result.telemetry is None or result.telemetry.num_rows == 0:
            raise InputError(f"simulation {run_id} recorded no telemetry")
        tables.append(result.telemetry)
        if progress is not None:
            progress(i, len(runs))
    return tables


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
    trajectories: int = typer.Option(128, help="trajectories per sync step (async: twice)"),
    in_flight: int = typer.Option(64, help="async: trajectories kept in flight"),
    horizons: str = typer.Option("1,2,5,10,30", help="forecast horizons (s)"),
    tick_s: float = typer.Option(1.0, help="control interval of the replay"),
    snapshot_every: int = typer.Option(2, help="per-trajectory snapshots every N ticks"),
    as_json: bool = typer.Option(False, "--json", help="print a JSON summary"),
) -> None:
    """Replay simulated runs or telemetry tick by tick into a forecasting dataset."""
    from prorsa.forecast.dataset import build_dataset
    from prorsa.telemetry.reader import read_telemetry

    hs = _horizons(horizons)
    if not (from_sim or from_trace or telemetry):
        raise ConfigError("give --from-sim, --from-trace or --telemetry")
    if (from_sim or from_trace) and telemetry:
        raise ConfigError("give simulations (--from-sim/--from-trace) or --telemetry, not both")
    modes = _list(mode)
    if not modes or any(m not in ("sync", "async") for m in modes):
        raise ConfigError(f"mode must be sync, async or sync,async, not '{mode}'")
    tables = []
    with _progress("simulating", disable=as_json) as bar:
        if telemetry:
            tables = [read_telemetry(p)[0] for p in telemetry]
        else:
            plan = SimPlan(
                scenarios=_list(from_sim),
                traces=_list(from_trace),
                modes=modes,
                seeds=range(seed_offset, seed_offset + seeds),
                engines=engines,
                policy=policy,
                profile=profile,
                trajectories=trajectories,
                in_flight=in_flight,
            )
            task = bar.add_task("sim", total=len(plan.runs()))
            tables = simulate_runs(plan, lambda i, n: bar.update(task, completed=i))
    with _progress("replaying", disable=as_json) as bar:
        task = bar.add_task("replay", total=None)
        data = build_dataset(
            tables,
            horizons=hs,
            tick_s=tick_s,
            snapshot_every=snapshot_every,
            progress=lambda i, n: bar.update(task, completed=i, total=n),
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
    mlflow: str | None = typer.Option(None, "--mlflow", help="MLflow tracking URI to log to"),
    as_json: bool = typer.Option(False, "--json", help="print a JSON summary"),
) -> None:
    """Fit a forecaster on a dataset and save it (manifest + model files)."""
    from prorsa.telemetry.reader import read_telemetry

    tables = [read_telemetry(p)[0] for p in validate]
    summary = train_model(
        model,
        data,
        out,
        seed=seed,
        horizons=horizons,
        params=_params(param),
        validate=tables,
        mlflow=mlflow,
        quiet=as_json,
    )
    if as_json:
        print_json(summary)
        return
    console.print(f"saved {summary['name']} to {out} (data {summary['data_hash'][:12]})")
    if summary["metrics"]:
        console.print(_metrics_table(summary["metrics"], f"{model}: metrics"))


def train_model(
    model: str,
    data_path: Path,
    out: Path,
    *,
    seed: int = 0,
    horizons: str | None = None,
    params: dict | None = None,
    validate: Sequence = (),
    mlflow: str | None = None,
    quiet: bool = False,
    extra_manifest: dict | None = None,
) -> dict:
    """Train, backtest on held-out telemetry if given, save, and log to MLflow when asked."""
    import pyarrow as pa

    from prorsa.forecast import make_forecaster
    from prorsa.forecast.backtest import backtest, score
    from prorsa.forecast.dataset import ForecastDataset
    from prorsa.forecast.tracking import log_run, tracking_uri

    data = ForecastDataset.load(data_path)
    kwargs = dict(params or {})
    kwargs["seed"] = seed
    kwargs["horizons"] = _horizons(horizons) if horizons else data.horizons
    forecaster = make_forecaster(model, **kwargs)
    status = console.status(f"training {model}", spinner="dots")
    with _Quiet() if quiet else status:
        forecaster.fit(data)
    metrics = dict(forecaster.metrics_)
    if validate:
        table = validate[0] if len(validate) == 1 else _concat(pa, list(validate))
        with _progress("validating", disable=quiet) as bar:
            task = bar.add_task("val", total=None)
            results = backtest(
                forecaster, table, progress=lambda i, n: bar.update(task, completed=i, total=n)
            )
        for r in score(results).itertuples(index=False):
            metrics[f"heldout_wape_{r.target}_h{r.horizon_s:g}"] = r.wape
    path = forecaster.save(out, metrics=metrics)
    if extra_manifest:
        manifest = json.loads((path / "manifest.json").read_text())
        manifest.update(extra_manifest)
        (path / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    uri = tracking_uri(mlflow)
    if uri:
        log_run(
            uri,
            run_name=f"train {model}",
            params={"model": model, **forecaster.get_params(), "data": str(data_path)},
            metrics=metrics,
            artifacts=path,
            tags={"prorsa.data_hash": forecaster.data_hash_ or ""},
        )
    return {
        "name": model,
        "out": str(path),
        "data_hash": forecaster.data_hash_ or "",
        "metrics": metrics,
    }


class _Quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


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
    import pyarrow as pa

    from prorsa.forecast.backtest import backtest, plot_backtest, score
    from prorsa.forecast.tracking import log_run, tracking_uri
    from prorsa.runtime.forecast_provider import resolve_forecaster
    from prorsa.telemetry.reader import read_telemetry

    forecaster = resolve_forecaster(model)
    tables = [read_telemetry(p)[0] for p in telemetry]
    table = tables[0] if len(tables) == 1 else _concat(pa, tables)
    hs = _horizons(horizons) if horizons else None
    with _progress("backtesting", disable=as_json) as bar:
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
    for col in ("target", "horizon_s", "wape", "mae", "pinball_0.5", "pinball_0.9", "coverage_0.9"):
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
            cell(r["pinball_0.9"], ",.1f"),
            cell(r["coverage_0.9"], ".2f"),
        )
    console.print(table_out)
    if files:
        console.print(f"plots in {plots}/ ({len(files)} files)")


def _concat(pa, tables):
    meta = tables[0].schema.metadata
    same = all(t.schema.metadata == meta for t in tables)
    merged = pa.concat_tables([t.replace_schema_metadata(None) for t in tables])
    return merged.replace_schema_metadata(meta if same else None)


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
#: What the shipped models are trained on (models/README.md is written from this).
SHIP_SCENARIOS = ["swe", "search", "math-tool", "mixed", "tau2"]
SHIP_TRACES = [
    "mini-swe-agent-swebench",
    "tau2-telecom-gpt4o",
    "tracelab-round-trace",
    "swe-agent",
]
SHIP_MODELS = ["lightgbm-trajectory", "lightgbm-aggregate", "gru"]
SHIP_PLANS = [  # (policy, engines, seeds)
    ("static", 8, (0, 1, 2)),
    ("colocate", 16, (3,)),
]
SHIP_HELDOUT = ("static", 8, (100,))


def split_trace(path: Path, out_dir: Path) -> tuple[Path, Path]:
    """Write the even- and odd-numbered trajectories of a trace (sorted ids) to two files:
    the first half trains the shipped models, the second is held out."""
    import pyarrow.compute as pc

    from prorsa.telemetry.reader import read_telemetry, write_parquet

    table, _ = read_telemetry(path)
    ids = sorted(set(table.column("trajectory_id").to_pylist()))
    halves = []
    for part, chosen in (("train", ids[0::2]), ("heldout", ids[1::2] or ids[:1])):
        mask = pc.is_in(table.column("trajectory_id"), value_set=pa_array(chosen))
        target = out_dir / f"{path.stem}-{part}.parquet"
        write_parquet(table.filter(mask), target)
        halves.append(target)
    return halves[0], halves[1]


def pa_array(values: list[str]):
    import pyarrow as pa

    return pa.array(values, pa.string())


def ship_plans(traces_dir: Path, work: Path) -> tuple[list[SimPlan], list[SimPlan]]:
    """Training and held-out simulation plans of the shipped models."""
    train_traces, heldout_traces = [], []
    for name in SHIP_TRACES:
        train, heldout = split_trace(traces_dir / f"{name}.parquet", work)
        train_traces.append(str(train))
        heldout_traces.append(str(heldout))
    modes = ["sync", "async"]
    train = [
        SimPlan(SHIP_SCENARIOS, train_traces, modes, seeds, engines, policy)
        for policy, engines, seeds in SHIP_PLANS
    ]
    policy, engines, seeds = SHIP_HELDOUT
    heldout = [SimPlan(SHIP_SCENARIOS, heldout_traces, modes, seeds, engines, policy)]
    return train, heldout


@app.command("ship")
@friendly_errors
def ship_cmd(
    out: Path = typer.Option(Path("models"), help="folder of the shipped models"),
    keep_data: Path | None = typer.Option(None, help="also keep the datasets in this folder"),
) -> None:
    """Regenerate the shipped models (and models/README.md) from the fixed recipe."""
    from prorsa.forecast.dataset import build_dataset
    from prorsa.workload.scenarios import datasets_dir

    with tempfile.TemporaryDirectory() as tmp:
        work = keep_data or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        train_plans, heldout_plans = ship_plans(datasets_dir() / "traces", work)
        tables = {"train": [], "heldout": []}
        for part, plans in (("train", train_plans), ("heldout", heldout_plans)):
            total = sum(len(p.runs()) for p in plans)
            with _progress(f"simulating ({part})") as bar:
                task = bar.add_task(part, total=total)
                for plan in plans:
                    done = len(tables[part])
                    tables[part] += simulate_runs(
                        plan, lambda i, n, d=done, t=task: bar.update(t, completed=d + i)
                    )
        with console.status("replaying the training runs", spinner="dots"):
            data = build_dataset(tables["train"])
            data_path = data.save(work / "train.parquet")
        heldout_path = work / "heldout-telemetry.parquet"
        _write_tables(tables["heldout"], heldout_path)
        results = {}
        for name in SHIP_MODELS:
            results[name] = train_model(
                name,
                data_path,
                out / name,
                validate=[_read(heldout_path)],
                extra_manifest={"recipe": ship_recipe(data)},
            )
        write_data_card(out / "README.md", data, results, tables["heldout"])
    console.print(f"shipped {', '.join(SHIP_MODELS)} to {out}/ (data card: {out / 'README.md'})")


def _write_tables(tables: list, path: Path) -> None:
    import pyarrow as pa

    from prorsa.telemetry.reader import write_parquet

    merged = _concat(pa, tables)
    write_parquet(merged, path)


def _read(path: Path):
    import pyarrow.parquet as pq

    # write_parquet keeps the schema metadata (prorsa.source=simulator).
    return pq.read_table(path)


def ship_recipe(data) -> dict:
    """JSON description of the shipped training data (also in the manifests)."""
    return {
        "scenarios": SHIP_SCENARIOS,
        "trace_replays": [
            f"datasets/traces/{t}.parquet (even-numbered trajectories)" for t in SHIP_TRACES
        ],
        "modes": ["sync (128 trajectories, 1 step)", "async (256 trajectories, 64 in flight)"],
        "plans": [
            {"policy": p, "engines": e, "seeds": list(s), "profile": DEFAULT_PROFILE}
            for p, e, s in SHIP_PLANS
        ],
        "runs": len(data.runs),
        "ticks": len(data.ticks),
        "turns": len(data.turns),
        "snapshots": len(data.snapshots),
        "tick_s": data.meta["tick_s"],
        "horizons_s": list(data.horizons),
        "tasks": list(data.tasks),
        "data_hash": data.data_hash(),
        "regenerate": "prorsa forecast ship --out models",
    }


def write_data_card(path: Path, data, results: dict, heldout_tables: list) -> None:
    """models/README.md: what the shipped models were trained on and how they score."""
    recipe = ship_recipe(data)
    lines = [
        "# Shipped forecasters (data card)",
        "",
        "Written by `prorsa forecast ship --out models`, which regenerates everything here",
        "(deterministic: fixed seeds, single-threaded training). Each folder holds",
        "`manifest.json` (forecaster, parameters, data hash, package versions, metrics,",
        "this recipe) and the model files. Load one with",
        "`prorsa.forecast.load_forecaster('models/NAME')`, or use it in a simulation with",
        "`prorsa simulate --policy predictive --forecaster NAME`. (Other models in this folder",
        "have their own cards.)",
        "",
        "## Training data",
        "",
        f"- Simulated with the cost profile `{DEFAULT_PROFILE}` (H200, Qwen2.5-7B, TP1).",
        f"- Scenarios (shipped workload profiles): {', '.join(SHIP_SCENARIOS)}.",
        "- Real-trace replays through the simulator: the even-numbered trajectories (sorted by",
        "  id) of " + ", ".join(f"`datasets/traces/{t}.parquet`" for t in SHIP_TRACES) + ";",
        "  the odd-numbered ones are held out.",
        "- Each scenario and each trace replay ran in two modes: sync (one step of 128",
        "  trajectories, GRPO groups of 8) and async (256 trajectories, 64 in flight).",
    ]
    for policy, engines, seeds in SHIP_PLANS:
        lines.append(
            f"- Policy `{policy}` on {engines} engines, seeds {', '.join(map(str, seeds))}."
        )
    lines += [
        f"- In all: {recipe['runs']} runs, {recipe['ticks']:,} ticks of {recipe['tick_s']:g} s, "
        f"{recipe['turns']:,} turns, {recipe['snapshots']:,} trajectory snapshots "
        "(every 2nd tick).",
        f"- Horizons: {', '.join(f'{h:g}' for h in recipe['horizons_s'])} s. Task vocabulary: "
        f"{', '.join(recipe['tasks'])}.",
        f"- Dataset hash (sha256 of the replayed tables): `{recipe['data_hash']}`.",
        "",
        "## Held-out scores",
        "",
        f"Rolling-origin backtest on {len(heldout_tables)} held-out runs (seed "
        f"{SHIP_HELDOUT[2][0]}, policy `{SHIP_HELDOUT[0]}`, {SHIP_HELDOUT[1]} engines, every",
        "scenario and the held-out trace halves, both modes). WAPE at 5 s:",
        "",
        "| model | prefill tokens | decode tokens | decode sequences | decode KV tokens | size |",
        "|---|---|---|---|---|---|",
    ]
    for name, summary in results.items():
        m = summary["metrics"]
        size = sum(f.stat().st_size for f in Path(summary["out"]).iterdir())
        cells = [
            f"{m.get(f'heldout_wape_{t}_h5', float('nan')):.3f}"
            for t in ("prefill_tokens", "decode_tokens", "decode_sequences", "decode_kv_tokens")
        ]
        lines.append(f"| `{name}` | " + " | ".join(cells) + f" | {size / 1e6:.2f} MB |")
    lines += [
        "",
        "See `benchmarks/results/forecast.json` for the comparison with the baselines.",
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
