"""Columnar, append-only buffer of lifecycle events: the in-memory form of the event stream.

The simulator, the Ray runtime and the recorder all append events here and read them back
as :class:`EventBatch` slices (numpy columns) or Arrow tables. Appending is one
``list.extend`` of nine numbers per event (the hot path of the simulator); strings are
never repeated per event: a trajectory's ``(trajectory_id, group_id, task)`` is registered
once as a *key* (an int), the event kind is its index in :data:`EVENT_KINDS`, and the rare
``detail`` strings live in a sparse map. Turning a slice into columns is a handful of
vector operations, so readers (the forecast tracker, the recorder's writer thread) work on
whole ticks or flushes at once.

Key 0 is reserved for cluster events (no trajectory: empty id, group and task).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from prorsa.telemetry.schema import ARROW_SCHEMA, EVENT_KINDS, KIND_TYPE

#: Event kind name -> its code in :class:`EventLog` (the index in ``EVENT_KINDS``).
KIND_CODE: dict[str, int] = {kind: i for i, kind in enumerate(EVENT_KINDS)}
#: The kinds as an Arrow dictionary, fixed so every table shares one encoding.
_KIND_DICTIONARY = pa.array(EVENT_KINDS, pa.string())
#: Columns of one event in the flat numeric buffer, in order.
NUMERIC_COLUMNS: tuple[str, ...] = (
    "time",
    "key",
    "turn",
    "kind",
    "engine_id",
    "context_tokens",
    "new_tokens",
    "cached_tokens",
    "output_tokens",
)
_WIDTH = len(NUMERIC_COLUMNS)
_INT32_MAX = 2**31 - 1
CLUSTER_KEY = 0


@dataclass
class EventBatch:
    """A slice of an :class:`EventLog` as numpy columns (rows ``start`` to ``stop``).

    ``key`` indexes ``keys`` (``(trajectory_id, group_id, task)`` per key; key 0 is the
    cluster); ``kind`` indexes :data:`EVENT_KINDS`; ``details`` maps a row of this batch
    (0-based) to its non-empty ``detail`` string.
    """

    run_id: str
    start: int
    time: np.ndarray  # float64, seconds
    key: np.ndarray  # int32
    turn: np.ndarray  # int32
    kind: np.ndarray  # int8
    engine_id: np.ndarray  # int32
    context_tokens: np.ndarray  # int64
    new_tokens: np.ndarray  # int64
    cached_tokens: np.ndarray  # int64
    output_tokens: np.ndarray  # int64
    keys: list[tuple[str, str, str]] = field(repr=False)
    details: dict[int, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.time)

    @property
    def stop(self) -> int:
        return self.start + len(self.time)

    def kind_names(self) -> list[str]:
        """The ``kind`` column as strings."""
        return [EVENT_KINDS[k] for k in self.kind.tolist()]

    def detail_column(self) -> list[str]:
        out = [""] * len(self.time)
        for row, text in self.details.items():
            out[row] = text
        return out

    def rows(self) -> Iterator[tuple]:
        """The events as tuples in ``FIELDS`` order (slow path; for small slices and tests)."""
        keys, details, run_id = self.keys, self.details, self.run_id
        columns = zip(
            self.time.tolist(),
            self.key.tolist(),
            self.turn.tolist(),
            self.kind.tolist(),
            self.engine_id.tolist(),
            self.context_tokens.tolist(),
            self.new_tokens.tolist(),
            self.cached_tokens.tolist(),
            self.output_tokens.tolist(),
            strict=True,
        )
        for i, (t, k, turn, kind, eng, ctx, new, cached, out) in enumerate(columns):
            traj, group, task = keys[k]
            yield (
                t,
                run_id,
                traj,
                group,
                task,
                turn,
                EVENT_KINDS[kind],
                eng,
                ctx,
                new,
                cached,
                out,
                details.get(i, ""),
            )

    def to_table(self) -> pa.Table:
        """The batch as a table of the canonical schema.

        Raises:
            OverflowError: a token count or id does not fit the schema's int32 (names the
                field and the row in the run).
        """
        n = len(self.time)
        if n == 0:
            return ARROW_SCHEMA.empty_table()
        key_columns = list(zip(*self.keys, strict=True))
        take = pa.array(self.key)
        strings = [pa.array(col, pa.string()).take(take) for col in key_columns]
        kind = pa.DictionaryArray.from_arrays(pa.array(self.kind, pa.int8()), _KIND_DICTIONARY)
        arrays = [
            pa.array(self.time, pa.float64()),
            pa.repeat(pa.scalar(self.run_id, pa.string()), n),
            *strings,
            self._int32("turn", self.turn),
            kind.cast(KIND_TYPE),
            self._int32("engine_id", self.engine_id),
            self._int32("context_tokens", self.context_tokens),
            self._int32("new_tokens", self.new_tokens),
            self._int32("cached_tokens", self.cached_tokens),
            self._int32("output_tokens", self.output_tokens),
            (
                pa.array(self.detail_column(), pa.string())
                if self.details
                else pa.repeat(pa.scalar("", pa.string()), n)
            ),
        ]
        return pa.Table.from_arrays(arrays, schema=ARROW_SCHEMA)

    def _int32(self, name: str, values: np.ndarray) -> pa.Array:
        if len(values) and (values.max() > _INT32_MAX or values.min() < -_INT32_MAX - 1):
            row = int(np.argmax((values > _INT32_MAX) | (values < -_INT32_MAX - 1)))
            raise OverflowError(
                f"event {self.start + row} of run {self.run_id!r}: {name}={int(values[row])} "
                "does not fit the telemetry schema's int32"
            )
        return pa.array(values.astype(np.int32, copy=False), pa.int32())


class EventLog:
    """Append-only columnar events of one run; see the module doc.

    Appends may come from several threads (``list.extend`` is atomic under the GIL); one
    reader may slice the log while writers append, as long as it reads only rows below a
    ``len(log)`` it took first.
    """

    def __init__(self, run_id: str = "run") -> None:
        self.run_id = run_id
        self._flat: list[float] = []
        # Rows with a non-empty detail, in append order (so a slice is found by bisection).
        self._detail_rows: list[int] = []
        self._detail_text: list[str] = []
        self._keys: list[tuple[str, str, str]] = [("", "", "")]
        self._key_of: dict[tuple[str, str, str], int] = {("", "", ""): CLUSTER_KEY}

    def __len__(self) -> int:
        return len(self._flat) // _WIDTH

    def key(self, trajectory_id: str, group_id: str = "", task: str = "") -> int:
        """The int key of a trajectory (registered on first use)."""
        ident = (trajectory_id, group_id, task)
        found = self._key_of.get(ident)
        if found is None:
            found = self._key_of[ident] = len(self._keys)
            self._keys.append(ident)
        return found

    @property
    def keys(self) -> list[tuple[str, str, str]]:
        """``(trajectory_id, group_id, task)`` per key (key 0: cluster events)."""
        return self._keys

    def append(
        self,
        time: float,
        key: int,
        turn: int,
        kind: int,
        engine_id: int = -1,
        context_tokens: int = 0,
        new_tokens: int = 0,
        cached_tokens: int = 0,
        output_tokens: int = 0,
        detail: str = "",
    ) -> None:
        """Append one event; ``kind`` is a :data:`KIND_CODE` value, ``key`` from :meth:`key`."""
        if detail:
            self._detail_rows.append(len(self._flat) // _WIDTH)
            self._detail_text.append(detail)
        self._flat.extend(
            (
                time,
                key,
                turn,
                kind,
                engine_id,
                context_tokens,
                new_tokens,
                cached_tokens,
                output_tokens,
            )
        )

    def append_row(self, row: tuple) -> None:
        """Append one event given as a tuple in ``FIELDS`` order (its run id is ignored)."""
        (t, _run, traj, group, task, turn, kind, eng, ctx, new, cached, out, detail) = row
        self.append(
            t,
            self.key(traj, group, task),
            turn,
            KIND_CODE[kind],
            eng,
            ctx,
            new,
            cached,
            out,
            detail,
        )

    def batch(self, start: int = 0, stop: int | None = None) -> EventBatch:
        """Rows ``start`` to ``stop`` (default: to the end now) as numpy columns."""
        stop = len(self) if stop is None else min(stop, len(self))
        start = max(0, min(start, stop))
        flat = np.array(self._flat[start * _WIDTH : stop * _WIDTH], dtype=np.float64)
        cols = flat.reshape(-1, _WIDTH).T
        ints = cols[1:].astype(np.int64)
        lo = bisect.bisect_left(self._detail_rows, start)
        hi = bisect.bisect_left(self._detail_rows, stop)
        details = {self._detail_rows[i] - start: self._detail_text[i] for i in range(lo, hi)}
        return EventBatch(
            run_id=self.run_id,
            start=start,
            time=np.ascontiguousarray(cols[0]),
            key=ints[0].astype(np.int32),
            turn=ints[1].astype(np.int32),
            kind=ints[2].astype(np.int8),
            engine_id=ints[3].astype(np.int32),
            context_tokens=ints[4],
            new_tokens=ints[5],
            cached_tokens=ints[6],
            output_tokens=ints[7],
            keys=self._keys,
            details=details,
        )

    def to_table(self, start: int = 0, stop: int | None = None) -> pa.Table:
        """Rows ``start`` to ``stop`` as an Arrow table of the canonical schema."""
        return self.batch(start, stop).to_table()

    def rows(self, start: int = 0, stop: int | None = None) -> list[tuple]:
        """Rows as tuples in ``FIELDS`` order (slow path)."""
        return list(self.batch(start, stop).rows())
