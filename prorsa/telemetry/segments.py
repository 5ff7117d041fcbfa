"""On-disk framing of telemetry segments, written so that a killed writer loses only its tail.

A segment file is a header followed by frames. Each frame is one Arrow IPC stream (schema
plus one record batch) behind a fixed 16-byte header carrying its length, record count and
CRC-32. A reader keeps every frame whose length and checksum are intact and reports the
rest as a truncated tail, so a ``kill -9`` in the middle of a write never costs the
records flushed before it.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

FILE_MAGIC = b"PRSTEL1\n"
FRAME_MAGIC = b"PRF1"
_FRAME_HEADER = struct.Struct("<4sIII")  # magic, payload bytes, records, crc32
SEGMENT_SUFFIX = ".ptel"


def segment_name(index: int) -> str:
    return f"segment-{index:06d}{SEGMENT_SUFFIX}"


def encode_frame(table: pa.Table) -> bytes:
    """Serialise ``table`` as one self-contained frame."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    payload = sink.getvalue().to_pybytes()
    header = _FRAME_HEADER.pack(FRAME_MAGIC, len(payload), table.num_rows, zlib.crc32(payload))
    return header + payload


@dataclass
class SegmentReadReport:
    """What reading one segment recovered and what it had to give up."""

    path: str
    frames: int = 0
    records: int = 0
    truncated_bytes: int = 0
    # Records in a damaged frame whose header survived; None when even the header was cut.
    truncated_records: int | None = 0
    problem: str | None = None
    tables: list[pa.Table] = field(default_factory=list, repr=False)


def read_segment(path: str | Path) -> SegmentReadReport:
    """Read every intact frame of a segment; never raises on a damaged tail."""
    path = Path(path)
    data = path.read_bytes()
    report = SegmentReadReport(path=str(path))
    if len(data) < len(FILE_MAGIC):
        report.truncated_bytes = len(data)
        report.truncated_records = None if data else 0
        report.problem = "file header incomplete" if data else None
        return report
    if data[: len(FILE_MAGIC)] != FILE_MAGIC:
        report.truncated_bytes = len(data)
        report.truncated_records = None
        report.problem = "not a prorsa telemetry segment (bad file header)"
        return report
    offset = len(FILE_MAGIC)
    while offset < len(data):
        remaining = len(data) - offset
        if remaining < _FRAME_HEADER.size:
            report.truncated_bytes = remaining
            report.truncated_records = None
            report.problem = "frame header cut short"
            break
        magic, length, records, crc = _FRAME_HEADER.unpack_from(data, offset)
        if magic != FRAME_MAGIC:
            report.truncated_bytes = remaining
            report.truncated_records = None
            report.problem = f"bad frame marker at byte {offset}"
            break
        start = offset + _FRAME_HEADER.size
        payload = data[start : start + length]
        if len(payload) < length or zlib.crc32(payload) != crc:
            report.truncated_bytes = remaining
            report.truncated_records = records
            report.problem = (
                "frame payload cut short" if len(payload) < length else "frame checksum mismatch"
            )
            break
        table = pa.ipc.open_stream(payload).read_all()
        report.tables.append(table)
        report.frames += 1
        report.records += table.num_rows
        offset = start + length
    return report
