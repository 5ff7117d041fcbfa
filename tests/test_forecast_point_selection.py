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
    selection = select_points(model, validation, every=1)
    assert model._check_drift  # restored after the backtest
    assert selection.runs == 2 and selection.ticks > 10
    assert set(selection.points) == set(TARGETS)
    for target in TARGETS:
        scores = selection.wape[target]
        assert set(scores) == set(POINT_CHOICES)  # all four offered by a calibrated model
        for j, choice in enumerate(selection.points[target]):
            assert scores[choice][j] == min(s[j] for s in scores.values())
    assert model.points_ == selection.points
    # The choice is what the model now hands out, and what the candidates' columns say.
    model.set_drift_check(False)
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
    chosen = select_points(aggregate, validation, every=2)
    assert set(chosen.wape["prefill_tokens"]) == {"mean", "median"}
    assert all(c in ("mean", "median") for t in TARGETS for c in chosen.points[t])
