"""Append-only, buffered, crash-tolerant lifecycle-event recorder.

Callers pay for a few checks and a ``deque.append`` (atomic under the GIL, so any number
of threads, and coroutines on an event loop, may record at once without a lock). A
background thread turns the buffered rows into Arrow frames and appends them to the
current segment at least every ``flush_interval_s`` and whenever ``flush_batch`` rows are
waiting. Segments rotate once they pass ``segment_max_bytes``.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import math
import os
import threading
import weakref
from collections import deque
from pathlib import Path

from prorsa.errors import InputError
from prorsa.telemetry.schema import (
    CLUSTER_EVENT_KINDS,
    EVENT_KIND_SET,
    FIELDS,
    LifecycleEvent,
    rows_to_table,
)
from prorsa.telemetry.segments import FILE_MAGIC, encode_frame, segment_name

logger = logging.getLogger(__name__)

_live_recorders: weakref.WeakSet[Recorder] = weakref.WeakSet()


@atexit.register
def _close_live_recorders() -> None:
    for recorder in list(_live_recorders):
        recorder.close()


class Recorder:
    """Record lifecycle events of one run into a directory of segment files.

    Args:
        directory: folder for ``segment-NNNNNN.ptel`` files (created if missing).
        run_id: default ``run_id`` for events recorded through :meth:`record`.
        flush_interval_s: upper bound on how long an accepted event waits before it is
            handed to the operating system.
        flush_batch: flush early once this many events are buffered.
        segment_max_bytes: start a new segment once the current one reaches this size.
        fsync: also ``fsync`` each frame (survives power loss, not just a killed process).
        validate: reject invalid events in the caller (see :mod:`.validation`).
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
    ) -> None:
        if flush_interval_s <= 0:
            raise ValueError("flush_interval_s must be > 0")
        if flush_batch <= 0 or segment_max_bytes <= 0:
            raise ValueError("flush_batch and segment_max_bytes must be > 0")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id
        self.flush_interval_s = flush_interval_s
        self.flush_batch = flush_batch
        self.segment_max_bytes = segment_max_bytes
        self.fsync = fsync
        self.validate = validate
        self.records_accepted = 0
        self.records_written = 0
        self._buffer: deque[tuple] = deque()
        self._last: dict[tuple[str, str], tuple[float, int]] = {}
        self._write_lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._error: BaseException | None = None
        self._segment_index = self._next_free_segment()
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
        """Accept one event. Raises :class:`InputError` for an invalid one (nothing kept)."""
        row = (
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
        self.append_row(row)

    def emit(self, event: LifecycleEvent) -> None:
        """Accept one :class:`LifecycleEvent`."""
        self.append_row(event.as_row())

    def append_row(self, row: tuple) -> None:
        """Accept one row in ``FIELDS`` order."""
        if self._closed:
            raise RuntimeError(f"recorder for {self.directory} is closed")
        if self.validate:
            self._check(row)
        self._buffer.append(row)
        self.records_accepted += 1
        if len(self._buffer) >= self.flush_batch:
            self._wake.set()

    def _check(self, row: tuple) -> None:
        # Inlined rather than delegated to EventValidator: this runs once per event on the
        # caller's thread and must stay well under two microseconds.
        time, _run, traj, _g, _task, turn, kind = row[:7]
        if kind not in EVENT_KIND_SET:
            self._reject(f"unknown kind {kind!r}", "kind")
        if not time >= 0 or time == math.inf:
            self._reject(f"time must be finite and >= 0, got {time!r}", "time")
        if min(row[8], row[9], row[10], row[11], turn) < 0:
            for idx in (5, 8, 9, 10, 11):
                if row[idx] < 0:
                    self._reject(f"must be >= 0, got {row[idx]!r}", FIELDS[idx])
        if kind in CLUSTER_EVENT_KINDS:
            return
        key = (row[1], traj)
        last = self._last.get(key)
        if last is not None and (time < last[0] or turn < last[1]):
            if time < last[0]:
                self._reject(
                    f"time goes backwards within trajectory {traj!r}: {time} after {last[0]}",
                    "time",
                )
            self._reject(
                f"turn out of order within trajectory {traj!r}: {turn} after {last[1]}", "turn"
            )
        self._last[key] = (time, turn)

    def _reject(self, reason: str, field: str) -> None:
        raise InputError(
            reason, source=str(self.directory), record=self.records_accepted, field=field
        )

    # ------------------------------------------------------------------ flushing
    def flush(self) -> None:
        """Write everything accepted so far to the operating system (and disk if ``fsync``)."""
        with self._write_lock:
            self._drain()
        if self._error is not None:
            raise RuntimeError("telemetry recorder failed to write") from self._error

    def close(self) -> None:
        """Flush and close. Idempotent; called at interpreter exit for open recorders."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=30)
        with self._write_lock:
            self._drain()
            if self._file is not None:
                self._file.close()
                self._file = None
        _live_recorders.discard(self)

    async def aclose(self) -> None:
        """Close from asyncio code without blocking the event loop."""
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Recorder:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _flush_loop(self) -> None:
        while not self._closed:
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            try:
                with self._write_lock:
                    self._drain()
            except BaseException as exc:  # keep the error for flush()/close() to raise
                logger.exception("telemetry flush failed")
                self._error = exc
                return

    def _drain(self) -> None:
        buffer = self._buffer
        while buffer and self._file is not None:
            count = min(len(buffer), self.flush_batch)
            rows = [buffer.popleft() for _ in range(count)]
            frame = encode_frame(rows_to_table(rows))
            self._file.write(frame)
            self._file.flush()
            if self.fsync:
                os.fsync(self._file.fileno())
            self.records_written += count
            if self._file.tell() >= self.segment_max_bytes:
                self._file.close()
                self._segment_index += 1
                self._open_segment()

    def _next_free_segment(self) -> int:
        existing = sorted(self.directory.glob("segment-*.ptel"))
        if not existing:
            return 0
        return int(existing[-1].stem.split("-")[1]) + 1

    def _open_segment(self) -> None:
        path = self.directory / segment_name(self._segment_index)
        self._file = open(path, "ab")  # noqa: SIM115 - lives as long as the recorder
        self._file.write(FILE_MAGIC)
        self._file.flush()

    @property
    def segment_count(self) -> int:
        return self._segment_index + 1
