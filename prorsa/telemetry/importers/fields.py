"""Typed access to raw trace records; every failure names the file, record and field.

Importers read untrusted JSON/CSV. Instead of ``KeyError`` or ``TypeError`` deep inside a
loop, each lookup goes through :class:`Fields`, which raises an :class:`InputError` that
says exactly where the bad value is (``file``, ``line 12`` or ``messages[5]``, and the
dotted field path), so a user can find it in the raw file.
"""

from __future__ import annotations

import codecs
import json
import math
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prorsa.errors import InputError
from prorsa.io import is_utf8

_MISSING: Any = object()
#: Token counts and indices are int32 in the telemetry schema.
INT32_MAX = 2**31 - 1
#: Wall-clock times before this are placeholders (0001-01-01, 1970-01-01), not when an LLM
#: call happened: no LLM serving or agent trace predates 2000. Accepting one would stretch
#: the trace by decades, since times are taken relative to the earliest event.
EARLIEST_PLAUSIBLE = datetime(2000, 1, 1, tzinfo=UTC)
EARLIEST_PLAUSIBLE_S = EARLIEST_PLAUSIBLE.timestamp()
#: Bytes inspected to tell a text file from a binary one.
_SNIFF_BYTES = 64 * 1024


class Fields:
    """Checked getters for one raw record of ``source`` (a file) at ``record``."""

    __slots__ = ("prefix", "record", "source")

    def __init__(self, source: str, record: int | str, prefix: str = "") -> None:
        self.source = source
        self.record = record
        self.prefix = prefix

    def within(self, path: str) -> Fields:
        """Getters for a nested object; errors name the field as ``path.field``."""
        return Fields(self.source, self.record, f"{self.prefix}{path}.")

    def error(self, field: str | None, reason: str) -> InputError:
        name = f"{self.prefix}{field}" if field else (self.prefix.rstrip(".") or None)
        return InputError(reason, source=self.source, record=self.record, field=name)

    def get(self, obj: Any, path: str, default: Any = _MISSING) -> Any:
        """The value at dotted ``path`` inside ``obj``; ``default`` if absent or null."""
        value = obj
        for key in path.split("."):
            if not isinstance(value, dict):
                raise self.error(path, f"expected an object at '{key}', got {_kind(value)}")
            value = value.get(key)
            if value is None:
                if default is _MISSING:
                    raise self.error(path, "missing")
                return default
        return value

    def count(self, obj: Any, path: str, default: Any = _MISSING) -> int:
        """A non-negative integer (token counts, indices)."""
        value = self.get(obj, path, default)
        if value is default and default is not _MISSING:
            return value
        # bool is an int subclass; a JSON `true` is never a token count.
        if isinstance(value, bool) or not isinstance(value, int):
            if not (isinstance(value, float) and value.is_integer()):
                raise self.error(path, f"must be a non-negative integer, got {value!r}")
            value = int(value)  # a JSON 3e3 or 3000.0 is a count; the checks below apply
        if value < 0:
            raise self.error(path, f"must be a non-negative integer, got {value!r}")
        if value > INT32_MAX:
            raise self.error(
                path, f"{value} exceeds the telemetry schema's int32 limit {INT32_MAX}"
            )
        return value

    def number(self, obj: Any, path: str, default: Any = _MISSING) -> float:
        """A finite, non-negative number (times, durations)."""
        value = self.get(obj, path, default)
        if value is default and default is not _MISSING:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(path, f"must be a number, got {value!r}")
        if not math.isfinite(value) or value < 0:
            raise self.error(path, f"must be a finite number >= 0, got {value!r}")
        return float(value)

    def text(self, obj: Any, path: str, default: Any = _MISSING) -> str:
        value = self.get(obj, path, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, str):
            raise self.error(path, f"must be a string, got {_kind(value)}")
        if not is_utf8(value):  # a lone surrogate from a JSON escape
            raise self.error(path, f"{value!r:.80} is not valid UTF-8")
        return value

    def seq(self, obj: Any, path: str, default: Any = _MISSING) -> list:
        value = self.get(obj, path, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, list):
            raise self.error(path, f"must be a list, got {_kind(value)}")
        return value

    def mapping(self, obj: Any, path: str, default: Any = _MISSING) -> dict:
        value = self.get(obj, path, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, dict):
            raise self.error(path, f"must be an object, got {_kind(value)}")
        return value

    def timestamp(self, obj: Any, path: str) -> float:
        """An ISO-8601 timestamp as unix seconds (naive times are taken as UTC), no
        earlier than :data:`EARLIEST_PLAUSIBLE`."""
        value = self.text(obj, path)
        try:
            seconds = parse_iso(value)
        except ValueError:
            raise self.error(path, f"not an ISO-8601 timestamp: {value!r}") from None
        return self._plausible(path, seconds, repr(value))

    def unix_time(self, obj: Any, path: str) -> float:
        """Unix seconds (a number), no earlier than :data:`EARLIEST_PLAUSIBLE`."""
        seconds = self.number(obj, path)
        return self._plausible(path, seconds, f"{seconds:g}")

    def _plausible(self, path: str, seconds: float, shown: str) -> float:
        if seconds < EARLIEST_PLAUSIBLE_S:
            raise self.error(
                path,
                f"implausible time {shown}: before {EARLIEST_PLAUSIBLE.date()} "
                "(a placeholder date?)",
            )
        return seconds


def parse_iso(value: str) -> float:
    """Unix seconds of an ISO-8601 string; naive times are taken as UTC."""
    # Python 3.11's parser takes 'Z', offsets and any number of fractional digits.
    moment = datetime.fromisoformat(value)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    try:
        return moment.timestamp()
    except (OverflowError, OSError) as exc:  # an offset pushing year 1 or 9999 out of range
        raise ValueError(str(exc)) from None


def check_text_file(path: Path) -> None:
    """Raise :class:`InputError` naming ``path`` if it is a binary file, not text.

    Looks at the first 64 KiB: a NUL byte, or more than 1% of bytes that are not UTF-8,
    mean a binary file (an archive, an image, a compiled file dropped into a trace
    folder), which is refused as a whole rather than as thousands of unreadable lines. A
    few bad bytes in a text file are left to the line they damage.
    """
    with path.open("rb") as handle:
        head = handle.read(_SNIFF_BYTES)
    where = head.find(b"\0")
    if where >= 0:
        raise InputError(f"binary file, not text (NUL byte at offset {where})", source=str(path))
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text = decoder.decode(head, final=len(head) < _SNIFF_BYTES)
    if text.count("\ufffd") > 0.01 * max(len(head), 1):
        raise InputError("binary file, not UTF-8 text", source=str(path))


def load_json(path: Path) -> Any:
    """Parse a whole JSON file; a truncated or invalid file names the line and column."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"not UTF-8 text: {exc}", source=str(path)) from None
    return _parse_json(text, str(path), None)


def _parse_json(text: str, source: str, line: int | None) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(
            f"invalid or truncated JSON: {exc.msg} (column {exc.colno})",
            source=source,
            record=f"line {exc.lineno if line is None else line}",
        ) from None
    except RecursionError:
        raise InputError(
            "JSON nested too deeply to read",
            source=source,
            record=None if line is None else f"line {line}",
        ) from None


def iter_jsonl(path: Path) -> Iterator[tuple[int, Any | InputError]]:
    """Yield ``(line number, parsed object or the InputError for that line)``.

    Errors (invalid JSON, a line that is not UTF-8) are yielded, not raised, so the
    caller decides whether to skip one line or stop; blank lines are ignored. Call
    :func:`check_text_file` first to refuse a binary file as a whole.
    """
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield (
                    number,
                    InputError(
                        f"not UTF-8 text: {exc.reason} at column {exc.start + 1}",
                        source=str(path),
                        record=f"line {number}",
                    ),
                )
                continue
            if not line.strip():
                continue
            try:
                yield number, _parse_json(line, str(path), number)
            except InputError as exc:
                yield number, exc


def list_files(src: Path, pattern: str) -> list[Path]:
    """``src`` itself if it is a file, else its files matching ``pattern``, sorted by name."""
    if src.is_file():
        return [src]
    files = sorted(p for p in src.glob(pattern) if p.is_file())
    if not files:
        raise InputError(f"folder holds no {pattern} files", source=str(src))
    return files


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__
