"""Calibrated quantiles (split conformal) and the drift fallback of learned forecasters."""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
import pytest

from prorsa.forecast import build_dataset, lgbm, make_forecaster
from prorsa.forecast.aggregate import LOSSES, fit_target_models
from prorsa.forecast.conformal import conformal_offset, coverage, held_out_runs
from prorsa.forecast.fallback import FALLBACK
from prorsa.forecast.features import DRIFT_FEATURES
from prorsa.forecast.types import TARGETS
from tests.sim_helpers import random_specs, run


def test_conformal_offset_by_hand():
    actual = np.arange(1.0, 11.0)
    zeros = np.zeros(10)
    # n = 10: the 0.9 shift is the ceil(11 * 0.9) = 10th smallest score, the 0.1 shift
    # the floor(11 * 0.1) = 1st (rounded outward: at least the nominal coverage).
    assert conformal_offset(actual, zeros, 0.9) == 10.0
    assert conformal_offset(actual, zeros, 0.1) == 1.0
    assert conformal_offset(actual, zeros + np.nan, 0.9) == 0.0
    assert coverage(actual, actual - 0.5) == 0.0 and coverage(actual, actual) == 1.0


def test_held_out_runs_are_seeded_and_never_all(caplog):
    runs = [f"r{i}" for i in range(10)]
    assert held_out_runs(runs, 0.2, 3) == held_out_runs(runs, 0.2, 3)
    assert len(held_out_runs(runs, 0.2, 3)) == 2
    assert len(held_out_runs(["a", "b"], 0.9, 0)) == 1
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="prorsa.forecast.conformal"):
        assert held_out_runs(["a"], 0.2, 0) == set()
    assert "in-sample" in caplog.text  # uncalibrated quantiles are said to be


def test_split_conformal_quantiles_cover_new_data():
    # y = x + skewed noise; quantile trees alone are over-confident on new data, the
    # conformal shifts measured on held-out runs bring coverage to the nominal level.
    rng = np.random.default_rng(0)

    def sample(n: int):
        x = rng.uniform(0, 10, (n, 2))
        noise = rng.gamma(2.0, 1.0, n) * (1 + x[:, 1] / 5)
        return x, x[:, 0] + noise

    x, y = sample(6000)
    xs = np.column_stack([x, np.full(len(x), 5.0)])  # last column: the horizon
    ys = np.repeat(y[:, None], len(TARGETS), axis=1)
    runs = np.repeat([f"r{i}" for i in range(12)], 500)

    def train(xk, yk, objective, alpha, init):
        return lgbm.train(
            xk,
            yk,
            objective=objective,
            alpha=alpha,
            seed=0,
            n_estimators=60,
            learning_rate=0.1,
            num_leaves=31,
            min_child_samples=5,
        )

    boosters, shifts, points = fit_target_models(xs, ys, runs, xs[:, -1], (5.0,), train, seed=1)
    assert set(points) == set(TARGETS)
    assert set(boosters) == {f"{t}:{k}" for t in TARGETS for k, _, _ in LOSSES}
    x_new, y_new = sample(4000)
    x_new = np.column_stack([x_new, np.full(len(x_new), 5.0)])
    target = TARGETS[0]
    for level in (0.1, 0.5, 0.9):
        raw = lgbm.predict(boosters[f"{target}:q{level:g}"], x_new)
        shifted = raw + shifts[f"{level:g}"][target][0]
        assert coverage(y_new, shifted) == pytest.approx(level, abs=0.04), level


def _telemetry(slots: int, n: int, seed: int, run_id: str) -> pa.Table:
    table = run(random_specs(n, seed=seed, turns=(2, 5)), "static", slots=slots).telemetry
    ids = pa.array([run_id] * table.num_rows, pa.string())
    field = pa.field("run_id", pa.string(), nullable=False)
    return table.set_column(table.schema.get_field_index("run_id"), field, ids)


def test_out_of_range_load_falls_back_to_last_value(caplog):
    # Trained on 4 engines with few trajectories each; run on 2 engines with many more.
    train = build_dataset([_telemetry(4, 12, s, f"t{s}") for s in range(2)], horizons=[1, 5])
    model = make_forecaster("lightgbm-aggregate", horizons=[1, 5], n_estimators=5).fit(train)
    assert "live_per_gpu" in model.feature_ranges_
    heavy = _telemetry(2, 80, 9, "heavy")
    baseline = make_forecaster("last-value", horizons=[1, 5]).fit(None)
    model.reset()
    baseline.reset()
    fallbacks, seen = 0, set()
    with caplog.at_level(logging.WARNING, logger="prorsa.forecast.base"):
        for t in np.arange(1.0, 15.0):
            events = heavy.filter(pa.compute.less_equal(heavy.column("time"), t))
            if t > 1.0:  # the first window includes t = 0 (the start allocation)
                events = events.filter(pa.compute.greater(events.column("time"), t - 1.0))
            model.update(events, float(t))
            baseline.update(events, float(t))
            fc, ref = model.predict(), baseline.predict()
            if fc.fallback:
                fallbacks += 1
                assert fc.fallback == FALLBACK and set(fc.drift) <= set(DRIFT_FEATURES)
                seen.update(fc.drift)
                assert fc.quantiles == {} and fc.fallback_ticks == fallbacks
                for target in TARGETS:
                    np.testing.assert_allclose(fc.point[target], ref.point[target])
    assert fallbacks >= 5 and "live_per_gpu" in seen
    warnings = [r for r in caplog.records if "outside the training range" in r.message]
    assert len(warnings) == 1  # logged as they leave the range, counted on every forecast
    model.set_drift_check(False)
    assert not model.predict().fallback and model.predict().quantiles


def test_telemetry_without_the_gpu_count_falls_back_until_it_arrives(caplog):
    # Found by review: without an allocation event the per-GPU features are NaN, which
    # the drift check skipped and LightGBM reads as 0 (an empty cluster).
    train = build_dataset([_telemetry(4, 12, s, f"t{s}") for s in range(2)], horizons=[1, 5])
    model = make_forecaster("lightgbm-aggregate", horizons=[1, 5], n_estimators=5).fit(train)
    live = _telemetry(4, 12, 0, "late-allocation")
    kinds = live.column("kind").to_pylist()
    times = [2.5 if kind == "allocation" else t for kind, t in
             zip(kinds, live.column("time").to_pylist(), strict=True)]  # fmt: skip
    live = live.set_column(0, "time", pa.array(times, pa.float64())).sort_by("time")
    model.reset()
    fallbacks = []
    with caplog.at_level(logging.INFO, logger="prorsa.forecast.base"):
        for t in np.arange(1.0, 6.0):  # the run ends at 5.1 s
            events = live.filter(pa.compute.less_equal(live.column("time"), t))
            if t > 1.0:
                events = events.filter(pa.compute.greater(events.column("time"), t - 1.0))
            model.update(events, float(t))
            fc = model.predict()
            fallbacks.append(bool(fc.fallback))
            if fc.fallback:
                assert "live_per_gpu" in fc.drift
    assert fallbacks == [True, True, False, False, False]
    messages = [r.message for r in caplog.records]
    assert sum("missing or outside" in m for m in messages) == 1
    assert sum("back in the training range" in m for m in messages) == 1


def test_last_value_does_not_stretch_a_launch_burst_over_the_horizon():
    # Found by review: half a second after 2,400 prompts of 3,000 tokens were queued, the
    # last-value forecast (and every drift fallback) read the burst as a rate and said
    # 60x the whole burst would arrive in the next 30 s.
    from prorsa.forecast.fallback import last_value_point
    from prorsa.forecast.tracker import LifecycleTracker
    from prorsa.telemetry.schema import LifecycleEvent, events_to_table

    events = []
    for i in range(2400):
        events.append(LifecycleEvent(0.5, "r", f"t{i}", "g", "task", 0, "traj_start"))
        events.append(
            LifecycleEvent(0.5, "r", f"t{i}", "g", "task", 0, "prefill_queued", -1, 3000, 3000)
        )
    tracker = LifecycleTracker(["task"], lags_s=(1.0, 30.0))
    tracker.update(events_to_table(events))
    tracker.tick(1.0)
    burst = 2400 * 3000
    point = last_value_point(tracker, [1.0, 30.0])["prefill_tokens"]
    assert point.tolist() == [burst, burst]


def test_turns_no_model_reads_are_not_kept_tick_after_tick():
    # Found by review: every turn arrival stayed in tracker.pending for the run unless
    # the forecaster was lightgbm-trajectory (~100 MB an hour at 2,700 turns a second).
    from prorsa.forecast import make_forecaster
    from prorsa.telemetry.schema import events_to_table
    from tests.conftest import make_two_turn_events

    model = make_forecaster("last-value", horizons=[1, 5]).fit(None).reset()
    for i in range(50):
        model.update(events_to_table(make_two_turn_events(f"t{i}", t0=10.0 * i)), 10.0 * i + 9)
    assert model.tracker_.pending == []
