"""What every importer shares: the turn record, the event builder and the import result.

An importer parses its format into :class:`Turn` tuples per trajectory and hands them to
:class:`TraceBuilder`, which writes the lifecycle events as plain row tuples (turned into
Arrow columns once, at the end: far cheaper than an object per event), counts what was
skipped and remembers which quantities were derived rather than read. An importer that
reads a whole file at once may hand over its events as a ready table instead
(:meth:`TraceBuilder.add_table`); :meth:`TraceBuilder.parts` gives both, in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa

from prorsa.errors import InputError
from prorsa.io import is_utf8
from prorsa.telemetry.schema import EventKind, rows_table

MAX_SKIPPED_EXAMPLES = 5

_Q, _PS, _PE = (
    EventKind.PREFILL_QUEUED.value,
    EventKind.PREFILL_START.value,
    EventKind.PREFILL_END.value,
)
_DS, _DE = EventKind.DECODE_START.value, EventKind.DECODE_END.value
_TS, _TE = EventKind.TOOL_START.value, EventKind.TOOL_END.value
_START, _END = EventKind.TRAJ_START.value, EventKind.TRAJ_END.value
_NO_TOKENS = (0, 0, 0, 0)
#: The events :meth:`TraceBuilder.add_trajectory` writes for a one-turn trajectory, in order.
ONE_TURN_KINDS = (_START, _Q, _PS, _PE, _DS, _DE, _END)


class Turn(NamedTuple):
    """One LLM call of a trajectory, with absolute times in seconds (any origin).

    There is no KV transfer in a public trace, so prefill ends when decoding starts.
    ``tool_end_s`` is ``None`` on the last turn (no tool follows it) and the time the next
    call was queued on every other turn. Details are ``detail_json`` strings placed on
    ``prefill_start`` (token provenance), ``decode_end`` (generation) and ``tool_end``.
    """

    queued_s: float
    prefill_start_s: float
    decode_start_s: float
    decode_end_s: float
    tool_end_s: float | None
    context_tokens: int
    new_tokens: int
    cached_tokens: int
    output_tokens: int
    prefill_detail: str = ""
    decode_detail: str = ""
    tool_detail: str = ""


@dataclass
class ImportResult:
    """An imported trace: validated events plus what was skipped and what was derived."""

    table: pa.Table
    fmt: str
    source: str
    trajectories: int
    turns: int
    skipped: int
    skipped_examples: list[str]
    #: quantity -> how it was derived (quantities not listed were read from the trace)
    derived: dict[str, str]
    #: choices a user should know about when reading the numbers
    notes: list[str] = field(default_factory=list)

    @property
    def events(self) -> int:
        return self.table.num_rows


@dataclass(frozen=True)
class TraceFormat:
    """A registered trace format: how to read it and where the shared copy lives."""

    name: str
    description: str
    read: Callable[[Path, TraceBuilder], None]
    #: path of the public example under the shared data folder
    shared_path: str


class TraceBuilder:
    """Collects lifecycle rows for one import and the report that goes with them."""

    def __init__(self, run_id: str, *, skip_bad: bool = False) -> None:
        self.run_id = run_id
        self.skip_bad = skip_bad
        self.rows: list[tuple] = []
        # Tables of whole trajectories, each placed before rows[position:]:
        # (position, table, its trajectory ids).
        self.tables: list[tuple[int, pa.Table, list[str]]] = []
        self.trajectories = 0
        self.turns = 0
        self.skipped = 0
        self.skipped_examples: list[str] = []
        self.first_error: InputError | None = None
        self.derived: dict[str, str] = {}
        self.notes: list[str] = []
        # trajectory id -> where it was first read, to refuse a second one
        self._origins: dict[str, str] = {}

    def mark(self) -> tuple[int, int, int, int]:
        """A point to :meth:`rollback` to (before reading a file that may fail half-way)."""
        return len(self.rows), len(self.tables), self.trajectories, self.turns

    def rollback(self, mark: tuple[int, int, int, int]) -> None:
        """Forget every trajectory added since ``mark``."""
        rows, tables, self.trajectories, self.turns = mark
        for row in self.rows[rows:]:
            self._origins.pop(row[2], None)
        del self.rows[rows:]
        for _, _, ids in self.tables[tables:]:
            for trajectory_id in ids:
                self._origins.pop(trajectory_id, None)
        del self.tables[tables:]

    @property
    def empty(self) -> bool:
        """No event added (or all rolled back)."""
        return not self.rows and not self.tables

    def known(self, trajectory_ids: Sequence[str]) -> bool:
        """Whether any of ``trajectory_ids`` was added already."""
        return not self._origins.keys().isdisjoint(trajectory_ids)

    def add_table(self, table: pa.Table, trajectory_ids: list[str], turns: int) -> None:
        """Append whole trajectories as a ready event table: ``FIELDS`` columns with
        ``kind`` as plain strings, each trajectory's events together and in the order
        :meth:`add_trajectory` writes them (ids not added before: see :meth:`known`)."""
        self._origins.update(dict.fromkeys(trajectory_ids, "an earlier record"))
        self.tables.append((len(self.rows), table, trajectory_ids))
        self.trajectories += len(trajectory_ids)
        self.turns += turns

    def parts(self) -> list[pa.Table]:
        """Every event added, in order, as tables with ``kind`` as plain strings."""
        out, start = [], 0
        for position, table, _ in self.tables:
            if position > start:
                out.append(rows_table(self.rows[start:position]))
            out.append(table)
            start = position
        if start < len(self.rows) or not out:
            out.append(rows_table(self.rows[start:]))
        return out

    def derive(self, quantity: str, how: str) -> None:
        """Record (once) that ``quantity`` is derived and how."""
        self.derived.setdefault(quantity, how)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def skip(self, error: InputError, what: str) -> None:
        """Raise ``error``, or with ``skip_bad`` count it as one skipped ``what``.

        ``what`` says what was dropped because of the bad record, e.g. ``"line"`` or
        ``"trajectory 'x' (its turns depend on each other)"``.
        """
        if not self.skip_bad:
            raise error
        self.skipped += 1
        self.first_error = self.first_error or error
        if len(self.skipped_examples) < MAX_SKIPPED_EXAMPLES:
            record = str(error.record).removeprefix("line ") if error.record is not None else None
            where = f"{error.source}:{record}" if record is not None else str(error.source)
            self.skipped_examples.append(
                f"{where}: {error.field or '-'}: {error.reason} [skipped {what}]"
            )

    def add_trajectory(
        self,
        trajectory_id: str,
        group_id: str,
        task: str,
        turns: Sequence[Turn],
        *,
        start_s: float | None = None,
        end_s: float | None = None,
        start_detail: str = "",
        end_detail: str = "",
        source: str | None = None,
        record: int | str | None = None,
        id_field: str | None = None,
    ) -> None:
        """Append one trajectory's events: start, per-turn stages, tools between, end.

        ``source``, ``record`` and ``id_field`` say where the trajectory's id was read;
        a second trajectory with the same id raises an :class:`InputError` naming both
        places (two trajectories under one id would interleave into nonsense).
        """
        if not turns:
            raise ValueError("a trajectory needs at least one turn")
        where = f"{source}" + (f", {record}" if record is not None else "")
        for name, value in (("trajectory id", trajectory_id), ("group", group_id), ("task", task)):
            if not is_utf8(value):
                raise InputError(
                    f"the {name} {value!r:.80} is not valid UTF-8 (a lone surrogate: an "
                    "undecodable file name or a JSON \\ud800 escape)",
                    source=source,
                    record=record,
                    field=id_field if name == "trajectory id" else None,
                )
        first = self._origins.get(trajectory_id)
        if first is not None:
            raise InputError(
                f"duplicate trajectory id {trajectory_id!r} (first read at {first})",
                source=source,
                record=record,
                field=id_field,
                hint="ids must be unique across the files of one import",
            )
        self._origins[trajectory_id] = where if source is not None else "an earlier record"
        head = (self.run_id, trajectory_id, group_id, task)
        rows = self.rows
        clock = turns[0].queued_s if start_s is None else start_s

        def add(time: float, turn: int, kind: str, tokens: tuple, detail: str) -> None:
            nonlocal clock
            # Stage times come from sums like `arrival + gap`; a running max keeps float
            # rounding from ever putting an event before the one it follows.
            clock = time if time > clock else clock
            rows.append((clock, *head, turn, kind, -1, *tokens, detail))

        add(clock, 0, _START, _NO_TOKENS, start_detail)
        last = len(turns) - 1
        for index, t in enumerate(turns):
            prompt = (t.context_tokens, t.new_tokens, t.cached_tokens, 0)
            add(t.queued_s, index, _Q, prompt, "")
            add(t.prefill_start_s, index, _PS, prompt, t.prefill_detail)
            add(t.decode_start_s, index, _PE, prompt, "")
            add(t.decode_start_s, index, _DS, (t.context_tokens, 0, 0, 0), "")
            add(t.decode_end_s, index, _DE, (0, 0, 0, t.output_tokens), t.decode_detail)
            if index < last:
                if t.tool_end_s is None:
                    raise ValueError(f"turn {index} of {trajectory_id!r} needs tool_end_s")
                add(t.decode_end_s, index, _TS, _NO_TOKENS, "")
                add(t.tool_end_s, index, _TE, _NO_TOKENS, t.tool_detail)
        add(turns[-1].decode_end_s if end_s is None else end_s, last, _END, _NO_TOKENS, end_detail)
        self.trajectories += 1
        self.turns += len(turns)
