"""Run manifests: whether a run's telemetry is the whole run, and if not, why not.

A run that ends early (Ctrl-C, SIGTERM, an exception, a dead engine) must not look
finished. A command that produces telemetry writes ``run-manifest.json`` beside it, first
with ``status: running``, at the end with ``complete``, ``interrupted`` or ``failed``,
the cause and the trajectory counts::

    with run_manifest(out, command="rollout", run_id=cfg.run_id, planned=len(specs)) as run:
        ...
        run.counts["trajectories_completed"] = done

A process killed outright leaves ``running`` behind, which readers treat as partial too.
Readers call :func:`check_complete` on a path or a table: it reads the manifest (beside a
file, in a run folder, or in the folder above a ``telemetry/`` directory), the
``prorsa.run_status`` schema metadata a table may carry (:func:`mark_table`), and the
events themselves (trajectories without ``traj_end``, or whose ``traj_end`` detail says
``"status": "interrupted"`` or ``"failed"``). A partial run raises
:class:`~prorsa.errors.PartialRunError` unless ``allow_partial``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from prorsa.errors import InputError, PartialRunError
from prorsa.io import atomic_write_text

MANIFEST_NAME = "run-manifest.json"
MANIFEST_SCHEMA = "prorsa.run-manifest/1"
STATUS_METADATA_KEY = b"prorsa.run_status"
Status = Literal["running", "interrupted", "failed", "complete"]
STATUSES: tuple[str, ...] = ("running", "interrupted", "failed", "complete")
#: ``traj_end`` detail ``status`` values that mark a trajectory as cut short.
INCOMPLETE_TRAJECTORY_STATUSES = frozenset({"interrupted", "failed"})
ALLOW_PARTIAL_HINT = (
    "pass --allow-partial to use it anyway (numbers then describe only what was recorded)"
)


@dataclass
class RunManifest:
    """What a run was asked to do and how far it got.

    ``counts`` holds at least ``trajectories_planned`` (when known),
    ``trajectories_started`` and ``trajectories_completed``; commands add their own
    (``events``, ``engines_lost``...).
    """

    command: str
    run_id: str = ""
    status: Status = "running"
    cause: str | None = None
    counts: dict[str, int] = field(default_factory=dict)
    started_at: str = field(default_factory=lambda: _now())
    ended_at: str | None = None
    schema: str = MANIFEST_SCHEMA

    @property
    def complete(self) -> bool:
        return self.status == "complete"

    def finish(self, status: Status, cause: str | None = None) -> None:
        """Set the final status (and cause) and the end time."""
        if status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
        self.status, self.cause, self.ended_at = status, cause, _now()

    def describe(self) -> str:
        text = self.status
        if self.cause:
            text += f" ({self.cause})"
        done, planned = (
            self.counts.get("trajectories_completed"),
            self.counts.get("trajectories_planned"),
        )
        if done is not None and planned is not None:
            text += f", {done} of {planned} trajectories completed"
        elif done is not None:
            text += f", {done} trajectories completed"
        return text

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object, *, source: str = "<manifest>") -> RunManifest:
        if not isinstance(data, dict):
            raise InputError("a run manifest must be a JSON object", source=source)
        status = data.get("status")
        if status not in STATUSES:
            raise InputError(
                f"status must be one of {', '.join(STATUSES)}, got {status!r}",
                source=source,
                field="status",
            )
        counts = data.get("counts") or {}
        if not isinstance(counts, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in counts.values()
        ):
            raise InputError("counts must map names to integers", source=source, field="counts")
        known = {f for f in cls.__dataclass_fields__}
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs.setdefault("command", "")
        return cls(**kwargs)


def write_manifest(directory: str | os.PathLike[str], manifest: RunManifest) -> Path:
    """Write ``run-manifest.json`` into ``directory`` (atomically; replaces an older one)."""
    path = Path(directory) / MANIFEST_NAME
    atomic_write_text(path, json.dumps(manifest.to_dict(), indent=2, sort_keys=True) + "\n")
    return path


def read_manifest(path: str | os.PathLike[str]) -> RunManifest:
    """Read a manifest file (or the ``run-manifest.json`` in a folder)."""
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_NAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError("no run manifest", source=str(path)) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"unreadable run manifest: {exc}", source=str(path)) from None
    return RunManifest.from_dict(data, source=str(path))


def find_manifest(path: str | os.PathLike[str]) -> Path | None:
    """The manifest that describes the telemetry at ``path``, if there is one.

    Looked for in ``path`` (a run folder), beside it (``telemetry.parquet`` in a run
    folder) and, for a ``telemetry/`` recorder folder, in the run folder above it.
    """
    path = Path(path)
    candidates = [path / MANIFEST_NAME] if path.is_dir() else []
    candidates.append(path.parent / MANIFEST_NAME)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    return None


@contextlib.contextmanager
def run_manifest(
    directory: str | os.PathLike[str],
    *,
    command: str,
    run_id: str = "",
    planned: int | None = None,
) -> Iterator[RunManifest]:
    """Write a ``running`` manifest now and the final status when the block ends.

    Ctrl-C (``KeyboardInterrupt``), task cancellation and ``SystemExit`` end as
    ``interrupted``; any other exception as ``failed``; both with the cause, and the
    exception propagates. A block that ends normally is ``complete`` unless the caller
    called :meth:`RunManifest.finish` itself, or fewer trajectories completed than were
    planned (then ``failed``, saying how many).
    """
    manifest = RunManifest(command=command, run_id=run_id)
    if planned is not None:
        manifest.counts["trajectories_planned"] = planned
    write_manifest(directory, manifest)
    try:
        yield manifest
    except (KeyboardInterrupt, asyncio.CancelledError, SystemExit) as exc:
        manifest.finish("interrupted", _cause(exc))
        write_manifest(directory, manifest)
        raise
    except BaseException as exc:
        manifest.finish("failed", _cause(exc))
        write_manifest(directory, manifest)
        raise
    if manifest.status == "running":
        done = manifest.counts.get("trajectories_completed")
        if planned is not None and done is not None and done < planned:
            manifest.finish("failed", f"only {done} of {planned} trajectories completed")
        else:
            manifest.finish("complete")
    write_manifest(directory, manifest)


def mark_table(table: pa.Table, manifest: RunManifest) -> pa.Table:
    """``table`` with the run's status in its schema metadata, so a Parquet file carried
    away from its run folder still says whether the run completed."""
    status = {"status": manifest.status, "cause": manifest.cause, "counts": manifest.counts}
    metadata = {**(table.schema.metadata or {}), STATUS_METADATA_KEY: json.dumps(status).encode()}
    return table.replace_schema_metadata(metadata)


@dataclass
class Completeness:
    """Whether telemetry covers a whole run, and the reasons it does not."""

    source: str
    complete: bool
    status: str
    reasons: list[str] = field(default_factory=list)
    manifest: RunManifest | None = None
    trajectories: int | None = None
    unfinished_trajectories: int | None = None

    def describe(self) -> str:
        if self.complete:
            return "complete run"
        return f"partial run ({self.status}): " + "; ".join(self.reasons)

    def to_dict(self) -> dict:
        return {
            "complete": self.complete,
            "status": self.status,
            "reasons": self.reasons,
            "trajectories": self.trajectories,
            "unfinished_trajectories": self.unfinished_trajectories,
        }


def check_complete(
    data: str | os.PathLike[str] | pa.Table | pd.DataFrame,
    *,
    allow_partial: bool = False,
    location: str | os.PathLike[str] | None = None,
) -> Completeness:
    """Say whether ``data`` (a telemetry path or an event table) is a complete run.

    A table already read from a path can pass that path as ``location``, so its run
    manifest is found without reading the events again.

    Raises:
        PartialRunError: the run is partial and ``allow_partial`` is false; the message
            says why (manifest status and cause, unfinished trajectories).
    """
    if isinstance(data, pd.DataFrame):
        columns = [c for c in ("run_id", "trajectory_id", "kind", "detail") if c in data.columns]
        data = pa.Table.from_pandas(data[columns].astype(str), preserve_index=False)
    if isinstance(data, pa.Table):
        table = data
    else:
        from prorsa.telemetry.reader import read_telemetry

        location = data
        table, _ = read_telemetry(data)
    source = "<table>" if location is None else str(location)
    found = find_manifest(location) if location is not None else None
    manifest = read_manifest(found) if found is not None else None
    result = Completeness(source=source, complete=True, status="complete", manifest=manifest)
    if manifest is not None and not manifest.complete:
        result.status = manifest.status
        result.reasons.append(f"the run manifest says {manifest.describe()}")
    embedded = _embedded_status(table)
    if embedded is not None and embedded.get("status") != "complete":
        if result.status == "complete":
            result.status = str(embedded.get("status"))
        cause = f" ({embedded['cause']})" if embedded.get("cause") else ""
        result.reasons.append(f"the table's metadata says {embedded.get('status')}{cause}")
    started, unfinished, cut = _trajectory_counts(table)
    result.trajectories, result.unfinished_trajectories = started, unfinished + cut
    if unfinished:
        result.reasons.append(f"{unfinished} of {started} trajectories have no traj_end")
    if cut:
        result.reasons.append(f"{cut} of {started} trajectories ended interrupted or failed")
    if (unfinished or cut) and result.status == "complete":
        result.status = "incomplete"
    result.complete = not result.reasons
    if not result.complete and not allow_partial:
        raise PartialRunError(result.describe(), source=source, hint=ALLOW_PARTIAL_HINT)
    return result


def _embedded_status(table: pa.Table) -> dict | None:
    raw = (table.schema.metadata or {}).get(STATUS_METADATA_KEY)
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {"status": "unknown", "cause": "unreadable prorsa.run_status metadata"}
    return value if isinstance(value, dict) else {"status": "unknown"}


def _trajectory_counts(table: pa.Table) -> tuple[int, int, int]:
    """(trajectories, trajectories without traj_end, ended interrupted or failed)."""
    from prorsa.telemetry.schema import CLUSTER_EVENT_KINDS, EventKind

    if table.num_rows == 0 or "kind" not in table.column_names:
        return 0, 0, 0
    kind = table.column("kind")
    if pa.types.is_dictionary(kind.type):
        kind = kind.cast(pa.string())
    on_trajectory = pc.invert(pc.is_in(kind, pa.array(sorted(CLUSTER_EVENT_KINDS))))
    ends = pc.equal(kind, EventKind.TRAJ_END.value)
    # Grouped by (run, trajectory) as they are: joining the two ids into one string per
    # event cost gigabytes on a recipe's tens of millions of events.
    keys = [c for c in ("run_id", "trajectory_id") if c in table.column_names]
    flags = pa.table(
        {**{c: table.column(c) for c in keys}, "on_trajectory": on_trajectory, "ended": ends}
    )
    # Chunks read from Parquet row groups carry dictionaries of their own.
    per_key = (
        flags.unify_dictionaries()
        .group_by(keys)
        .aggregate([("on_trajectory", "max"), ("ended", "max")])
    )
    per_key = per_key.filter(per_key.column("on_trajectory_max"))
    ended = int(pc.sum(per_key.column("ended_max")).as_py() or 0)
    cut = 0
    if "detail" in table.column_names:
        details = pc.filter(table.column("detail"), ends).to_pylist()
        cut = sum(
            1 for text in details if _trajectory_status(text) in INCOMPLETE_TRAJECTORY_STATUSES
        )
    return per_key.num_rows, per_key.num_rows - ended, cut


def _trajectory_status(detail: str | None) -> str | None:
    if not detail or '"status"' not in detail:
        return None
    try:
        value = json.loads(detail)
    except json.JSONDecodeError:
        return None
    return value.get("status") if isinstance(value, dict) else None


def _cause(exc: BaseException) -> str:
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted by the user (SIGINT)" if not str(exc) else str(exc)
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
