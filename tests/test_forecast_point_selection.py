"""Choosing a learned forecaster's point forecast on validation runs."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from prorsa.errors import ConfigError, InputError
from prorsa.forecast import build_dataset, load_forecaster, make_forecaster
from prorsa.forecast.aggregate import POINT_CHOICES
from prorsa.forecast.backtest import backtest
from prorsa.forecast.point_selection import select_points
from prorsa.forecast.types import TARGETS
from tests.sim_helpers import random_specs, run


def _telemetry(slots: int, n: int, seed: int, run_id: str) -> pa.Table:
    table = run(random_specs(n, seed=seed, turns=(2, 5)), "static", slots=slots).telemetry
    ids = pa.array([run_id] * table.num_rows, pa.string())
    field = pa.field("run_id", pa.string(), nullable=False)
    return table.set_column(table.schema.get_field_index("run_id"), field, ids)


@pytest.fixture(scope="module")
def fitted():
    data = build_dataset([_telemetry(2, 60, s, f"r{s}") for s in range(3)], horizons=[1, 5])
    settings = {"horizons": [1, 5], "n_estimators": 5, "calibration_estimators": 5}
    model = make_forecaster("lightgbm-trajectory", decode_offset="blend", **settings)
    validation = pa.concat_tables([_telemetry(3, 90, s, f"v{s}") for s in (20, 21)])
    return model.fit(data), validation


def _pooled_wape(frame, column: str, target: str, h: float) -> float:
    g = frame[(frame["target"] == target) & np.isclose(frame["horizon_s"], h)]
    g = g[np.isfinite(g["actual"])]
    return float(np.abs(g["actual"] - np.maximum(g[column], 0.0)).sum() / g["actual"].abs().sum())


def test_the_chosen_point_is_the_candidate_of_least_validation_wape(fitted, tmp_path):
    model, validation = fitted
    model.set_drift_check(False)
    selection = select_points(model, validation, every=1)
    assert selection.runs == 2 and selection.ticks > 10 and selection.fallback_ticks == 0
    assert set(selection.points) == set(TARGETS)
    for target in TARGETS:
        scores = selection.wape[target]
        assert set(scores) == set(POINT_CHOICES)  # all four offered by a calibrated model
        for j, choice in enumerate(selection.points[target]):
            assert scores[choice][j] == min(s[j] for s in scores.values())
    assert model.points_ == selection.points
    # The choice is what the model now hands out, and what the candidates' columns say.
    frame = backtest(model, validation, candidates=True)
    for target in TARGETS:
        for j, h in enumerate(model.horizons_):
            choice = selection.points[target][j]
            at = (frame["target"] == target) & np.isclose(frame["horizon_s"], h)
            np.testing.assert_allclose(
                frame.loc[at, "forecast"], np.maximum(frame.loc[at, f"forecast:{choice}"], 0.0)
            )
            assert _pooled_wape(frame, "forecast", target, h) == pytest.approx(
                selection.wape[target][choice][j], abs=1e-4
            )
    # The "bottom-up" candidate is the point of the same model with no calibration.
    model.calibrate = False
    try:
        plain = backtest(model, validation)
    finally:
        model.calibrate = True
    np.testing.assert_allclose(
        plain["forecast"].to_numpy(), np.maximum(frame["forecast:bottom-up"].to_numpy(), 0.0)
    )
    # ... and it travels with the saved model.
    model.save(tmp_path / "m")
    assert load_forecaster(tmp_path / "m").points_ == selection.points
    model.set_drift_check(True)


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
    selection = select_points(model, both, every=1)
    ticks = frame.drop_duplicates(["run_id", "cutoff"])
    assert selection.fallback_ticks == int(ticks["fallback"].sum())
    assert 0 < selection.fallback_ticks < selection.ticks == len(ticks)
    model.points_ = before
    with pytest.raises(ConfigError, match="drift fallback"):
        select_points(model, heavy, every=1)  # it forecast every tick
    model.points_ = before


def test_ship_training_records_the_choice_in_manifest_metrics_and_card(tmp_path):
    from prorsa.forecast.shipping import _point_selection_card, train_model

    # Drift is on as shipped: validation runs like the training ones, so ticks are scored.
    validation = pa.concat_tables([_telemetry(2, 60, s, f"v{s}") for s in (20, 21)])
    data = build_dataset([_telemetry(2, 60, s, f"r{s}") for s in range(3)], horizons=[1, 5])
    data.save(tmp_path / "d.parquet")
    params = {"n_estimators": 5, "calibration_estimators": 5, "decode_offset": "blend"}
    summary = train_model(
        "lightgbm-trajectory", tmp_path / "d.parquet", tmp_path / "m", params=params,
        select_on=validation,
    )  # fmt: skip
    chosen = summary["point_selection"]
    manifest = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert manifest["point_selection"] == chosen
    assert manifest["state"]["point"] == chosen["points"]
    assert load_forecaster(tmp_path / "m").points_ == chosen["points"]
    j = chosen["horizons_s"].index(5.0)
    wape = chosen["wape"]["prefill_tokens"]
    assert summary["metrics"]["validation_wape_prefill_tokens_h5"] == min(
        w[j] for w in wape.values()
    )
    card = "\n".join(_point_selection_card({"lightgbm-trajectory": summary}))
    bold = f"**{wape[chosen['points']['prefill_tokens'][j]][j]:.3f}**"
    assert "At 5 s" in card and "| prefill_tokens |" in card and bold in card
    with pytest.raises(InputError, match="empty"):
        train_model(
            "lightgbm-trajectory", tmp_path / "d.parquet", tmp_path / "m2", params=params,
            select_on=validation.slice(0, 0),
        )  # fmt: skip
    gru = train_model("gru", tmp_path / "d.parquet", tmp_path / "g", params={"epochs": 1},
                      select_on=validation)  # fmt: skip
    assert gru["point_selection"] is None  # one point: nothing to choose


def test_a_choice_outside_the_candidates_is_refused_on_load(fitted, tmp_path):
    model, _ = fitted
    model.save(tmp_path / "m")
    manifest = tmp_path / "m" / "manifest.json"
    text = json.loads(manifest.read_text())
    text["state"]["point"]["decode_tokens"] = ["bottom-up", "p90"]
    manifest.write_text(json.dumps(text))
    with pytest.raises(InputError, match=r"state\.point\.decode_tokens"):
        load_forecaster(tmp_path / "m")


def test_single_point_forecasters_are_refused(fitted):
    _, validation = fitted
    data = build_dataset([_telemetry(2, 30, 1, "r1")], horizons=[1, 5])
    uncalibrated = make_forecaster(
        "lightgbm-trajectory", horizons=[1, 5], n_estimators=5, calibrate=False
    ).fit(data)
    for single in (uncalibrated, make_forecaster("last-value", horizons=[1, 5]).fit(None)):
        assert single.point_choices() == ()
        with pytest.raises(ConfigError, match="single point"):
            select_points(single, validation)
    aggregate = make_forecaster("lightgbm-aggregate", horizons=[1, 5], n_estimators=5).fit(data)
    assert aggregate.point_choices() == ("mean", "median")
    chosen = select_points(aggregate.set_drift_check(False), validation, every=2)
    assert set(chosen.wape["prefill_tokens"]) == {"mean", "median"}
    assert all(c in ("mean", "median") for t in TARGETS for c in chosen.points[t])


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
