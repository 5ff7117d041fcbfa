"""Azure LLM inference traces (CSV: ``TIMESTAMP, ContextTokens, GeneratedTokens``).

Arrivals only: each request is a one-turn trajectory without tools. Arrival times and
token counts are real; prefill and decode take nominal self-hosted engine times, and
nothing is known about prefix caching, so every prompt token counts as new.

The published traces are sorted by ``TIMESTAMP``; a row earlier than the one before it,
or before 2000, is a damaged timestamp and an error (with ``--skip-bad``, that row is
skipped): arrival times are taken relative to the earliest one, so a single bad row would
shift or stretch the whole trace.
"""

from __future__ import annotations

import csv
from pathlib import Path

from prorsa.errors import InputError
from prorsa.telemetry.importers.base import TraceBuilder, TraceFormat, Turn
from prorsa.telemetry.importers.fields import (
    EARLIEST_PLAUSIBLE,
    EARLIEST_PLAUSIBLE_S,
    INT32_MAX,
    Fields,
    check_text_file,
    list_files,
    parse_iso,
)
from prorsa.telemetry.importers.timing import SELF_HOSTED_ENGINE
from prorsa.telemetry.schema import detail_json

RATES = SELF_HOSTED_ENGINE
COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def read(src: Path, out: TraceBuilder) -> None:
    """Import one Azure trace CSV (or every ``*.csv`` in a folder)."""
    out.derive("prefill_s", f"estimated from nominal rates: {RATES.describe()}")
    out.derive("decode_s", f"estimated from nominal rates: {RATES.describe()}")
    out.derive("cached_tokens", "unknown in the trace: taken as 0 (every prompt token is new)")
    for path in list_files(src, "*.csv"):
        mark = out.mark()
        try:
            check_text_file(path)
            _read_file(path, out)
        except InputError as exc:
            out.rollback(mark)  # a file that fails half-way is skipped whole
            out.skip(exc, "file")


def _read_file(path: Path, out: TraceBuilder) -> None:
    task = _task(path)
    line = 1
    previous: tuple[float, int] | None = None  # arrival and line of the last good row
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            reader = csv.reader(handle)
            header = next(reader, [])
            missing = [c for c in COLUMNS if c not in header]
            if missing:
                raise InputError(
                    "missing column", source=str(path), record="line 1", field=missing[0]
                )
            columns = [header.index(c) for c in COLUMNS]
            for line, row in enumerate(reader, start=2):
                if not row:
                    continue
                rec = Fields(str(path), f"line {line}")
                try:
                    arrival, context, generated = _parse(row, columns, rec)
                    if previous is not None and arrival < previous[0]:
                        raise rec.error(
                            "TIMESTAMP",
                            f"{row[columns[0]].strip()!r} is earlier than line {previous[1]}'s "
                            "(the trace is sorted by arrival)",
                        )
                except InputError as exc:
                    out.skip(exc, "line (one request = one trajectory)")
                    continue
                previous = (arrival, line)
                prefill_s = RATES.prefill_s(context)
                decode_s = RATES.decode_s(generated)
                turn = Turn(
                    arrival,
                    arrival,
                    arrival + prefill_s,
                    arrival + prefill_s + decode_s,
                    None,
                    context,
                    context,
                    0,
                    generated,
                    prefill_detail=_TOKENS_DERIVED,
                    decode_detail=_GENERATION_DERIVED,
                )
                out.add_trajectory(f"{path.stem}-r{line - 2:05d}", "", task, [turn])
    except (csv.Error, UnicodeDecodeError) as exc:
        raise InputError(
            f"unreadable CSV: {exc}", source=str(path), record=f"line {line + 1}"
        ) from None


def _parse(row: list[str], columns: list[int], rec: Fields) -> tuple[float, int, int]:
    if len(row) <= max(columns):
        missing = next(c for c, i in zip(COLUMNS, columns, strict=True) if i >= len(row))
        raise rec.error(missing, f"missing (the row has only {len(row)} fields)")
    stamp, context, generated = (row[i].strip() for i in columns)
    try:
        arrival = parse_iso(stamp)
    except ValueError:
        raise rec.error("TIMESTAMP", f"not a timestamp: {stamp!r}") from None
    if arrival < EARLIEST_PLAUSIBLE_S:
        raise rec.error(
            "TIMESTAMP",
            f"implausible time {stamp!r}: before {EARLIEST_PLAUSIBLE.date()} (a placeholder date?)",
        )
    return arrival, _count(context, "ContextTokens", rec), _count(generated, "GeneratedTokens", rec)


def _count(text: str, column: str, rec: Fields) -> int:
    try:
        value = int(text)
    except ValueError:
        raise rec.error(column, f"must be a non-negative integer, got {text!r}") from None
    if value < 0:
        raise rec.error(column, f"must be a non-negative integer, got {value}")
    if value > INT32_MAX:
        raise rec.error(column, f"{value} exceeds the telemetry schema's int32 limit {INT32_MAX}")
    return value


def _task(path: Path) -> str:
    # AzureLLMInferenceTrace_code.csv -> azure-code, ..._conv.csv -> azure-conv
    kind = path.stem.rpartition("_")[2].lower()
    return f"azure-{kind}" if kind and kind != path.stem.lower() else "azure"


_TOKENS_DERIVED = detail_json(derived=["cached_tokens"])
_GENERATION_DERIVED = detail_json(derived=["prefill_s", "decode_s"])

FORMAT = TraceFormat(
    name="azure",
    description="Azure LLM inference trace CSV: request arrivals and lengths, one turn each",
    read=read,
    shared_path="traces/azure-llm-2023/AzureLLMInferenceTrace_code.csv",
)
