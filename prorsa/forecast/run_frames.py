"""One run's events at a time, from telemetry tables (what building a dataset replays).

A pandas frame of events takes about 2.5x the memory of the Arrow table it came from
(strings become Python objects), and the shipping recipe's telemetry holds tens of
millions of events: converting it whole, then grouping it by run, held several copies at
once. An Arrow table is therefore only indexed here (each row's run, in one integer
array) and a run is converted when it is replayed, then dropped. A pandas frame given
by the caller is already in memory and is grouped as it is.

Either way a run's frame is what :func:`~prorsa.forecast.targets.event_frame` gives for
that run alone, allocations kept: its rows in the same order as in the whole table's
frame, so a dataset built from runs one at a time equals one built from everything.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from prorsa.errors import InputError
from prorsa.forecast.targets import event_frame
from prorsa.telemetry.schema import CLUSTER_EVENT_KINDS, EventKind, conform

_TASK_PAIR = ["task", "trajectory_id"]
_CLUSTER_KINDS = pa.array(sorted(map(str, CLUSTER_EVENT_KINDS)), pa.string())


class RunFrames:
    """The runs of one telemetry table (``name`` names it in errors).

    Attributes:
        run_ids: the runs holding trajectory events (sorted).
        task_pairs: each distinct (task, trajectory id) of its trajectory events, what
            the task vocabulary is learnt from
            (:func:`~prorsa.forecast.features.top_tasks`).
    """

    def __init__(self, table: pa.Table | pd.DataFrame, name: str) -> None:
        self.name = name
        if isinstance(table, pd.DataFrame):
            frame = event_frame(table, source=name, keep_allocations=True)
            self._groups = {str(k): g for k, g in frame.groupby("run_id", sort=True)}
            self.run_ids = list(self._groups)
            trajectory = frame["kind"] != EventKind.ALLOCATION
            self.task_pairs = frame.loc[trajectory, _TASK_PAIR].drop_duplicates()
            return
        # One dictionary per column (Parquet row groups each bring their own).
        table = conform(table, source=name, keep_dictionaries=True).unify_dictionaries()
        self._index_arrow(table)

    def _index_arrow(self, table: pa.Table) -> None:
        if table.num_rows == 0:
            raise InputError("telemetry is empty (no events)", source=self.name)
        # Kinds are dictionary-encoded: decide per distinct kind, then look rows up.
        kind = table.column("kind").combine_chunks()
        names = kind.dictionary
        cluster = pc.is_in(names, value_set=_CLUSTER_KINDS).take(kind.indices)
        trajectory = pc.invert(cluster)
        if not pc.any(trajectory).as_py():
            raise InputError("telemetry holds no trajectory events", source=self.name)
        allocation = pc.equal(names, str(EventKind.ALLOCATION)).take(kind.indices)
        kept = pc.or_(trajectory, allocation).to_numpy(zero_copy_only=False)
        times = table.column("time").to_numpy()
        if not np.isfinite(times[kept]).all():
            raise InputError("non-finite event time", source=self.name, field="time")
        encoded = pc.dictionary_encode(table.column("run_id")).combine_chunks()
        codes = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
        codes[~kept] = -1
        run_names = encoded.dictionary.to_pylist()
        present = np.unique(codes[codes >= 0])
        # Runs in sorted id order; each run's rows in table order (a stable sort).
        self.run_ids = sorted(str(run_names[c]) for c in present)
        self._code = {str(run_names[c]): int(c) for c in present}
        self._order = np.argsort(codes, kind="stable")
        self._sorted_codes = codes[self._order]
        self._table = table
        # Select before filtering: a filter copies every column it is given.
        pairs = table.select(_TASK_PAIR).filter(trajectory).group_by(_TASK_PAIR).aggregate([])
        self.task_pairs = pairs.to_pandas()

    def frame(self, run_id: str) -> pd.DataFrame:
        """The events of ``run_id`` (allocations kept), sorted by time, ties in table order."""
        if hasattr(self, "_groups"):
            return self._groups[run_id]
        code = self._code[run_id]
        lo, hi = np.searchsorted(self._sorted_codes, [code, code + 1])
        rows = self._table.take(pa.array(self._order[lo:hi]))
        return event_frame(rows, source=self.name, keep_allocations=True)
