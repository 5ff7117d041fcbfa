"""Read telemetry from a recorder directory, one segment, or a Parquet file.

Damage (a writer killed mid-frame, flipped bytes) is reported, never raised: every intact
record is returned together with a :class:`RecoveryReport` saying exactly how many records
were lost and where. Input that is not telemetry at all (a JSON-lines trace, a CSV, a
truncated Parquet file) is an :class:`InputError` naming the file.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from prorsa.errors import InputError
from prorsa.io import atomic_path
from prorsa.telemetry.schema import ARROW_SCHEMA, conform
from prorsa.telemetry.segments import (
    FILE_MAGIC,
    FILE_MAGIC_V1,
    SEGMENT_SUFFIX,
    SegmentReadReport,
    count_name,
    read_count,
    read_segment,
    segment_index,
)
from prorsa.telemetry.validation import validate_table

logger = logging.getLogger(__name__)

PARQUET_MAGIC = b"PAR1"
_NOT_TELEMETRY_HINT = (
    "telemetry is a .parquet file, a .ptel segment or a recorder folder; import public "
    "traces first with `prorsa traces import`"
)


@dataclass
class RecoveryReport:
    """Summary of a read: how much was recovered and exactly what was lost.

    ``lost_records`` counts records that were accepted by the recorder but cannot be read
    back: frames damaged on disk, rows the writer dropped, and events still buffered when
    the writer was killed or failed. It is None only when the count cannot be known
    (first-version segments whose damaged frame headers did not survive, or a session
    whose ``accepted-*.count`` file is missing).
    """

    source: str
    segments: int = 0
    records: int = 0
    lost_records: int | None = 0
    damaged: list[SegmentReadReport] = field(default_factory=list)
    #: one line per loss: where, how many records, why
    losses: list[str] = field(default_factory=list)

    @property
    def truncated_bytes(self) -> int:
        """Bytes of segment files that could not be read."""
        return sum(seg.truncated_bytes for seg in self.damaged)

    @property
    def truncated_records(self) -> int | None:
        """Former name of :attr:`lost_records`."""
        return self.lost_records

    @property
    def clean(self) -> bool:
        """Nothing damaged, nothing lost, nothing odd (such as a repeated frame)."""
        return not self.damaged and not self.losses and self.lost_records == 0

    def describe(self) -> str:
        if self.clean:
            return f"{self.records} records from {self.segments} segment(s), no damage"
        lost = "an unknown number of" if self.lost_records is None else str(self.lost_records)
        return (
            f"{self.records} records recovered from {self.segments} segment(s); "
            f"{lost} record(s) lost; " + "; ".join(self.losses)
        )


def read_telemetry(
    path: str | os.PathLike[str], *, validate: bool = False
) -> tuple[pa.Table, RecoveryReport]:
    """Return every intact event under ``path`` and a report of what was lost.

    ``path`` may be a recorder directory (segments read in order), a single ``.ptel``
    segment, a Parquet file, or a run folder holding ``telemetry/`` (a recorder
    directory, preferred: it is the raw record) or ``telemetry.parquet``. With
    ``validate=True`` the events are also checked against the schema rules and an
    :class:`InputError` names the first bad record.
    """
    path = Path(path)
    if not path.exists():
        raise InputError("no such file or directory", source=str(path))
    path = _inside_run_folder(path)
    report = RecoveryReport(source=str(path))
    if path.is_dir():
        segments = sorted(
            (p for p in path.glob(f"segment-*{SEGMENT_SUFFIX}") if segment_index(p) is not None),
            key=lambda p: segment_index(p) or 0,
        )
        counts = _session_counts(path)
        if not segments and not counts:
            raise InputError(
                "directory holds no telemetry segments", source=str(path), hint=_NOT_TELEMETRY_HINT
            )
    else:
        head = _head(path)
        if head.startswith(PARQUET_MAGIC) or (path.suffix == ".parquet" and not _is_segment(head)):
            return _read_parquet(path, report, validate)
        if not _is_segment(head) and path.suffix != SEGMENT_SUFFIX:
            raise InputError(
                "not telemetry (neither Parquet nor a telemetry segment)",
                source=str(path),
                hint=_NOT_TELEMETRY_HINT,
            )
        segments, counts = [path], {}
    reads = [read_segment(segment) for segment in segments]
    if not path.is_dir() and reads[0].version == 0:
        raise InputError(
            "not a telemetry segment (bad file header, no frame found)",
            source=str(path),
            hint=_NOT_TELEMETRY_HINT,
        )
    for seg in reads:
        report.segments += 1
        if seg.damage:
            report.damaged.append(seg)
    tables = _account(reads, counts, report, whole_directory=path.is_dir())
    report.records = sum(t.num_rows for t in tables)
    if not report.clean:
        logger.warning("telemetry %s: %s", path, report.describe())
    table = pa.concat_tables(tables) if tables else ARROW_SCHEMA.empty_table()
    if validate:
        validate_table(table, source=str(path))
    return table, report


def load_events(path: str | os.PathLike[str]) -> pa.Table:
    """Read telemetry and validate it; convenience for tools that need clean input."""
    table, _ = read_telemetry(path, validate=True)
    return table


def write_parquet(table: pa.Table, path: str | os.PathLike[str]) -> None:
    """Write an event table as Parquet (the exchange format between tools).

    Written under a temporary name and renamed when complete, so a failed write (a full
    disk, Ctrl-C) keeps any previous file at ``path``.
    """
    with atomic_path(path) as tmp:
        pq.write_table(conform(table), tmp, compression="zstd")


# ----------------------------------------------------------------------------- helpers
def _inside_run_folder(path: Path) -> Path:
    if not path.is_dir() or any(path.glob(f"segment-*{SEGMENT_SUFFIX}")):
        return path
    recorder = path / "telemetry"
    if recorder.is_dir() and any(recorder.glob(f"segment-*{SEGMENT_SUFFIX}")):
        return recorder
    parquet = path / "telemetry.parquet"
    return parquet if parquet.is_file() else path


def _head(path: Path) -> bytes:
    with path.open("rb") as handle:
        return handle.read(len(FILE_MAGIC))


def _is_segment(head: bytes) -> bool:
    return head.startswith((FILE_MAGIC, FILE_MAGIC_V1))


def _read_parquet(
    path: Path, report: RecoveryReport, validate: bool
) -> tuple[pa.Table, RecoveryReport]:
    try:
        raw = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(
            f"not a readable Parquet file: {exc}", source=str(path), hint=_NOT_TELEMETRY_HINT
        ) from None
    table = conform(raw, source=str(path))
    report.segments, report.records = 1, table.num_rows
    if validate:
        validate_table(table, source=str(path))
    return table, report


def _conformed(table: pa.Table, source: str) -> pa.Table:
    if table.schema.equals(ARROW_SCHEMA, check_metadata=False):
        return table
    return conform(table, source=source)


def _session_counts(directory: Path) -> dict[int, int | None]:
    counts: dict[int, int | None] = {}
    for path in directory.glob("accepted-*.count"):
        number = path.stem.removeprefix("accepted-")
        if number.isdigit():
            counts[int(number)] = read_count(path)
    return counts


def _account(
    reads: list[SegmentReadReport],
    counts: dict[int, int | None],
    report: RecoveryReport,
    *,
    whole_directory: bool,
) -> list[pa.Table]:
    """Fill ``report.lost_records`` and ``report.losses`` from frame sequence numbers,
    damaged frame headers and the sessions' accepted counts; return the frames' tables
    to keep (a frame repeating records already read, e.g. a copied block, is dropped)."""
    kept: list[pa.Table] = []
    lost: int | None = 0
    # Per session: records accounted for so far (the next expected first record).
    expected: dict[int, int] = {}
    # Damage after a session's last intact frame, for sessions without a count.
    tail_damage: dict[int, list] = {}
    session: int | None = None
    for seg in reads:
        name = Path(seg.path).name
        index = segment_index(Path(seg.path))
        if seg.version == 1:
            kept += [_conformed(t, seg.path) for t in seg.tables]
            for damage in seg.damage:
                lost = _add(lost, damage.records)
                report.losses.append(_damage_line(name, damage))
            continue
        if index is not None and (index in counts or index in expected):
            session = index
        frames = {
            info.offset: table for info, table in zip(seg.frame_info, seg.tables, strict=True)
        }
        events = sorted(
            [(info.offset, "frame", info) for info in seg.frame_info]
            + [(d.offset, "damage", d) for d in seg.damage]
        )
        for offset, what, item in events:
            if what == "damage":
                if item.records == 0 and item.bytes and "file header" in item.problem:
                    report.losses.append(f"{name}: {item.problem} (no records in it)")
                    continue
                key = -1 if session is None else session
                tail_damage.setdefault(key, []).append((name, item))
                continue
            session = item.session
            start = expected.get(session, 0)
            table = frames[offset]
            end = item.first_record + item.records
            if item.first_record < start:
                repeated = min(end, start) - item.first_record
                report.losses.append(
                    f"{name}: frame at byte {offset} repeats records {item.first_record}-"
                    f"{item.first_record + repeated - 1} of session {session} already read "
                    "(ignored; no records lost)"
                )
                table = table.slice(repeated)
            if table.num_rows:
                kept.append(_conformed(table, seg.path))
            if item.first_record > start:
                gap = item.first_record - start
                lost = _add(lost, gap)
                where = ", ".join(
                    _damage_line(n, d, records=False) for n, d in tail_damage.pop(session, [])
                )
                why = where or "dropped by the writer (see the recorder's log)"
                report.losses.append(
                    f"{name}: records {start}-{item.first_record - 1} of session {session} "
                    f"({gap} records): {why}"
                )
            else:
                for n, d in tail_damage.pop(session, []):
                    report.losses.append(_damage_line(n, d, records=False) + ": no records lost")
            expected[session] = max(start, end)
    sessions = set(expected) | (set(counts) if whole_directory else set())
    for session in sorted(sessions):
        written = expected.get(session, 0)
        count = counts.get(session)
        damage = tail_damage.pop(session, [])
        if count is not None and count >= written:
            if count > written:
                lost = _add(lost, count - written)
                cut = ", ".join(_damage_line(n, d, records=False) for n, d in damage)
                if cut:
                    why = f"truncated tail after the last intact frame: {cut}"
                else:
                    why = (
                        "accepted but never written (the recorder was killed or its writer failed)"
                    )
                report.losses.append(f"session {session}: {count - written} record(s) {why}")
            continue
        for name, item in damage:
            lost = _add(lost, item.records)
            report.losses.append(_damage_line(name, item))
        if count is None and whole_directory:
            report.losses.append(
                f"session {session}: accepted count missing ({count_name(session)}); events "
                "buffered when the recorder stopped cannot be counted"
            )
    for damages in tail_damage.values():  # damage before any session was identified
        for name, item in damages:
            lost = _add(lost, item.records)
            report.losses.append(_damage_line(name, item))
    report.lost_records = lost
    return kept


def _add(total: int | None, records: int | None) -> int | None:
    return None if total is None or records is None else total + records


def _damage_line(name: str, damage, *, records: bool = True) -> str:
    text = f"{name}: {damage.problem} at byte {damage.offset} ({damage.bytes} bytes"
    if records:
        count = "unknown number of" if damage.records is None else str(damage.records)
        text += f", {count} records"
    return text + ")"
