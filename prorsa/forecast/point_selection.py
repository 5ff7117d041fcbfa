"""Choosing a learned forecaster's point forecast on runs its training never saw.

A calibrated forecaster can hand out several points per target and horizon
(:data:`~prorsa.forecast.aggregate.POINT_CHOICES`: the squared-error model, the median,
the offset the trees correct, lightgbm-trajectory's raw bottom-up sum). Fitting chooses
among them on the conformal runs, which are drawn from the training cells; but which one
transfers is a question about cells the training never saw: on those, the calibration
trained in-distribution moved the bottom-up sum away from demand (docs/results.md,
"Forecasting"). :func:`select_points` backtests the fitted model once on validation
telemetry, scores every candidate, and keeps per target and horizon the one of least
WAPE; the shipped recipe runs it on the scenario runs of
:data:`~prorsa.forecast.shipping.VALIDATION_CELLS`: other clusters, models and loads
than both the training cells and the held-out cells the benchmark scores on, and no
trace replay (a trace's trajectories are either trained on or held out).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa

from prorsa.errors import ConfigError
from prorsa.forecast.aggregate import POINT_CHOICES, choose_points, point_wape
from prorsa.forecast.base import Forecaster
from prorsa.forecast.types import TARGETS


@dataclass(frozen=True)
class PointSelection:
    """What :func:`select_points` chose and why.

    ``points``: ``{target: [choice per fitted horizon]}`` (the forecaster's ``points_``);
    ``wape``: ``{target: {choice: [WAPE per horizon]}}`` of every candidate on the
    validation runs (None where the horizon saw no demand); ``runs`` and ``ticks``: what
    was scored; ``fallback_ticks``: those of them the drift fallback forecast, which
    offer no candidates and are left out (whatever the choice, the fallback answers
    there).
    """

    points: dict[str, list[str]]
    wape: dict[str, dict[str, list[float | None]]]
    horizons_s: tuple[float, ...]
    runs: int
    ticks: int
    fallback_ticks: int

    def chosen_wape(self) -> dict[str, list[float | None]]:
        """``{target: [WAPE of the chosen point per horizon]}``."""
        return {t: [self.wape[t][c][j] for j, c in enumerate(self.points[t])] for t in self.points}

    def to_dict(self) -> dict:
        """JSON form (what a shipped manifest records)."""
        return {
            "points": self.points,
            "wape": self.wape,
            "horizons_s": list(self.horizons_s),
            "runs": self.runs,
            "ticks": self.ticks,
            "fallback_ticks": self.fallback_ticks,
        }


def select_points(
    forecaster: Forecaster,
    telemetry: pa.Table | pd.DataFrame,
    *,
    every: int = 3,
    progress: Callable[[int, int], None] | None = None,
) -> PointSelection:
    """Backtest ``forecaster`` on ``telemetry`` (every ``every``-th tick), set its point
    choice per target and horizon to the candidate of least WAPE there, and return the
    selection. The drift check stays as set, as it runs when shipped: ticks the fallback
    forecasts are left out. A horizon the validation cannot score keeps the choice the
    model had.

    Raises :class:`~prorsa.errors.ConfigError` for a forecaster with a single point (gru,
    an uncalibrated lightgbm-trajectory) or telemetry with no tick to score.
    """
    from prorsa.forecast.backtest import backtest

    if not forecaster.point_choices():
        raise ConfigError(
            f"forecaster '{forecaster.name}' has a single point forecast: nothing to choose",
            hint="select points only for lightgbm-aggregate or a calibrated lightgbm-trajectory",
        )
    results = backtest(forecaster, telemetry, every=every, candidates=True, progress=progress)
    offered = [c for c in POINT_CHOICES if f"forecast:{c}" in results.columns]
    if not offered or results.empty:
        raise ConfigError(
            f"forecaster '{forecaster.name}' offered no point candidates on the validation "
            "telemetry: no tick was scored, or the drift fallback forecast every one"
        )
    horizons = tuple(forecaster.horizons_)
    points: dict[str, list[str]] = {}
    wape: dict[str, dict[str, list[float]]] = {}
    for target in TARGETS:
        rows = results[(results["target"] == target) & np.isfinite(results["actual"])]
        values = {c: rows[f"forecast:{c}"].to_numpy(float) for c in offered}
        complete = np.logical_and.reduce([np.isfinite(v) for v in values.values()])
        y = rows["actual"].to_numpy(float)[complete]
        at = rows["horizon_s"].to_numpy(float)[complete]
        values = {c: v[complete] for c, v in values.items()}
        points[target] = choose_points(y, values, at, horizons, forecaster.points_[target])
        wape[target] = {c: [_rounded(point_wape(y, v, at, h)) for h in horizons]
                         for c, v in values.items()}  # fmt: skip
    forecaster.points_ = points
    ticks = results.drop_duplicates(["run_id", "cutoff"])
    return PointSelection(
        points=points,
        wape=wape,
        horizons_s=horizons,
        runs=int(ticks["run_id"].nunique()),
        ticks=len(ticks),
        fallback_ticks=int(ticks["fallback"].sum()),
    )


def _rounded(wape: float | None) -> float | None:
    """As recorded (None without demand: JSON has no NaN)."""
    return None if wape is None else round(wape, 4)
