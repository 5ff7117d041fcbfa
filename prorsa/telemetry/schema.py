"""The lifecycle event: the one data contract every part of prorsa reads and writes.

Columns and types follow the design's telemetry table exactly. Rows are kept as plain
tuples in column order on hot paths (recorder, simulator) and become an Arrow table in
bulk, which is far cheaper than building one Python object per event.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import astuple, dataclass
from enum import StrEnum
from typing import Any

import pyarrow as pa


class EventKind(StrEnum):
    """What happened. Trajectory stages first, then cluster events."""

    TRAJ_START = "traj_start"
    PREFILL_QUEUED = "prefill_queued"
    PREFILL_START = "prefill_start"
    PREFILL_END = "prefill_end"
    KV_TRANSFER_START = "kv_transfer_start"
    KV_TRANSFER_END = "kv_transfer_end"
    DECODE_START = "decode_start"
    DECODE_END = "decode_end"
    TOOL_START = "tool_start"
    TOOL_END = "tool_end"
    TRAJ_END = "traj_end"
    ROLE_SWITCH_START = "role_switch_start"
    ROLE_SWITCH_END = "role_switch_end"
    ALLOCATION = "allocation"
    WEIGHT_SYNC = "weight_sync"  # new weights on every engine; serving paused meanwhile


EVENT_KINDS: tuple[str, ...] = tuple(k.value for k in EventKind)
EVENT_KIND_SET: frozenset[str] = frozenset(EVENT_KINDS)
CLUSTER_EVENT_KINDS: frozenset[str] = frozenset(
    {
        EventKind.ROLE_SWITCH_START,
        EventKind.ROLE_SWITCH_END,
        EventKind.ALLOCATION,
        EventKind.WEIGHT_SYNC,
    }
)

FIELDS: tuple[str, ...] = (
    "time",
    "run_id",
    "trajectory_id",
    "group_id",
    "task",
    "turn",
    "kind",
    "engine_id",
    "context_tokens",
    "new_tokens",
    "cached_tokens",
    "output_tokens",
    "detail",
)
TOKEN_FIELDS: tuple[str, ...] = ("context_tokens", "new_tokens", "cached_tokens", "output_tokens")

# `kind` is dictionary-encoded: 14 distinct strings over millions of rows.
KIND_TYPE = pa.dictionary(pa.int8(), pa.string())

ARROW_SCHEMA = pa.schema(
    [
        pa.field("time", pa.float64(), nullable=False),
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("trajectory_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("task", pa.string(), nullable=False),
        pa.field("turn", pa.int32(), nullable=False),
        pa.field("kind", KIND_TYPE, nullable=False),
        pa.field("engine_id", pa.int32(), nullable=False),
        pa.field("context_tokens", pa.int32(), nullable=False),
        pa.field("new_tokens", pa.int32(), nullable=False),
        pa.field("cached_tokens", pa.int32(), nullable=False),
        pa.field("output_tokens", pa.int32(), nullable=False),
        pa.field("detail", pa.string(), nullable=False),
    ],
    metadata={"prorsa.schema": "lifecycle-event/1"},
)


@dataclass(slots=True)
class LifecycleEvent:
    """One row of telemetry. See the design's section 3 for each field's meaning."""

    time: float
    run_id: str
    trajectory_id: str
    group_id: str
    task: str
    turn: int
    kind: str
    engine_id: int = -1
    context_tokens: int = 0
    new_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    detail: str = ""

    def as_row(self) -> tuple:
        """The event as a tuple in ``FIELDS`` order."""
        return astuple(self)


def detail_json(**items: Any) -> str:
    """Encode a small ``detail`` payload compactly; empty string when there is nothing."""
    items = {k: v for k, v in items.items() if v is not None}
    return json.dumps(items, separators=(",", ":"), sort_keys=True) if items else ""


# Converting tuples straight into a struct array is about 2.5x faster than transposing
# them into Python columns first; it matters on the recorder's flush path.
_ROW_STRUCT = pa.struct(
    [pa.field(f.name, pa.string() if f.name == "kind" else f.type) for f in ARROW_SCHEMA]
)
_KIND_INDEX = FIELDS.index("kind")


def rows_to_table(rows: Sequence[tuple]) -> pa.Table:
    """Build an Arrow table from rows in ``FIELDS`` order (no validation)."""
    if not rows:
        return ARROW_SCHEMA.empty_table()
    return encode_kinds(rows_table(rows))


#: :data:`ARROW_SCHEMA` with ``kind`` as plain strings (tables still to be joined).
PLAIN_KIND_SCHEMA = pa.schema(
    [pa.field(f.name, pa.string(), nullable=False) if f.name == "kind" else f for f in ARROW_SCHEMA]
)


def rows_table(rows: Sequence[tuple]) -> pa.Table:
    """Rows in ``FIELDS`` order as a table with ``kind`` as plain strings."""
    if not rows:
        return PLAIN_KIND_SCHEMA.empty_table()
    return pa.Table.from_arrays(
        pa.array(rows, type=_ROW_STRUCT).flatten(), schema=PLAIN_KIND_SCHEMA
    )


def encode_kinds(table: pa.Table) -> pa.Table:
    """A :func:`rows_table` (or several joined) in the canonical schema."""
    kind = table.column(_KIND_INDEX).combine_chunks().dictionary_encode().cast(KIND_TYPE)
    return table.set_column(_KIND_INDEX, ARROW_SCHEMA.field("kind"), kind).cast(ARROW_SCHEMA)


def columns_to_table(columns: Sequence[Sequence[Any]]) -> pa.Table:
    """Build an Arrow table from 13 column sequences in ``FIELDS`` order."""
    if len(columns) != len(FIELDS):
        raise ValueError(f"expected {len(FIELDS)} columns, got {len(columns)}")
    arrays = []
    for field, values in zip(ARROW_SCHEMA, columns, strict=True):
        if field.name == "kind":
            arrays.append(pa.array(values, pa.string()).dictionary_encode().cast(KIND_TYPE))
        else:
            arrays.append(pa.array(values, field.type))
    return pa.Table.from_arrays(arrays, schema=ARROW_SCHEMA)


def events_to_table(events: Iterable[LifecycleEvent]) -> pa.Table:
    """Build an Arrow table from event objects (no validation)."""
    return rows_to_table([e.as_row() for e in events])


def conform(
    table: pa.Table, *, source: str = "<table>", keep_dictionaries: bool = False
) -> pa.Table:
    """Cast a table with the right column names to the canonical schema and column order.

    ``keep_dictionaries`` leaves dictionary-encoded string columns encoded (the schema
    then differs from :data:`ARROW_SCHEMA` in those columns): a run id repeated on every
    one of tens of millions of events stays an index per event until a run is cast.
    """
    from prorsa.errors import InputError

    missing = [f for f in FIELDS if f not in table.column_names]
    if missing:
        raise InputError(
            f"missing column(s) {', '.join(missing)}",
            source=source,
            field=missing[0],
            hint="telemetry needs the columns of prorsa.telemetry.schema.FIELDS",
        )
    table = table.select(list(FIELDS))
    if table.schema.equals(ARROW_SCHEMA, check_metadata=False):
        return table
    arrays, fields = [], []
    for field in ARROW_SCHEMA:
        col = table.column(field.name)
        if (
            keep_dictionaries
            and field.type == pa.string()
            and pa.types.is_dictionary(col.type)
            and pa.types.is_string(col.type.value_type)
        ):
            arrays.append(col)
            fields.append(field.with_type(col.type))
            continue
        try:
            if field.name == "kind":
                if pa.types.is_dictionary(col.type):
                    col = col.cast(pa.string())
                col = col.cast(pa.string()).dictionary_encode().cast(KIND_TYPE)
            else:
                col = col.cast(field.type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise InputError(
                f"cannot convert to {field.type}: {exc}", source=source, field=field.name
            ) from None
        arrays.append(col)
        fields.append(field)
    # Keep the source's own metadata (e.g. ``prorsa.source``) on top of the schema's.
    metadata = {**(ARROW_SCHEMA.metadata or {}), **(table.schema.metadata or {})}
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=metadata))
