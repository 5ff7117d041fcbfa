"""On-disk framing of telemetry segments: a killed or corrupted writer loses only what it
must, the reader says exactly how many records that was, and finds the next intact frame.

A segment file is a file header followed by frames. Each frame is one Arrow IPC stream
(schema plus one record batch) behind a 32-byte header::

    magic "PRF2" | session u32 | payload bytes u32 | records u32 | first record u64 |
    payload crc32 u32 | header crc32 u32

``session`` is the index of the first segment a recorder wrote (one recorder = one
session); ``first record`` numbers the frame's first row in the session's acceptance
order. Because every frame says where it starts, a gap between two intact frames is an
exact count of lost records, even when the frames in between are unreadable. The header
has its own checksum, so after damage the reader scans for the next ``PRF2`` whose header
checks out and carries on from there (resynchronisation).

Beside the segments, each session keeps ``accepted-NNNNNN.count``: a memory-mapped count of
the events the recorder accepted, updated on every accepted event. The operating system
keeps a killed process's mapped pages, so after ``kill -9`` accepted minus written is
exactly what was still buffered.

Files of the first version (``PRSTEL1``, 16-byte ``PRF1`` headers without session,
sequence or header checksum) are still read; their losses are known only from damaged
frames whose header survived.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

FILE_MAGIC = b"PRSTEL2\n"
FILE_MAGIC_V1 = b"PRSTEL1\n"
FRAME_MAGIC = b"PRF2"
FRAME_MAGIC_V1 = b"PRF1"
_HEADER = struct.Struct("<4sIIIQI")  # magic, session, payload bytes, records, first, crc
_HEADER_CRC = struct.Struct("<I")
HEADER_BYTES = _HEADER.size + _HEADER_CRC.size  # 32
_HEADER_V1 = struct.Struct("<4sIII")  # magic, payload bytes, records, crc32
SEGMENT_SUFFIX = ".ptel"
COUNT_MAGIC = b"PRCNT1\0\0"
_COUNT = struct.Struct("<8sQ")


def segment_name(index: int) -> str:
    return f"segment-{index:06d}{SEGMENT_SUFFIX}"


def count_name(session: int) -> str:
    return f"accepted-{session:06d}.count"


def segment_index(path: Path) -> int | None:
    """The number in ``segment-NNNNNN.ptel``, or None for another name."""
    stem = path.name.removesuffix(SEGMENT_SUFFIX)
    head, _, number = stem.partition("-")
    return int(number) if head == "segment" and number.isdigit() else None


def encode_frame(table: pa.Table, *, session: int = 0, first_record: int = 0) -> bytes:
    """Serialise ``table`` as one self-contained frame starting at record ``first_record``."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    payload = sink.getvalue().to_pybytes()
    head = _HEADER.pack(
        FRAME_MAGIC, session, len(payload), table.num_rows, first_record, zlib.crc32(payload)
    )
    return head + _HEADER_CRC.pack(zlib.crc32(head)) + payload


class AcceptedCounter:
    """The session's count of accepted events, in a small memory-mapped file.

    ``view[0] = n`` is one 8-byte store into the mapping, cheap enough for every event.
    Where a file system cannot map files the count lives in memory only and is written on
    close.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_bytes(_COUNT.pack(COUNT_MAGIC, 0))
        self._file = open(path, "r+b")  # noqa: SIM115 - mapped for the recorder's life
        try:
            self._map: mmap.mmap | None = mmap.mmap(self._file.fileno(), _COUNT.size)
            self.view = memoryview(self._map)[len(COUNT_MAGIC) :].cast("Q")
        except (OSError, ValueError):
            self._map = None
            self.view = memoryview(bytearray(8)).cast("Q")

    def close(self) -> None:
        value = self.view[0]
        self.view.release()
        if self._map is not None:
            self._map.flush()
            self._map.close()
        else:
            self._file.seek(0)
            self._file.write(_COUNT.pack(COUNT_MAGIC, value))
        self._file.close()


def read_count(path: Path) -> int | None:
    """The accepted count stored at ``path``; None when the file is missing or damaged."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) != _COUNT.size or not data.startswith(COUNT_MAGIC):
        return None
    return _COUNT.unpack(data)[1]


@dataclass(frozen=True)
class FrameInfo:
    """Where an intact frame sits and which records of its session it holds."""

    offset: int
    session: int | None  # None for first-version frames
    first_record: int | None
    records: int


@dataclass(frozen=True)
class Damage:
    """A stretch of a segment that could not be read."""

    offset: int
    bytes: int
    problem: str
    # Records the damaged frame held, from a header that survived; None if unknown.
    records: int | None


@dataclass
class SegmentReadReport:
    """What reading one segment recovered and what it had to give up."""

    path: str
    version: int = 2
    frames: int = 0
    records: int = 0
    frame_info: list[FrameInfo] = field(default_factory=list, repr=False)
    damage: list[Damage] = field(default_factory=list)
    tables: list[pa.Table] = field(default_factory=list, repr=False)

    @property
    def truncated_bytes(self) -> int:
        """Bytes that could not be read (damaged frames, garbage, a cut tail)."""
        return sum(d.bytes for d in self.damage)

    @property
    def problem(self) -> str | None:
        return "; ".join(f"{d.problem} at byte {d.offset}" for d in self.damage) or None

    @property
    def is_segment(self) -> bool:
        """Whether the file looked like a telemetry segment at all."""
        return self.version > 0


def read_segment(path: str | Path) -> SegmentReadReport:
    """Read every intact frame of a segment; never raises on damage, only on I/O errors."""
    path = Path(path)
    data = path.read_bytes()
    report = SegmentReadReport(path=str(path))
    head = data[: len(FILE_MAGIC)]
    if head == FILE_MAGIC_V1:
        report.version = 1
        _scan(data, len(head), report, _frame_v1, FRAME_MAGIC_V1)
        return report
    if head != FILE_MAGIC:
        if FILE_MAGIC.startswith(head) or FILE_MAGIC_V1.startswith(head):
            # Killed while writing the file header: an empty segment.
            if head:
                report.damage.append(Damage(0, len(head), "file header cut short", 0))
            return report
        if _next_frame(data, 0, FRAME_MAGIC) is None:
            report.version = 0
            report.damage.append(Damage(0, len(data), "not a telemetry segment", None))
            return report
        # A damaged file header does not lose the frames behind it.
        report.damage.append(Damage(0, len(head), "bad file header", 0))
    _scan(data, len(head), report, _frame_v2, FRAME_MAGIC)
    return report


# A parsed frame: (info, payload end offset, table) or a Damage for a frame whose header is
# intact but whose payload is not.
_Parsed = tuple[FrameInfo, int, pa.Table] | Damage


def _scan(data: bytes, offset: int, report: SegmentReadReport, parse, magic: bytes) -> None:
    end = len(data)
    while offset < end:
        parsed = parse(data, offset)
        if isinstance(parsed, tuple):
            info, offset, table = parsed
            report.frames += 1
            report.records += table.num_rows
            report.frame_info.append(info)
            report.tables.append(table)
            continue
        if isinstance(parsed, Damage):
            report.damage.append(parsed)
            offset += parsed.bytes
            continue
        # No frame starts here: skip to the next place where one does.
        nxt = _next_frame(data, offset + 1, magic)
        stop = end if nxt is None else nxt
        if nxt is None and end - offset < _header_size(magic):
            problem = "frame header cut short"
        else:
            problem = "damaged bytes without a valid frame header"
        report.damage.append(Damage(offset, stop - offset, problem, None))
        offset = stop


def _next_frame(data: bytes, offset: int, magic: bytes) -> int | None:
    """Offset of the next frame with a valid header (v2) or fully intact frame (v1)."""
    valid = _header_ok if magic == FRAME_MAGIC else _intact_v1
    found = data.find(magic, offset)
    while found >= 0:
        if valid(data, found) is not None:
            return found
        found = data.find(magic, found + 1)
    return None


def _header_size(magic: bytes) -> int:
    return HEADER_BYTES if magic == FRAME_MAGIC else _HEADER_V1.size


def _header_ok(data: bytes, offset: int) -> tuple | None:
    """The fields of a frame header at ``offset`` whose checksum is right, else None."""
    if offset + HEADER_BYTES > len(data):
        return None
    head = data[offset : offset + _HEADER.size]
    fields = _HEADER.unpack(head)
    if fields[0] != FRAME_MAGIC:
        return None
    (head_crc,) = _HEADER_CRC.unpack_from(data, offset + _HEADER.size)
    return fields if zlib.crc32(head) == head_crc else None


def _frame_v2(data: bytes, offset: int) -> _Parsed | None:
    """The frame at ``offset``; None if no valid frame header starts there."""
    fields = _header_ok(data, offset)
    if fields is None:
        return None
    _, session, length, records, first, crc = fields
    start = offset + HEADER_BYTES
    payload = data[start : start + length]
    if len(payload) < length:
        return Damage(offset, len(data) - offset, "frame payload cut short", records)
    if zlib.crc32(payload) != crc:
        return Damage(offset, HEADER_BYTES + length, "frame checksum mismatch", records)
    table = _decode(payload)
    if table is None or table.num_rows != records:
        return Damage(offset, HEADER_BYTES + length, "frame payload unreadable", records)
    return FrameInfo(offset, session, first, records), start + length, table


def _intact_v1(data: bytes, offset: int) -> tuple[FrameInfo, int, pa.Table] | None:
    if offset + _HEADER_V1.size > len(data):
        return None
    magic, length, records, crc = _HEADER_V1.unpack_from(data, offset)
    if magic != FRAME_MAGIC_V1:
        return None
    start = offset + _HEADER_V1.size
    payload = data[start : start + length]
    if len(payload) < length or zlib.crc32(payload) != crc:
        return None
    table = _decode(payload)
    if table is None or table.num_rows != records:
        return None
    return FrameInfo(offset, None, None, records), start + length, table


def _frame_v1(data: bytes, offset: int) -> _Parsed | None:
    intact = _intact_v1(data, offset)
    if intact is not None:
        return intact
    if offset + _HEADER_V1.size > len(data):
        return None
    magic, length, records, _ = _HEADER_V1.unpack_from(data, offset)
    if magic != FRAME_MAGIC_V1:
        return None
    # Without a header checksum a damaged length cannot be told from a damaged payload,
    # so the damage runs to the next fully intact frame (or the end of the file).
    nxt = _next_frame(data, offset + 1, FRAME_MAGIC_V1)
    stop = len(data) if nxt is None else nxt
    cut = offset + _HEADER_V1.size + length > len(data)
    problem = "frame payload cut short" if cut else "frame checksum mismatch"
    return Damage(offset, stop - offset, problem, records)


def _decode(payload: bytes) -> pa.Table | None:
    try:
        return pa.ipc.open_stream(payload).read_all()
    except (pa.ArrowException, ValueError, OSError):
        return None


def fsync_file(handle) -> None:
    """``fsync`` an open file, ignoring file systems that cannot."""
    with contextlib.suppress(OSError):
        os.fsync(handle.fileno())
