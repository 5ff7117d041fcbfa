"""Rolling-origin backtests: tidy frame, metrics by hand, plots, and the oracle's zero error."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from prorsa.forecast import TARGETS, make_forecaster
from prorsa.forecast.backtest import backtest, pinball, plot_backtest, score
from tests.sim_helpers import random_specs, run


@pytest.fixture(scope="module")
def telemetry():
    return run(random_specs(20, seed=9, turns=(2, 5)), "static", slots=2).telemetry


def test_tidy_frame_and_oracle_upper_bound(telemetry):
    oracle = make_forecaster("oracle", horizons=[1, 5]).fit(None)
    frame = backtest(oracle, telemetry)
    assert list(frame.columns) == [
        "model",
        "run_id",
        "cutoff",
        "target",
        "horizon_s",
        "actual",
        "forecast",
        "q0.1",
        "q0.5",
        "q0.9",
        "fallback",
    ]
    cutoffs = frame["cutoff"].nunique()
    assert len(frame) == cutoffs * len(TARGETS) * 2
    assert set(frame["target"]) == set(TARGETS) and set(frame["horizon_s"]) == {1.0, 5.0}
    np.testing.assert_allclose(frame["forecast"], frame["actual"])
    scores = score(frame)
    assert len(scores) == len(TARGETS) * 2
    assert (scores["wape"].fillna(0) == 0).all()
    assert len(frame.attrs["predict_s"]) == cutoffs


def test_scores_by_hand():
    frame = pd.DataFrame(
        {
            "model": "m",
            "run_id": "r",
            "cutoff": [1.0, 2.0, 3.0],
            "target": "prefill_tokens",
            "horizon_s": 5.0,
            "actual": [10.0, 0.0, 30.0],
            "forecast": [12.0, 1.0, 20.0],
            "q0.1": [5.0, np.nan, 20.0],
            "q0.5": [10.0, 0.0, 25.0],
            "q0.9": [20.0, 5.0, 28.0],
            "fallback": [False, True, False],
        }
    )
    row = score(frame).iloc[0]
    assert row["wape"] == pytest.approx((2 + 1 + 10) / 40)
    assert row["mae"] == pytest.approx(13 / 3)
    # Pinball at 0.9: under-forecast costs 0.9 per token, over-forecast 0.1.
    assert row["pinball_0.9"] == pytest.approx((0.1 * 10 + 0.1 * 5 + 0.9 * 2) / 3)
    assert row["pinball_0.5"] == pytest.approx((0 + 0 + 0.5 * 5) / 3)
    assert row["coverage_0.9"] == pytest.approx(2 / 3)
    # A tick without the quantile (a drift fallback) is left out of its scores.
    assert row["coverage_0.1"] == pytest.approx(0.0)
    assert row["pinball_0.1"] == pytest.approx((0.1 * 5 + 0.1 * 10) / 2)
    assert row["fallback_share"] == pytest.approx(1 / 3)
    assert pinball(np.array([1.0]), np.array([1.0]), 0.9) == 0


def test_point_only_models_have_no_quantile_scores(telemetry, tmp_path):
    frame = backtest(make_forecaster("last-value", horizons=[1, 5]).fit(None), telemetry)
    scores = score(frame)
    assert scores["pinball_0.9"].isna().all() and scores["pinball_0.5"].notna().all()
    files = plot_backtest(frame, tmp_path, horizon_s=5.0)
    assert files and all(f.suffix == ".png" and f.stat().st_size > 1000 for f in files)
