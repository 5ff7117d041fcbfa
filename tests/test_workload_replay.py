"""Trace replay: vectorised specs equal the turn-table reference; arrival times; bad input."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from prorsa.errors import InputError
from prorsa.telemetry import events_to_table
from prorsa.telemetry.reader import read_telemetry
from prorsa.telemetry.views import turn_table
from prorsa.workload import specs_from_trace
from prorsa.workload.replay import _from_turn_frame, arrivals_from_trace, load_replay
from tests.conftest import REPO, make_two_turn_events
from tests.sim_helpers import random_specs, run

TRACES = sorted((REPO / "datasets" / "traces").glob("*.parquet"))


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        x.to_dict() == y.to_dict() and x.meta == y.meta for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.stem)
def test_specs_equal_the_turn_table_reference_on_shipped_traces(path):
    table, _ = read_telemetry(path)
    fast = load_replay(table)
    ref = _from_turn_frame(turn_table(table), None)
    assert _same(fast.specs, ref.specs)
    assert _same(specs_from_trace(path), ref.specs)  # from the file too
    for spec in fast.specs:
        assert not spec.new_tokens.flags.writeable and spec.tool_latency_s[-1] == 0.0


def test_specs_and_arrivals_of_a_simulated_run_with_preemptions():
    from tests.sim_helpers import profile

    specs = random_specs(80, seed=3, turns=(1, 7))
    table = run(specs, "static", slots=2, prof=profile(kv_capacity_tokens=3000)).telemetry
    replay = arrivals_from_trace(table, task="replayed")
    ref = _from_turn_frame(turn_table(table), "replayed")
    assert _same(replay.specs, ref.specs)
    # A sync step launches everything at once: every arrival at the trace's start.
    np.testing.assert_allclose(replay.arrival_s, 0.0)
    by_id = {s.trajectory_id: s for s in specs}
    for got in replay.specs:
        want = by_id[got.trajectory_id]
        assert list(got.output_tokens) == list(want.output_tokens)
        assert got.num_turns == want.num_turns


def test_arrival_times_are_first_events_from_the_trace_start():
    events = make_two_turn_events("b", t0=12.5) + make_two_turn_events("a", t0=10.0)
    replay = arrivals_from_trace(events_to_table(events))
    assert [s.trajectory_id for s in replay.specs] == ["a", "b"]  # sorted by id
    np.testing.assert_allclose(replay.arrival_s, [0.0, 2.5])
    spec = replay.specs[1]
    # context 100 then 150 after 20 output tokens: 30 appended; tool 4 -> 6 s.
    assert list(spec.new_tokens) == [100, 30] and list(spec.output_tokens) == [20, 10]
    assert list(spec.tool_latency_s) == [2.0, 0.0]


def test_bad_traces_are_refused_with_the_record():
    table = events_to_table(make_two_turn_events("a"))
    cluster_only = table.filter(pa.compute.equal(table.column("kind").cast(pa.string()), "x"))
    with pytest.raises(InputError, match="no trajectory turns"):
        load_replay(cluster_only)
    ctx = table.column("context_tokens").to_numpy().copy()
    ctx[1:3] = -5  # the first turn's prefill_queued and prefill_start
    bad = table.set_column(8, "context_tokens", pa.array(ctx, pa.int32()))
    with pytest.raises(InputError, match="negative") as err:
        load_replay(bad)
    assert err.value.record == "a"
    kinds = table.column("kind").cast(pa.string()).to_pylist()
    kinds[3] = "prefill_finished"
    with pytest.raises(InputError, match="unknown event kind"):
        load_replay(table.set_column(6, "kind", pa.array(kinds)))
