from __future__ import annotations

import asyncio
import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from prorsa.errors import InputError, RecorderError
from prorsa.telemetry import Recorder, read_telemetry
from prorsa.telemetry.segments import read_segment


def _record_n(rec: Recorder, traj: str, n: int) -> None:
    for k in range(n):
        rec.record(float(k), traj, "decode_start", turn=0, context_tokens=k, engine_id=1)


def test_round_trip_and_close_flushes(tmp_path):
    with Recorder(tmp_path, run_id="run-1", flush_interval_s=30) as rec:
        _record_n(rec, "t0", 1000)
    table, report = read_telemetry(tmp_path, validate=True)
    assert report.clean and table.num_rows == 1000
    assert table.column("context_tokens").to_pylist() == list(range(1000))
    assert set(table.column("run_id").to_pylist()) == {"run-1"}


def _rows_on_disk_within(path, seconds: float) -> int:
    deadline = time.monotonic() + seconds
    while True:
        table, _ = read_telemetry(path)
        if table.num_rows or time.monotonic() >= deadline:
            return table.num_rows
        time.sleep(0.05)


def test_flushes_within_interval_without_close(tmp_path):
    # The timer, not close(), puts the event on disk: with a 30 s interval it is not there
    # after 0.5 s; with 0.2 s it is there well before that 30 s (2 s leaves room for a
    # machine busy with other work).
    slow = Recorder(tmp_path / "slow", flush_interval_s=30.0)
    slow.record(0.0, "t", "traj_start")
    assert _rows_on_disk_within(tmp_path / "slow", 0.5) == 0
    slow.close()
    assert read_telemetry(tmp_path / "slow")[0].num_rows == 1
    rec = Recorder(tmp_path / "fast", flush_interval_s=0.2)
    rec.record(0.0, "t", "traj_start")
    assert _rows_on_disk_within(tmp_path / "fast", 2.0) == 1, "event not on disk within 2 s"
    rec.close()


def test_many_threads_lose_and_duplicate_nothing(tmp_path):
    rec = Recorder(tmp_path, flush_interval_s=0.05, flush_batch=5_000)
    threads = [threading.Thread(target=_record_n, args=(rec, f"t{i}", 20_000)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rec.close()
    table, report = read_telemetry(tmp_path, validate=True)
    assert report.clean and table.num_rows == 160_000
    df = table.to_pandas()
    for traj, rows in df.groupby("trajectory_id"):
        # Each thread's events arrive in its own order, none missing, none twice.
        assert rows["context_tokens"].tolist() == list(range(20_000)), traj


def test_usable_from_asyncio(tmp_path):
    async def main():
        async with Recorder(tmp_path, flush_interval_s=0.05) as rec:

            async def worker(i):
                for k in range(200):
                    rec.record(float(k), f"a{i}", "tool_start", turn=k)
                    await asyncio.sleep(0)

            await asyncio.gather(*(worker(i) for i in range(5)))

    asyncio.run(main())
    table, _ = read_telemetry(tmp_path, validate=True)
    assert table.num_rows == 1000


def test_segments_rotate_and_read_back_in_order(tmp_path):
    rec = Recorder(tmp_path, flush_batch=500, segment_max_bytes=20_000, flush_interval_s=30)
    _record_n(rec, "t", 10_000)
    rec.close()
    assert rec.segment_count > 3
    assert len(list(tmp_path.glob("segment-*.ptel"))) == rec.segment_count
    table, report = read_telemetry(tmp_path)
    assert report.segments == rec.segment_count
    assert table.column("context_tokens").to_pylist() == list(range(10_000))


def test_reopening_a_directory_appends_new_segments(tmp_path):
    with Recorder(tmp_path) as rec:
        _record_n(rec, "a", 10)
    with Recorder(tmp_path) as rec:
        _record_n(rec, "b", 10)
    table, _ = read_telemetry(tmp_path)
    assert table.num_rows == 20


def test_invalid_event_rejected_and_accepted_data_kept(tmp_path):
    rec = Recorder(tmp_path)
    _record_n(rec, "t", 5)
    with pytest.raises(InputError) as info:
        rec.record(1.0, "t", "decode_start", output_tokens=-4)
    assert info.value.field == "output_tokens" and info.value.record == 5
    with pytest.raises(InputError, match="time goes backwards"):
        rec.record(0.5, "t", "decode_end")
    with pytest.raises(InputError, match="unknown kind"):
        rec.record(9.0, "t", "bogus")
    rec.record(9.0, "t", "decode_end", output_tokens=3)
    rec.close()
    table, _ = read_telemetry(tmp_path, validate=True)
    assert table.num_rows == 6


@pytest.mark.parametrize("cut", [1, 7, 15, 40, 200])
def test_reader_reports_truncated_tail(tmp_path, cut):
    with Recorder(tmp_path, flush_batch=100, flush_interval_s=30) as rec:
        _record_n(rec, "t", 300)  # three frames of 100
    seg = next(tmp_path.glob("segment-*.ptel"))
    data = seg.read_bytes()
    seg.write_bytes(data[:-cut])
    table, report = read_telemetry(tmp_path)
    assert table.num_rows == 200
    assert table.column("context_tokens").to_pylist() == list(range(200))
    assert report.truncated_bytes > 0 and not report.clean
    assert report.truncated_records == 100
    assert "truncated tail" in report.describe()


def test_reader_handles_cut_frame_header(tmp_path):
    with Recorder(tmp_path, flush_batch=100, flush_interval_s=30) as rec:
        _record_n(rec, "t", 200)
    seg = next(tmp_path.glob("segment-*.ptel"))
    full = read_segment(seg)
    assert full.frames == 2
    first_frame_end = len(seg.read_bytes()) - (len(seg.read_bytes()) - 8) // 2
    seg.write_bytes(seg.read_bytes()[: first_frame_end + 5])  # 5 bytes of the next header
    table, report = read_telemetry(seg)
    # The segment alone cannot say how many records the cut frame held...
    assert table.num_rows == 100 and report.lost_records is None
    # ...its directory can: the session's accepted count says 200.
    table, report = read_telemetry(tmp_path)
    assert table.num_rows == 100 and report.lost_records == 100


CHILD = textwrap.dedent(
    """
    import sys, time
    from prorsa.telemetry import Recorder
    rec = Recorder(sys.argv[1], flush_interval_s=0.02, flush_batch=2000, segment_max_bytes=200_000)
    k = 0
    print("ready", flush=True)
    while True:
        rec.record(float(k), "t", "decode_start", context_tokens=k % 2_000_000_000,
                   detail="x" * (k % 50))
        k += 1
    """
)


def test_survives_kill_9_mid_write(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.stdout.readline().strip() == b"ready"
    # Kill once several segments are on disk and writes still go on. The producer's
    # tight loop competes with the writer thread for the GIL, so on a loaded machine the
    # writer can take far longer than the usual second or two to get there. Count files,
    # not bytes: under load the writer drains a large backlog into one frame, so one
    # segment can hold most of the bytes. A fourth file means three segments rotated out.
    deadline = time.monotonic() + 120
    files = 0
    while time.monotonic() < deadline:
        files = len(list(tmp_path.glob("segment-*.ptel")))
        if files >= 4:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert files >= 4, f"the writer rotated only {files} segment file(s) in 120 s"
    table, report = read_telemetry(tmp_path)
    assert report.segments >= 3
    n = table.num_rows
    assert n >= 4_000  # at least two full frames made it
    # Every recovered record is complete and nothing in the middle is missing.
    assert table.column("time").to_pylist() == [float(k) for k in range(n)]
    assert report.truncated_bytes >= 0  # a kill between frames leaves a clean tail


# ------------------------------------------------------------ nothing lost silently
@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"context_tokens": 2**31}, "context_tokens"),
        ({"output_tokens": 1.5}, "output_tokens"),
        ({"engine_id": "3"}, "engine_id"),
        ({"engine_id": -2}, "engine_id"),
        ({"turn": True}, "turn"),
        ({"detail": {"tool": "bash"}}, "detail"),
        ({"group_id": None}, "group_id"),
        ({"run_id": 7}, "run_id"),
        # Strings Parquet cannot hold (lone surrogates) would fail every row beside them.
        ({"group_id": "g\udce9"}, "group_id"),
        ({"task": "\ud800"}, "task"),
        ({"detail": "caf\udce9"}, "detail"),
        ({"run_id": "r\ud800"}, "run_id"),
    ],
)
def test_a_bad_event_is_refused_in_the_caller_and_poisons_nothing(tmp_path, bad, field):
    rec = Recorder(tmp_path, flush_interval_s=30)
    _record_n(rec, "t", 100)
    with pytest.raises(InputError) as info:
        rec.record(100.0, "t", "decode_start", **bad)
    assert info.value.field == field and info.value.record == 100
    with pytest.raises(InputError) as info:
        rec.record(100.0, 12345, "decode_start")
    assert info.value.field == "trajectory_id"
    for k in range(100, 301):
        rec.record(float(k), "t", "decode_start", context_tokens=k, engine_id=1)
    rec.close()
    table, report = read_telemetry(tmp_path, validate=True)
    assert report.clean and table.num_rows == 301
    assert table.column("context_tokens").to_pylist() == list(range(301))


def test_a_trajectory_id_parquet_cannot_hold_is_refused_and_loses_no_other_event(tmp_path):
    # Found by review: accepted, it failed the string column of every frame it was in,
    # and the writer dropped each buffered event of every trajectory one by one.
    rec = Recorder(tmp_path, flush_interval_s=30)
    _record_n(rec, "t", 100)
    with pytest.raises(InputError) as info:
        rec.record(100.0, "traj-\udce9", "traj_start")
    assert info.value.field == "trajectory_id"
    rec.record(100.0, "t", "decode_start")
    rec.close()
    table, report = read_telemetry(tmp_path, validate=True)
    assert report.clean and table.num_rows == 101


def test_numpy_numbers_and_enum_kinds_are_normalised(tmp_path):
    import numpy as np

    from prorsa.telemetry import EventKind

    with Recorder(tmp_path) as rec:
        rec.record(
            np.float64(1.0), "t", EventKind.PREFILL_START, turn=np.int64(2), engine_id=np.int32(0)
        )
        rec.record(2, "t", "prefill_end", turn=2, context_tokens=np.uint16(7))
    table, report = read_telemetry(tmp_path, validate=True)
    assert report.clean
    assert table.column("kind").to_pylist() == ["prefill_start", "prefill_end"]
    assert table.column("context_tokens").to_pylist() == [0, 7]
    assert table.column("time").to_pylist() == [1.0, 2.0]


class _FailingFile:
    """Stands in for a segment file on a disk that fills up after ``good`` writes."""

    def __init__(self, real, good: int) -> None:
        self.real, self.good = real, good

    def write(self, data: bytes) -> int:
        if self.good <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.good -= 1
        return self.real.write(data)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_writer_failure_is_raised_by_the_next_record_and_close(tmp_path):
    rec = Recorder(tmp_path, flush_interval_s=30, flush_batch=100)
    rec._file = _FailingFile(rec._file, good=1)  # the first frame fits, then the disk is full
    _record_n(rec, "t", 100)
    rec.flush()
    rec.record(100.0, "t", "decode_start")  # accepted; the writer fails when it flushes
    with pytest.raises(RecorderError, match="No space left on device") as info:
        rec.flush()
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(RecorderError, match="1 of 101 accepted event"):
        rec.record(101.0, "t", "decode_start")
    with pytest.raises(RecorderError, match="failed to write"):
        rec.close()
    rec.close()  # idempotent once reported
    table, report = read_telemetry(tmp_path)
    assert table.num_rows == 100 and report.lost_records == 1


def test_writer_thread_failure_surfaces_without_flush(tmp_path):
    rec = Recorder(tmp_path, flush_interval_s=0.05, flush_batch=10)
    rec._file = _FailingFile(rec._file, good=0)
    _record_n(rec, "t", 10)
    deadline = time.monotonic() + 5
    with pytest.raises(RecorderError, match="No space left"):
        while time.monotonic() < deadline:
            rec.record(100.0, "t", "decode_end")
            time.sleep(0.01)
    with pytest.raises(RecorderError):
        rec.close()


def test_full_buffer_blocks_then_refuses_never_drops(tmp_path):
    rec = Recorder(
        tmp_path, flush_interval_s=30, flush_batch=50, max_buffered_events=100, buffer_timeout_s=0.2
    )
    rec._write_lock.acquire()  # the writer is stuck (a slow disk)
    try:
        _record_n(rec, "t", 100)
        started = time.monotonic()
        with pytest.raises(RecorderError, match="still wait for the writer"):
            rec.record(100.0, "t", "decode_end")
        assert time.monotonic() - started >= 0.2
        assert rec.records_accepted == 100
    finally:
        rec._write_lock.release()
    rec.record(100.0, "t", "decode_end")  # the writer caught up: room again
    rec.close()
    table, report = read_telemetry(tmp_path)
    assert report.clean and table.num_rows == 101


def test_full_buffer_waits_for_the_writer(tmp_path):
    rec = Recorder(tmp_path, flush_interval_s=30, flush_batch=20, max_buffered_events=40)
    _record_n(rec, "t", 5_000)  # 125 times the buffer: callers wait, nothing is lost
    rec.close()
    table, report = read_telemetry(tmp_path)
    assert report.clean and table.num_rows == 5_000


def _ten_frames(tmp_path) -> tuple[Path, list]:
    # Only flush() writes: one frame of 100 records per call.
    with Recorder(tmp_path, flush_batch=10_000, flush_interval_s=30) as rec:
        for k in range(10):
            _record_n_from(rec, "t", k * 100, 100)
            rec.flush()
    seg = next(tmp_path.glob("segment-*.ptel"))
    return seg, read_segment(seg).frame_info


def _record_n_from(rec: Recorder, traj: str, first: int, n: int) -> None:
    for k in range(first, first + n):
        rec.record(float(k), traj, "decode_start", context_tokens=k, engine_id=1)


@pytest.mark.parametrize("where", ["payload", "header"])
def test_flipped_byte_loses_exactly_its_frame_and_later_frames_are_recovered(tmp_path, where):
    seg, frames = _ten_frames(tmp_path)
    assert [f.records for f in frames] == [100] * 10
    data = bytearray(seg.read_bytes())
    third = frames[2].offset
    data[third + (100 if where == "payload" else 9)] ^= 0x40
    seg.write_bytes(bytes(data))
    table, report = read_telemetry(tmp_path)
    kept = list(range(200)) + list(range(300, 1000))
    assert table.column("context_tokens").to_pylist() == kept
    assert report.lost_records == 100 and not report.clean
    assert "records 200-299" in report.describe()


def test_garbage_between_frames_is_skipped_and_reported(tmp_path):
    seg, frames = _ten_frames(tmp_path)
    data = seg.read_bytes()
    at = frames[5].offset
    seg.write_bytes(data[:at] + b"\x00garbage PRF2 not a header" * 3 + data[at:])
    table, report = read_telemetry(tmp_path)
    assert table.num_rows == 1000 and report.lost_records == 0 and not report.clean
    assert "no records lost" in report.describe()


KILL_CHILD = textwrap.dedent(
    """
    import sys
    from prorsa.telemetry import Recorder
    rec = Recorder(sys.argv[1], flush_interval_s=3600, flush_batch=10**6)
    for k in range(300):
        rec.record(float(k), "t", "decode_start", context_tokens=k)
    rec.flush()
    for k in range(300, 1234):
        rec.record(float(k), "t", "decode_start", context_tokens=k)
    print("ready", flush=True)
    sys.stdin.read()
    """
)


def test_kill_9_reports_exactly_the_buffered_events(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_CHILD, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        assert proc.stdout.readline().strip() == b"ready"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    table, report = read_telemetry(tmp_path)
    assert table.num_rows == 300
    assert report.lost_records == 934 and not report.clean
    assert "never written" in report.describe()


def test_reads_first_version_segments(tmp_path):
    import struct
    import zlib

    import pyarrow as pa

    from prorsa.telemetry.schema import rows_to_table

    def frame(first: int) -> bytes:
        rows = [
            (float(k), "r", "t", "", "", 0, "decode_start", 1, k, 0, 0, 0, "")
            for k in range(first, first + 5)
        ]
        sink = pa.BufferOutputStream()
        table = rows_to_table(rows)
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        payload = sink.getvalue().to_pybytes()
        return struct.pack("<4sIII", b"PRF1", len(payload), 5, zlib.crc32(payload)) + payload

    frames = [frame(0), frame(5), frame(10)]
    broken = bytearray(frames[1])
    broken[40] ^= 1
    (tmp_path / "segment-000000.ptel").write_bytes(
        b"PRSTEL1\n" + frames[0] + bytes(broken) + frames[2]
    )
    table, report = read_telemetry(tmp_path)
    assert table.column("context_tokens").to_pylist() == [*range(5), *range(10, 15)]
    assert report.lost_records == 5
    with Recorder(tmp_path) as rec:  # a new session appends beside the old files
        rec.record(0.0, "u", "traj_start")
    table, report = read_telemetry(tmp_path)
    assert table.num_rows == 11 and report.lost_records == 5


def test_unencodable_row_without_validation_is_dropped_counted_and_reported(tmp_path):
    rec = Recorder(tmp_path, validate=False, flush_interval_s=30)
    _record_n(rec, "t", 50)
    rec.record(50.0, "t", "decode_start", engine_id="not a number")
    _record_n_from(rec, "t", 51, 49)
    rec.close()
    assert rec.records_dropped == 1
    table, report = read_telemetry(tmp_path)
    assert table.num_rows == 99 and report.lost_records == 1
    assert "records 50-50" in report.describe()


# ------------------------------------------------------------------- columnar input
def _event_log(n: int = 500):
    from prorsa.telemetry.columns import KIND_CODE, EventLog

    log = EventLog("cols")
    for k in range(n):
        key = log.key(f"t{k % 7}", "g", "swe")
        kind = "decode_end" if k % 2 else "decode_start"
        log.append(float(k), key, k // 50, KIND_CODE[kind], k % 3, k, 1, 2, k % 11, "x" * (k % 3))
    log.append(float(n), 0, 0, KIND_CODE["allocation"], -1, detail='{"prefill":2}')
    return log


def test_append_batch_round_trips_and_writes_the_same_bytes_as_record(tmp_path):
    log = _event_log()
    with Recorder(tmp_path / "bulk", run_id="cols", flush_interval_s=30) as rec:
        rec.append_batch(log.batch(0, 200))
        rec.append_batch(log.batch(200))
    with Recorder(tmp_path / "rows", run_id="cols", flush_interval_s=30) as rec:
        for row in log.rows():
            rec.append_row(row)
    bulk, report = read_telemetry(tmp_path / "bulk", validate=True)
    assert report.clean and bulk.equals(log.to_table())
    rows, _ = read_telemetry(tmp_path / "rows")
    assert rows.equals(bulk)
    # Frames are cut at flush boundaries, so compare one-frame recordings byte for byte.
    with Recorder(tmp_path / "bulk1", run_id="cols", flush_interval_s=30) as rec:
        rec.append_batch(log.batch())
    for name in ("segment-000000.ptel", "accepted-000000.count"):
        assert (tmp_path / "bulk1" / name).read_bytes() == (tmp_path / "rows" / name).read_bytes()


def test_append_batch_refuses_a_bad_batch_whole(tmp_path):
    from prorsa.telemetry.columns import KIND_CODE, EventLog

    log = EventLog("cols")
    key = log.key("t")
    log.append(5.0, key, 0, KIND_CODE["decode_start"])
    log.append(4.0, key, 0, KIND_CODE["decode_end"])  # back in time
    with Recorder(tmp_path, run_id="cols") as rec:
        with pytest.raises(InputError) as info:
            rec.append_batch(log.batch())
        assert (info.value.record, info.value.field) == (1, "time")
        big = _event_log(10).batch()
        big.context_tokens[3] = 2**31
        with pytest.raises(InputError) as info:
            rec.append_batch(big)
        assert (info.value.record, info.value.field) == (3, "context_tokens")
        rec.append_batch(log.batch(0, 1))
        with pytest.raises(InputError, match="time goes backwards"):  # against what came before
            rec.append_batch(log.batch(1))
        rec.record(6.0, "t", "decode_end", run_id="cols")
        odd = EventLog("cols")
        odd.append(7.0, odd.key("t\ud800"), 0, KIND_CODE["decode_start"])
        with pytest.raises(InputError) as info:  # Parquet cannot hold it
            rec.append_batch(odd.batch())
        assert info.value.field == "trajectory_id"
    table, report = read_telemetry(tmp_path, validate=True)
    assert report.clean and table.column("time").to_pylist() == [5.0, 6.0]
