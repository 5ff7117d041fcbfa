"""Lifecycle events in the columnar form the tracker ingests (:class:`EventBatch`).

The simulator and the Ray runtime append events to an :class:`~prorsa.telemetry.columns.EventLog`
and hand the tracker one :class:`EventBatch` per control tick. Everything else that feeds
the tracker (telemetry tables read from disk, data frames, lists of row tuples in tests) is
converted here, once, into the same form: tables column by column with Arrow compute, rows
through an ``EventLog``. Offline replays convert a whole run once and take per-tick slices
(:func:`slice_batch`), so the key space (and the tracker's key -> slot cache) stays the same
over the run.

Keys: a table's trajectories are keyed by ``trajectory_id`` (the tracker's identity of a
trajectory); the group and task of a key are those of its first event.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from prorsa.errors import InputError
from prorsa.telemetry.columns import CLUSTER_KEY, EventBatch, EventLog
from prorsa.telemetry.schema import CLUSTER_EVENT_KINDS, EVENT_KINDS, FIELDS

#: Codes of the trajectory kinds are below this; cluster events (switches, allocations) at
#: or above it (``EVENT_KINDS`` lists trajectory stages first).
FIRST_CLUSTER_KIND = min(EVENT_KINDS.index(k) for k in CLUSTER_EVENT_KINDS)
_ALLOCATION_KIND = EVENT_KINDS.index("allocation")
_KINDS = pa.array(EVENT_KINDS, pa.string())
_INT_COLUMNS = ("context_tokens", "new_tokens", "cached_tokens", "output_tokens")

Events = EventBatch | EventLog | pa.Table | pd.DataFrame | Sequence[tuple]


def as_batch(events: Events, *, source: str = "<events>") -> EventBatch:
    """Any accepted form of events as one :class:`EventBatch` (a batch is returned as is)."""
    if isinstance(events, EventBatch):
        return events
    if isinstance(events, EventLog):
        return events.batch()
    if isinstance(events, pd.DataFrame):
        missing = [f for f in FIELDS if f not in events.columns]
        if missing:
            raise InputError(f"missing column(s) {', '.join(missing)}", source=source)
        frame = events[list(FIELDS)]
        if not isinstance(frame["kind"].dtype, pd.StringDtype | np.dtypes.ObjectDType):
            frame = frame.assign(kind=frame["kind"].astype(str))
        return table_batch(pa.Table.from_pandas(frame, preserve_index=False), source=source)
    if isinstance(events, pa.Table):
        return table_batch(events, source=source)
    return rows_batch(events)


def rows_batch(rows: Sequence[tuple]) -> EventBatch:
    """Row tuples in ``FIELDS`` order as a batch (one ``EventLog.append_row`` each)."""
    rows = list(rows)
    log = EventLog(str(rows[0][1]) if rows else "run")
    for row in rows:
        log.append_row(row)
    return log.batch()


def table_batch(table: pa.Table, *, source: str = "<table>") -> EventBatch:
    """A telemetry table (columns of ``FIELDS``) as a batch, column-wise."""
    missing = [f for f in FIELDS if f not in table.column_names]
    if missing:
        raise InputError(f"missing column(s) {', '.join(missing)}", source=source)
    n = table.num_rows
    kind_col = table.column("kind")
    if pa.types.is_dictionary(kind_col.type):
        kind_col = kind_col.cast(pa.string())
    codes = pc.index_in(kind_col, value_set=_KINDS)
    if codes.null_count:
        bad = int(np.flatnonzero(codes.is_null().to_numpy(zero_copy_only=False))[0])
        raise InputError(
            f"unknown event kind {kind_col[bad].as_py()!r}", source=source, record=bad, field="kind"
        )
    kind = codes.to_numpy(zero_copy_only=False).astype(np.int8)
    traj = pc.dictionary_encode(table.column("trajectory_id")).combine_chunks()
    index = traj.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    ids = traj.dictionary.to_pylist()
    _, first = np.unique(index, return_index=True)
    groups = table.column("group_id").take(pa.array(first)).to_pylist()
    tasks = table.column("task").take(pa.array(first)).to_pylist()
    keys: list[tuple[str, str, str]] = [("", "", "")]
    keys += [(ids[i], g, t) for i, g, t in zip(range(len(ids)), groups, tasks, strict=True)]
    key = (index + 1).astype(np.int32)
    key[kind >= FIRST_CLUSTER_KIND] = CLUSTER_KEY
    detail = table.column("detail")
    details: dict[int, str] = {}
    if n:
        nonempty = np.flatnonzero(
            pc.fill_null(pc.not_equal(detail, ""), False).to_numpy(zero_copy_only=False)
        )
        if len(nonempty):
            texts = detail.take(pa.array(nonempty)).to_pylist()
            details = dict(zip(nonempty.tolist(), texts, strict=True))
    run_ids = table.column("run_id")
    return EventBatch(
        run_id=str(run_ids[0].as_py()) if n else "run",
        start=0,
        time=_numpy(table, "time", np.float64),
        key=key,
        turn=_numpy(table, "turn", np.int32),
        kind=kind,
        engine_id=_numpy(table, "engine_id", np.int32),
        **{name: _numpy(table, name, np.int64) for name in _INT_COLUMNS},
        keys=keys,
        details=details,
    )


def _numpy(table: pa.Table, name: str, dtype: type) -> np.ndarray:
    column = table.column(name)
    return np.asarray(column.to_numpy(), dtype=dtype)


def slice_batch(batch: EventBatch, start: int, stop: int) -> EventBatch:
    """Rows ``start`` to ``stop`` of ``batch`` (views of its columns, the same keys)."""
    details = {}
    if batch.details:
        details = {r - start: s for r, s in batch.details.items() if start <= r < stop}
    return EventBatch(
        run_id=batch.run_id,
        start=batch.start + start,
        time=batch.time[start:stop],
        key=batch.key[start:stop],
        turn=batch.turn[start:stop],
        kind=batch.kind[start:stop],
        engine_id=batch.engine_id[start:stop],
        context_tokens=batch.context_tokens[start:stop],
        new_tokens=batch.new_tokens[start:stop],
        cached_tokens=batch.cached_tokens[start:stop],
        output_tokens=batch.output_tokens[start:stop],
        keys=batch.keys,
        details=details,
    )


def gpus_in_detail(detail: str) -> int:
    """Total GPUs an ``allocation`` event's detail names (``{"gpus": {role: n}}``); 0 when
    it names none or is not that shape (the count is optional context, never required)."""
    try:
        gpus = json.loads(detail).get("gpus") if detail else None
    except (ValueError, AttributeError):
        return 0
    if not isinstance(gpus, dict):
        return 0
    return int(sum(v for v in gpus.values() if isinstance(v, int | float) and v > 0))


def allocated_gpus(batch: EventBatch) -> int:
    """GPUs of the cluster as the batch's latest ``allocation`` event states (0: none).

    Runtimes record one when a run starts (reason ``start``) and whenever the allocation
    changes, so a telemetry stream carries its cluster's size for per-GPU features.
    """
    for row in np.flatnonzero(np.asarray(batch.kind) == _ALLOCATION_KIND)[::-1]:
        total = gpus_in_detail(batch.details.get(int(row), ""))
        if total:
            return total
    return 0
