from __future__ import annotations

import math

import pytest

from prorsa.telemetry import events_to_table
from prorsa.telemetry.views import STATES, cluster_state_at, trajectory_table, turn_table
from tests.conftest import make_two_turn_events


def test_turn_table_stage_times_and_tokens(two_turn_table):
    turns = turn_table(two_turn_table)
    assert list(turns["turn"]) == [0, 1]
    t0, t1 = turns.iloc[0], turns.iloc[1]
    assert (t0.prefill_start, t0.prefill_end, t0.kv_transfer_end, t0.decode_end) == (1, 2, 2.5, 4)
    assert (t0.context_tokens, t0.new_tokens, t0.cached_tokens, t0.output_tokens) == (
        100,
        100,
        0,
        20,
    )
    assert (t0.prefill_engine, t0.decode_engine) == (0, 1)
    assert t0.tool_latency_s == 2.0 and t0.ttft_s == 2.5 and t0.tpot_s == pytest.approx(1.5 / 20)
    assert math.isnan(t1.kv_transfer_start) and math.isnan(t1.tool_latency_s)
    assert (t1.new_tokens, t1.cached_tokens, t1.output_tokens) == (30, 120, 10)


def test_turn_table_counts_recomputed_prefills():
    events = make_two_turn_events()
    again = make_two_turn_events()[2]  # a second prefill_start of turn 0 (preempted, recomputed)
    again.time = 1.5
    events.insert(3, again)
    turns = turn_table(events_to_table(events))
    assert turns.loc[0, "prefill_attempts"] == 2
    assert turns.loc[0, "prefill_start"] == 1.0 and turns.loc[0, "prefill_end"] == 2.0


def test_trajectory_table(two_turn_table):
    trajs = trajectory_table(two_turn_table)
    row = trajs.iloc[0]
    assert row.turns == 2 and row.done
    assert (row.start_s, row.end_s, row.completion_s) == (0, 8, 8)
    assert (row.new_tokens, row.cached_tokens, row.output_tokens) == (130, 120, 30)
    assert row.final_context_tokens == 150 and row.tool_time_s == 2.0


@pytest.mark.parametrize(
    ("t", "state"),
    [
        (0, "queued"),
        (1.5, "prefilling"),
        (2.2, "transferring"),
        (3, "decoding"),
        (5, "in_tool"),
        (6.5, "prefilling"),
        (7.5, "decoding"),
        (8, "done"),
        (100, "done"),
    ],
)
def test_cluster_state_follows_lifecycle(two_turn_table, t, state):
    snapshot = cluster_state_at(two_turn_table, t)
    assert set(snapshot) == set(STATES)
    assert snapshot[state].count == 1
    assert sum(s.count for s in snapshot.values()) == 1


def test_cluster_state_sums_tokens_across_trajectories():
    events = make_two_turn_events("a") + make_two_turn_events("b", t0=5.0)
    table = events_to_table(sorted(events, key=lambda e: e.time))
    snap = cluster_state_at(table, 5.5)
    assert snap["in_tool"].count == 1 and snap["in_tool"].context_tokens == 100  # a
    assert snap["queued"].count == 1 and snap["queued"].context_tokens == 100  # b
    snap = cluster_state_at(table, 6.5)  # a prefilling turn 1 (150), b prefilling turn 0 (100)
    assert snap["prefilling"].count == 2 and snap["prefilling"].context_tokens == 250
    assert sum(s.count for s in cluster_state_at(table, -1).values()) == 0


def test_views_ignore_cluster_events(two_turn_table):
    from prorsa.telemetry import LifecycleEvent

    switch = LifecycleEvent(3.0, "r", "", "", "", 0, "role_switch_start", 2)
    events = [*make_two_turn_events(), switch]
    table = events_to_table(events)
    assert len(turn_table(table)) == 2
    assert sum(s.count for s in cluster_state_at(table, 3.0).values()) == 1
