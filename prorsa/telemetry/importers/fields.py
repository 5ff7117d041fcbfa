"""Typed access to raw trace records; every failure names the file, record and field.

Importers read untrusted JSON/CSV. Instead of ``KeyError`` or ``TypeError`` deep inside a
loop, each lookup goes through :class:`Fields`, which raises an :class:`InputError` that
says exactly where the bad value is (``file``, ``line 12`` or ``messages[5]``, and the
dotted field path), so a user can find it in the raw file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prorsa.errors import InputError

_MISSING: Any = object()


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
            if isinstance(value, float) and value.is_integer() and value >= 0:
                return int(value)
            raise self.error(path, f"must be a non-negative integer, got {value!r}")
        if value < 0:
            raise self.error(path, f"must be a non-negative integer, got {value!r}")
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
        """An ISO-8601 timestamp as unix seconds (naive times are taken as UTC)."""
        value = self.text(obj, path)
        try:
            return parse_iso(value)
        except ValueError:
            raise self.error(path, f"not an ISO-8601 timestamp: {value!r}") from None


def parse_iso(value: str) -> float:
    """Unix seconds of an ISO-8601 string; naive times are taken as UTC."""
    # Python 3.11's parser takes 'Z', offsets and any number of fractional digits.
    moment = datetime.fromisoformat(value)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def load_json(path: Path) -> Any:
    """Parse a whole JSON file; a truncated or invalid file names the line and column."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"not UTF-8 text: {exc}", source=str(path)) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(
            f"invalid or truncated JSON: {exc.msg} (column {exc.colno})",
            source=str(path),
            record=f"line {exc.lineno}",
        ) from None


def iter_jsonl(path: Path) -> Iterator[tuple[int, Any | InputError]]:
    """Yield ``(line number, parsed object or the InputError for that line)``.

    Errors are yielded, not raised, so the caller decides whether to skip one line or
    stop; blank lines are ignored.
    """
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as exc:
                yield (
                    number,
                    InputError(
                        f"invalid or truncated JSON: {exc.msg} (column {exc.colno})",
                        source=str(path),
                        record=f"line {number}",
                    ),
                )


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
