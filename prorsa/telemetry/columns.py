"""Columnar, append-only buffer of lifecycle events: the in-memory form of the event stream.

The simulator, the Ray runtime and the recorder all append events here and read them back
as :class:`EventBatch` slices (numpy columns) or Arrow tables. Appending packs the event's
nine numbers into a byte buffer (one ``struct`` pack and one ``bytearray.extend``: the
hot path of the simulator, which calls the two directly through :meth:`EventLog.row_writer`);
strings are never repeated per event: a trajectory's ``(trajectory_id, group_id, task)`` is
registered once as a *key* (an int), the event kind is its index in :data:`EVENT_KINDS`,
and the rare ``detail`` strings live in a sparse map. The single writer of a long run
(the simulator) seals the buffer every :data:`SEAL_ROWS` events into typed numpy columns
(37 bytes an event, the schema's own int32 types), which the run's Arrow table then
shares without copying. Turning a slice into columns is a handful of vector operations,
so readers (the forecast tracker, the recorder's writer thread) work on whole ticks or
flushes at once.

Key 0 is reserved for cluster events (no trajectory: empty id, group and task).
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Callable, Iterator
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
#: One event in the write buffer: its nine numbers as float64 (what the columns were
#: always converted through: ids and token counts are exact up to 2**53).
_ROW = struct.Struct(f"={_WIDTH}d")
_ROW_BYTES = _ROW.size
_pack = _ROW.pack
_ZERO_ROW = bytes(_ROW_BYTES)
#: Events per sealed chunk (about 2.4 MB of typed columns).
SEAL_ROWS = 1 << 16


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
        if len(self.time) == 0:
            return ARROW_SCHEMA.empty_table()
        columns = (
            self.time,
            self.key,
            self.turn,
            self.kind,
            self.engine_id,
            self.context_tokens,
            self.new_tokens,
            self.cached_tokens,
            self.output_tokens,
        )
        details = self.detail_column() if self.details else None
        batch = _record_batch(self.run_id, self.start, columns, _key_strings(self.keys), details)
        return pa.Table.from_batches([batch], schema=ARROW_SCHEMA)


def _key_strings(keys: list[tuple[str, str, str]]) -> list[pa.Array]:
    """The trajectory, group and task of every key, as three Arrow string arrays."""
    return [pa.array(col, pa.string()) for col in zip(*keys, strict=True)]


def _record_batch(
    run_id: str,
    start: int,
    columns: tuple[np.ndarray, ...],
    key_strings: list[pa.Array],
    details: list[str] | None,
) -> pa.RecordBatch:
    """Rows of the canonical schema from numeric ``columns`` in :data:`NUMERIC_COLUMNS`
    order (``start``: the first row's index in the run, for error messages). Columns that
    already have the schema's type are shared, not copied."""
    time, key, turn, kind, engine_id, *tokens = columns
    n = len(time)
    take = pa.array(key)
    kind_array = pa.DictionaryArray.from_arrays(pa.array(kind, pa.int8()), _KIND_DICTIONARY)
    arrays = [
        pa.array(time, pa.float64()),
        pa.repeat(pa.scalar(run_id, pa.string()), n),
        *(strings.take(take) for strings in key_strings),
        _int32(run_id, start, "turn", turn),
        kind_array.cast(KIND_TYPE),
        _int32(run_id, start, "engine_id", engine_id),
        *(
            _int32(run_id, start, name, col)
            for name, col in zip(NUMERIC_COLUMNS[5:], tokens, strict=True)
        ),
        (pa.array(details, pa.string()) if details else pa.repeat(pa.scalar("", pa.string()), n)),
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=ARROW_SCHEMA)


def _int32(run_id: str, start: int, name: str, values: np.ndarray) -> pa.Array:
    fits = values.dtype == np.int32 or not len(values)
    if not fits and (values.max() > _INT32_MAX or values.min() < -_INT32_MAX - 1):
        row = int(np.argmax((values > _INT32_MAX) | (values < -_INT32_MAX - 1)))
        raise OverflowError(
            f"event {start + row} of run {run_id!r}: {name}={int(values[row])} "
            "does not fit the telemetry schema's int32"
        )
    return pa.array(values.astype(np.int32, copy=False), pa.int32())


def _typed_columns(block: np.ndarray, *, compact: bool) -> tuple[np.ndarray, ...]:
    """Rows of nine float64 numbers as the :class:`EventBatch` columns (token counts int32
    when ``compact`` and every value fits, else int64)."""
    cols = block.T
    ints = cols[1:].astype(np.int64)
    tokens = []
    for values in ints[4:]:
        if compact and (
            not len(values) or (values.max() <= _INT32_MAX and values.min() >= -_INT32_MAX - 1)
        ):
            tokens.append(values.astype(np.int32))
        else:
            tokens.append(np.ascontiguousarray(values))
    return (
        np.ascontiguousarray(cols[0]),
        ints[0].astype(np.int32),
        ints[1].astype(np.int32),
        ints[2].astype(np.int8),
        ints[3].astype(np.int32),
        *tokens,
    )


#: dtype of each :class:`EventBatch` column, in :data:`NUMERIC_COLUMNS` order.
_BATCH_DTYPES = (
    np.float64,
    np.int32,
    np.int32,
    np.int8,
    np.int32,
    np.int64,
    np.int64,
    np.int64,
    np.int64,
)


class EventLog:
    """Append-only columnar events of one run; see the module doc.

    One writer at a time: registering a key and placing a detail row are read-then-write
    steps, so callers that append from several threads serialise their appends (the
    recorder does, under its lock; the simulator and the Ray router append from one
    thread). One reader may slice the log while the writer appends, as long as it reads
    only rows below a ``len(log)`` it took first. :meth:`seal` is for a writer with no
    concurrent reader (the simulator).
    """

    def __init__(self, run_id: str = "run") -> None:
        self.run_id = run_id
        self._buf = bytearray()  # rows not sealed yet, _ROW_BYTES each
        self._chunks: list[tuple[np.ndarray, ...]] = []  # sealed rows as typed columns
        self._chunk_starts: list[int] = []  # first row of each chunk
        self._sealed = 0  # rows before the buffer's first (in chunks, or forgotten)
        self._first = 0  # the first row still held (see forget_before)
        # Rows appended with values that are not plain numbers, kept as given (the buffer
        # holds zeros there): they are converted when read, failing as a float64 column
        # would (the recorder without validation isolates and drops such rows).
        self._odd: dict[int, tuple] = {}
        # Rows with a non-empty detail, in append order (so a slice is found by bisection).
        self._detail_rows: list[int] = []
        self._detail_text: list[str] = []
        self._keys: list[tuple[str, str, str]] = [("", "", "")]
        self._key_of: dict[tuple[str, str, str], int] = {("", "", ""): CLUSTER_KEY}

    def __len__(self) -> int:
        return self._sealed + len(self._buf) // _ROW_BYTES

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
        buf = self._buf
        if detail:
            self._detail_rows.append(self._sealed + len(buf) // _ROW_BYTES)
            self._detail_text.append(detail)
        try:
            packed = _pack(
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
        except (struct.error, OverflowError, TypeError):
            self._odd[self._sealed + len(buf) // _ROW_BYTES] = (
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
            packed = _ZERO_ROW
        buf.extend(packed)

    def row_writer(self) -> tuple[Callable[..., bytes], Callable[[bytes], None]]:
        """``(pack, write)`` for hot paths: ``write(pack(time, key, turn, kind, engine_id,
        context_tokens, new_tokens, cached_tokens, output_tokens))`` appends one event
        without detail (plain numbers only; two C calls, no Python frame)."""
        return _ROW.pack, self._buf.extend

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

    # ----------------------------------------------------------------- sealing
    def seal_if_full(self) -> None:
        """:meth:`seal` once :data:`SEAL_ROWS` events are waiting (single writer only)."""
        if len(self._buf) >= SEAL_ROWS * _ROW_BYTES:
            self.seal()

    def seal(self) -> None:
        """Move the unsealed events into typed columns (single writer, no concurrent
        reader). Skipped while rows appended with odd values are waiting: converting
        them may fail, and that belongs to the reader."""
        if self._odd or not self._buf:
            return
        block = np.frombuffer(bytes(self._buf), dtype=np.float64).reshape(-1, _WIDTH)
        self._chunks.append(_typed_columns(block, compact=True))
        self._chunk_starts.append(self._sealed)
        self._sealed += len(block)
        del self._buf[:]

    # ----------------------------------------------------------------- forgetting
    @property
    def first_row(self) -> int:
        """The first row still held: rows before it were let go by :meth:`forget_before`."""
        return self._first

    def forget_before(self, row: int) -> int:
        """Let go of the rows before ``row``, once every reader has read them: a
        long-lived service otherwise holds every event it ever served. Row numbers,
        ``len()`` and keys stay as they were; sealed rows go a whole chunk at a time.
        Same thread as the writer. Returns how many rows were let go."""
        row = min(row, len(self))
        before = self._first
        while self._chunks and self._chunk_starts[0] + len(self._chunks[0][0]) <= row:
            self._chunks.pop(0)
            self._chunk_starts.pop(0)
            self._first = self._chunk_starts[0] if self._chunks else self._sealed
        if row > self._sealed and not self._chunks:
            del self._buf[: (row - self._sealed) * _ROW_BYTES]
            self._sealed = self._first = row
        if self._first > before:
            drop = bisect.bisect_left(self._detail_rows, self._first)
            del self._detail_rows[:drop], self._detail_text[:drop]
            for odd in [r for r in self._odd if r < self._first]:
                del self._odd[odd]
        return self._first - before

    # ----------------------------------------------------------------- reading
    def _parts(
        self, start: int, stop: int, *, compact: bool
    ) -> Iterator[tuple[int, tuple[np.ndarray, ...]]]:
        """``(first row, columns)`` of each stored piece of rows ``start`` to ``stop``."""
        if start < self._sealed:
            first = bisect.bisect_right(self._chunk_starts, start) - 1
            for i in range(first, len(self._chunks)):
                chunk_start = self._chunk_starts[i]
                if chunk_start >= stop:
                    break
                chunk = self._chunks[i]
                lo = max(start, chunk_start) - chunk_start
                hi = min(stop, chunk_start + len(chunk[0])) - chunk_start
                yield chunk_start + lo, tuple(col[lo:hi] for col in chunk)
        if stop > self._sealed:
            lo = max(start, self._sealed)
            raw = self._buf[(lo - self._sealed) * _ROW_BYTES : (stop - self._sealed) * _ROW_BYTES]
            block = np.frombuffer(raw, dtype=np.float64).reshape(-1, _WIDTH)
            if self._odd:
                for row, values in self._odd.items():
                    if lo <= row < stop:
                        block[row - lo] = np.array(values, dtype=np.float64)
            yield lo, _typed_columns(block, compact=compact)

    def _details(self, start: int, stop: int) -> dict[int, str]:
        lo = bisect.bisect_left(self._detail_rows, start)
        hi = bisect.bisect_left(self._detail_rows, stop)
        return {self._detail_rows[i] - start: self._detail_text[i] for i in range(lo, hi)}

    def _bounds(self, start: int, stop: int | None) -> tuple[int, int]:
        stop = len(self) if stop is None else min(stop, len(self))
        start = max(0, min(start, stop))
        if start < self._first:
            raise ValueError(
                f"rows {start} to {self._first} of run {self.run_id!r} were let go "
                "(forget_before); read from first_row on"
            )
        return start, stop

    def batch(self, start: int = 0, stop: int | None = None) -> EventBatch:
        """Rows ``start`` to ``stop`` (default: to the end now) as numpy columns (copies:
        a caller may change them)."""
        start, stop = self._bounds(start, stop)
        parts = [columns for _, columns in self._parts(start, stop, compact=False)]
        if not parts:
            parts = [tuple(np.empty(0, dtype) for dtype in _BATCH_DTYPES)]
        cols = [
            np.concatenate([part[i] for part in parts]).astype(dtype, copy=False)
            for i, dtype in enumerate(_BATCH_DTYPES)
        ]
        return EventBatch(
            self.run_id,
            start,
            *cols,
            keys=self._keys,
            details=self._details(start, stop),
        )

    def to_table(self, start: int = 0, stop: int | None = None) -> pa.Table:
        """Rows ``start`` to ``stop`` as an Arrow table of the canonical schema (one record
        batch per stored piece; numeric columns share the sealed chunks' memory).

        Raises:
            OverflowError: a token count or id does not fit the schema's int32 (names the
                field and the row in the run).
        """
        start, stop = self._bounds(start, stop)
        if stop <= start:
            return ARROW_SCHEMA.empty_table()
        key_strings = _key_strings(self._keys)
        batches = []
        for first, columns in self._parts(start, stop, compact=True):
            details = self._details(first, first + len(columns[0]))
            texts = None
            if details:
                texts = [""] * len(columns[0])
                for row, text in details.items():
                    texts[row] = text
            batches.append(_record_batch(self.run_id, first, columns, key_strings, texts))
        return pa.Table.from_batches(batches, schema=ARROW_SCHEMA)

    def rows(self, start: int = 0, stop: int | None = None) -> list[tuple]:
        """Rows as tuples in ``FIELDS`` order (slow path)."""
        return list(self.batch(start, stop).rows())
