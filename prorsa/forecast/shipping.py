"""Training data from simulations, model training, and the recipe of the shipped models.

The library behind ``prorsa forecast dataset --from-sim``, ``prorsa forecast train`` and
``prorsa forecast ship`` (the CLI only parses options and prints). It drives the
simulator, so it sits on top of the runtime: the simulator is imported inside the
functions that run it, never at import time, and nothing in the forecast package imports
this module.

The shipped models are trained on a fixed design over the regime map rather than one
cluster: every shipped scenario and the training half of every shipped real trace
(replayed through the simulator), sync and async, at loads from 4 to 128 trajectories per
GPU, on clusters of 2 to 32 slots, with and without the KV store (``reuse_mode``
kv-store or reprefill) and the regime map's four models (7B TP1, 32B TP2, and the MoE
Qwen3-30B-A3B and Qwen3-235B-A22B on data-parallel-attention engines of 4 and 8 GPUs).
Held-out runs use other seeds, the other half of each trace, and cells the training never
saw (including 128 trajectories per GPU on a larger cluster, and the 235B model at 64 per
GPU). Manifests record the dataset hash and the simulator version.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow as pa

from prorsa.errors import InputError
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.cluster.control import ControlConfig
from prorsa.runtime.sim.version import simulator_version
from prorsa.workload.config import WorkloadConfig

logger = logging.getLogger(__name__)

Progress = Callable[[int, int], None]


# --------------------------------------------------------------------------- runs
@dataclass(frozen=True)
class SimRun:
    """One simulation that yields telemetry for a forecasting dataset: the run
    configurations every entry point shares, and the load per GPU the workload was sized
    by (:meth:`at_load`; part of the run id)."""

    work: WorkloadConfig
    cluster: ClusterConfig
    control: ControlConfig
    load_per_gpu: int

    @classmethod
    def at_load(
        cls,
        load_per_gpu: int,
        work: WorkloadConfig,
        cluster: ClusterConfig,
        control: ControlConfig,
    ) -> SimRun:
        """``work`` sized to ``load_per_gpu`` trajectories per GPU of ``cluster``: a sync
        step of that many x GPUs, or async with that many x GPUs in flight (twice as many
        in all, so the telemetry is not only the ramp-up and the drain)."""
        in_flight = load_per_gpu * cluster.total_gpus
        sized = replace(
            work,
            trajectories=in_flight if work.mode == "sync" else 2 * in_flight,
            max_in_flight=in_flight,
        )
        return cls(sized, cluster, control, load_per_gpu)

    @property
    def scenario(self) -> str | None:
        return self.work.scenario

    @property
    def trace(self) -> str | None:
        """The replayed trace, or None for a scenario."""
        return self.work.trace

    @property
    def workload(self) -> str:
        return self.scenario or f"replay:{Path(self.trace or '').stem}"

    @property
    def run_id(self) -> str:
        layout = self.cluster.layouts.get("colocated")
        layout = f"-{layout}" if layout else ""
        return (
            f"{self.workload}-{self.work.mode}-{self.control.policy}-e{self.cluster.num_slots}"
            f"-l{self.load_per_gpu}-{self.cluster.reuse_mode}-{self.cluster.profile}{layout}"
            f"-s{self.work.seed}"
        )

    def simulate(self) -> pa.Table:
        """Run it; the telemetry table (marked as simulated)."""
        from prorsa.runtime.sim.scenario import RunRequest, simulate

        request = RunRequest(self.work, self.cluster, self.control, run_id=self.run_id)
        result = simulate(request)
        if result.telemetry is None or result.telemetry.num_rows == 0:
            raise InputError(f"simulation {self.run_id} recorded no telemetry")
        return result.telemetry


@dataclass
class SimPlan:
    """A grid of simulated runs: scenarios or trace replays x modes x seeds, at one load
    per GPU on one cluster under one control loop (``work`` is the template of every
    run's workload: group size, staleness ...)."""

    scenarios: list[str] = field(default_factory=list)
    traces: list[str] = field(default_factory=list)
    modes: list[str] = field(default_factory=lambda: ["sync"])
    seeds: Sequence[int] = (0,)
    load_per_gpu: int = 16
    work: WorkloadConfig = field(default_factory=WorkloadConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    control: ControlConfig = field(default_factory=ControlConfig)

    def runs(self) -> list[SimRun]:
        out = []
        for mode in self.modes:
            for seed in self.seeds:
                workloads = [(s, None) for s in self.scenarios] + [(None, t) for t in self.traces]
                for scenario, trace in workloads:
                    work = replace(self.work, scenario=scenario, trace=trace, mode=mode, seed=seed)
                    out.append(SimRun.at_load(self.load_per_gpu, work, self.cluster, self.control))
        return out


def simulate_runs(
    runs: Sequence[SimRun] | SimPlan, progress: Progress | None = None
) -> list[pa.Table]:
    """Telemetry of every run, in order (``progress(done, total)`` after each)."""
    runs = runs.runs() if isinstance(runs, SimPlan) else list(runs)
    tables = []
    for i, run in enumerate(runs, 1):
        tables.append(run.simulate())
        if progress is not None:
            progress(i, len(runs))
    return tables


def simulate_to_parquet(
    runs: Sequence[SimRun] | SimPlan, path: str | Path, progress: Progress | None = None
) -> int:
    """Simulate every run, in order, into one Parquet file of their telemetry; the number
    of events written.

    Holds one run's table at a time (a recipe's telemetry is tens of millions of events).
    The file appears only once every run is in it (a failed run leaves any earlier file
    as it was).
    """
    import pyarrow.parquet as pq

    from prorsa.io import atomic_path
    from prorsa.telemetry.schema import conform

    runs = runs.runs() if isinstance(runs, SimPlan) else list(runs)
    if not runs:
        raise InputError("no runs to simulate", source=str(path))
    events = 0
    with atomic_path(path) as tmp:
        writer = None
        try:
            for i, run in enumerate(runs, 1):
                table = conform(run.simulate())
                if writer is None:
                    # Every simulated table carries the same schema metadata (the source).
                    writer = pq.ParquetWriter(tmp, table.schema, compression="zstd")
                writer.write_table(table)
                events += table.num_rows
                del table
                if progress is not None:
                    progress(i, len(runs))
        finally:
            if writer is not None:
                writer.close()
    return events


# -------------------------------------------------------------------------- train
def train_model(
    model: str,
    data_path: str | Path,
    out: str | Path,
    *,
    seed: int = 0,
    horizons: Sequence[float] | None = None,
    params: dict | None = None,
    validate: Sequence[pa.Table] = (),
    select_on: pa.Table | None = None,
    mlflow: str | None = None,
    extra_manifest: dict | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Train ``model`` on a saved dataset, recalibrate its quantiles and choose its point
    forecast on ``select_on`` telemetry if given (learned models:
    :func:`~prorsa.forecast.validation_fit.fit_on_validation`), backtest it on held-out
    telemetry if given, save it to ``out`` and log to MLflow when a tracking URI is given;
    a summary (``validation_fit``: what was fitted there, or None)."""
    from prorsa.forecast import make_forecaster
    from prorsa.forecast.backtest import backtest, score
    from prorsa.forecast.dataset import ForecastDataset
    from prorsa.forecast.tracking import log_run, tracking_uri
    from prorsa.forecast.types import check_horizons
    from prorsa.forecast.validation_fit import fit_on_validation

    if select_on is not None and select_on.num_rows == 0:
        raise InputError("the telemetry to choose the point forecast on is empty")
    data = ForecastDataset.load(data_path)
    kwargs = dict(params or {})
    kwargs["seed"] = seed
    kwargs["horizons"] = check_horizons(horizons) if horizons else data.horizons
    forecaster = make_forecaster(model, **kwargs)
    forecaster.fit(data)
    metrics = dict(forecaster.metrics_)
    fitted = None
    extra = dict(extra_manifest or {})
    if select_on is not None and (
        forecaster.point_choices() or forecaster.quantile_shifts() is not None
    ):
        fitted = fit_on_validation(forecaster, select_on, progress=progress)
        extra["validation_fit"] = fitted.to_dict()
        chosen = fitted.point.chosen_wape() if fitted.point is not None else {}
        for target, per_h in chosen.items():
            for h, w in zip(fitted.horizons_s, per_h, strict=True):
                if w is not None:
                    metrics[f"validation_wape_{target}_h{h:g}"] = w
    if validate:
        table = concat_tables(list(validate))
        results = backtest(forecaster, table, progress=progress)
        for r in score(results).itertuples(index=False):
            metrics[f"heldout_wape_{r.target}_h{r.horizon_s:g}"] = r.wape
    path = forecaster.save(out, metrics=metrics, extra=extra or None)
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
        "validation_fit": None if fitted is None else fitted.to_dict(),
    }


def concat_tables(tables: list[pa.Table]) -> pa.Table:
    """One table of several runs (schema metadata kept when they all share it)."""
    if len(tables) == 1:
        return tables[0]
    meta = tables[0].schema.metadata
    same = all(t.schema.metadata == meta for t in tables)
    merged = pa.concat_tables([t.replace_schema_metadata(None) for t in tables])
    return merged.replace_schema_metadata(meta if same else None)


# ------------------------------------------------------------------------- recipe
#: What the shipped models are trained on (models/README.md is written from this).
SHIP_SCENARIOS = ["swe", "search", "math-tool", "mixed", "tau2"]
SHIP_TRACES = [
    "mini-swe-agent-swebench",
    "tau2-telecom-gpt4o",
    "tracelab-round-trace",
    "swe-agent",
]
SHIP_MODELS = ["lightgbm-trajectory", "lightgbm-aggregate", "gru"]
SHIP_MODES = ["sync", "async"]
#: Parameters the recipe sets (recorded in each manifest's params).
SHIP_PARAMS: dict[str, dict] = {
    "gru": {"epochs": 15},
    "lightgbm-trajectory": {
        "prefill_offset": "blend",
        "decode_offset": "blend",
        "queue_wait": True,
    },
}


@dataclass(frozen=True)
class Cell:
    """A cluster and load of the recipe (every workload and mode runs in it).

    The recipe names its profile and reuse mode itself rather than taking the cluster
    configuration's defaults: a changed default must not change what the shipped models
    were trained on."""

    engines: int  # slots: GPU groups that switch roles together
    load_per_gpu: int
    seed: int
    reuse_mode: str = "reprefill"
    profile: str = "h200-qwen2.5-7b-tp1"
    policy: str = "static"
    #: One parallel layout for every role (e.g. ``tp1-dp8-ep8``: 8-GPU data-parallel-
    #: attention MoE engines, as on the regime map); None runs the profile's TP.
    layout: str | None = None

    def plan(self, scenarios: Sequence[str], traces: Sequence[str]) -> SimPlan:
        """Every workload x mode of the recipe in this cell."""
        layouts = dict.fromkeys(("prefill", "decode", "colocated"), self.layout)
        return SimPlan(
            scenarios=list(scenarios),
            traces=list(traces),
            modes=list(SHIP_MODES),
            seeds=(self.seed,),
            load_per_gpu=self.load_per_gpu,
            cluster=ClusterConfig(
                profile=self.profile,
                num_slots=self.engines,
                reuse_mode=self.reuse_mode,
                layouts=layouts if self.layout else {},
            ),
            control=ControlConfig(policy=self.policy),
        )

    @property
    def model(self) -> str:
        """The profile and layout as the data card names them."""
        return f"`{self.profile}`" + (f" `{self.layout}`" if self.layout else "")


_MOE_30B, _MOE_235B = "h200-qwen3-30b-a3b-tp1", "h200-qwen3-235b-a22b-tp4"
#: Training cells: 4-128 trajectories per GPU, 2-32 slots, KV store or not, the four models
#: of the regime map (the MoE ones on 4- and 8-GPU data-parallel-attention engines), fixed
#: and switching allocations.
TRAIN_CELLS = (
    Cell(8, 4, 0),
    Cell(8, 16, 1),
    Cell(4, 64, 2, reuse_mode="kv-store"),
    Cell(4, 128, 3),
    Cell(16, 32, 4, policy="colocate"),
    Cell(4, 16, 5, profile="h200-qwen2.5-32b-tp2"),
    Cell(4, 32, 6, profile=_MOE_30B, policy="threshold", layout="tp1-dp8-ep8"),
    Cell(2, 128, 7, profile=_MOE_30B, layout="tp1-dp4-ep4"),
    Cell(
        4, 64, 8, reuse_mode="kv-store", profile=_MOE_235B, policy="colocate", layout="tp1-dp8-ep8"
    ),
)
#: Held-out cells: other seeds and clusters, incl. 128 per GPU on a larger cluster and the
#: largest model at 64 per GPU on 8-GPU engines.
HELDOUT_CELLS = (
    Cell(8, 16, 100),
    Cell(8, 128, 101),
    Cell(32, 8, 102, reuse_mode="kv-store"),
    Cell(4, 64, 103, profile=_MOE_235B, layout="tp1-dp8-ep8"),
)


#: Validation cells: the learned models' quantile shifts are measured and their point
#: forecast chosen on their scenario runs (:mod:`prorsa.forecast.validation_fit`), for
#: transfer to clusters the training never saw without touching the held-out cells it is
#: scored on. Each differs from every training and held-out cell in model or cluster and
#: load: the 32B on twice the slots, the 7B on 16 slots at 64 per GPU, the 30B MoE on
#: 4-GPU engines at 64 per GPU. No trace replays: a trace's trajectories are either
#: trained on or held out.
VALIDATION_CELLS = (
    Cell(8, 32, 200, profile="h200-qwen2.5-32b-tp2"),
    Cell(16, 64, 201, reuse_mode="kv-store"),
    Cell(4, 64, 202, profile=_MOE_30B, layout="tp1-dp4-ep4"),
)


#: Seeds the shipped forecasters trained or chose their point on: a simulated result
#: scored on one of them would score the forecaster on trajectories it has seen (the
#: regime map refuses them as held-out seeds).
TRAINING_SEEDS = frozenset(c.seed for c in (*TRAIN_CELLS, *VALIDATION_CELLS))


def split_trace(path: Path, out_dir: Path) -> tuple[Path, Path]:
    """Write the even- and odd-numbered trajectories of a trace (sorted ids) to two files:
    the first half trains the shipped models, the second is held out."""
    import pyarrow.compute as pc

    from prorsa.telemetry.reader import read_telemetry, write_parquet

    table, _ = read_telemetry(path)
    ids = sorted(set(table.column("trajectory_id").to_pylist()))
    halves = []
    for part, chosen in (("train", ids[0::2]), ("heldout", ids[1::2] or ids[:1])):
        mask = pc.is_in(table.column("trajectory_id"), value_set=pa.array(chosen, pa.string()))
        target = out_dir / f"{path.stem}-{part}.parquet"
        write_parquet(table.filter(mask), target)
        halves.append(target)
    return halves[0], halves[1]


def recipe_runs(traces_dir: Path, work: Path, cells: Sequence[Cell], part: str) -> list[SimRun]:
    """Every workload x mode in every cell; traces replay their ``part`` half."""
    traces = []
    for name in SHIP_TRACES:
        train, heldout = split_trace(traces_dir / f"{name}.parquet", work)
        traces.append(str(train if part == "train" else heldout))
    return [run for cell in cells for run in cell.plan(SHIP_SCENARIOS, traces).runs()]


def validation_runs() -> list[SimRun]:
    """Every scenario x mode in every validation cell (no trace replays)."""
    return [run for cell in VALIDATION_CELLS for run in cell.plan(SHIP_SCENARIOS, []).runs()]


def ship_recipe(data) -> dict[str, Any]:
    """JSON description of the shipped training data (also in the manifests)."""
    return {
        "scenarios": SHIP_SCENARIOS,
        "trace_replays": [
            f"datasets/traces/{t}.parquet (even-numbered trajectories)" for t in SHIP_TRACES
        ],
        "modes": SHIP_MODES,
        "train_cells": [asdict(c) for c in TRAIN_CELLS],
        "validation_cells": [asdict(c) for c in VALIDATION_CELLS],
        "heldout_cells": [asdict(c) for c in HELDOUT_CELLS],
        "runs": len(data.runs),
        "ticks": len(data.ticks),
        "turns": len(data.turns),
        "snapshots": len(data.snapshots),
        "tick_s": data.meta["tick_s"],
        "horizons_s": list(data.horizons),
        "tasks": list(data.tasks),
        "data_hash": data.data_hash(),
        "simulator": data.meta.get("simulator", {}),
        "regenerate": "prorsa forecast ship --out models",
    }


@dataclass
class ShipReport:
    """What :func:`ship` did."""

    out: Path
    models: dict[str, dict]
    train_runs: int
    heldout_runs: int
    data_hash: str
    simulator: dict[str, str]


def ship(
    out: str | Path,
    *,
    keep_data: str | Path | None = None,
    models: Sequence[str] = SHIP_MODELS,
    validate_every: int = 3,
    progress: Callable[[str, int, int], None] | None = None,
) -> ShipReport:
    """Regenerate the shipped models (and ``out/README.md``) from the fixed recipe.

    ``keep_data``: keep the training dataset and telemetry, the validation telemetry
    (the quantiles are recalibrated and the point forecast chosen on it) and the
    held-out telemetry there; a later call with the same folder reuses them when they
    were made by the same simulator (same sources hash), so retraining does not
    re-simulate. The data card's held-out scores backtest every ``validate_every``-th
    held-out run (all cells and workloads take turns; 0: none;
    ``benchmarks/forecast_bench.py`` scores all of them against the baselines).
    ``progress(stage, done, total)`` reports simulation, replay and backtest progress.
    """
    from prorsa.forecast.dataset import ForecastDataset, build_dataset
    from prorsa.workload.scenarios import datasets_dir

    out = Path(out)
    version = simulator_version()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(keep_data) if keep_data else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        data_path, heldout_path = work / "train.parquet", work / "heldout-telemetry.parquet"
        validation_path = work / "validation-telemetry.parquet"
        train_path = work / "train-telemetry.parquet"
        data = None
        if data_path.exists() and heldout_path.exists() and validation_path.exists():
            data = ForecastDataset.load(data_path)
            made_by = data.meta.get("simulator", {}).get("source_sha256")
            if made_by != version["source_sha256"]:
                logger.info("%s was made by another simulator: simulating again", data_path)
                data = None
        if data is None:
            traces_dir = datasets_dir() / "traces"
            parts = {
                train_path: recipe_runs(traces_dir, work, TRAIN_CELLS, "train"),
                validation_path: validation_runs(),
                heldout_path: recipe_runs(traces_dir, work, HELDOUT_CELLS, "heldout"),
            }
            # Each part goes to disk run by run: no part is ever whole in memory, and the
            # training telemetry is read back as Arrow and replayed one run at a time.
            for path, runs in parts.items():
                stage = f"simulating ({path.name.removesuffix('-telemetry.parquet')})"
                simulate_to_parquet(runs, path, _stage(progress, stage))
            # The run id, repeated on every event, stays an index per event (~2 GB less).
            train = _read_table(train_path, dictionaries=["run_id"])
            data = build_dataset(train, progress=_stage(progress, "replaying"))
            del train
            data.meta["simulator"] = version
            data.save(data_path)
        made_by = data.meta.get("simulator", version)  # a kept set may predate this commit
        recipe = ship_recipe(data)
        # Each model loads the dataset itself: a copy held here too would double it.
        del data
        validate = (
            [_every_nth_run(_read_table(heldout_path), validate_every)]
            if validate_every > 0
            else []
        )
        validation = _read_table(validation_path)
        results = {}
        for name in models:
            logger.info("training %s", name)
            results[name] = train_model(
                name,
                data_path,
                out / name,
                params=SHIP_PARAMS.get(name),
                validate=validate,
                select_on=validation,
                extra_manifest={"recipe": recipe, "simulator": made_by},
                progress=_stage(progress, f"backtesting {name}"),
            )
        heldout_runs = len(set(validate[0].column("run_id").to_pylist())) if validate else 0
        kept = {n: _shipped_summary(out / n) for n in SHIP_MODELS if n not in results}
        kept = {n: s for n, s in kept.items() if s is not None}
        composed = _compose_if_shipped(out)
        write_data_card(
            out / "README.md", recipe, results, heldout_runs, kept=kept, composed=composed
        )
    return ShipReport(
        out=out,
        models=results,
        train_runs=recipe["runs"],
        heldout_runs=heldout_runs,
        data_hash=recipe["data_hash"],
        simulator=made_by,
    )


def _compose_if_shipped(out: Path) -> dict | None:
    """Compose ``out/per-target`` from the shipped candidates once all of them are in
    ``out`` (:func:`~prorsa.forecast.per_target.compose_shipped`); its choice, or None."""
    from prorsa.forecast.model_folder import MANIFEST
    from prorsa.forecast.per_target import SHIPPED_CANDIDATES, compose_shipped

    if not all((out / name / MANIFEST).is_file() for name in SHIPPED_CANDIDATES):
        return None
    return compose_shipped(out, SHIPPED_CANDIDATES)[1]


def _shipped_summary(folder: Path) -> dict | None:
    """A model already in ``folder`` (one a partial ``ship`` did not retrain), as the
    card lists it: its manifest's metrics, data hash and simulator; None if absent."""
    import json

    from prorsa.forecast.model_folder import MANIFEST

    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return {
        "out": str(folder),
        "metrics": manifest.get("metrics", {}),
        "data_hash": manifest.get("data_hash", ""),
        "simulator": manifest.get("simulator", {}),
    }


def _read_table(path: Path, dictionaries: Sequence[str] = ()) -> pa.Table:
    """``path`` as read (schema metadata kept: prorsa.source=simulator); ``dictionaries``
    are string columns kept dictionary-encoded (see :func:`build_dataset`'s input)."""
    import pyarrow.parquet as pq

    return pq.read_table(path, read_dictionary=list(dictionaries) or None)


def _every_nth_run(table: pa.Table, every: int) -> pa.Table:
    """The runs of ``table`` at positions 0, n, 2n... of its sorted run ids."""
    import pyarrow.compute as pc

    runs = sorted(set(table.column("run_id").to_pylist()))[:: max(every, 1)]
    return table.filter(pc.is_in(table.column("run_id"), value_set=pa.array(runs, pa.string())))


def _stage(progress: Callable[[str, int, int], None] | None, stage: str) -> Progress | None:
    return None if progress is None else lambda done, total: progress(stage, done, total)


def write_data_card(
    path: Path,
    recipe: dict[str, Any],
    results: dict,
    heldout_runs: int,
    *,
    scored_by: str | None = None,
    kept: dict | None = None,
    composed: dict | None = None,
) -> None:
    """models/README.md: what the shipped models were trained on and how they score.

    ``recipe`` is :func:`ship_recipe` of the training data. ``scored_by`` replaces the
    sentence that says which held-out runs were backtested.
    ``kept``: models in the folder this run did not retrain (:func:`_shipped_summary`),
    listed with the scores, data and simulator their own manifests record.
    """
    sim = recipe["simulator"]
    lines = [
        "# Shipped forecasters (data card)",
        "",
        "Written by `prorsa forecast ship --out models`, which regenerates everything here",
        "(deterministic: fixed seeds, single-threaded training). Each folder holds",
        "`manifest.json` (forecaster, parameters, data hash, simulator version, package",
        "versions, metrics, this recipe) and the model files. Load one with",
        "`prorsa.forecast.load_forecaster('models/NAME')`, or use it in a simulation with",
        "`prorsa simulate --policy predictive --forecaster NAME`. (Other models in this folder",
        "have their own cards.)",
        "",
        "## Training data",
        "",
        f"- Scenarios (shipped workload profiles): {', '.join(SHIP_SCENARIOS)}.",
        "- Real-trace replays through the simulator: the even-numbered trajectories (sorted by",
        "  id) of " + ", ".join(f"`datasets/traces/{t}.parquet`" for t in SHIP_TRACES) + ";",
        "  the odd-numbered ones are held out.",
        "- Every workload in both modes: sync (one step of load x GPUs trajectories, GRPO",
        "  groups of 8) and async (load x GPUs in flight, twice as many in all), in each cell:",
        "",
        "| slots | trajectories per GPU | KV reuse | profile | policy | seed |",
        "|---|---|---|---|---|---|",
    ]
    for c in TRAIN_CELLS:
        lines.append(
            f"| {c.engines} | {c.load_per_gpu} | {c.reuse_mode} | {c.model} | "
            f"`{c.policy}` | {c.seed} |"
        )
    lines += [
        "",
        f"- In all: {recipe['runs']} runs, {recipe['ticks']:,} ticks of {recipe['tick_s']:g} s, "
        f"{recipe['turns']:,} turns, {recipe['snapshots']:,} trajectory snapshots.",
        f"- Horizons: {', '.join(f'{h:g}' for h in recipe['horizons_s'])} s. Task vocabulary: "
        f"{', '.join(recipe['tasks'])}.",
        f"- Dataset hash (sha256 of the replayed tables): `{recipe['data_hash']}`.",
        f"- Simulator: prorsa {sim.get('prorsa', '?')}, commit `{sim.get('commit', '?')}`, "
        f"sources sha256 `{sim.get('source_sha256', '?')[:16]}…`.",
        "",
        "## Held-out scores",
        "",
        scored_by
        or f"Rolling-origin backtest on {heldout_runs} held-out runs (every third of the "
        "recipe's held-out runs: workloads, the held-out trace halves and both modes take "
        "turns) in cells the training did not see:",
        "",
        "| slots | trajectories per GPU | KV reuse | profile | seed |",
        "|---|---|---|---|---|",
    ]
    for c in HELDOUT_CELLS:
        lines.append(f"| {c.engines} | {c.load_per_gpu} | {c.reuse_mode} | {c.model} | {c.seed} |")
    lines += [
        "",
        "WAPE at 5 s:",
        "",
        "| model | prefill tokens | decode tokens | decode sequences | decode KV tokens | size |",
        "|---|---|---|---|---|---|",
    ]
    kept = kept or {}
    for name, summary in {**results, **kept}.items():
        m = summary["metrics"]
        size = sum(f.stat().st_size for f in Path(summary["out"]).iterdir())
        cells = [
            f"{m.get(f'heldout_wape_{t}_h5', float('nan')):.3f}"
            for t in ("prefill_tokens", "decode_tokens", "decode_sequences", "decode_kv_tokens")
        ]
        label = f"`{name}`" + (" (not retrained)" if name in kept else "")
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {size / 1e6:.2f} MB |")
    for name, summary in kept.items():
        made = summary["simulator"]
        lines += [
            "",
            f"`{name}` was not retrained by the run that wrote this card: its row is the",
            f"score its own manifest records, trained on data `{summary['data_hash'][:16]}…`",
            f"by the simulator at commit `{made.get('commit', '?')}` (same recipe cells).",
        ]
    lines += _validation_fit_card(results)
    lines += _per_target_card(composed)
    lines += [
        "",
        "See `benchmarks/results/forecast.json` for the comparison with the baselines.",
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def _per_target_card(composed: dict | None) -> list[str]:
    """The data card's section on ``per-target``: which member forecasts each target,
    and the validation scores it was chosen by."""
    from prorsa.forecast.per_target import choice_cells

    if not composed:
        return []
    names = list(next(iter(composed.values()))["scores"])
    lines = [
        "",
        "## Per target",
        "",
        "`per-target` forecasts each target with the shipped model of least validation",
        "WAPE at 5 s on it (chosen on the validation cells above, never on held-out runs);",
        "its folder holds a copy of each member it uses (`prorsa forecast compose` redoes",
        "this choice):",
        "",
        "| target | " + " | ".join(f"`{n}`" for n in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for target, entry in composed.items():
        cells = choice_cells(entry, names, digits=3, mark=lambda text: f"**{text}**")
        lines.append(f"| {target} | " + " | ".join(cells) + " |")
    return lines


def _validation_fit_card(results: dict) -> list[str]:
    """The data card's section on what was fitted on the validation cells: the point
    chosen per target, and the quantiles' coverage there before and after their shifts
    moved."""
    from prorsa.forecast.aggregate import POINT_CHOICES
    from prorsa.forecast.types import QUANTILES, TARGETS

    levels = [f"{q:g}" for q in QUANTILES]
    fits = {n: r["validation_fit"] for n, r in results.items() if r.get("validation_fit")}
    if not fits:
        return []
    lines = [
        "",
        "## Fitted on validation cells",
        "",
        "Each learned model's quantile shifts are moved until each level covers its share",
        "of the outcomes, and its point (its squared-error model, its median, the offset its",
        "trees correct or the raw bottom-up sum) is chosen per target and horizon as the one",
        "of least WAPE, on the scenario runs of cells apart from both the training and the",
        "held-out ones:",
        "",
        "| slots | trajectories per GPU | KV reuse | profile | policy | seed |",
        "|---|---|---|---|---|---|",
    ]
    for c in VALIDATION_CELLS:
        lines.append(
            f"| {c.engines} | {c.load_per_gpu} | {c.reuse_mode} | {c.model} | "
            f"`{c.policy}` | {c.seed} |"
        )
    first = next(iter(fits.values()))
    horizon = 5.0 if 5.0 in first["horizons_s"] else first["horizons_s"][0]
    points = {n: f for n, f in fits.items() if f["point"] and horizon in f["horizons_s"]}
    if points:
        lines += [
            "",
            f"Point at {horizon:g} s (validation WAPE of each candidate; the chosen one in bold):",
            "",
            "| model | target | " + " | ".join(POINT_CHOICES) + " |",
            "|---|---|" + "---|" * len(POINT_CHOICES),
        ]
    for name, fit in points.items():
        at = fit["horizons_s"].index(horizon)
        for target, by_choice in fit["point"]["wape"].items():
            cells = []
            for choice in POINT_CHOICES:
                value = by_choice.get(choice, [None] * (at + 1))[at]
                if value is None:
                    cells.append("")
                    continue
                text = f"{value:.3f}"
                chosen = fit["point"]["chosen"][target][at] == choice
                cells.append(f"**{text}**" if chosen else text)
            lines.append(f"| `{name}` | {target} | " + " | ".join(cells) + " |")
    quantiles = {n: f for n, f in fits.items() if f["quantiles"] and horizon in f["horizons_s"]}
    if quantiles:
        lines += [
            "",
            f"Quantile coverage at {horizon:g} s on the validation runs, before -> after "
            "(the share of outcomes at or below each level):",
            "",
            "| model | target | " + " | ".join(f"P{float(q) * 100:g}" for q in levels) + " |",
            "|---|---|" + "---|" * len(levels),
        ]
    for name, fit in quantiles.items():
        at = fit["horizons_s"].index(horizon)
        for target in TARGETS:
            cells = []
            for level in levels:
                entry = fit["quantiles"].get(level, {})
                before = entry.get("coverage_before", {}).get(target, [None] * (at + 1))[at]
                after = entry.get("coverage_after", {}).get(target, [None] * (at + 1))[at]
                cells.append("" if before is None else f"{before:.2f} -> {after:.2f}")
            lines.append(f"| `{name}` | {target} | " + " | ".join(cells) + " |")
    return lines
