"""Offline datasets: telemetry replayed tick by tick through the lifecycle tracker.

A :class:`ForecastDataset` holds three tables, all produced by the same tracker the online
provider uses:

* ``ticks`` — one row per (run, tick): the aggregate features, the run's ``scale`` (peak
  live trajectories so far) and every target at every horizon (``y_<target>_h<h>``);
* ``snapshots`` — every ``snapshot_every``-th tick, one row per live trajectory: its state,
  elapsed times and estimated tokens decoded (what the bottom-up model conditions on);
* ``turns`` — one row per turn arrival: the frozen turn-arrival features and the turn's
  outcomes as labels (output tokens, whether another turn follows, the tool time after
  it, the next turn's new tokens).

Saved as ``DATA.parquet`` (ticks, with the metadata) beside ``DATA.snapshots.parquet`` and
``DATA.turns.parquet``.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from prorsa.errors import ConfigError, InputError
from prorsa.forecast.features import LifecycleFeatures, replay, top_tasks
from prorsa.forecast.run_frames import RunFrames
from prorsa.forecast.targets import run_targets, tick_times, trajectory_events
from prorsa.forecast.tracker import EVENT_FEATURES, START_RATE_VERSION
from prorsa.forecast.types import DEFAULT_HORIZONS, TARGETS, check_horizons, target_column
from prorsa.io import atomic_path
from prorsa.telemetry.schema import EventKind

SNAPSHOT_COLUMNS = (
    "state",
    "open",
    "ctx",
    "turn",
    "turn_new",
    "since_queued",
    "decode_elapsed",
    "decoded",
    "tool_elapsed",
    "out_last",
)
TURN_LABELS = ("output_tokens", "continues", "tool_s", "next_new_tokens")
#: Tick column (not a feature): the tracker's turn_start_rate, which the bottom-up
#: expectation of lightgbm-trajectory reads beside the features.
TURN_START_RATE = "turn_start_rate"
_META_KEY = b"prorsa.forecast_dataset"
#: Written into the main file and its siblings alike by one save.
_SAVE_KEY = b"prorsa.forecast_dataset.save"


@dataclass
class ForecastDataset:
    """Ticks, trajectory snapshots and turn rows of one or more runs (see the module doc)."""

    ticks: pd.DataFrame
    snapshots: pd.DataFrame
    turns: pd.DataFrame
    meta: dict = field(default_factory=dict)

    @property
    def horizons(self) -> tuple[float, ...]:
        return tuple(self.meta["horizons"])

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(self.meta["tasks"])

    @property
    def feature_names(self) -> list[str]:
        return list(self.meta["feature_names"])

    @property
    def runs(self) -> list[str]:
        return sorted(self.ticks["run_id"].unique())

    @property
    def sources(self) -> dict[str, str]:
        return dict(self.meta.get("sources", {}))

    def validate(self, horizons: Sequence[float] | None = None) -> None:
        """Raise InputError when the dataset cannot train a forecaster for ``horizons``."""
        if self.ticks.empty:
            raise InputError("dataset has no ticks", hint="simulate or replay longer runs")
        need = ["run_id", "time", "scale", TURN_START_RATE, *self.feature_names]
        for h in horizons or self.horizons:
            if h not in self.horizons:
                raise ConfigError(
                    f"horizon {h:g} s is not in the dataset (it has {list(self.horizons)})"
                )
            need += [target_column(t, h) for t in TARGETS]
        missing = [c for c in need if c not in self.ticks.columns]
        if missing:
            raise InputError(
                f"dataset lacks column(s) {missing[:5]}",
                field=missing[0],
                hint="a dataset built by an older version: rebuild it (`prorsa forecast dataset`)",
            )
        from prorsa.forecast.features import aggregate_feature_names

        # Models read features by position in today's list: a dataset built by another
        # version of the features would train on the wrong columns.
        expected = aggregate_feature_names(self.horizons, self.tasks)
        if self.feature_names != expected:
            changed = sorted(set(self.feature_names) ^ set(expected)) or ["(their order)"]
            raise InputError(
                f"the dataset's features are not this version's: {changed[:6]} differ",
                field="feature_names",
                hint="rebuild it (`prorsa forecast dataset`)",
            )

    def data_hash(self) -> str:
        """SHA-256 over the three tables' contents (order-sensitive)."""
        digest = hashlib.sha256()
        for frame in (self.ticks, self.snapshots, self.turns):
            digest.update(",".join(map(str, frame.columns)).encode())
            if len(frame):
                digest.update(pd.util.hash_pandas_object(frame, index=False).to_numpy().tobytes())
        return digest.hexdigest()

    def subset(self, runs: Sequence[str]) -> ForecastDataset:
        """Only the given runs."""
        keep = set(runs)
        pick = lambda df: df[df["run_id"].isin(keep)].reset_index(drop=True)  # noqa: E731
        meta = {**self.meta, "sources": {r: s for r, s in self.sources.items() if r in keep}}
        return ForecastDataset(pick(self.ticks), pick(self.snapshots), pick(self.turns), meta)

    # ------------------------------------------------------------------ files
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write ``path`` (ticks + metadata) and its ``.snapshots`` / ``.turns`` siblings."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        table = pa.Table.from_pandas(self.ticks, preserve_index=False)
        # One token in all three files: a save that fails between them (over an earlier
        # dataset of the same name) leaves files that :meth:`load` sees do not match.
        token = {_SAVE_KEY: uuid.uuid4().hex.encode()}
        meta = {
            **(table.schema.metadata or {}),
            _META_KEY: json.dumps(self.meta).encode(),
            **token,
        }
        # Siblings first, the main file last: a crash never leaves a complete-looking
        # dataset whose siblings are missing, and each file appears whole or not at all.
        for name, frame in sibling_tables(self).items():
            part = pa.Table.from_pandas(frame, preserve_index=False)
            part = part.replace_schema_metadata({**(part.schema.metadata or {}), **token})
            with atomic_path(sibling(path, name)) as tmp:
                pq.write_table(part, tmp, compression="zstd")
        with atomic_path(path) as tmp:
            pq.write_table(table.replace_schema_metadata(meta), tmp, compression="zstd")
        return path

    @staticmethod
    def read_meta(path: str | os.PathLike[str]) -> dict:
        """A saved dataset's metadata (horizons, tasks, features, the simulator that made
        it ...) without reading its tables."""
        path = Path(path)
        try:
            schema = pq.read_schema(path)
        except (pa.ArrowInvalid, OSError) as exc:
            raise InputError(f"not a Parquet file: {exc}", source=str(path)) from None
        raw = (schema.metadata or {}).get(_META_KEY)
        if raw is None:
            raise InputError(
                "not a forecast dataset (no prorsa.forecast_dataset metadata)", source=str(path)
            )
        return _meta(raw, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ForecastDataset:
        path = Path(path)
        if not path.exists():
            raise InputError("no such dataset file", source=str(path))
        try:
            table = pq.read_table(path)
        except (pa.ArrowInvalid, OSError) as exc:
            raise InputError(f"not a Parquet file: {exc}", source=str(path)) from None
        raw = (table.schema.metadata or {}).get(_META_KEY)
        if raw is None:
            raise InputError(
                "not a forecast dataset (no prorsa.forecast_dataset metadata)",
                source=str(path),
                hint="build one with `prorsa forecast dataset`",
            )
        frames = {}
        token = (table.schema.metadata or {}).get(_SAVE_KEY)
        for name in ("snapshots", "turns"):
            p = sibling(path, name)
            if not p.exists():
                raise InputError(f"missing sibling file {p.name}", source=str(path))
            try:
                part = pq.read_table(p)
            except (pa.ArrowInvalid, OSError) as exc:
                raise InputError(
                    f"cannot read {p.name}: {exc}",
                    source=str(path),
                    hint="build the dataset again (`prorsa forecast dataset`)",
                ) from None
            if token is not None and (part.schema.metadata or {}).get(_SAVE_KEY) != token:
                raise InputError(
                    f"{p.name} is from another save than this file (a save that failed "
                    "part-way over an earlier dataset)",
                    source=str(path),
                    hint="build the dataset again",
                )
            frames[name] = part.to_pandas()
        return cls(table.to_pandas(), frames["snapshots"], frames["turns"], _meta(raw, path))


def _meta(raw: bytes, path: Path) -> dict:
    """A saved dataset's metadata, checked for what training reads from it."""
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"unreadable metadata: {exc}", source=str(path),
                         field=_META_KEY.decode()) from None  # fmt: skip
    if not isinstance(meta, dict):
        raise InputError("metadata is not an object", source=str(path), field=_META_KEY.decode())
    for key in ("horizons", "tasks", "feature_names"):
        if not isinstance(meta.get(key), list):
            raise InputError("missing or not a list", source=str(path), field=f"meta.{key}")
    return meta


def sibling(path: Path, name: str) -> Path:
    """``data.parquet`` -> ``data.<name>.parquet``."""
    return path.with_name(f"{path.stem}.{name}{path.suffix or '.parquet'}")


def sibling_tables(data: ForecastDataset) -> dict[str, pd.DataFrame]:
    return {"snapshots": data.snapshots, "turns": data.turns}


def _source_of(table: pa.Table | pd.DataFrame) -> str:
    if isinstance(table, pa.Table):
        meta = table.schema.metadata or {}
        return meta.get(b"prorsa.source", b"unknown").decode()
    return str(getattr(table, "attrs", {}).get("prorsa.source", "unknown"))


def build_dataset(
    telemetry: pa.Table | pd.DataFrame | Sequence[pa.Table | pd.DataFrame],
    *,
    horizons: Sequence[float] = DEFAULT_HORIZONS,
    tick_s: float = 1.0,
    snapshot_every: int = 2,
    tasks: Sequence[str] | None = None,
    max_tasks: int = 8,
    max_snapshot_rows: int = 60_000,
    progress: Callable[[int, int], None] | None = None,
    allow_partial: bool = False,
    names: Sequence[str] | None = None,
) -> ForecastDataset:
    """Replay telemetry (one or more event tables, each with one or more runs) into a dataset.

    Run ids must be unique across the tables. ``names`` name the tables in errors (their
    files, say; default ``telemetry[i]``). ``tasks`` fixes the task vocabulary (default:
    the ``max_tasks`` tasks with the most trajectories). Snapshots are taken every
    ``snapshot_every``-th tick, or more sparsely in a run whose live trajectories would
    give more than about ``max_snapshot_rows`` of them (a busy run must not crowd out the
    others in the calibration data). ``progress(done, total)`` is called after each run.

    A table from a run that ended early (its metadata says so, or trajectories have no
    ``traj_end`` or one that says ``interrupted``/``failed``; see
    :func:`~prorsa.telemetry.manifest.check_complete`) is refused: its cut-short
    trajectories would teach forecasters that trajectories end sooner than they do. With
    ``allow_partial`` it is used and listed in ``meta["partial_runs"]``.
    """
    from prorsa.telemetry.manifest import check_complete

    horizons = check_horizons(horizons)
    if tick_s <= 0:
        raise ConfigError(f"tick_s must be > 0, got {tick_s}")
    if snapshot_every < 1:
        raise ConfigError(f"snapshot_every must be >= 1, got {snapshot_every}")
    tables = list(telemetry) if isinstance(telemetry, list | tuple) else [telemetry]
    if not tables:
        raise InputError("no telemetry given")
    names = [str(n) for n in names] if names is not None else []
    if names and len(names) != len(tables):
        raise ConfigError(f"{len(names)} names for {len(tables)} telemetry tables")
    names = names or [f"telemetry[{i}]" for i in range(len(tables))]
    sources, partial = {}, {}
    read_from: dict[str, str] = {}  # run id -> the table it came from
    by_table = []
    for name, table in zip(names, tables, strict=True):
        completeness = check_complete(table, allow_partial=allow_partial)
        if not completeness.complete:
            partial[name] = completeness.describe()
        runs = RunFrames(table, name)
        for run_id in runs.run_ids:
            if run_id in sources:
                raise InputError(
                    f"run id '{run_id}' is also in {read_from[run_id]}",
                    source=name,
                    hint="run ids must be unique across the telemetry given",
                )
            sources[run_id] = _source_of(table)
            read_from[run_id] = name
        by_table.append(runs)
    pipeline = LifecycleFeatures(horizons, max_tasks=max_tasks, tick_s=tick_s)
    if tasks is None:
        pairs = pd.concat([runs.task_pairs for runs in by_table], ignore_index=True)
        tasks = top_tasks(pairs, max_tasks)
    pipeline = pipeline.set_tasks(tasks)
    tick_frames, snap_frames, turn_frames = [], [], []
    # Every run in id order, each converted to pandas only while it is replayed.
    order = sorted((run_id, i) for i, runs in enumerate(by_table) for run_id in runs.run_ids)
    for done, (run_id, i) in enumerate(order, 1):
        run = by_table[i].frame(run_id)
        ticks = tick_times(run, tick_s)
        if len(ticks):
            stages = trajectory_events(run)  # what targets and snapshot sizing read
            every = snapshot_stride(stages, tick_s, snapshot_every, max_snapshot_rows)
            t, s, u = _replay_run(pipeline, run_id, run, stages, ticks, horizons, every)
            tick_frames.append(t)
            snap_frames.append(s)
            turn_frames.append(u)
        del run
        if progress is not None:
            progress(done, len(order))
    if not tick_frames:
        raise InputError(f"telemetry is shorter than one tick ({tick_s} s)")
    meta = {
        "version": 1,
        "turn_start_rate_version": START_RATE_VERSION,
        "horizons": list(horizons),
        "tick_s": tick_s,
        "snapshot_every": snapshot_every,
        "max_snapshot_rows": max_snapshot_rows,
        "tasks": list(pipeline.tasks_),
        "feature_names": pipeline.feature_names_,
        "sources": sources,
        "partial_runs": partial,
    }
    return ForecastDataset(
        pd.concat(tick_frames, ignore_index=True),
        pd.concat(snap_frames, ignore_index=True),
        pd.concat(turn_frames, ignore_index=True),
        meta,
    )


def snapshot_stride(run: pd.DataFrame, tick_s: float, every: int, max_rows: int) -> int:
    """Snapshot every n-th tick: ``every``, or sparser so that about ``max_rows`` rows of
    live trajectories result (live-ticks estimated from each trajectory's first and last
    event)."""
    span = run.groupby("trajectory_id", sort=False)["time"].agg(["min", "max"])
    live_ticks = float(((span["max"] - span["min"]) / tick_s).sum())
    return max(every, int(np.ceil(live_ticks / max(max_rows, 1))))


def _replay_run(
    pipeline: LifecycleFeatures,
    run_id: str,
    run: pd.DataFrame,
    stages: pd.DataFrame,
    ticks: np.ndarray,
    horizons: tuple[float, ...],
    snapshot_every: int,
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Ticks, snapshots and turns of one run: ``run`` is its events with its allocations
    (the tracker reads the GPU count from them), ``stages`` the same without (targets)."""
    tracker = pipeline.make_tracker(record_event_rows=True)
    scales = np.empty(len(ticks))
    start_rates = np.empty(len(ticks))
    snaps: list[dict[str, np.ndarray]] = []

    def on_tick(tr, i: int) -> None:
        scales[i] = max(tr.peak_live, 1)
        start_rates[i] = tr.turn_start_rate
        tr.pending.clear()
        if i % snapshot_every == 0 and len(tr.snapshot["slot"]):
            snap = {c: tr.snapshot[c] for c in SNAPSHOT_COLUMNS}
            snap["trajectory_id"] = tr.ids[tr.snapshot["slot"]]
            snap["time"] = np.full(len(tr.snapshot["slot"]), ticks[i])
            snaps.append(snap)

    features = replay(tracker, run, ticks, on_tick)
    tick_frame = pd.DataFrame(features, columns=pipeline.feature_names_)
    tick_frame.insert(0, TURN_START_RATE, start_rates)
    tick_frame.insert(0, "scale", scales)
    tick_frame.insert(0, "time", ticks)
    tick_frame.insert(0, "run_id", run_id)
    targets = run_targets(stages, ticks, horizons)
    tick_frame = pd.concat([tick_frame, pd.DataFrame(targets)], axis=1)

    if snaps:
        snap_frame = pd.DataFrame({k: np.concatenate([s[k] for s in snaps]) for k in snaps[0]})
    else:
        snap_frame = pd.DataFrame({k: [] for k in (*SNAPSHOT_COLUMNS, "trajectory_id", "time")})
    snap_frame.insert(0, "run_id", run_id)
    snap_frame["trajectory_id"] = snap_frame["trajectory_id"].astype(str)
    return tick_frame, snap_frame, _turn_rows(run_id, run, tracker.event_rows)


def _turn_rows(run_id: str, run: pd.DataFrame, rows: list[tuple]) -> pd.DataFrame:
    """Frozen turn-arrival rows joined with each turn's outcome (labels from the future)."""
    # EVENT_FEATURES holds the turn index itself.
    columns = ["trajectory_id", "time", *EVENT_FEATURES, *TURN_LABELS]
    if not rows:
        return pd.DataFrame({"run_id": [], **{c: [] for c in columns}})
    frame = pd.DataFrame(
        [(tid, t, *feats) for tid, _, t, feats in rows],
        columns=["trajectory_id", "time", *EVENT_FEATURES],
    )
    frame["trajectory_id"] = frame["trajectory_id"].astype(str)
    frame["turn"] = frame["turn"].astype(np.int64)
    key = ["trajectory_id", "turn"]
    ev = run.assign(
        trajectory_id=run["trajectory_id"].astype(str), turn=run["turn"].astype(np.int64)
    )
    kind = ev["kind"]
    per_turn = pd.DataFrame(index=pd.MultiIndex.from_frame(frame[key].drop_duplicates()))
    per_turn = per_turn.join(ev[kind == EventKind.DECODE_END].groupby(key)["output_tokens"].last())
    per_turn = per_turn.join(
        ev[kind == EventKind.DECODE_END].groupby(key)["time"].last().rename("d_end")
    )
    per_turn = per_turn.join(
        ev[kind == EventKind.TOOL_START].groupby(key)["time"].first().rename("t_start")
    )
    queued = (
        ev[kind == EventKind.PREFILL_QUEUED]
        .groupby(key)
        .agg(q_time=("time", "first"), q_new=("new_tokens", "first"))
    )
    nxt = queued.reset_index()
    nxt["turn"] -= 1  # the next turn's arrival, keyed by the turn before it
    frame = frame.merge(per_turn.reset_index(), on=key, how="left")
    frame = frame.merge(nxt, on=key, how="left")
    ended = set(ev.loc[kind == EventKind.TRAJ_END, "trajectory_id"])
    continues = frame["q_time"].notna().to_numpy()
    known_end = frame["trajectory_id"].isin(ended).to_numpy()
    frame["continues"] = np.where(continues, 1.0, np.where(known_end, 0.0, np.nan))
    # Without tool events the next turn's wait counts from the end of this turn's decode.
    wait_from = frame["t_start"].fillna(frame["d_end"]).to_numpy(float)
    frame["tool_s"] = np.where(continues, frame["q_time"].to_numpy(float) - wait_from, np.nan)
    frame["next_new_tokens"] = np.where(continues, frame["q_new"].to_numpy(float), np.nan)
    frame["output_tokens"] = frame["output_tokens"].astype(float)
    frame = frame.drop(columns=["d_end", "t_start", "q_time", "q_new"])
    frame.insert(0, "run_id", run_id)
    return frame
