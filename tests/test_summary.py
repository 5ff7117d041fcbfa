"""summarize() on a hand-built table whose statistics are worked out by hand."""

from __future__ import annotations

import pytest

from prorsa.telemetry import LifecycleEvent, events_to_table
from prorsa.telemetry.summary import summarize
from tests.conftest import make_two_turn_events


def _one_turn(traj: str, t0: float) -> list[LifecycleEvent]:
    def e(t, kind, ctx=0, new=0, cached=0, out=0):
        return LifecycleEvent(t0 + t, "r", traj, "", "math", 0, kind, -1, ctx, new, cached, out)

    return [
        e(0, "traj_start"),
        e(0, "prefill_start", 400, 400, 0),
        e(1, "prefill_end", 400, 400, 0),
        e(1, "decode_start", 400),
        e(9, "decode_end", out=300),
        e(9, "traj_end"),
    ]


@pytest.fixture
def table():
    # a: turns at 0..8 s, b: the same shifted by 10 s (conftest), c: one turn at 20..29 s
    events = make_two_turn_events("a") + make_two_turn_events("b", t0=10) + _one_turn("c", 20)
    return events_to_table(events)


def test_summary_by_hand(table):
    s = summarize(table)
    assert (s["events"], s["trajectories"], s["turns"]) == (38, 3, 5)
    # turns per trajectory 2, 2, 1
    assert s["turns_per_trajectory"] == {"mean": 1.667, "p50": 2.0, "p90": 2.0, "max": 2}
    # per turn: context 100, 150, 100, 150, 400 -> sorted 100 100 150 150 400
    assert s["context_tokens"] == {"p50": 150.0, "p90": 300.0}
    # new 100, 30, 100, 30, 400 -> 30 30 100 100 400: p90 = 100 + 0.6 * 300
    assert s["new_tokens"] == {"p50": 100.0, "p90": 280.0}
    assert s["cached_tokens"] == {"p50": 0.0, "p90": 120.0}
    assert s["output_tokens"] == {"p50": 20.0, "p90": 188.0}
    assert s["cache_hit_ratio"] == round(240 / 900, 3)
    # one tool call per two-turn trajectory, 2 s each
    assert s["tool_latency_s"] == {"count": 2, "p50": 2.0, "p90": 2.0, "p99": 2.0}
    # completion 8, 8, 9 s
    assert s["completion_s"] == {"p50": 8.0, "p90": 8.8, "max": 9.0}
    assert s["span_s"] == 29.0
    assert s["tasks"] == {"math": 1, "swe": 2}


def test_summary_of_empty_table():
    s = summarize(events_to_table([]))
    assert (s["events"], s["trajectories"], s["turns"]) == (0, 0, 0)
    assert s["tool_latency_s"] == {"count": 0, "p50": None, "p90": None, "p99": None}
    assert s["span_s"] == 0.0 and s["tasks"] == {}


def test_summary_counts_unfinished_trajectories(table):
    assert summarize(table)["trajectories_unfinished"] == 0
    cut = table.filter(
        ~((table["trajectory_id"].to_numpy() == "b") & (table["kind"].to_numpy() == "traj_end"))
    )
    assert summarize(cut)["trajectories_unfinished"] == 1
