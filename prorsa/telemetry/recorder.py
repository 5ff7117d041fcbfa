"""Append-only, buffered, crash-tolerant lifecycle-event recorder.

Callers pay for the checks and one append to a columnar :class:`EventLog` (nine numbers;
strings are registered once per trajectory). A background thread takes the buffered log,
turns it into Arrow frames of at most ``flush_batch`` rows and appends them to the current
segment at least every ``flush_interval_s`` and whenever ``flush_batch`` events wait.
Segments rotate once they pass ``segment_max_bytes``.

Nothing is lost silently:

* every event is checked in the caller (types, int32 ranges, kinds, order within its
  trajectory), so a bad event raises there and never reaches, let alone poisons, a frame;
* a writer failure (a full or read-only disk) is raised by the next :meth:`record`,
  :meth:`flush` or :meth:`close`, with the cause and the number of events not written;
* the buffer is bounded: once ``max_buffered_events`` wait for the writer, callers block
  until it catches up, and after ``buffer_timeout_s`` the event is refused with a
  :class:`RecorderError` (back-pressure, never a silent drop);
* each accepted event bumps a memory-mapped counter, so after a crash the reader can say
  exactly how many buffered events never reached the disk (see :mod:`.segments`).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import math
import os
import threading
import time as _time
import weakref

import numpy as np

from prorsa.errors import InputError, RecorderError
from prorsa.io import check_output, is_utf8
from prorsa.telemetry.columns import CLUSTER_KEY, KIND_CODE, EventBatch, EventLog
from prorsa.telemetry.schema import CLUSTER_EVENT_KINDS, EVENT_KINDS, FIELDS, LifecycleEvent
from prorsa.telemetry.segments import (
    FILE_MAGIC,
    AcceptedCounter,
    count_name,
    encode_frame,
    fsync_file,
    segment_index,
    segment_name,
)

logger = logging.getLogger(__name__)

INT32_MAX = 2**31 - 1
_INF = math.inf
# Kind codes at or above this are cluster events (no trajectory order to check).
_FIRST_CLUSTER_CODE = min(KIND_CODE[k] for k in CLUSTER_EVENT_KINDS)
assert all(KIND_CODE[k] >= _FIRST_CLUSTER_CODE for k in CLUSTER_EVENT_KINDS)
assert all(KIND_CODE[k] < _FIRST_CLUSTER_CODE for k in EVENT_KINDS if k not in CLUSTER_EVENT_KINDS)
_STRING_FIELDS = ("run_id", "trajectory_id", "group_id", "task")
_ENCODED_FIELDS = ("trajectory_id", "group_id", "task", "detail", "run_id")


_INT_FIELDS = (
    "turn",
    "engine_id",
    "context_tokens",
    "new_tokens",
    "cached_tokens",
    "output_tokens",
)

_live_recorders: weakref.WeakSet[Recorder] = weakref.WeakSet()


@atexit.register
def _close_live_recorders() -> None:
    for recorder in list(_live_recorders):
        try:
            recorder.close()
        except Exception:  # at exit there is no caller left to raise to
            logger.exception("telemetry recorder for %s failed at exit", recorder.directory)


class Recorder:
    """Record lifecycle events of one run into a directory of segment files.

    Args:
        directory: folder for ``segment-NNNNNN.ptel`` files (created if missing).
        run_id: default ``run_id`` for events recorded through :meth:`record`.
        flush_interval_s: upper bound on how long an accepted event waits before it is
            handed to the operating system.
        flush_batch: flush early once this many events are buffered; also the most rows
            in one frame.
        segment_max_bytes: start a new segment once the current one reaches this size.
        fsync: also ``fsync`` each frame (survives power loss, not just a killed process).
        validate: check every event in the caller (see the module doc). Without it only
            the kind is checked; an event the writer then cannot encode is dropped, counted
            in :attr:`records_dropped`, logged, and reported as lost by the reader.
        max_buffered_events: most events waiting for the writer before callers block.
        buffer_timeout_s: how long a caller blocks on a full buffer before the event is
            refused with :class:`RecorderError`.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        run_id: str = "run",
        flush_interval_s: float = 1.0,
        flush_batch: int = 65_536,
        segment_max_bytes: int = 64 * 1024 * 1024,
        fsync: bool = False,
        validate: bool = True,
        max_buffered_events: int = 500_000,
        buffer_timeout_s: float = 30.0,
    ) -> None:
        if not (isinstance(flush_interval_s, (int, float)) and 0 < flush_interval_s < _INF):
            raise ValueError(f"flush_interval_s must be finite and > 0, got {flush_interval_s!r}")
        if not (isinstance(buffer_timeout_s, (int, float)) and 0 <= buffer_timeout_s < _INF):
            raise ValueError(f"buffer_timeout_s must be finite and >= 0, got {buffer_timeout_s!r}")
        if min(flush_batch, segment_max_bytes, max_buffered_events) <= 0:
            raise ValueError("flush_batch, segment_max_bytes and max_buffered_events must be > 0")
        if not isinstance(run_id, str):
            raise ValueError(f"run_id must be a string, got {type(run_id).__name__}")
        if not is_utf8(run_id):
            raise ValueError(f"run_id {run_id!r} is not valid UTF-8 (Parquet strings are)")
        self.directory = check_output(directory, kind="dir")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id
        self.flush_interval_s = flush_interval_s
        self.flush_batch = flush_batch
        self.segment_max_bytes = segment_max_bytes
        self.fsync = fsync
        self.validate = validate
        self.max_buffered_events = max_buffered_events
        self.buffer_timeout_s = buffer_timeout_s
        self.records_written = 0
        self.records_dropped = 0

        # Appends and the writer's swap of the log are serialised by one lock: an
        # EventLog's trajectory keys and detail rows are not safe for concurrent writers.
        self._lock = threading.Lock()
        self._log = EventLog(run_id)
        self._generation = 0  # bumped when the log is swapped: trajectory keys start over
        self._queue: list[EventLog | EventBatch] = []  # closed-off work, in accepted order
        self._accepted = 0
        self._unwritten = 0
        self._written_seq = 0  # session record number of the next row to write
        # record() goes straight on while _unwritten < _gate; -1 sends every call to
        # _admit (closed or failed), which raises.
        self._gate = max_buffered_events
        self._wake_at = flush_batch
        # trajectory -> [time, turn, group_id, task, key, generation]
        self._last: dict[object, list] = {}
        self._space = threading.Condition()
        self._write_lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._closed = False
        self._failure: BaseException | None = None

        self._session = self._next_free_segment()
        self._segment_index = self._session
        self._counter = AcceptedCounter(self.directory / count_name(self._session))
        self._count_view = self._counter.view
        self._file = None
        self._open_segment()
        self._thread = threading.Thread(
            target=self._flush_loop, name="prorsa-recorder", daemon=True
        )
        self._thread.start()
        _live_recorders.add(self)

    # ----------------------------------------------------------------- recording
    def record(
        self,
        time: float,
        trajectory_id: str,
        kind: str,
        *,
        turn: int = 0,
        group_id: str = "",
        task: str = "",
        engine_id: int = -1,
        context_tokens: int = 0,
        new_tokens: int = 0,
        cached_tokens: int = 0,
        output_tokens: int = 0,
        detail: str = "",
        run_id: str | None = None,
    ) -> None:
        """Accept one event.

        Raises:
            InputError: the event is invalid (names the field); nothing is kept.
            RecorderError: the writer failed earlier, or the buffer stayed full for
                ``buffer_timeout_s``; nothing is kept.
        """
        if self._unwritten >= self._gate:
            self._admit(1)
        if run_id is None and self._accept_plain(
            time,
            trajectory_id,
            group_id,
            task,
            turn,
            kind,
            engine_id,
            context_tokens,
            new_tokens,
            cached_tokens,
            output_tokens,
            detail,
        ):
            return
        # Anything unusual (another run, numpy numbers, an enum kind, a bad value) takes
        # the careful path, which normalises or names the bad field.
        self._accept_row(
            (
                time,
                self.run_id if run_id is None else run_id,
                trajectory_id,
                group_id,
                task,
                turn,
                kind,
                engine_id,
                context_tokens,
                new_tokens,
                cached_tokens,
                output_tokens,
                detail,
            )
        )

    def emit(self, event: LifecycleEvent) -> None:
        """Accept one :class:`LifecycleEvent`."""
        self.append_row(event.as_row())

    def append_row(self, row: tuple) -> None:
        """Accept one row in ``FIELDS`` order (same checks and errors as :meth:`record`)."""
        if self._unwritten >= self._gate:
            self._admit(1)
        if type(row) is tuple and len(row) == 13 and row[1] == self.run_id:
            (time, _, traj, group, task, turn, kind, engine, ctx, new, cached, out, detail) = row
            if self._accept_plain(
                time, traj, group, task, turn, kind, engine, ctx, new, cached, out, detail
            ):
                return
        self._accept_row(row)

    def append_batch(self, batch: EventBatch) -> None:
        """Accept a slice of an :class:`EventLog` in bulk (a run's events persisted at once).

        Checked as a whole with vector operations (kinds, int32 ranges, finite times,
        order within each trajectory, also against events recorded earlier); an invalid
        batch raises :class:`InputError` naming the first bad row (its index in the source
        log) and nothing of it is kept.
        """
        n = len(batch)
        if n == 0:
            return
        if self._unwritten + n > self._gate:
            self._admit(n)
        states = self._check_batch(batch) if self.validate else None
        with self._lock:
            if self._gate < 0:
                self._raise_refusal()
            if len(self._log):
                self._queue.append(self._log)
                self._log = EventLog(self._log.run_id)
                self._generation += 1
            self._queue.append(batch)
            if states is not None:
                self._last.update(states)
            self._accepted += n
            self._count_view[0] = self._accepted
            self._unwritten += n
            if self._unwritten >= self._wake_at:
                self._wake_at = self._unwritten + self.flush_batch
                self._wake.set()

    @property
    def records_accepted(self) -> int:
        """Events accepted so far (written, buffered, or dropped by the writer)."""
        return self._accepted

    # ------------------------------------------------------------------ internals
    def _accept_plain(
        self,
        time: float,
        trajectory_id: str,
        group_id: str,
        task: str,
        turn: int,
        kind: str,
        engine_id: int,
        context_tokens: int,
        new_tokens: int,
        cached_tokens: int,
        output_tokens: int,
        detail: str,
    ) -> bool:
        """Accept an event of the default run whose values have plain types and valid
        ranges; False (nothing done) for anything else, which the careful path handles."""
        code = KIND_CODE.get(kind) if type(kind) is str else None
        if (
            code is None
            or not self.validate
            or type(time) is not float
            or type(trajectory_id) is not str
            or type(group_id) is not str
            or type(task) is not str
            or type(detail) is not str
            or not detail.isascii()  # the careful path checks it encodes
            or type(turn) is not int
            or type(engine_id) is not int
            or type(context_tokens) is not int
            or type(new_tokens) is not int
            or type(cached_tokens) is not int
            or type(output_tokens) is not int
            # NaN fails both comparisons; the literal is the largest finite float.
            or not 0.0 <= time <= 1.7976931348623157e308
            # One test for all int32 ranges: a negative int, or one >= 2**31, has bits
            # above bit 30 (engine_id may be -1, hence the + 1).
            or (
                turn | context_tokens | new_tokens | cached_tokens | output_tokens | (engine_id + 1)
            )
            >> 31
        ):
            return False
        state = self._last.get(trajectory_id)
        if (
            state is not None
            and code < _FIRST_CLUSTER_CODE
            and time >= state[0]
            and turn >= state[1]
            and state[2] == group_id
            and state[3] == task
        ):
            # The common case, inlined: a known trajectory's next event.
            state[0] = time
            state[1] = turn
            lock = self._lock
            lock.acquire()
            try:
                if state[5] == self._generation and self._gate >= 0:
                    self._log.append(
                        time,
                        state[4],
                        turn,
                        code,
                        engine_id,
                        context_tokens,
                        new_tokens,
                        cached_tokens,
                        output_tokens,
                        detail,
                    )
                    accepted = self._accepted = self._accepted + 1
                    self._count_view[0] = accepted
                    unwritten = self._unwritten = self._unwritten + 1
                    if unwritten >= self._wake_at:
                        self._wake_at = unwritten + self.flush_batch
                        self._wake.set()
                    return True
            finally:
                lock.release()
        self._accept(
            time,
            trajectory_id,
            group_id,
            task,
            turn,
            code,
            engine_id,
            context_tokens,
            new_tokens,
            cached_tokens,
            output_tokens,
            detail,
            self.run_id,
            trajectory_id,
        )
        return True

    def _accept(
        self,
        time: float,
        trajectory_id: str,
        group_id: str,
        task: str,
        turn: int,
        code: int,
        engine_id: int,
        context_tokens: int,
        new_tokens: int,
        cached_tokens: int,
        output_tokens: int,
        detail: str,
        run_id: str,
        state_key: object,
    ) -> None:
        """Check order within the trajectory and that the strings encode (a string Parquet
        cannot hold would fail every row written beside it), then append."""
        if self.validate:
            fields = (trajectory_id, group_id, task, detail, run_id)
            for name, value in zip(_ENCODED_FIELDS, fields, strict=True):
                if not is_utf8(value):
                    self._reject(f"{value!r:.80} is not valid UTF-8", name)
        if code < _FIRST_CLUSTER_CODE and self.validate:
            state = self._last.get(state_key)
            if state is None:
                state = self._last[state_key] = [time, turn, group_id, task, 0, -1]
            else:
                if time < state[0] or turn < state[1]:
                    self._reject_order(trajectory_id, time, turn, state)
                state[0] = time
                state[1] = turn
                if state[2] != group_id or state[3] != task:
                    state[2], state[3], state[5] = group_id, task, -1
        else:
            state = None
        with self._lock:
            if self._gate < 0:  # closed or failed after this call passed the gate
                self._raise_refusal()
            log = self._log
            if log.run_id != run_id:
                log = self._switch_run(run_id)
            if state is None:
                key = (
                    CLUSTER_KEY
                    if not (trajectory_id or group_id or task)
                    else log.key(trajectory_id, group_id, task)
                )
            elif state[5] == self._generation:
                key = state[4]
            else:
                key = state[4] = log.key(trajectory_id, group_id, task)
                state[5] = self._generation
            log.append(
                time,
                key,
                turn,
                code,
                engine_id,
                context_tokens,
                new_tokens,
                cached_tokens,
                output_tokens,
                detail,
            )
            accepted = self._accepted = self._accepted + 1
            self._count_view[0] = accepted
            unwritten = self._unwritten = self._unwritten + 1
            if unwritten >= self._wake_at:
                self._wake_at = unwritten + self.flush_batch
                self._wake.set()

    def _switch_run(self, run_id: str) -> EventLog:
        # Called with the lock held: one EventLog holds one run.
        if len(self._log):
            self._queue.append(self._log)
        self._log = EventLog(run_id)
        self._generation += 1
        return self._log

    def _accept_row(self, row: tuple) -> None:
        """The careful path: normalise the row's values or raise naming the bad field."""
        if not isinstance(row, tuple) or len(row) != len(FIELDS):
            got = len(row) if isinstance(row, tuple) else type(row).__name__
            self._reject(f"expected a tuple of {len(FIELDS)} fields, got {got}", None)
        (time, run_id, traj, group, task, turn, kind, engine, ctx, new, cached, out, detail) = row
        if not isinstance(kind, str) or kind not in KIND_CODE:
            self._reject(f"unknown kind {kind!r:.60}", "kind")
        code = KIND_CODE[kind]
        if self.validate:
            for name, value in zip(_STRING_FIELDS, (run_id, traj, group, task), strict=True):
                if not isinstance(value, str):
                    self._reject(f"must be a string, got {_describe(value)}", name)
            if not isinstance(detail, str):
                self._reject(
                    f"must be a string, got {_describe(detail)} "
                    "(encode structured detail with prorsa.telemetry.schema.detail_json)",
                    "detail",
                )
            time = self._checked_time(time)
            turn = self._checked_int("turn", turn, 0)
            engine = self._checked_int("engine_id", engine, -1)
            ctx = self._checked_int("context_tokens", ctx, 0)
            new = self._checked_int("new_tokens", new, 0)
            cached = self._checked_int("cached_tokens", cached, 0)
            out = self._checked_int("output_tokens", out, 0)
            # str subclasses (enums, numpy strings) become plain strings.
            run_id, traj, group, task = str(run_id), str(traj), str(group), str(task)
            detail = str(detail)
        state_key = traj if run_id == self.run_id else (run_id, traj)
        self._accept(
            time, traj, group, task, turn, code, engine, ctx, new, cached, out, detail, run_id,
            state_key,
        )  # fmt: skip

    def _checked_time(self, value: object) -> float:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
            self._reject(f"must be a number, got {_describe(value)}", "time")
        time = float(value)  # type: ignore[arg-type]
        if not 0.0 <= time < _INF:
            self._reject(f"must be finite and >= 0, got {value!r}", "time")
        return time

    def _checked_int(self, name: str, value: object, low: int) -> int:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            self._reject(f"must be an integer, got {_describe(value)}", name)
        number = int(value)  # type: ignore[arg-type]
        if number < low:
            self._reject(f"must be >= {low}, got {number}", name)
        if number > INT32_MAX:
            self._reject(f"{number} exceeds the telemetry schema's int32 limit {INT32_MAX}", name)
        return number

    def _check_batch(self, batch: EventBatch) -> dict[object, list]:
        """Vectorised checks of a batch; the trajectories' new last (time, turn) states."""
        bad = _first_bad_row(batch)
        if bad is not None:
            row, name, reason = bad
            self._reject(reason, name, record=batch.start + row)
        keys = batch.keys
        for text in batch.details.values():
            if not isinstance(text, str):
                self._reject(f"must be a string, got {_describe(text)}", "detail")
            if not is_utf8(text):
                self._reject(f"{text!r:.80} is not valid UTF-8", "detail")
        if not is_utf8(batch.run_id):
            self._reject(f"{batch.run_id!r:.80} is not valid UTF-8", "run_id")
        trajectory_rows = np.flatnonzero(batch.kind < _FIRST_CLUSTER_CODE)
        if not len(trajectory_rows):
            return {}
        used = np.unique(batch.key[trajectory_rows])
        for key in used.tolist():
            if not all(isinstance(part, str) for part in keys[key]):
                self._reject(f"key {key} is not three strings: {keys[key]!r:.80}", "trajectory_id")
            for name, part in zip(("trajectory_id", "group_id", "task"), keys[key], strict=True):
                if not is_utf8(part):
                    self._reject(f"{part!r:.80} is not valid UTF-8", name)
        # Stable sort by key keeps each trajectory's rows in their order.
        order = trajectory_rows[np.argsort(batch.key[trajectory_rows], kind="stable")]
        key, time, turn = batch.key[order], batch.time[order], batch.turn[order]
        same = key[1:] == key[:-1]
        back = np.flatnonzero(same & (time[1:] < time[:-1]))
        down = np.flatnonzero(same & (turn[1:] < turn[:-1]))
        if len(back) or len(down):
            first = min(
                [(int(order[i + 1]), "time") for i in back[:1]]
                + [(int(order[i + 1]), "turn") for i in down[:1]]
            )
            row, name = first
            traj = keys[int(batch.key[row])][0]
            self._reject(
                f"{name} goes backwards within trajectory {traj!r}", name, batch.start + row
            )
        starts = np.flatnonzero(np.concatenate([[True], ~same]))
        ends = np.concatenate([starts[1:] - 1, [len(order) - 1]])
        states: dict[object, list] = {}
        run_id = batch.run_id
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
            traj, group, task = keys[int(key[s])]
            state_key = traj if run_id == self.run_id else (run_id, traj)
            last = self._last.get(state_key) or states.get(state_key)
            if last is not None and (time[s] < last[0] or turn[s] < last[1]):
                name = "time" if time[s] < last[0] else "turn"
                self._reject(
                    f"{name} goes backwards within trajectory {traj!r}: "
                    f"{time[s] if name == 'time' else turn[s]} after "
                    f"{last[0] if name == 'time' else last[1]}",
                    name,
                    batch.start + int(order[s]),
                )
            states[state_key] = [float(time[e]), int(turn[e]), group, task, 0, -1]
        return states

    def _reject_order(self, trajectory_id: str, time: float, turn: int, state: list) -> None:
        if time < state[0]:
            self._reject(
                f"time goes backwards within trajectory {trajectory_id!r}: {time} after {state[0]}",
                "time",
            )
        self._reject(
            f"turn out of order within trajectory {trajectory_id!r}: {turn} after {state[1]}",
            "turn",
        )

    def _reject(self, reason: str, field: str | None, record: int | None = None) -> None:
        raise InputError(
            reason,
            source=str(self.directory),
            record=self._accepted if record is None else record,
            field=field,
        )

    def _admit(self, n: int) -> None:
        """Slow path of an append: refuse when closed or failed, wait for buffer space."""
        if self._gate < 0:
            self._raise_refusal()
        deadline = _time.monotonic() + self.buffer_timeout_s
        self._wake.set()
        with self._space:
            while (
                self._unwritten > 0
                and self._unwritten + n > self.max_buffered_events
                and self._gate >= 0
            ):
                left = deadline - _time.monotonic()
                if left <= 0:
                    raise RecorderError(
                        f"telemetry recorder for {self.directory}: {self._unwritten} events "
                        f"still wait for the writer after {self.buffer_timeout_s:g} s; "
                        f"{n} event(s) not recorded",
                        hint="the disk is slower than the event rate: record fewer events, "
                        "write to a faster disk, or raise max_buffered_events",
                    )
                self._space.wait(left)
        if self._gate < 0:
            self._raise_refusal()

    def _raise_refusal(self) -> None:
        if self._failure is not None:
            raise self._failure_error() from self._failure
        raise RuntimeError(f"recorder for {self.directory} is closed")

    def _failure_error(self) -> RecorderError:
        unwritten = self._accepted - self.records_written - self.records_dropped
        return RecorderError(
            f"telemetry recorder for {self.directory} failed to write: "
            f"{type(self._failure).__name__}: {self._failure}; {unwritten} of "
            f"{self._accepted} accepted event(s) not written",
            hint="free space on that disk or record to another folder; events already "
            "written stay readable",
        )

    # ------------------------------------------------------------------ flushing
    def flush(self) -> None:
        """Write everything accepted so far to the operating system (and disk if ``fsync``).

        Raises:
            RecorderError: the writer failed (now or earlier), with the cause.
        """
        if self._failure is None:
            try:
                with self._write_lock:
                    self._drain()
            except BaseException as exc:
                self._fail(exc)
        if self._failure is not None:
            raise self._failure_error() from self._failure

    def close(self) -> None:
        """Flush and close. Idempotent; called at interpreter exit for open recorders.

        Raises:
            RecorderError: the writer failed; says how many events were not written.
        """
        if self._closed:
            return
        self._closed = True
        self._closing = True
        with self._lock:
            self._gate = -1
        self._wake.set()
        self._thread.join(timeout=60)
        try:
            if self._failure is None:
                with self._write_lock:
                    self._drain()
        except BaseException as exc:
            self._fail(exc)
        finally:
            with self._write_lock:
                if self._file is not None:
                    try:
                        self._file.close()
                    except OSError as exc:
                        self._fail(exc)
                    self._file = None
                self._counter.close()
            _live_recorders.discard(self)
        if self._failure is not None:
            raise self._failure_error() from self._failure

    async def aclose(self) -> None:
        """Close from asyncio code without blocking the event loop."""
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._close_after(exc is not None)

    async def __aenter__(self) -> Recorder:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._close_after, exc is not None)

    def _close_after(self, failing: bool) -> None:
        # A recorder failure must not hide the exception that is already unwinding.
        try:
            self.close()
        except RecorderError:
            if not failing:
                raise
            logger.exception("telemetry recorder failed while another error was raised")

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
            logger.error("telemetry writer for %s failed: %r", self.directory, exc)
        with self._lock:
            self._gate = -1
        with self._space:
            self._space.notify_all()

    def _flush_loop(self) -> None:
        while True:
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            closing = self._closing
            try:
                with self._write_lock:
                    self._drain()
            except BaseException as exc:  # kept for record()/flush()/close() to raise
                self._fail(exc)
                return
            if closing:
                return

    def _drain(self) -> None:
        """Write every accepted event (call with the write lock held)."""
        if self._file is None:
            return
        with self._lock:
            if len(self._log):
                self._queue.append(self._log)
                self._log = EventLog(self._log.run_id)
                self._generation += 1
            items, self._queue = self._queue, []
        for item in items:
            total = len(item)
            for start in range(0, total, self.flush_batch):
                self._write_rows(item, start, min(total, start + self.flush_batch))

    def _write_rows(self, source: EventLog | EventBatch, start: int, stop: int) -> None:
        try:
            if isinstance(source, EventLog):
                table = source.batch(start, stop).to_table()
            else:
                table = _slice(source, start, stop).to_table()
        except Exception as exc:
            # Only reachable with validate=False: isolate the row(s) that cannot be
            # encoded, write the rest, count and log what is dropped.
            if stop - start == 1:
                self._drop(1, exc)
                return
            middle = (start + stop) // 2
            self._write_rows(source, start, middle)
            self._write_rows(source, middle, stop)
            return
        self._write_table(table)

    def _write_table(self, table) -> None:
        n = table.num_rows
        frame = encode_frame(table, session=self._session, first_record=self._written_seq)
        self._file.write(frame)
        self._file.flush()
        if self.fsync:
            fsync_file(self._file)
        self._written_seq += n
        self.records_written += n
        self._release(n)
        if self._file.tell() >= self.segment_max_bytes:
            self._file.close()
            self._file = None
            self._segment_index += 1
            self._open_segment()

    def _drop(self, n: int, exc: BaseException) -> None:
        logger.error(
            "telemetry recorder for %s dropped event %d (cannot encode it: %s)",
            self.directory,
            self._written_seq,
            exc,
        )
        self._written_seq += n
        self.records_dropped += n
        self._release(n)

    def _release(self, n: int) -> None:
        with self._lock:
            self._unwritten -= n
            self._wake_at = self._unwritten + self.flush_batch
        with self._space:
            self._space.notify_all()

    def _next_free_segment(self) -> int:
        used = [segment_index(p) for p in self.directory.glob("segment-*")]
        used += [
            int(p.stem.removeprefix("accepted-"))
            for p in self.directory.glob("accepted-*.count")
            if p.stem.removeprefix("accepted-").isdigit()
        ]
        used = [i for i in used if i is not None]
        return max(used) + 1 if used else 0

    def _open_segment(self) -> None:
        path = self.directory / segment_name(self._segment_index)
        self._file = open(path, "ab")  # noqa: SIM115 - lives as long as the recorder
        if self._file.tell() == 0:
            self._file.write(FILE_MAGIC)
            self._file.flush()

    @property
    def segment_count(self) -> int:
        """Segments this recorder has written to."""
        return self._segment_index - self._session + 1


def _describe(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _slice(batch: EventBatch, start: int, stop: int) -> EventBatch:
    """Rows ``start`` to ``stop`` of a batch (0-based within it)."""
    if start == 0 and stop >= len(batch):
        return batch
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
        details={r - start: t for r, t in batch.details.items() if start <= r < stop},
    )


def _first_bad_row(batch: EventBatch) -> tuple[int, str, str] | None:
    """``(row, field, reason)`` of the first row breaking a per-row rule, else None."""
    n = len(batch)
    checks: list[tuple[str, np.ndarray, str]] = [
        ("kind", (batch.kind < 0) | (batch.kind >= len(EVENT_KINDS)), "unknown kind code"),
        ("time", ~(np.isfinite(batch.time) & (batch.time >= 0)), "must be finite and >= 0"),
        ("trajectory_id", (batch.key < 0) | (batch.key >= len(batch.keys)), "unknown key"),
        ("turn", (batch.turn < 0), "must be >= 0"),
        ("engine_id", (batch.engine_id < -1), "must be >= -1"),
    ]
    for name in ("context_tokens", "new_tokens", "cached_tokens", "output_tokens"):
        values = getattr(batch, name)
        checks.append((name, values < 0, "must be >= 0"))
        checks.append((name, values > INT32_MAX, f"exceeds the schema's int32 limit {INT32_MAX}"))
    best: tuple[int, str, str] | None = None
    for name, mask, reason in checks:
        if len(mask) != n:
            return 0, name, f"column has {len(mask)} values for {n} rows"
        hits = np.flatnonzero(mask)
        if len(hits) and (best is None or hits[0] < best[0]):
            best = (int(hits[0]), name, reason)
    return best
