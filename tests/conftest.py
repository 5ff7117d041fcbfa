"""Shared fixtures: small hand-built event tables and the shared real-data folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from prorsa.telemetry import LifecycleEvent, events_to_table

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = (REPO / ".." / "shared" / "data").resolve()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The public traces and kernel tables beside the checkout (CI has them too)."""
    assert SHARED_DATA.is_dir(), f"shared data folder missing at {SHARED_DATA}"
    return SHARED_DATA


def make_two_turn_events(traj: str = "a", t0: float = 0.0, run: str = "r") -> list[LifecycleEvent]:
    """A disaggregated two-turn trajectory with one tool call, times hand-chosen."""

    def e(t: float, turn: int, kind: str, engine: int = -1, ctx=0, new=0, cached=0, out=0):
        return LifecycleEvent(
            t0 + t, run, traj, "g", "swe", turn, kind, engine, ctx, new, cached, out
        )

    return [
        e(0, 0, "traj_start"),
        e(0, 0, "prefill_queued", -1, 100, 100, 0),
        e(1, 0, "prefill_start", 0, 100, 100, 0),
        e(2, 0, "prefill_end", 0, 100, 100, 0),
        e(2, 0, "kv_transfer_start", 0, 100),
        e(2.5, 0, "kv_transfer_end", 1, 100),
        e(2.5, 0, "decode_start", 1, 100),
        e(4, 0, "decode_end", 1, out=20),
        e(4, 0, "tool_start"),
        e(6, 0, "tool_end"),
        e(6, 1, "prefill_queued", -1, 150, 30, 120),
        e(6, 1, "prefill_start", 0, 150, 30, 120),
        e(7, 1, "prefill_end", 0, 150, 30, 120),
        e(7, 1, "decode_start", 0, 150),
        e(8, 1, "decode_end", 0, out=10),
        e(8, 1, "traj_end"),
    ]


@pytest.fixture
def two_turn_table():
    return events_to_table(make_two_turn_events())
