from __future__ import annotations

import pyarrow as pa
import pytest

from prorsa.errors import InputError
from prorsa.telemetry import (
    ARROW_SCHEMA,
    FIELDS,
    EventKind,
    EventValidator,
    LifecycleEvent,
    events_to_table,
    find_violations,
    rows_to_table,
    validate_table,
)
from prorsa.telemetry.schema import conform
from tests.conftest import make_two_turn_events


def test_schema_matches_design_contract():
    assert FIELDS == (
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
    types = {f.name: f.type for f in ARROW_SCHEMA}
    assert types["time"] == pa.float64()
    assert types["turn"] == pa.int32() and types["engine_id"] == pa.int32()
    assert all(types[f] == pa.int32() for f in FIELDS[8:12])
    assert {k.value for k in EventKind} >= {"traj_start", "kv_transfer_end", "allocation"}


def test_rows_and_events_build_identical_tables():
    events = make_two_turn_events()
    a = events_to_table(events)
    b = rows_to_table([e.as_row() for e in events])
    assert a.equals(b)
    assert a.schema.equals(ARROW_SCHEMA, check_metadata=False)
    assert a.column("kind").to_pylist()[0] == "traj_start"


def test_valid_events_pass(two_turn_table):
    validate_table(two_turn_table)
    v = EventValidator()
    for i, e in enumerate(make_two_turn_events()):
        v.check(e.as_row(), i)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"kind": "prefil_start"}, "kind"),
        ({"new_tokens": -3}, "new_tokens"),
        ({"output_tokens": -1}, "output_tokens"),
        ({"time": float("nan")}, "time"),
        ({"turn": -1}, "turn"),
    ],
)
def test_row_rule_violations_name_record_and_field(change, field):
    events = make_two_turn_events()
    bad = events[3]
    for k, val in change.items():
        setattr(bad, k, val)
    v = EventValidator(source="x.ptel")
    for i, e in enumerate(events[:3]):
        v.check(e.as_row(), i)
    with pytest.raises(InputError) as info:
        v.check(bad.as_row(), 3)
    assert info.value.field == field and info.value.record == 3
    assert "x.ptel" in str(info.value) and "record 3" in str(info.value)

    table = rows_to_table([e.as_row() for e in events]) if field != "kind" else None
    if table is not None:
        problems = find_violations(table)
        assert (3, field) in [(r, f) for r, f, _ in problems]


def test_time_backwards_and_turn_out_of_order_within_trajectory():
    events = make_two_turn_events()
    events[5].time = 0.5  # before the previous event of the same trajectory
    with pytest.raises(InputError) as info:
        validate_table(events_to_table(events), source="t.parquet")
    assert info.value.field == "time" and info.value.record == 5

    events = make_two_turn_events()
    events[12].turn = 0  # turn goes back from 1 to 0
    with pytest.raises(InputError) as info:
        validate_table(events_to_table(events))
    assert info.value.field == "turn" and info.value.record == 12


def test_interleaved_trajectories_are_checked_separately():
    a = make_two_turn_events("a")
    b = make_two_turn_events("b", t0=0.25)
    merged = sorted(a + b, key=lambda e: e.time)
    validate_table(events_to_table(merged))
    # Cluster events carry no trajectory and may come at any time.
    merged.append(LifecycleEvent(0.1, "r", "", "", "", 0, "allocation", 3))
    validate_table(events_to_table(merged))


def test_unknown_kind_in_table_is_reported():
    table = events_to_table(make_two_turn_events())
    kinds = table.column("kind").cast(pa.string()).to_pylist()
    kinds[2] = "teleport"
    table = table.set_column(6, "kind", pa.array(kinds))
    with pytest.raises(InputError) as info:
        validate_table(table, source="f")
    assert info.value.field == "kind" and info.value.record == 2


def test_conform_casts_and_names_missing_columns():
    table = events_to_table(make_two_turn_events())
    loose = table.set_column(5, "turn", table.column("turn").cast(pa.int64()))
    assert conform(loose).schema.equals(ARROW_SCHEMA, check_metadata=False)
    with pytest.raises(InputError, match="output_tokens"):
        conform(table.drop(["output_tokens"]), source="f.parquet")


def test_conform_keeps_source_metadata():
    table = events_to_table(make_two_turn_events())
    loose = table.set_column(5, "turn", table.column("turn").cast(pa.int64()))
    loose = loose.replace_schema_metadata({b"prorsa.source": b"simulator"})
    assert conform(loose).schema.metadata[b"prorsa.source"] == b"simulator"
