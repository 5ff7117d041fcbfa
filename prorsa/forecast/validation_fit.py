"""Fitting a learned forecaster's last choices on runs its training never saw.

Two things are best decided on cells unlike the training cells, because the shipped
model is used on such cells:

* *the point forecast.* A calibrated forecaster can hand out several points per target
  and horizon (:data:`~prorsa.forecast.aggregate.POINT_CHOICES`: the squared-error model,
  the median, the offset the trees correct, lightgbm-trajectory's raw bottom-up sum).
  Fitting chooses among them on the conformal runs, drawn from the training cells; on
  cells the training never saw, the calibration trained in-distribution moved the
  bottom-up sum away from demand (docs/results.md, "Forecasting").
* *the quantiles.* Their conformal shifts, measured on runs held out of the same
  training cells, left the P10/P50/P90 covering 2%/89%/99% of held-out outcomes
  (docs/results.md): what holds in-distribution does not hold after the shift.

:func:`fit_on_validation` backtests the fitted model once on validation telemetry and
moves each quantile's shift until that level alone covers its share there
(:func:`~prorsa.forecast.conformal.recalibrate_on_backtest`; putting the levels in order
afterwards can only raise a level's coverage). It then scores every point candidate, the
recalibrated median included, and keeps per target and horizon the one of least WAPE.
The shipped recipe runs it on the scenario runs of
:data:`~prorsa.forecast.shipping.VALIDATION_CELLS`: other clusters, models and loads
than both the training cells and the held-out cells the benchmark scores on, and no
trace replay (a trace's trajectories are either trained on or held out).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd
import pyarrow as pa

from prorsa.errors import ConfigError
from prorsa.forecast.aggregate import POINT_CHOICES, choose_points, point_wape
from prorsa.forecast.base import Forecaster
from prorsa.forecast.conformal import recalibrate_on_backtest
from prorsa.forecast.types import TARGETS


@dataclass(frozen=True)
class PointSelection:
    """The point chosen per target and horizon, and why.

    ``chosen``: ``{target: [choice per fitted horizon]}`` (the forecaster's ``points_``);
    ``wape``: ``{target: {choice: [WAPE per horizon]}}`` of every candidate on the
    validation runs (None where the horizon saw no demand).
    """

    chosen: dict[str, list[str]]
    wape: dict[str, dict[str, list[float | None]]]

    def chosen_wape(self) -> dict[str, list[float | None]]:
        """``{target: [WAPE of the chosen point per horizon]}``."""
        return {t: [self.wape[t][c][j] for j, c in enumerate(self.chosen[t])] for t in self.chosen}


@dataclass(frozen=True)
class ValidationFit:
    """What :func:`fit_on_validation` changed and on what.

    ``point``: the point selection (None for a model with one point); ``quantiles``:
    per level, how far each target's shift moved per horizon (in the model's units) and
    the validation coverage before and after
    (:func:`~prorsa.forecast.conformal.recalibrate_on_backtest`; None for a model
    without quantiles). ``runs`` and ``ticks``: what was scored; ``fallback_ticks``:
    those of them the drift fallback forecast, left out of both (whatever is chosen, the
    fallback answers there).
    """

    point: PointSelection | None
    quantiles: dict | None
    horizons_s: tuple[float, ...]
    runs: int
    ticks: int
    fallback_ticks: int

    def to_dict(self) -> dict:
        """JSON form (what a shipped manifest records)."""
        return {
            "point": None if self.point is None else asdict(self.point),
            "quantiles": self.quantiles,
            "horizons_s": list(self.horizons_s),
            "runs": self.runs,
            "ticks": self.ticks,
            "fallback_ticks": self.fallback_ticks,
        }


def fit_on_validation(
    forecaster: Forecaster,
    telemetry: pa.Table | pd.DataFrame,
    *,
    every: int = 3,
    progress: Callable[[int, int], None] | None = None,
) -> ValidationFit:
    """Backtest ``forecaster`` on ``telemetry`` (every ``every``-th tick), recalibrate its
    quantile shifts there, then set its point choice per target and horizon to the
    candidate of least WAPE (the median as recalibrated). The drift check stays as set,
    as it runs when shipped: ticks the fallback forecasts are left out. A horizon the
    validation cannot score keeps the choice and the shift the model had.

    Raises :class:`~prorsa.errors.ConfigError` for a forecaster with neither a choice of
    points nor quantile shifts (a baseline, an uncalibrated lightgbm-trajectory) or
    telemetry with no tick the model itself forecast.
    """
    from prorsa.forecast.backtest import backtest

    shifts = forecaster.quantile_shifts()
    if not forecaster.point_choices() and shifts is None:
        raise _nothing_to_fit(forecaster)
    results = backtest(forecaster, telemetry, every=every, candidates=True, progress=progress)
    ticks = results.drop_duplicates(["run_id", "cutoff"])
    if results.empty or ticks["fallback"].all():
        raise ConfigError(
            f"forecaster '{forecaster.name}' forecast no tick itself on the validation "
            "telemetry: no tick was scored, or the drift fallback forecast every one"
        )
    horizons = tuple(forecaster.horizons_)
    quantiles = None
    if shifts is not None:
        quantiles = recalibrate_on_backtest(shifts, results, horizons) or None
    point = _choose_points(forecaster, results, horizons) if forecaster.point_choices() else None
    if point is None and quantiles is None:  # its quantiles were NaN on every scored tick
        raise _nothing_to_fit(forecaster)
    return ValidationFit(
        point=point,
        quantiles=quantiles,
        horizons_s=horizons,
        runs=int(ticks["run_id"].nunique()),
        ticks=len(ticks),
        fallback_ticks=int(ticks["fallback"].sum()),
    )


def _nothing_to_fit(forecaster: Forecaster) -> ConfigError:
    return ConfigError(
        f"forecaster '{forecaster.name}' has one point and no quantiles: nothing to fit on "
        "validation runs",
        hint="fit on validation lightgbm-aggregate, gru or a calibrated lightgbm-trajectory",
    )


def _choose_points(
    forecaster: Forecaster, results: pd.DataFrame, horizons: tuple[float, ...]
) -> PointSelection:
    """Set ``forecaster.points_`` to the candidates of least WAPE in ``results``."""
    offered = [c for c in POINT_CHOICES if f"forecast:{c}" in results.columns]
    chosen: dict[str, list[str]] = {}
    wape: dict[str, dict[str, list[float | None]]] = {}
    for target in TARGETS:
        rows = results[(results["target"] == target) & np.isfinite(results["actual"])]
        values = {c: rows[f"forecast:{c}"].to_numpy(float) for c in offered}
        complete = np.logical_and.reduce([np.isfinite(v) for v in values.values()])
        y = rows["actual"].to_numpy(float)[complete]
        at = rows["horizon_s"].to_numpy(float)[complete]
        values = {c: v[complete] for c, v in values.items()}
        chosen[target] = choose_points(y, values, at, horizons, forecaster.points_[target])
        wape[target] = {c: [_rounded(point_wape(y, v, at, h)) for h in horizons]
                         for c, v in values.items()}  # fmt: skip
    forecaster.points_ = chosen
    return PointSelection(chosen=chosen, wape=wape)


def _rounded(wape: float | None) -> float | None:
    """As recorded (None without demand: JSON has no NaN)."""
    return None if wape is None else round(wape, 4)
