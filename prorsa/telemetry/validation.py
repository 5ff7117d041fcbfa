"""Validation of lifecycle events, one row at a time (streams) or a whole table at once.

Both paths enforce the same rules and name the record and field that broke them:
unknown kind, negative or missing tokens, non-finite or negative time, and, within one
trajectory, time going backwards or the turn index going down.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prorsa.errors import InputError
from prorsa.telemetry.schema import CLUSTER_EVENT_KINDS, EVENT_KIND_SET, FIELDS, TOKEN_FIELDS

_TIME, _RUN, _TRAJ, _TURN, _KIND = 0, 1, 2, 5, 6
_TOKEN_IDX = tuple(FIELDS.index(f) for f in TOKEN_FIELDS)


class EventValidator:
    """Checks rows in arrival order, remembering each trajectory's last time and turn.

    ``check`` costs a few dictionary operations, cheap enough for the recorder's hot path.
    """

    def __init__(self, source: str = "<events>") -> None:
        self.source = source
        self._last: dict[tuple[str, str], tuple[float, int]] = {}

    def check(self, row: tuple, record: int | str) -> None:
        """Raise :class:`InputError` if ``row`` (in ``FIELDS`` order) is invalid here."""
        if len(row) != len(FIELDS):
            raise InputError(
                f"expected {len(FIELDS)} fields, got {len(row)}", source=self.source, record=record
            )
        kind = row[_KIND]
        if kind not in EVENT_KIND_SET:
            raise InputError(
                f"unknown kind {kind!r}", source=self.source, record=record, field="kind"
            )
        time = row[_TIME]
        if not isinstance(time, (int, float)) or not math.isfinite(time) or time < 0:
            raise InputError(
                f"time must be a finite number >= 0, got {time!r}",
                source=self.source,
                record=record,
                field="time",
            )
        for idx in _TOKEN_IDX:
            value = row[idx]
            if not isinstance(value, (int, np.integer)) or value < 0:
                raise InputError(
                    f"must be a non-negative integer, got {value!r}",
                    source=self.source,
                    record=record,
                    field=FIELDS[idx],
                )
        turn = row[_TURN]
        if not isinstance(turn, (int, np.integer)) or turn < 0:
            raise InputError(
                f"must be a non-negative integer, got {turn!r}",
                source=self.source,
                record=record,
                field="turn",
            )
        if kind in CLUSTER_EVENT_KINDS:
            return
        key = (row[_RUN], row[_TRAJ])
        last = self._last.get(key)
        if last is not None:
            if time < last[0]:
                raise InputError(
                    f"time goes backwards within trajectory {row[_TRAJ]!r}: {time} after {last[0]}",
                    source=self.source,
                    record=record,
                    field="time",
                )
            if turn < last[1]:
                raise InputError(
                    f"turn out of order within trajectory {row[_TRAJ]!r}: {turn} after {last[1]}",
                    source=self.source,
                    record=record,
                    field="turn",
                )
        self._last[key] = (time, turn)


def find_violations(table: pa.Table, *, limit: int | None = None) -> list[tuple[int, str, str]]:
    """Return ``(record, field, reason)`` for every invalid row of ``table``, in row order.

    Vectorised over Arrow columns and NumPy arrays (imports, Parquet telemetry): no copy of
    the table as a pandas frame, so a file of 13 million events is checked in seconds.
    """
    missing = [f for f in FIELDS if f not in table.column_names]
    if missing:
        return [(0, missing[0], "column missing")]
    problems: list[tuple[int, str, str]] = []
    for name in FIELDS:
        nulls = _mask(pc.is_null(table.column(name), nan_is_null=True))
        problems += [(int(i), name, "missing value") for i in np.flatnonzero(nulls)]
    kind = _as_strings(table.column("kind"))
    # A missing kind is reported above, once.
    known = _mask(pc.is_in(kind, value_set=pa.array(sorted(EVENT_KIND_SET))))
    unknown = ~known & ~_mask(pc.is_null(kind))
    problems += [
        (int(i), "kind", f"unknown kind {kind[int(i)].as_py()!r}") for i in np.flatnonzero(unknown)
    ]
    time = _as_floats(table.column("time"))
    bad_time = ~np.isfinite(time) | (time < 0)
    problems += [(int(i), "time", "must be a finite number >= 0") for i in np.flatnonzero(bad_time)]
    turn = _as_floats(table.column("turn"))  # kept for the order check below
    for name in (*TOKEN_FIELDS, "turn"):
        values = turn if name == "turn" else _as_floats(table.column(name))
        bad = np.flatnonzero(~(values >= 0))
        problems += [(int(i), name, "must be a non-negative integer") for i in bad]

    in_trajectory = ~_mask(pc.is_in(kind, value_set=pa.array(sorted(CLUSTER_EVENT_KINDS))))
    order, group = _trajectory_order(table, in_trajectory)
    if len(order):
        problems += [
            (int(i), "time", "time goes backwards within its trajectory")
            for i in _below_running_max(time[order], group, order)
        ]
        problems += [
            (int(i), "turn", "turn out of order within its trajectory")
            for i in _below_running_max(turn[order], group, order)
        ]
    problems.sort()
    return problems[:limit] if limit is not None else problems


def _mask(values: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A boolean Arrow result as a NumPy mask (null -> False)."""
    return np.asarray(pc.fill_null(values, False).to_numpy(zero_copy_only=False), dtype=bool)


def _as_strings(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """The column as strings (dictionary-encoded or not); other types as their text."""
    try:
        return pc.cast(column, pa.string())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return pa.chunked_array(
            [pa.array([None if v is None else str(v) for v in column.to_pylist()], pa.string())]
        )


def _as_floats(column: pa.ChunkedArray) -> np.ndarray:
    """The column as float64, NaN where a value is missing or not a number."""
    try:
        floats = pc.cast(column, pa.float64())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):  # e.g. text: parse value by value
        return np.array([_to_float(v) for v in column.to_pylist()], dtype=float)
    return np.asarray(pc.fill_null(floats, math.nan).to_numpy(zero_copy_only=False), dtype=float)


def _to_float(value: object) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan


def _codes(column: pa.ChunkedArray) -> np.ndarray:
    """Each row's index into the column's distinct values (-1 where missing)."""
    encoded = column if pa.types.is_dictionary(column.type) else column.dictionary_encode()
    unified = pa.table({"c": encoded}).unify_dictionaries().column("c")
    if not unified.num_chunks:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(
        [
            np.asarray(pc.fill_null(chunk.indices, -1).to_numpy(zero_copy_only=False), np.int64)
            for chunk in unified.chunks
        ]
    )


def _trajectory_order(table: pa.Table, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows of ``rows`` that name a run and a trajectory, grouped by (run, trajectory)
    with each group in table order; and each of those rows' group number."""
    runs, trajectories = _codes(table.column("run_id")), _codes(table.column("trajectory_id"))
    keep = np.flatnonzero(rows & (runs >= 0) & (trajectories >= 0))
    group = runs[keep] * (int(trajectories.max(initial=0)) + 1) + trajectories[keep]
    by_group = np.argsort(group, kind="stable")
    return keep[by_group], group[by_group]


def _below_running_max(values: np.ndarray, group: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Rows whose value is below the largest earlier value of their group.

    ``values`` and ``rows`` are in group order (``group`` sorted). A group that never
    decreases from one row to the next and holds no NaN cannot have such a row, so only
    the others are walked. A NaN breaks the running maximum for the row after it (that
    row is not compared), as pandas' ``cummax().shift()`` reads it.
    """
    same = group[1:] == group[:-1]
    suspect = np.flatnonzero(same & (values[1:] < values[:-1])) + 1
    suspect = np.concatenate([suspect, np.flatnonzero(np.isnan(values))])
    found: list[np.ndarray] = []
    for g in np.unique(group[suspect]):
        start = int(np.searchsorted(group, g, side="left"))
        stop = int(np.searchsorted(group, g, side="right"))
        run = values[start:stop]
        running = np.fmax.accumulate(run)
        running[np.isnan(run)] = np.nan
        earlier = np.concatenate([[np.nan], running[:-1]])
        found.append(rows[start:stop][run < earlier])
    return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)


def validate_table(table: pa.Table, *, source: str = "<table>") -> None:
    """Raise :class:`InputError` naming the first invalid record and field, if any."""
    problems = find_violations(table, limit=1)
    if problems:
        record, field, reason = problems[0]
        raise InputError(reason, source=source, record=record, field=field)
