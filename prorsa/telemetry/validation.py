"""Validation of lifecycle events, one row at a time (streams) or a whole table at once.

Both paths enforce the same rules and name the record and field that broke them:
unknown kind, negative or missing tokens, non-finite or negative time, and, within one
trajectory, time going backwards or the turn index going down.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow as pa

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

    Vectorised: used to validate whole files (imports, Parquet telemetry) quickly.
    """
    missing = [f for f in FIELDS if f not in table.column_names]
    if missing:
        return [(0, missing[0], "column missing")]
    df = table.select(list(FIELDS)).to_pandas()
    problems: list[tuple[int, str, str]] = []
    for name in FIELDS:
        nulls = np.flatnonzero(df[name].isna().to_numpy())
        problems += [(int(i), name, "missing value") for i in nulls]
    kind = df["kind"].astype(str)
    problems += [
        (int(i), "kind", f"unknown kind {kind.iloc[i]!r}")
        for i in np.flatnonzero(~kind.isin(EVENT_KIND_SET).to_numpy())
    ]
    time = pd.to_numeric(df["time"], errors="coerce").to_numpy(dtype=float)
    bad_time = ~np.isfinite(time) | (time < 0)
    problems += [(int(i), "time", "must be a finite number >= 0") for i in np.flatnonzero(bad_time)]
    for name in (*TOKEN_FIELDS, "turn"):
        values = pd.to_numeric(df[name], errors="coerce").to_numpy(dtype=float)
        bad = np.flatnonzero(~(values >= 0))
        problems += [(int(i), name, "must be a non-negative integer") for i in bad]

    traj_rows = ~kind.isin(CLUSTER_EVENT_KINDS).to_numpy()
    if traj_rows.any():
        sub = df.loc[traj_rows, ["run_id", "trajectory_id", "time", "turn"]]
        grouped = sub.groupby(["run_id", "trajectory_id"], sort=False)
        # Compare with the running maximum so one early outlier is reported once.
        prev_time = grouped["time"].cummax().groupby([sub["run_id"], sub["trajectory_id"]]).shift()
        prev_turn = grouped["turn"].cummax().groupby([sub["run_id"], sub["trajectory_id"]]).shift()
        back = (sub["time"] < prev_time).to_numpy()
        down = (sub["turn"] < prev_turn).to_numpy()
        index = sub.index.to_numpy()
        problems += [
            (int(i), "time", "time goes backwards within its trajectory") for i in index[back]
        ]
        problems += [
            (int(i), "turn", "turn out of order within its trajectory") for i in index[down]
        ]
    problems.sort()
    return problems[:limit] if limit is not None else problems


def validate_table(table: pa.Table, *, source: str = "<table>") -> None:
    """Raise :class:`InputError` naming the first invalid record and field, if any."""
    problems = find_violations(table, limit=1)
    if problems:
        record, field, reason = problems[0]
        raise InputError(reason, source=source, record=record, field=field)
