"""Fitting a learned forecaster's quantiles and point forecast on validation runs."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pytest

from prorsa.errors import ConfigError, InputError
from prorsa.forecast import build_dataset, load_forecaster, make_forecaster
from prorsa.forecast.aggregate import POINT_CHOICES
from prorsa.forecast.backtest import backtest
from prorsa.forecast.types import TARGETS
from prorsa.forecast.validation_fit import fit_on_validation
from tests.sim_helpers import random_specs, run


def _telemetry(slots: int, n: int, seed: int, run_id: str) -> pa.Table:
    table = run(random_specs(n, seed=seed, turns=(2, 5)), "static", slots=slots).telemetry
    ids = pa.array([run_id] * table.num_rows, pa.string())
    field = pa.field("run_id", pa.string(), nullable=False)
    return table.set_column(table.schema.get_field_index("run_id"), field, ids)


@pytest.fixture(scope="module")
def _fitted_once(tmp_path_factory):
    data = build_dataset([_telemetry(2, 60, s, f"r{s}") for s in range(3)], horizons=[1, 5])
    settings = {"horizons": [1, 5], "n_estimators": 5, "calibration_estimators": 5}
    model = make_forecaster("lightgbm-trajectory", decode_offset="blend", **settings)
    folder = tmp_path_factory.mktemp("fitted") / "m"
    model.fit(data).save(folder)
    validation = pa.concat_tables([_telemetry(3, 90, s, f"v{s}") for s in (20, 21)])
    return folder, validation


@pytest.fixture
def fitted(_fitted_once):
    """A fresh copy of the fitted model per test (fitting on validation changes it)."""
    folder, validation = _fitted_once
    return load_forecaster(folder), validation


def _pooled_wape(frame, column: str, target: str, h: float) -> float:
    g = frame[(frame["target"] == target) & np.isclose(frame["horizon_s"], h)]
    g = g[np.isfinite(g["actual"])]
    return float(np.abs(g["actual"] - np.maximum(g[column], 0.0)).sum() / g["actual"].abs().sum())


def test_the_chosen_point_is_the_candidate_of_least_validation_wape(fitted, tmp_path):
    model, validation = fitted
    model.set_drift_check(False)
    fit = fit_on_validation(model, validation, every=1)
    selection = fit.point
    assert fit.runs == 2 and fit.ticks > 10 and fit.fallback_ticks == 0
    assert set(selection.chosen) == set(TARGETS)
    for target in TARGETS:
        scores = selection.wape[target]
        assert set(scores) == set(POINT_CHOICES)  # all four offered by a calibrated model
        for j, choice in enumerate(selection.chosen[target]):
            assert scores[choice][j] == min(s[j] for s in scores.values())
    assert model.points_ == selection.chosen
    # The choice is what the model now hands out, and what the candidates' columns say.
    frame = backtest(model, validation, candidates=True)
    for target in TARGETS:
        for j, h in enumerate(model.horizons_):
            choice = selection.chosen[target][j]
            at = (frame["target"] == target) & np.isclose(frame["horizon_s"], h)
            np.testing.assert_allclose(
                frame.loc[at, "forecast"], np.maximum(frame.loc[at, f"forecast:{choice}"], 0.0)
            )
            assert _pooled_wape(frame, "forecast", target, h) == pytest.approx(
                selection.wape[target][choice][j], abs=1e-4
            )
    # The "bottom-up" candidate is the point of the same model with no calibration.
    model.calibrate = False
    plain = backtest(model, validation)
    model.calibrate = True
    np.testing.assert_allclose(
        plain["forecast"].to_numpy(), np.maximum(frame["forecast:bottom-up"].to_numpy(), 0.0)
    )
    # ... and it travels with the saved model.
    model.save(tmp_path / "m")
    assert load_forecaster(tmp_path / "m").points_ == selection.chosen


def test_ticks_the_drift_fallback_forecasts_offer_no_candidates_and_are_left_out(fitted):
    model, validation = fitted
    heavy = _telemetry(2, 300, 30, "heavy")  # far more live per GPU than trained on
    both = pa.concat_tables([validation, heavy])
    frame = backtest(model, both, candidates=True)
    fell_back = frame["fallback"].to_numpy(bool)
    assert fell_back.any() and (~fell_back).any()
    assert frame.loc[fell_back, "forecast:mean"].isna().all()
    assert frame.loc[~fell_back, "forecast:mean"].notna().all()
    before = {t: list(c) for t, c in model.points_.items()}
    shifts = json.loads(json.dumps(model.conformal_))
    fit = fit_on_validation(model, both, every=1)
    ticks = frame.drop_duplicates(["run_id", "cutoff"])
    assert fit.fallback_ticks == int(ticks["fallback"].sum())
    assert 0 < fit.fallback_ticks < fit.ticks == len(ticks)
    model.points_, model.conformal_ = before, shifts
    with pytest.raises(ConfigError, match="drift fallback"):
        fit_on_validation(model, heavy, every=1)  # it forecast every tick


def test_ship_training_records_the_choice_in_manifest_metrics_and_card(tmp_path):
    from prorsa.forecast.shipping import _validation_fit_card, train_model

    # Drift is on as shipped: validation runs like the training ones, so ticks are scored.
    validation = pa.concat_tables([_telemetry(2, 60, s, f"v{s}") for s in (20, 21)])
    data = build_dataset([_telemetry(2, 60, s, f"r{s}") for s in range(3)], horizons=[1, 5])
    data.save(tmp_path / "d.parquet")
    params = {"n_estimators": 5, "calibration_estimators": 5, "decode_offset": "blend"}
    summary = train_model(
        "lightgbm-trajectory", tmp_path / "d.parquet", tmp_path / "m", params=params,
        select_on=validation,
    )  # fmt: skip
    fit = summary["validation_fit"]
    chosen = fit["point"]
    manifest = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert manifest["validation_fit"] == fit
    assert manifest["state"]["point"] == chosen["chosen"]
    assert load_forecaster(tmp_path / "m").points_ == chosen["chosen"]
    j = fit["horizons_s"].index(5.0)
    wape = chosen["wape"]["prefill_tokens"]
    assert summary["metrics"]["validation_wape_prefill_tokens_h5"] == min(
        w[j] for w in wape.values()
    )
    gru = train_model("gru", tmp_path / "d.parquet", tmp_path / "g", params={"epochs": 1},
                      select_on=validation)  # fmt: skip
    assert gru["validation_fit"]["point"] is None  # one point: nothing to choose
    assert gru["validation_fit"]["quantiles"]  # but its quantiles are recalibrated
    card = "\n".join(_validation_fit_card({"lightgbm-trajectory": summary, "gru": gru}))
    bold = f"**{wape[chosen['chosen']['prefill_tokens'][j]][j]:.3f}**"
    assert "Point at 5 s" in card and "| prefill_tokens |" in card and bold in card
    before = fit["quantiles"]["0.9"]["coverage_before"]["decode_tokens"][j]
    after = fit["quantiles"]["0.9"]["coverage_after"]["decode_tokens"][j]
    assert "| `gru` | decode_tokens |" in card
    assert f"{before:.2f} -> {after:.2f}" in card
    with pytest.raises(InputError, match="empty"):
        train_model(
            "lightgbm-trajectory", tmp_path / "d.parquet", tmp_path / "m2", params=params,
            select_on=validation.slice(0, 0),
        )  # fmt: skip


def test_a_choice_outside_the_candidates_is_refused_on_load(fitted, tmp_path):
    model, _ = fitted
    model.save(tmp_path / "m")
    manifest = tmp_path / "m" / "manifest.json"
    text = json.loads(manifest.read_text())
    text["state"]["point"]["decode_tokens"] = ["bottom-up", "p90"]
    manifest.write_text(json.dumps(text))
    with pytest.raises(InputError, match=r"state\.point\.decode_tokens"):
        load_forecaster(tmp_path / "m")


def test_forecasters_with_nothing_to_fit_are_refused(fitted):
    _, validation = fitted
    data = build_dataset([_telemetry(2, 30, 1, "r1")], horizons=[1, 5])
    uncalibrated = make_forecaster(
        "lightgbm-trajectory", horizons=[1, 5], n_estimators=5, calibrate=False
    ).fit(data)
    for single in (uncalibrated, make_forecaster("last-value", horizons=[1, 5]).fit(None)):
        assert single.point_choices() == ()
        with pytest.raises(ConfigError, match="nothing to fit"):
            fit_on_validation(single, validation)
    aggregate = make_forecaster("lightgbm-aggregate", horizons=[1, 5], n_estimators=5).fit(data)
    assert aggregate.point_choices() == ("mean", "median")
    chosen = fit_on_validation(aggregate.set_drift_check(False), validation, every=2).point
    assert set(chosen.wape["prefill_tokens"]) == {"mean", "median"}
    assert all(c in ("mean", "median") for t in TARGETS for c in chosen.chosen[t])


def test_a_saved_choice_the_model_does_not_offer_is_refused_on_load(tmp_path):
    data = build_dataset([_telemetry(2, 30, 1, "r1")], horizons=[1, 5])
    aggregate = make_forecaster("lightgbm-aggregate", horizons=[1, 5], n_estimators=5).fit(data)
    aggregate.save(tmp_path / "a")
    manifest = tmp_path / "a" / "manifest.json"
    text = json.loads(manifest.read_text())
    text["state"]["point"]["prefill_tokens"] = ["median", "bottom-up"]  # trajectory's only
    manifest.write_text(json.dumps(text))
    with pytest.raises(InputError, match=r"state\.point\.prefill_tokens"):
        load_forecaster(tmp_path / "a")


def _coverage(frame, level: float, target: str, h: float) -> tuple[float, int]:
    g = frame[(frame["target"] == target) & np.isclose(frame["horizon_s"], h)]
    g = g[np.isfinite(g["actual"]) & ~g["fallback"].astype(bool)]
    return float(np.mean(g["actual"] <= g[f"q{level:g}"])), len(g)


def test_quantiles_recalibrated_on_validation_cover_their_levels_there(fitted, tmp_path):
    model, validation = fitted
    model.set_drift_check(False)
    old = json.loads(json.dumps(model.conformal_))
    fit = fit_on_validation(model, validation, every=1)
    fresh = backtest(model, validation)  # the model as it now forecasts
    moves = []
    for level in (0.1, 0.5, 0.9):
        entry = fit.quantiles[f"{level:g}"]
        for target in TARGETS:
            for j, h in enumerate(model.horizons_):
                moved = entry["moved_by"][target][j]
                moves.append(abs(moved))
                assert model.conformal_[f"{level:g}"][target][j] == pytest.approx(
                    old[f"{level:g}"][target][j] + moved, abs=1e-6
                )  # moved_by is recorded to 6 decimals
                now, n = _coverage(fresh, level, target, h)
                # The shift puts the quantile on an outcome; rounding may tip that one tick.
                assert entry["coverage_after"][target][j] == pytest.approx(now, abs=1.01 / n)
                # At least the conformal order statistic's share (rounded outward: down
                # below the median), less the tipped tick; the floor at 0 can only lift it.
                assert now >= math.floor((n + 1) * level) / n - 1.01 / n
                assert level < 0.5 or now <= level + 0.1
    assert max(moves) > 1e-3  # the training runs' shifts did not already fit these runs
    # The shifts travel with the saved model.
    model.save(tmp_path / "m")
    assert load_forecaster(tmp_path / "m").conformal_ == model.conformal_


def test_gru_quantile_shifts_move_its_quantiles_and_are_saved(tmp_path):
    data = build_dataset([_telemetry(2, 30, 1, "r1")], horizons=[1, 5])
    model = make_forecaster("gru", horizons=[1, 5], epochs=1).fit(data)
    validation = _telemetry(2, 40, 9, "v9")
    plain = backtest(model.set_drift_check(False), validation, candidates=True)
    fit = fit_on_validation(model, validation, every=1)
    assert fit.point is None and set(fit.quantiles) == {"0.1", "0.5", "0.9"}
    moved = backtest(model, validation)
    # Each quantile moves by its shift in tokens: shift x live trajectories (x h for sums).
    for level in ("0.1", "0.9"):
        for target in TARGETS:
            for j, h in enumerate(model.horizons_):
                at = (plain["target"] == target) & np.isclose(plain["horizon_s"], h)
                per = h if target in ("prefill_tokens", "decode_tokens") else 1.0
                expected = (
                    plain.loc[at, f"raw:q{level}"]
                    + model.conformal_[level][target][j] * plain.loc[at, "live_scale"] * per
                )
                lifted = np.maximum(expected.to_numpy(), 0.0)
                if level == "0.1":
                    np.testing.assert_allclose(moved.loc[at, "q0.1"], lifted, rtol=1e-9, atol=1e-6)
                else:  # P90 is lifted to the P50 where they cross
                    assert (moved.loc[at, "q0.9"].to_numpy() >= lifted - 1e-6).all()
    model.save(tmp_path / "g")
    again = load_forecaster(tmp_path / "g")
    assert again.conformal_ == model.conformal_
    np.testing.assert_allclose(
        backtest(again.set_drift_check(False), validation)["q0.9"], moved["q0.9"]
    )


def test_train_model_skips_validation_for_a_model_with_nothing_to_fit(tmp_path):
    from prorsa.forecast.shipping import train_model

    data = build_dataset([_telemetry(2, 30, 1, "r1")], horizons=[1, 5])
    data.save(tmp_path / "d.parquet")
    summary = train_model(
        "lightgbm-trajectory", tmp_path / "d.parquet", tmp_path / "m",
        params={"n_estimators": 5, "calibrate": False}, select_on=_telemetry(2, 30, 2, "v2"),
    )  # fmt: skip
    assert summary["validation_fit"] is None  # raw bottom-up sum: no points, no quantiles


def test_shifts_are_checked_on_load_and_against_the_fitted_horizons(fitted, tmp_path):
    from prorsa.forecast.conformal import recalibrate_on_backtest

    model, validation = fitted
    frame = backtest(model.set_drift_check(False), validation, candidates=True)
    with pytest.raises(ConfigError, match="fitted horizons"):
        recalibrate_on_backtest(model.conformal_, frame, [5.0])  # positions would shift
    model.save(tmp_path / "m")
    manifest = tmp_path / "m" / "manifest.json"
    text = json.loads(manifest.read_text())
    text["state"]["conformal"]["0.95"] = text["state"]["conformal"]["0.9"]  # not a level
    manifest.write_text(json.dumps(text))
    with pytest.raises(InputError, match=r"state\.conformal"):
        load_forecaster(tmp_path / "m")
