"""Importers of public agent traces into lifecycle telemetry (design, section 3).

``import_trace(src, fmt)`` reads one of the formats in :data:`IMPORTERS` and returns an
:class:`ImportResult` whose table follows ``ARROW_SCHEMA`` and passes ``find_violations``.
Times are seconds since the first event of the source. Quantities a trace lacks are
derived, listed in ``ImportResult.derived`` and marked per event in ``detail``
(``{"derived": [...]}``).
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from prorsa.errors import ConfigError, InputError
from prorsa.io import is_utf8
from prorsa.registry import Registry
from prorsa.telemetry.importers import azure, mini_swe_agent, mooncake, swe_agent, tau2, tracelab
from prorsa.telemetry.importers.base import ImportResult, TraceBuilder, TraceFormat, Turn
from prorsa.telemetry.schema import ARROW_SCHEMA, encode_kinds
from prorsa.telemetry.validation import find_violations

IMPORTERS: Registry[TraceFormat] = Registry("trace format")
for _module in (mini_swe_agent, tracelab, tau2, mooncake, azure, swe_agent):
    IMPORTERS.register(_module.FORMAT.name, _module.FORMAT)

__all__ = [
    "IMPORTERS",
    "ImportResult",
    "TraceBuilder",
    "TraceFormat",
    "Turn",
    "import_trace",
    "shared_data_dir",
]


def shared_data_dir() -> Path:
    """The shared public-data folder: ``$PRORSA_SHARED_DATA`` or ``../shared/data`` beside
    the repository root (where CI puts it)."""
    env = os.environ.get("PRORSA_SHARED_DATA")
    path = Path(env) if env else Path(__file__).resolve().parents[3] / ".." / "shared" / "data"
    path = path.resolve()
    if not (path / "traces").is_dir():
        raise ConfigError(
            f"shared data folder not found at {path} (it needs a traces/ folder)",
            hint="put the shared data beside the checkout or set PRORSA_SHARED_DATA",
        )
    return path


def import_trace(
    src: str | os.PathLike[str],
    fmt: str,
    *,
    run_id: str | None = None,
    skip_bad: bool = False,
) -> ImportResult:
    """Import the trace at ``src`` (a file or a folder, per format) as lifecycle events.

    Args:
        src: trace file or folder.
        fmt: a name registered in :data:`IMPORTERS` (``prorsa traces formats`` lists them).
        run_id: ``run_id`` of every event; defaults to the source's name.
        skip_bad: skip malformed records (or the trajectories that cannot be imported
            without them), count them and report the first few, instead of raising.

    Raises:
        InputError: a malformed record (naming file, record and field), unless
            ``skip_bad``; also when nothing importable is left.
        ConfigError: an unknown format.
    """
    trace_format = IMPORTERS.get(fmt)
    path = Path(src)
    if not path.exists():
        raise InputError("no such file or directory", source=str(path))
    run = run_id or _default_run_id(path)
    if not is_utf8(run):  # Parquet strings must be UTF-8; ids from names are checked per trajectory
        raise InputError(
            f"the run id {run!r} is not valid UTF-8"
            + ("" if run_id else " (it is the file's name)"),
            source=str(path),
            hint="rename the file (some formats also name trajectories after it)",
        )
    builder = TraceBuilder(run, skip_bad=skip_bad)
    try:
        trace_format.read(path, builder)
    except (UnicodeDecodeError, csv.Error) as exc:
        raise InputError(f"not a readable {fmt} trace: {exc}", source=str(path)) from None
    if builder.empty:
        if builder.first_error is not None:
            raise builder.first_error
        raise InputError("no trajectories found", source=str(path))
    try:
        table = _finish(builder.parts())
    except (pa.ArrowException, OverflowError) as exc:  # every value was checked: a bug
        raise InputError(
            f"cannot build the event table: {exc}; please report this importer bug",
            source=str(path),
        ) from None
    problems = find_violations(table, limit=1)
    if problems:  # the importers check every record, so this is a bug, not bad input
        record, column, reason = problems[0]
        trajectory = table.column("trajectory_id")[record].as_py()
        raise InputError(
            f"{reason} (trajectory {trajectory!r}); please report this importer bug",
            source=str(path),
            record=record,
            field=column,
        )
    return ImportResult(
        table=table,
        fmt=fmt,
        source=str(path),
        trajectories=builder.trajectories,
        turns=builder.turns,
        skipped=builder.skipped,
        skipped_examples=builder.skipped_examples,
        derived=dict(sorted(builder.derived.items())),
        notes=builder.notes,
    )


def _finish(parts: list[pa.Table]) -> pa.Table:
    """Events as a table in time order, times shifted to start at the first event."""
    table = encode_kinds(pa.concat_tables(parts))
    time = table.column("time")
    table = table.set_column(0, ARROW_SCHEMA.field("time"), pc.subtract(time, pc.min(time)))
    # Arrow's sort is stable: events at the same time keep their lifecycle order.
    return table.take(pc.sort_indices(table, sort_keys=[("time", "ascending")]))


def _default_run_id(path: Path) -> str:
    name = path.name
    for suffix in (".traj.json", ".jsonl", ".json", ".csv", ".traj"):
        name = name.removesuffix(suffix)
    return name or "trace"
