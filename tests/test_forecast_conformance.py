"""One conformance check, run on every registered forecaster."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from prorsa.errors import ConfigError, NotFittedError
from prorsa.forecast import FORECASTERS, TARGETS, build_dataset, load_forecaster, make_forecaster
from prorsa.forecast.types import QUANTILES, Forecast
from prorsa.registry import Registry
from tests.sim_helpers import random_specs, run

HORIZONS = (1.0, 5.0, 10.0)
# Small settings keep the whole suite fast; the checks do not depend on model quality.
FAST = {
    "lightgbm-aggregate": {"n_estimators": 8},
    "lightgbm-trajectory": {"n_estimators": 8, "calibration_estimators": 8},
    "gru": {"epochs": 2, "window": 6, "hidden": 8},
    "per-target": {
        "member_params": {
            "lightgbm-aggregate": {"n_estimators": 8},
            "lightgbm-trajectory": {"n_estimators": 8, "calibration_estimators": 8},
        }
    },
}


def _telemetry(seed: int, run_id: str) -> pa.Table:
    specs = random_specs(30, seed=seed, turns=(2, 6))
    table = run(specs, "static", slots=3, seed=seed).telemetry
    # Distinct run ids per simulation (metadata prorsa.source=simulator is kept).
    ids = pa.array([run_id] * table.num_rows, pa.string())
    field = pa.field("run_id", pa.string(), nullable=False)
    return table.set_column(table.schema.get_field_index("run_id"), field, ids)


@pytest.fixture(scope="module")
def data():
    train = build_dataset([_telemetry(0, "a"), _telemetry(1, "b")], horizons=HORIZONS)
    return train, _telemetry(2, "c")


def _stream(forecaster, events: pa.Table, ticks: int = 12) -> list[Forecast]:
    """Feed the run tick by tick like the controller does; forecasts at each tick."""
    forecaster.reset()
    if forecaster.needs_future:
        forecaster.attach(events)
    df = events.to_pandas()
    df["kind"] = df["kind"].astype(str)
    rows = list(df.itertuples(index=False, name=None))
    times = df["time"].to_numpy()
    out, start = [], 0
    for t in np.arange(1.0, ticks + 1.0):
        end = int(np.searchsorted(times, t, side="right"))
        forecaster.update(rows[start:end], float(t))
        start = end
        out.append(forecaster.predict())
    return out


def _as_array(forecasts: list[Forecast]) -> np.ndarray:
    parts = []
    for fc in forecasts:
        parts.append(np.stack([fc.point[t] for t in TARGETS]))
        for q in sorted(fc.quantiles):
            parts.append(np.stack([fc.quantiles[q][t] for t in TARGETS]))
    return np.concatenate([p.ravel() for p in parts])


@pytest.mark.parametrize("name", FORECASTERS.names())
def test_forecaster_conformance(name, data, tmp_path):
    train, events = data
    make = lambda: make_forecaster(name, horizons=HORIZONS, seed=7, **FAST.get(name, {}))  # noqa: E731

    fresh = make()
    with pytest.raises(NotFittedError, match="not fitted"):
        fresh.predict()
    with pytest.raises(NotFittedError):
        fresh.update([], 1.0)

    # Quantiles and save/load are checked on the model itself; the drift fallback (the
    # tiny training set makes any new run look out of range) has its own test.
    model = make().set_drift_check(False)
    assert model.fit(train) is model
    assert all(
        k.endswith("_")
        for k in vars(model)
        if not k.startswith("_") and k not in model.get_params()
    )
    forecasts = _stream(model, events)
    for fc in forecasts:
        assert fc.horizons_s == HORIZONS
        assert set(fc.point) == set(TARGETS)
        for target in TARGETS:
            values = fc.point[target]
            assert values.shape == (len(HORIZONS),)
            assert np.isfinite(values).all() and (values >= 0).all()
        if fc.quantiles:
            assert set(fc.quantiles) == set(QUANTILES)
            for target in TARGETS:
                lo, mid, hi = (fc.quantiles[q][target] for q in QUANTILES)
                assert lo.shape == mid.shape == hi.shape == (len(HORIZONS),)
                assert (lo >= 0).all() and (lo <= mid).all() and (mid <= hi).all()
        elif model.provides_quantiles and name != "lightgbm-trajectory":
            pytest.fail(f"{name} promises quantiles but gave none")
    # Any subset of the fitted horizons, each predicted on its own (the controller asks
    # only for the horizons its policy reads); nothing else.
    last = forecasts[-1]
    for subset in ([5.0], [HORIZONS[0], HORIZONS[-1]]):
        sub = model.predict(subset)
        assert sub.horizons_s == tuple(subset)
        at = [HORIZONS.index(h) for h in subset]
        assert sub.quantiles.keys() == last.quantiles.keys()
        for target in TARGETS:
            np.testing.assert_allclose(sub.point[target], last.point[target][at], rtol=1e-12)
            for q in sub.quantiles:
                np.testing.assert_allclose(
                    sub.quantiles[q][target], last.quantiles[q][target][at], rtol=1e-12
                )
    with pytest.raises(ConfigError, match="not fitted"):
        model.predict([3.0])

    # Save / load round trip: identical predictions on the same stream.
    folder = model.save(tmp_path / name)
    assert (folder / "manifest.json").exists()
    loaded = load_forecaster(folder).set_drift_check(False)
    assert type(loaded) is type(model) and loaded.get_params() == model.get_params()
    np.testing.assert_array_equal(_as_array(_stream(loaded, events)), _as_array(forecasts))

    # Same seed, same model, same forecasts.
    again = make().set_drift_check(False).fit(train)
    np.testing.assert_array_equal(_as_array(_stream(again, events)), _as_array(forecasts))


def test_registry_refuses_duplicates():
    reg: Registry = Registry("forecaster")
    reg.register("x", object)
    with pytest.raises(ConfigError, match="already registered"):
        reg.register("x", object)
    with pytest.raises(ConfigError, match="already registered"):
        FORECASTERS.register("ewma", object)


def test_expected_forecasters_are_registered():
    assert {
        "last-value",
        "ewma",
        "kalman",
        "lightgbm-aggregate",
        "lightgbm-trajectory",
        "gru",
        "oracle",
    } <= set(FORECASTERS.names())


def test_learned_points_are_chosen_on_held_out_runs(data):
    # The point per target and horizon is the candidate of least WAPE on the conformal
    # runs, and it travels with the saved model.
    train, _ = data
    for name in ("lightgbm-aggregate", "lightgbm-trajectory"):
        model = make_forecaster(name, horizons=HORIZONS, seed=7, **FAST.get(name, {}))
        model.fit(train)
        assert set(model.points_) == set(TARGETS)
        assert all(len(v) == len(HORIZONS) for v in model.points_.values())
        allowed = {"mean", "median"} | ({"offset"} if name == "lightgbm-trajectory" else set())
        assert {c for v in model.points_.values() for c in v} <= allowed


def test_a_median_point_is_the_p50_the_forecast_reports(data):
    # Found by review: the point chosen as "median" was the P50 before the quantiles were
    # put in order, so where the P10 crossed above it the point sat below the reported P50.
    train, events = data
    for name in ("lightgbm-aggregate", "lightgbm-trajectory"):
        model = make_forecaster(name, horizons=HORIZONS, seed=7, **FAST.get(name, {}))
        model.set_drift_check(False).fit(train)
        model.points_ = {t: ["median"] * len(HORIZONS) for t in TARGETS}
        for t in TARGETS:  # lift the P10 far above the P50: they cross everywhere
            model.conformal_.setdefault("0.1", {})[t] = [25.0] * len(HORIZONS)
        fc = _stream(model, events, ticks=6)[-1]
        assert any((fc.quantiles[0.1][t] > 0).any() for t in TARGETS)
        for t in TARGETS:
            np.testing.assert_allclose(fc.point[t], fc.quantiles[0.5][t], err_msg=f"{name} {t}")


def test_the_median_candidate_at_training_is_the_ordered_p50(monkeypatch):
    # The point choice on the held-out runs scores the P50 as the forecast will report
    # it: here the P10 model sits above the P50 model everywhere, so the median is the P10.
    from prorsa.forecast import aggregate

    rng = np.random.default_rng(0)
    rows = 400
    xs = rng.random((rows, 2))
    ys = rng.random((rows, len(TARGETS))) * 10
    lift = {None: 1.0, 0.1: 7.0, 0.5: 3.0, 0.9: 9.0}  # booster = the level's constant
    seen = {}
    monkeypatch.setattr(aggregate.lgbm, "predict", lambda booster, x: np.full(len(x), booster))
    monkeypatch.setattr(aggregate, "conformal_offset", lambda y, pred, alpha: 0.0)

    def spy(y, candidates, horizon_of_row, horizons):
        seen.update(candidates)
        return ["mean"] * len(horizons)

    monkeypatch.setattr(aggregate, "choose_points", spy)
    aggregate.fit_target_models(
        xs, ys, np.array([f"run-{i % 10}" for i in range(rows)]), np.full(rows, 5.0), (5.0,),
        lambda x, y, objective, alpha, init: lift[alpha], seed=0,
    )  # fmt: skip
    assert seen["median"].size and np.all(seen["median"] == 7.0)
    assert np.all(seen["mean"] == 1.0)


def test_ordered_median_is_lifted_to_the_quantiles_below_it():
    from prorsa.forecast.aggregate import ordered_median

    by_level = {0.1: np.array([5.0, 1.0]), 0.5: np.array([3.0, 2.0]), 0.9: np.array([0.0, 9.0])}
    np.testing.assert_array_equal(ordered_median(by_level), [5.0, 2.0])


def test_an_uncalibrated_trajectory_model_forecasts_its_bottom_up_sum(data, tmp_path):
    # Found in use: with calibrate=False there are no quantiles to take the point from.
    train, events = data
    model = make_forecaster(
        "lightgbm-trajectory", horizons=HORIZONS, seed=7, calibrate=False,
        **FAST.get("lightgbm-trajectory", {}),
    ).set_drift_check(False).fit(train)  # fmt: skip
    forecasts = _stream(model, events, ticks=6)  # mid-run: demand still to come
    fc = forecasts[-1]
    assert not fc.quantiles and fc.point["decode_tokens"].sum() > 0
    sums = model.bottom_up_now(HORIZONS)
    for i, target in enumerate(TARGETS):
        np.testing.assert_allclose(fc.point[target], np.maximum(sums[i], 0.0))
    loaded = load_forecaster(model.save(tmp_path / "uncalibrated")).set_drift_check(False)
    np.testing.assert_array_equal(_as_array(_stream(loaded, events, ticks=6)), _as_array(forecasts))


def test_choose_points_takes_the_least_wape_per_horizon():
    from prorsa.forecast.aggregate import choose_points

    y = np.array([10.0, 10.0, 1.0, 1.0])
    at = np.array([5.0, 5.0, 30.0, 30.0])
    candidates = {
        "mean": np.array([10.0, 10.0, 9.0, 9.0]),  # right at 5 s, far off at 30 s
        "median": np.array([4.0, 4.0, 1.0, 1.0]),  # the other way round
    }
    assert choose_points(y, candidates, at, (5.0, 30.0)) == ["mean", "median"]
    assert choose_points(y, {}, at, (5.0, 30.0)) == ["mean", "mean"]


def test_queue_wait_refuses_a_dataset_with_rates_counted_the_old_way(data):
    import copy

    from prorsa.errors import InputError

    train, _ = data
    old = copy.copy(train)
    old.meta = {k: v for k, v in train.meta.items() if k != "turn_start_rate_version"}
    settings = {"horizons": HORIZONS, "seed": 7, **FAST["lightgbm-trajectory"]}
    with pytest.raises(InputError, match="counted by version 1"):
        make_forecaster("lightgbm-trajectory", queue_wait=True, **settings).fit(old)
    make_forecaster("lightgbm-trajectory", **settings).fit(old)  # off: the column unused


def test_queue_wait_is_an_option_of_the_bottom_up_sum(data, monkeypatch):
    # Off (the shipped model's setting) a queued turn waits the recent queue-to-decode
    # time less its own wait (no queue rate reaches decode_waits); on, the tracker's rate.
    import prorsa.forecast.trajectory as trajectory

    train, events = data
    seen = []
    real = trajectory.decode_waits

    def spy(state, is_open, since, ttft, rate, tick=None):
        seen.append(np.asarray(rate, float))
        return real(state, is_open, since, ttft, rate, tick)

    monkeypatch.setattr(trajectory, "decode_waits", spy)
    for on in (False, True):
        model = make_forecaster(
            "lightgbm-trajectory", horizons=HORIZONS, seed=7, calibrate=False,
            queue_wait=on, **FAST.get("lightgbm-trajectory", {}),
        ).set_drift_check(False).fit(train)  # fmt: skip
        assert model.get_params()["queue_wait"] is on
        seen.clear()
        _stream(model, events, ticks=6)
        rates = np.concatenate([np.atleast_1d(r) for r in seen])
        assert np.isnan(rates).all() if not on else np.isfinite(rates).any()
