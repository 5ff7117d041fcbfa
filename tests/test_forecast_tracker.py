"""The incremental lifecycle tracker: hand-checked state, no lookahead, offline == online."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from prorsa.errors import InputError
from prorsa.forecast.dataset import build_dataset
from prorsa.forecast.features import LifecycleFeatures, aggregate_feature_names
from prorsa.forecast.tracker import DECODING, EVENT_FEATURES, IN_TOOL, QUEUED, LifecycleTracker
from prorsa.telemetry.views import cluster_state_at
from tests.conftest import make_two_turn_events
from tests.sim_helpers import random_specs, run


@pytest.fixture(scope="module")
def sim_events() -> pa.Table:
    return run(random_specs(24, seed=3, turns=(2, 6)), "static", slots=2).telemetry


def _rows(events):
    return [e.as_row() for e in events]


def test_state_and_decode_estimate_by_hand():
    tr = LifecycleTracker(["swe"])
    events = make_two_turn_events()
    rows = _rows(events)
    tr.update([r for r in rows if r[0] <= 3.0])
    tr.tick(3.0)
    snap = tr.snapshot
    assert list(snap["state"]) == [DECODING]
    assert snap["decode_elapsed"][0] == pytest.approx(0.5)
    # No decode has completed yet: the default per-sequence rate (50 tok/s) is used.
    assert snap["decoded"][0] == pytest.approx(0.5 * 50)
    tr.update([r for r in rows if 3.0 < r[0] <= 5.0])
    tr.tick(5.0)
    assert list(tr.snapshot["state"]) == [IN_TOOL]
    assert tr.snapshot["tool_elapsed"][0] == pytest.approx(1.0)
    assert tr.decode_rate == pytest.approx(20 / 1.5)  # 20 tokens in 1.5 s of decode
    assert tr.ttft_s == pytest.approx(2.5)  # queued at 0, first decode step at 2.5
    tr.update([r for r in rows if 5.0 < r[0] <= 7.5])
    tr.tick(7.5)
    assert snap is not tr.snapshot
    assert list(tr.snapshot["state"]) == [DECODING]
    assert tr.snapshot["decoded"][0] == pytest.approx(0.5 * 20 / 1.5)
    tr.update([r for r in rows if r[0] > 7.5])
    tr.tick(8.0)
    assert tr.live_count() == 0 and tr.counts["ends"] == 1
    assert tr.cum_prefill == 130 and tr.out_completed == 30
    assert tr.cum_first_prefill == 100  # the first turn's prompt, not the later turn's 30


def test_states_agree_with_cluster_state_at(sim_events):
    tr = LifecycleTracker()
    df = sim_events.to_pandas()
    df["kind"] = df["kind"].astype(str)
    for t in (0.5, 2.0, 5.0, 9.0):
        tr.update(
            list(
                df[(df["time"] <= t) & (df["time"] > tr.last_event_time)].itertuples(
                    index=False, name=None
                )
            )
        )
        tr.tick(t)
        ref = cluster_state_at(sim_events, t)
        counts = np.bincount(tr.snapshot["state"], minlength=6)
        for code, state in enumerate(
            ("queued", "prefilling", "transferring", "decoding", "in_tool")
        ):
            assert counts[code] == ref[state].count, (t, state)


def test_frozen_turn_rows_carry_history_and_siblings():
    first = make_two_turn_events("a")
    second = make_two_turn_events("b", t0=10.0)
    tr = LifecycleTracker(["swe"], record_event_rows=True)
    tr.update(_rows(first + second))
    tr.tick(20.0)
    rows = {
        (tid, turn): dict(zip(EVENT_FEATURES, feats, strict=True))
        for tid, turn, _, feats in tr.event_rows
    }
    a1 = rows[("a", 1)]
    assert a1["turn"] == 1 and a1["context_tokens"] == 150 and a1["turn_new_tokens"] == 30
    assert a1["output_last"] == 20 and a1["tool_last_s"] == 2.0 and a1["turns_done"] == 1
    b0 = rows[("b", 0)]
    # b starts after a finished: its sibling's 2 turns and outputs are known.
    assert b0["group_members"] == 2 and b0["group_done_frac"] == 0.5
    assert b0["group_final_turns_mean"] == 2 and b0["group_output_mean"] == 15
    assert b0["turn_rel"] == pytest.approx(0.5)


def test_tick_going_backwards_is_an_error():
    tr = LifecycleTracker()
    tr.tick(5.0)
    with pytest.raises(InputError, match="before the previous tick"):
        tr.tick(4.0)


def _perturb_after(df: pd.DataFrame, t: float, seed: int) -> pd.DataFrame:
    """Change everything that happens after ``t``: tokens, times, drop and add events."""
    rng = np.random.default_rng(seed)
    late = df["time"] > t
    out = df.copy()
    out.loc[late, "new_tokens"] = rng.integers(0, 5000, late.sum()).astype(np.int32)
    out.loc[late, "output_tokens"] = rng.integers(1, 5000, late.sum()).astype(np.int32)
    out.loc[late, "time"] = out.loc[late, "time"] + rng.uniform(0, 3, late.sum())
    out = out.drop(index=out.index[late][::3])
    extra = df[late].head(20).copy()
    extra["trajectory_id"] = "intruder"
    extra["time"] = t + 0.25
    return pd.concat([out, extra], ignore_index=True)


def test_features_at_t_ignore_everything_after_t(sim_events):
    """No lookahead: perturbing events after t leaves every feature at ticks <= t unchanged."""
    df = sim_events.to_pandas()
    t = float(np.floor(df["time"].max() / 2))
    base = build_dataset(df, snapshot_every=1)
    tasks = list(base.tasks)
    for seed in range(2):
        # Dropped events leave trajectories without traj_end: a partial run on purpose.
        perturbed = _perturb_after(df, t, seed)
        other = build_dataset(perturbed, snapshot_every=1, tasks=tasks, allow_partial=True)
        names = base.feature_names
        a = base.ticks[base.ticks["time"] <= t][names].reset_index(drop=True)
        b = other.ticks[other.ticks["time"] <= t][names].reset_index(drop=True)
        pd.testing.assert_frame_equal(a, b)
        sa = base.snapshots[base.snapshots["time"] <= t].reset_index(drop=True)
        sb = other.snapshots[other.snapshots["time"] <= t].reset_index(drop=True)
        pd.testing.assert_frame_equal(sa, sb)
        feats = ["trajectory_id", "time", *EVENT_FEATURES]
        ua = base.turns[base.turns["time"] <= t][feats].reset_index(drop=True)
        ub = other.turns[other.turns["time"] <= t][feats].reset_index(drop=True)
        pd.testing.assert_frame_equal(ua, ub)
        # ... while the targets, which look ahead by definition, do change.
        ya = base.ticks[base.ticks["time"] <= t]["y_prefill_tokens_h30"].to_numpy()
        yb = other.ticks[other.ticks["time"] <= t]["y_prefill_tokens_h30"].to_numpy()
        assert not np.array_equal(ya, yb)


def test_online_chunking_gives_the_offline_features(sim_events):
    """Feeding events in uneven chunks (as a controller would) gives the replay's features."""
    pipe = LifecycleFeatures().fit(sim_events)
    offline = pipe.transform(sim_events)
    tr = pipe.make_tracker()
    df = sim_events.to_pandas()
    df["kind"] = df["kind"].astype(str)
    rows = list(df.itertuples(index=False, name=None))
    times = df["time"].to_numpy()
    rng = np.random.default_rng(0)
    start = 0
    from prorsa.forecast.features import aggregate_features

    for i, t in enumerate(offline["time"]):
        end = int(np.searchsorted(times, t, side="right"))
        # Split this tick's events into random pieces.
        cuts = sorted(rng.integers(start, end + 1, 2)) if end > start else []
        for a, b in zip([start, *cuts], [*cuts, end], strict=True):
            tr.update(rows[a:b])
        start = end
        tr.tick(float(t))
        np.testing.assert_array_equal(
            aggregate_features(tr), offline.loc[i, pipe.feature_names_].to_numpy(float)
        )
    assert pipe.feature_names_ == aggregate_feature_names(pipe.lags_, pipe.tasks_)


def test_slots_are_reused_and_arrays_grow():
    tr = LifecycleTracker()
    tr.add_slot_array("extra", 7.0)
    rows = []
    for i in range(600):  # more than the initial capacity, ending in waves
        tid = f"t{i}"
        rows.append((float(i), "r", tid, "", "x", 0, "traj_start", -1, 0, 0, 0, 0, ""))
        rows.append((float(i), "r", tid, "", "x", 0, "prefill_queued", -1, 10, 10, 0, 0, ""))
        if i >= 300:
            old = f"t{i - 300}"
            rows.append((float(i), "r", old, "", "x", 0, "traj_end", -1, 0, 0, 0, 0, ""))
    tr.update(rows)
    tr.tick(600.0)
    assert tr.live_count() == 300
    assert len(tr.slot_array("extra")) >= tr._n_slots
    assert set(tr.ids[tr.snapshot["slot"]]) == {f"t{i}" for i in range(300, 600)}
    assert (tr.snapshot["state"] == QUEUED).all()


def test_the_cohort_restarts_with_each_sync_step():
    """Two sync steps of two trajectories each: the second step reads as young and
    undone as the first did (time since the run began and ends over all starts do not)."""
    from tests.conftest import make_two_turn_events

    def step(t0: float, names: tuple[str, str], short_end_after: float) -> list:
        a = make_two_turn_events(names[0], t0=t0)
        b = [e for e in make_two_turn_events(names[1], t0=t0) if e.time <= t0 + 2.5]
        b.append(type(b[0])(t0 + short_end_after, "r", names[1], "g", "swe", 0, "traj_end",
                            -1, 0, 0, 0, 0))  # fmt: skip
        return sorted(a + b, key=lambda e: e.time)

    rows = _rows(step(0.0, ("a", "b"), 3.0) + step(20.0, ("c", "d"), 3.0))
    tr = LifecycleTracker(["swe"])
    seen, before = {}, -1.0
    for t in (1.0, 5.0, 9.0, 21.0, 25.0):
        tr.update([r for r in rows if before < r[0] <= t])
        tr.tick(t)
        before = t
        seen[t] = (tr.cohort_age_s, tr.cohort_done)
    assert seen[1.0] == (1.0, 0.0)
    assert seen[5.0] == (5.0, 0.5)  # b ended, a still live
    assert seen[9.0] == (0.0, 0.0)  # nothing live
    assert seen[21.0] == (1.0, 0.0) and seen[25.0] == (5.0, 0.5)  # as in the first step


def test_turn_start_rate_counts_only_time_with_a_queue():
    """Ten turns queued at once start one every 0.5 s: 2 turns/s, and a pause with
    nothing waiting before the next burst does not dilute the rate."""
    from prorsa.telemetry.schema import LifecycleEvent

    def burst(t0: float, tag: str) -> list:
        events = []
        for k in range(10):
            name = f"{tag}{k}"
            at = t0 + 0.5 * (k + 1)

            def e(t, kind, ctx=100, new=100, out=0, name=name):
                return LifecycleEvent(t, "r", name, "g", "swe", 0, kind, 0, ctx, new, 0, out)

            events += [e(t0, "traj_start"), e(t0, "prefill_queued"), e(at, "prefill_start"),
                       e(at, "prefill_end"), e(at, "decode_start"),
                       e(at + 0.2, "decode_end", out=5), e(at + 0.2, "traj_end")]  # fmt: skip
        return events

    rows = _rows(sorted(burst(0.0, "a") + burst(30.0, "b"), key=lambda e: e.time))
    tr = LifecycleTracker(["swe"])
    seen, before = {}, -1.0
    for t in np.arange(0.0, 34.01, 0.25):
        tr.update([r for r in rows if before < r[0] <= t])
        tr.tick(float(t))
        before = t
        seen[round(float(t), 2)] = tr.turn_start_rate
    assert np.isnan(seen[0.0])  # nothing has started yet
    assert seen[3.0] == pytest.approx(2.0)
    assert seen[4.0] == pytest.approx(2.0)
    # 25 s idle, then the second burst: its first second reads 2/s, not 2/26.
    assert seen[31.0] == pytest.approx(2.0)
    assert seen[34.0] == pytest.approx(2.0)


def test_turn_start_rate_leaves_out_the_interval_a_queue_formed_in():
    """A burst queued half-way between two ticks: the interval it arrived in had no
    queue when it began, so neither its time nor the turns started in it count; the
    next tick reads the true rate (4 turns/s), not that interval's starts over the
    following second's time (6/s)."""
    from prorsa.telemetry.schema import LifecycleEvent

    events = []
    for k in range(20):
        name, at = f"t{k}", 0.5 + 0.25 * (k + 1)

        def e(t, kind, ctx=100, new=100, out=0, name=name):
            return LifecycleEvent(t, "r", name, "g", "swe", 0, kind, 0, ctx, new, 0, out)

        events += [e(0.5, "traj_start"), e(0.5, "prefill_queued"), e(at, "prefill_start"),
                   e(at, "prefill_end"), e(at, "decode_start"),
                   e(at + 0.1, "decode_end", out=5), e(at + 0.1, "traj_end")]  # fmt: skip
    rows = _rows(sorted(events, key=lambda e: e.time))
    tr = LifecycleTracker(["swe"])
    seen, before = {}, -1.0
    for t in (0.0, 1.0, 2.0, 3.0):
        tr.update([r for r in rows if before < r[0] <= t])
        tr.tick(t)
        before = t
        seen[t] = tr.turn_start_rate
    assert np.isnan(seen[1.0])  # the queue formed inside the only interval so far
    assert seen[2.0] == pytest.approx(4.0)
    assert seen[3.0] == pytest.approx(4.0)
