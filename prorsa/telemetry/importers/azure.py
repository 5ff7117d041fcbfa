"""Azure LLM inference traces (CSV: ``TIMESTAMP, ContextTokens, GeneratedTokens``).

Arrivals only: each request is a one-turn trajectory without tools. Arrival times and
token counts are real; prefill and decode take nominal self-hosted engine times, and
nothing is known about prefix caching, so every prompt token counts as new.

The published traces are sorted by ``TIMESTAMP``; a row out of that order, or before
2000, is a damaged timestamp and an error (with ``--skip-bad``, that row is skipped):
arrival times are taken relative to the earliest one, so a single bad row would shift or
stretch the whole trace. The rows blamed for the order are the fewest whose removal
leaves the rest sorted, so one timestamp that jumps forward blames that row alone.

A file is first read whole with Arrow and checked column by column (:func:`_read_whole`;
the import of the 8,819-request code trace takes ~60 ms instead of 311 ms); a file in
which anything looks unusual is read again line by line, which names the line and field
of every problem. Both give the same events.
"""

from __future__ import annotations

import bisect
import codecs
import csv
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

from prorsa.errors import InputError
from prorsa.telemetry.importers.base import ONE_TURN_KINDS, TraceBuilder, TraceFormat, Turn
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
from prorsa.telemetry.schema import PLAIN_KIND_SCHEMA, detail_json

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
            if not _read_whole(path, out):
                _read_file(path, out)
        except InputError as exc:
            out.rollback(mark)  # a file that fails half-way is skipped whole
            out.skip(exc, "file")


def _decoded_lines(handle: BinaryIO, path: Path, out: TraceBuilder) -> Iterator[str]:
    """The file's lines as text, each decoded on its own: a line that is not UTF-8 is
    an error naming that line (skipped with ``--skip-bad``, an empty line in its place
    so the reader's line count stays right). A byte-order mark is dropped."""
    for number, raw in enumerate(handle, start=1):
        try:
            yield raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            error = InputError(
                f"not UTF-8 text ({exc.reason} at byte {exc.start})",
                source=str(path),
                record=f"line {number}",
            )
            out.skip(error, "line (one request = one trajectory)")
            yield "\n"


class _Row(NamedTuple):
    """A parsed line, kept until the arrival order of the whole file is known."""

    index: int  # among the data rows: the trajectory id's number
    line: int
    arrival: float
    context: int
    generated: int
    stamp: str


def _read_file(path: Path, out: TraceBuilder) -> None:
    task = _task(path)
    parsed: list[_Row] = []
    reader = None
    try:
        with path.open("rb") as handle:
            reader = csv.reader(_decoded_lines(handle, path, out))
            header = next(reader, [])
            missing = [c for c in COLUMNS if c not in header]
            if missing:
                raise InputError(
                    "missing column", source=str(path), record="line 1", field=missing[0]
                )
            columns = [header.index(c) for c in COLUMNS]
            for index, row in enumerate(reader):
                if not row:
                    continue
                line = reader.line_num  # the physical line (a quoted field may span lines)
                try:
                    values = _parse(row, columns, Fields(str(path), f"line {line}"))
                except InputError as exc:
                    out.skip(exc, "line (one request = one trajectory)")
                    continue
                parsed.append(_Row(index, line, *values, row[columns[0]].strip()))
    except csv.Error as exc:
        line = reader.line_num if reader is not None else 1
        raise InputError(
            f"unreadable CSV: {exc}", source=str(path), record=f"line {line}"
        ) from None
    in_order = _longest_sorted_run([row.arrival for row in parsed])
    for position, (index, _, arrival, context, generated, _) in enumerate(parsed):
        if not in_order[position]:
            out.skip(
                _order_error(path, parsed, in_order, position),
                "line (one request = one trajectory)",
            )
            continue
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
        out.add_trajectory(f"{path.stem}-r{index:05d}", "", task, [turn])


def _longest_sorted_run(arrivals: list[float]) -> list[bool]:
    """Which rows to keep: the most rows that are already in arrival order (a longest
    non-decreasing subsequence), so the rows blamed are the fewest that break the order.

    Several choices can be equally long (``03, 04, +1 year, 05`` keeps either the jump or
    the row after it): of the one that keeps the smallest times and the one that keeps
    the earliest rows, the one spanning the shorter time wins, so a timestamp that jumps
    forward or back is the row blamed."""
    forward = _sorted_run(arrivals)
    backward = _sorted_run([-a for a in reversed(arrivals)])[::-1]

    def span(keep: list[bool]) -> float:
        kept = [a for a, k in zip(arrivals, keep, strict=True) if k]
        return kept[-1] - kept[0] if kept else 0.0

    return forward if span(forward) < span(backward) else backward


def _sorted_run(values: list[float]) -> list[bool]:
    """A longest non-decreasing subsequence of ``values`` (patience sorting, the one
    ending in the smallest values), as a keep mask."""
    tails: list[float] = []
    tail_row: list[int] = []
    previous = [-1] * len(values)
    for row, value in enumerate(values):
        place = bisect.bisect_right(tails, value)
        previous[row] = tail_row[place - 1] if place else -1
        if place == len(tails):
            tails.append(value)
            tail_row.append(row)
        else:
            tails[place] = value
            tail_row[place] = row
    keep = [False] * len(values)
    row = tail_row[-1] if tail_row else -1
    while row >= 0:
        keep[row] = True
        row = previous[row]
    return keep


def _order_error(path: Path, parsed: list[_Row], keep: list[bool], at: int) -> InputError:
    """The error for a row outside the kept order, naming the kept row it contradicts."""
    row = parsed[at]
    before = next((r for r in range(at - 1, -1, -1) if keep[r]), None)
    if before is not None and row.arrival < parsed[before].arrival:
        other, relation = parsed[before].line, "earlier than"
    else:  # a kept row after it is earlier (else it would have been kept)
        after = next(r for r in range(at + 1, len(parsed)) if keep[r])
        other, relation = parsed[after].line, "later than"
    return Fields(str(path), f"line {row.line}").error(
        "TIMESTAMP", f"{row.stamp!r} is {relation} line {other}'s (the trace is sorted by arrival)"
    )


# What a well-formed line holds: a naive ISO time (taken as UTC) and two counts.
_ISO_NAIVE = r"^\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(\.\d{1,9})?$"
_COUNT = r"^\d{1,10}$"


def _read_whole(path: Path, out: TraceBuilder) -> bool:
    """Import ``path`` in whole-column operations; False (nothing added) when any line is
    unusual (blank, short, quoted across lines, not UTF-8, a value out of range, out of
    order, an id already imported), for the line-by-line reader to name it."""
    raw = path.read_bytes()
    if not _plain_text(raw):
        return False
    try:
        table = pa_csv.read_csv(
            pa.py_buffer(raw),
            read_options=pa_csv.ReadOptions(block_size=max(len(raw), 1 << 20)),
            parse_options=pa_csv.ParseOptions(newlines_in_values=False),
            convert_options=pa_csv.ConvertOptions(
                include_columns=list(COLUMNS),
                column_types=dict.fromkeys(COLUMNS, pa.string()),
                strings_can_be_null=False,
            ),
        )
    except (pa.ArrowInvalid, pa.ArrowKeyError, KeyError):
        return False
    n = table.num_rows
    # One record per physical line after the header: no blank lines (the line-by-line
    # reader numbers trajectories by line) and no record spanning lines.
    if n == 0 or _line_breaks(raw) != n:
        return False
    stamp, context, generated = (pc.utf8_trim_whitespace(table.column(c)) for c in COLUMNS)
    if not (
        pc.all(pc.match_substring_regex(stamp, _ISO_NAIVE)).as_py()
        and pc.all(pc.match_substring_regex(context, _COUNT)).as_py()
        and pc.all(pc.match_substring_regex(generated, _COUNT)).as_py()
    ):
        return False
    try:
        ns = pc.cast(stamp, pa.timestamp("ns")).cast(pa.int64()).to_numpy()
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return False
    # datetime.fromisoformat keeps whole microseconds; timestamp() divides them by 10**6.
    arrival = (ns // 1000) / 1e6
    ctx = pc.cast(context, pa.int64()).to_numpy()
    gen = pc.cast(generated, pa.int64()).to_numpy()
    if (
        arrival.min() < EARLIEST_PLAUSIBLE_S
        or (np.diff(arrival) < 0).any()
        or max(ctx.max(), gen.max()) > INT32_MAX
    ):
        return False
    ids = [f"{path.stem}-r{i:05d}" for i in range(n)]
    if out.known(ids):
        return False
    prefill_s = RATES.base_s + ctx / RATES.prefill_tokens_per_s
    decode_start = arrival + prefill_s
    decode_end = decode_start + gen / RATES.decode_tokens_per_s
    out.add_table(
        _events(out.run_id, ids, _task(path), arrival, decode_start, decode_end, ctx, gen), ids, n
    )
    return True


def _plain_text(raw: bytes) -> bool:
    """What the line reader reads the same way Arrow does: UTF-8 throughout (Arrow checks
    only the columns it imports), no byte-order mark (Arrow drops it; the line reader
    would not find the first column), no line longer than the csv module's field limit,
    and under Arrow's 2 GiB block."""
    if len(raw) >= 2**31 - 1 or raw.startswith(codecs.BOM_UTF8):
        return False
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    data = np.frombuffer(raw, np.uint8)
    ends = np.flatnonzero((data == 10) | (data == 13))
    longest = np.diff(ends, prepend=-1, append=len(raw)).max() - 1
    return bool(longest <= csv.field_size_limit())


def _line_breaks(raw: bytes) -> int:
    """Line breaks between lines (CRLF, LF or CR; a final one ends the last line)."""
    breaks = raw.count(b"\n") + raw.count(b"\r") - raw.count(b"\r\n")
    return breaks - 1 if raw.endswith((b"\n", b"\r")) else breaks


def _events(run_id, ids, task, arrival, decode_start, decode_end, ctx, gen):
    """The seven events of each one-turn trajectory as a table (``ONE_TURN_KINDS``)."""
    n, per = len(ids), len(ONE_TURN_KINDS)
    zero = np.zeros(n, np.int64)
    time = np.stack(
        [arrival, arrival, arrival, decode_start, decode_start, decode_end, decode_end], 1
    )
    context = np.stack([zero, ctx, ctx, ctx, ctx, zero, zero], 1)
    new = np.stack([zero, ctx, ctx, ctx, zero, zero, zero], 1)
    output = np.stack([zero, zero, zero, zero, zero, gen, zero], 1)
    rows = n * per
    position = pa.array(np.tile(np.arange(per), n))  # each row's place in its trajectory
    columns = {
        "time": pa.array(time.ravel()),
        "run_id": pa.repeat(pa.scalar(run_id), rows),
        "trajectory_id": pa.array(ids).take(pa.array(np.repeat(np.arange(n), per))),
        "group_id": pa.repeat(pa.scalar(""), rows),
        "task": pa.repeat(pa.scalar(task), rows),
        "turn": pa.array(np.zeros(rows, np.int32)),
        "kind": pa.array(ONE_TURN_KINDS).take(position),
        "engine_id": pa.array(np.full(rows, -1, np.int32)),
        "context_tokens": pa.array(context.ravel()),
        "new_tokens": pa.array(new.ravel()),
        "cached_tokens": pa.array(np.zeros(rows, np.int64)),
        "output_tokens": pa.array(output.ravel()),
        "detail": pa.array(_DETAILS).take(position),
    }
    return pa.table(columns).cast(PLAIN_KIND_SCHEMA)


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
_DETAILS = ("", "", _TOKENS_DERIVED, "", "", _GENERATION_DERIVED, "")  # as ONE_TURN_KINDS

FORMAT = TraceFormat(
    name="azure",
    description="Azure LLM inference trace CSV: request arrivals and lengths, one turn each",
    read=read,
    shared_path="traces/azure-llm-2023/AzureLLMInferenceTrace_code.csv",
)
