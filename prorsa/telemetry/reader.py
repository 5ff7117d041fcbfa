"""Read telemetry from a recorder directory, one segment, or a Parquet file.

Damaged tails (a writer killed mid-frame) are reported, never raised: every complete
record is returned together with a :class:`RecoveryReport` saying what was lost.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from prorsa.errors import InputError
from prorsa.telemetry.schema import ARROW_SCHEMA, conform
from prorsa.telemetry.segments import SEGMENT_SUFFIX, SegmentReadReport, read_segment
from prorsa.telemetry.validation import validate_table

logger = logging.getLogger(__name__)


@dataclass
class RecoveryReport:
    """Summary of a read: how much was recovered and what tail, if any, was lost."""

    source: str
    segments: int = 0
    records: int = 0
    truncated_bytes: int = 0
    # Sum of records in damaged frames whose headers survived; None if some count is unknown.
    truncated_records: int | None = 0
    damaged: list[SegmentReadReport] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return self.truncated_bytes == 0

    def describe(self) -> str:
        if self.clean:
            return f"{self.records} records from {self.segments} segment(s), no damage"
        lost = "an unknown number of" if self.truncated_records is None else self.truncated_records
        return (
            f"{self.records} records recovered from {self.segments} segment(s); "
            f"truncated tail: {self.truncated_bytes} bytes, {lost} record(s) lost in "
            + ", ".join(f"{Path(d.path).name} ({d.problem})" for d in self.damaged)
        )


def read_telemetry(
    path: str | os.PathLike[str], *, validate: bool = False
) -> tuple[pa.Table, RecoveryReport]:
    """Return every complete event under ``path`` and a report of any truncated tail.

    ``path`` may be a recorder directory (segments read in order), a single ``.ptel``
    segment or a ``.parquet`` file. With ``validate=True`` the events are also checked
    against the schema rules and an :class:`InputError` names the first bad record.
    """
    path = Path(path)
    if not path.exists():
        raise InputError("no such file or directory", source=str(path))
    report = RecoveryReport(source=str(path))
    if path.is_dir():
        segments = sorted(path.glob(f"segment-*{SEGMENT_SUFFIX}"))
        if not segments:
            raise InputError("directory holds no telemetry segments", source=str(path))
    elif path.suffix == ".parquet":
        table = conform(pq.read_table(path), source=str(path))
        report.segments, report.records = 1, table.num_rows
        if validate:
            validate_table(table, source=str(path))
        return table, report
    else:
        segments = [path]
    tables: list[pa.Table] = []
    for segment in segments:
        seg = read_segment(segment)
        report.segments += 1
        report.records += seg.records
        tables += seg.tables
        if seg.truncated_bytes:
            report.truncated_bytes += seg.truncated_bytes
            report.damaged.append(seg)
            if report.truncated_records is not None:
                report.truncated_records = (
                    None
                    if seg.truncated_records is None
                    else report.truncated_records + seg.truncated_records
                )
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
    """Write an event table as Parquet (the exchange format between tools)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(conform(table), path, compression="zstd")
