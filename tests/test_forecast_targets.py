"""Demand targets on hand-built telemetry, with hand-computed answers."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from prorsa.errors import ConfigError, InputError
from prorsa.forecast.targets import decode_segments, demand_targets, event_frame
from prorsa.forecast.types import target_column
from prorsa.telemetry import LifecycleEvent, events_to_table
from tests.conftest import make_two_turn_events


def _row(df: pd.DataFrame, t: float) -> pd.Series:
    return df[np.isclose(df["time"], t)].iloc[0]


def test_two_turn_targets_by_hand(two_turn_table):
    y = demand_targets(two_turn_table, [1, 2, 5])
    # Ticks every second up to the last event (t = 8).
    assert list(y["time"]) == [1, 2, 3, 4, 5, 6, 7, 8]
    # Turn 0 decodes 20 tokens over [2.5, 4] (13.33/s) on a 100-token context; turn 1
    # decodes 10 tokens over [7, 8] on 150; prefill arrivals: 100 at t=0, 30 at t=6.
    at2, at3 = _row(y, 2), _row(y, 3)
    assert at2[target_column("decode_tokens", 1)] == pytest.approx(20 * 0.5 / 1.5)
    assert at2[target_column("decode_sequences", 1)] == pytest.approx(0.5)
    # KV over (2.5, 3]: integral of 100 + 13.33 (u - 2.5) = 50 + 13.33 * 0.125.
    assert at2[target_column("decode_kv_tokens", 1)] == pytest.approx(50 + 40 / 3 * 0.125)
    assert at3[target_column("decode_kv_tokens", 1)] == pytest.approx(100 + 40 / 3)
    # (t, t+h] excludes t: the t=0 arrival is never in a window; t=6 is in (5, 6].
    assert _row(y, 5)[target_column("prefill_tokens", 1)] == 30
    assert _row(y, 6)[target_column("prefill_tokens", 1)] == 0
    assert _row(y, 1)[target_column("prefill_tokens", 5)] == 30
    assert _row(y, 7)[target_column("decode_tokens", 1)] == pytest.approx(10)
    assert _row(y, 7)[target_column("decode_kv_tokens", 1)] == pytest.approx(155)
    # Over (3, 8]: 13.33 tokens of turn 0 and all 10 of turn 1.
    assert at3[target_column("decode_tokens", 5)] == pytest.approx(40 / 3 + 10)
    assert at3[target_column("decode_sequences", 5)] == pytest.approx((1 + 1) / 5)
    # Windows past the last event count nothing there.
    assert _row(y, 8)[target_column("decode_tokens", 5)] == 0


def test_total_decode_tokens_conserved(two_turn_table):
    y = demand_targets(two_turn_table, [1])
    assert y[target_column("decode_tokens", 1)].sum() == pytest.approx(30)


def _events(rows):
    return events_to_table([LifecycleEvent(*r) for r in rows])


def test_preempted_decode_splits_tokens_over_both_segments():
    # Decodes [1, 2], is preempted (re-queued with new_tokens=0), decodes again [4, 5]:
    # 40 tokens over 2 s of decode time, 20 per segment; the re-queue adds no prefill.
    rows = [
        (0.0, "r", "a", "", "t", 0, "traj_start"),
        (0.0, "r", "a", "", "t", 0, "prefill_queued", -1, 100, 100),
        (1.0, "r", "a", "", "t", 0, "decode_start", 0, 100),
        (2.0, "r", "a", "", "t", 0, "prefill_queued", 0, 100, 0),
        (4.0, "r", "a", "", "t", 0, "decode_start", 0, 100),
        (5.0, "r", "a", "", "t", 0, "decode_end", 0, 100, 0, 0, 40),
        (5.0, "r", "a", "", "t", 0, "traj_end"),
    ]
    seg = decode_segments(event_frame(_events(rows)))
    assert list(seg.start_s) == [1.0, 4.0] and list(seg.end_s) == [2.0, 5.0]
    assert list(seg.tokens) == [20.0, 20.0]
    # The second segment starts with the 20 tokens already generated in its KV.
    assert list(seg.context_tokens) == [100.0, 120.0]
    y = demand_targets(_events(rows), [1, 5])
    assert _row(y, 1)[target_column("decode_tokens", 1)] == pytest.approx(20)
    assert _row(y, 2)[target_column("decode_sequences", 1)] == 0
    assert _row(y, 1)[target_column("prefill_tokens", 5)] == 0
    assert _row(y, 4)[target_column("decode_kv_tokens", 1)] == pytest.approx(120 + 10)


def test_zero_length_decode_counts_at_its_end_and_multiple_runs():
    rows = [
        (0.0, "r1", "a", "", "t", 0, "prefill_queued", -1, 10, 10),
        (1.5, "r1", "a", "", "t", 0, "decode_start", 0, 10),
        (1.5, "r1", "a", "", "t", 0, "decode_end", 0, 10, 0, 0, 7),
        (2.0, "r1", "a", "", "t", 0, "traj_end"),
        (0.0, "r2", "b", "", "t", 0, "prefill_queued", -1, 10, 10),
        (3.0, "r2", "b", "", "t", 0, "traj_end"),
    ]
    y = demand_targets(_events(rows), [1])
    assert sorted(y["run_id"].unique()) == ["r1", "r2"]
    r1 = y[y["run_id"] == "r1"]
    assert _row(r1, 1)[target_column("decode_tokens", 1)] == 7
    assert _row(r1, 1)[target_column("decode_sequences", 1)] == 0
    assert len(y[y["run_id"] == "r2"]) == 3


def test_open_decode_counts_as_a_sequence_without_tokens():
    # Trajectory a starts decoding at 2.5 and the telemetry ends at 4 (b's start).
    rows = [*make_two_turn_events()[:7], LifecycleEvent(4.0, "r", "b", "g", "swe", 0, "traj_start")]
    y = demand_targets(events_to_table(rows), [1])
    assert _row(y, 3)[target_column("decode_sequences", 1)] == pytest.approx(1.0)
    assert _row(y, 3)[target_column("decode_tokens", 1)] == 0


def test_bad_input_is_named():
    with pytest.raises(InputError, match="empty"):
        demand_targets(_events([]), [1])
    frame = events_to_table(make_two_turn_events()).to_pandas().drop(columns=["new_tokens"])
    with pytest.raises(InputError, match="new_tokens"):
        demand_targets(frame, [1])
    with pytest.raises(ConfigError, match="positive"):
        demand_targets(events_to_table(make_two_turn_events()), [0, 5])
    with pytest.raises(ConfigError, match="empty"):
        demand_targets(events_to_table(make_two_turn_events()), [])
    short = [LifecycleEvent(0.5, "r", "a", "", "t", 0, "traj_start")]
    with pytest.raises(InputError, match="shorter than one tick"):
        demand_targets(events_to_table(short), [1])
