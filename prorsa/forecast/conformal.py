"""Split-conformal calibration of quantile forecasts.

A quantile model fitted by pinball loss is calibrated on the data it was trained on, which
makes its intervals too narrow on new data. Split conformal fixes that without
assumptions on the model: hold out whole sources of trajectories (every run of one
scenario sample or replayed trace, :mod:`prorsa.forecast.sources`), measure on them how
far the outcome lands above each predicted quantile, and shift the quantile by that
amount's empirical quantile at the same level. On exchangeable data the shifted
level-``a`` quantile then covers the outcome with probability about ``a`` (slightly more:
the order statistic is rounded outward, the finite-sample correction).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from prorsa.errors import ConfigError

logger = logging.getLogger(__name__)


def held_out_runs(runs: list[str], fraction: float, seed: int) -> set[str]:
    """The runs of a seeded share of the runs' sources, replays and scenario samples
    drawn separately (:func:`prorsa.forecast.sources.held_out_sources`), so no held-out
    run shares trajectories with a training run and replays are held out too.

    With one source nothing is held out (logged): the quantiles keep the quantile
    models' own in-sample fit, too narrow on new data."""
    from prorsa.forecast.sources import held_out_sources, runs_by_source

    if fraction <= 0:
        return set()
    groups = runs_by_source(runs)
    if len(groups) < 2:
        logger.warning(
            "one source of trajectories: none is held out to calibrate the quantiles, "
            "which stay in-sample (too narrow on new data); train on several workloads "
            "or seeds for coverage"
        )
        return set()
    return {run for source in held_out_sources(groups, fraction, seed) for run in groups[source]}


def conformal_offset(actual: np.ndarray, predicted: np.ndarray, level: float) -> float:
    """Shift to add to a level-``level`` quantile prediction (0 without finite pairs)."""
    scores = np.asarray(actual, float) - np.asarray(predicted, float)
    scores = np.sort(scores[np.isfinite(scores)])
    n = len(scores)
    if n == 0:
        return 0.0
    if level >= 0.5:
        k = min(n, math.ceil((n + 1) * level)) - 1
    else:
        k = max(0, math.floor((n + 1) * level) - 1)
    return float(scores[k])


def coverage(actual: np.ndarray, predicted: np.ndarray) -> float:
    """Share of outcomes at or below the predicted quantile."""
    ok = np.isfinite(actual) & np.isfinite(predicted)
    return float(np.mean(actual[ok] <= predicted[ok])) if ok.any() else float("nan")


def recalibrate_on_backtest(
    shifts: dict[str, dict[str, list[float]]],
    results: pd.DataFrame,
    horizons: Sequence[float],
) -> dict[str, dict[str, dict[str, list[float | None]]]]:
    """Move a forecaster's quantile shifts so each level, taken alone, covers its share of
    the outcomes in a backtest on runs it never saw (putting the levels in order after can
    only raise a level's coverage: a P90 below the moved P50 is lifted to it).

    ``shifts`` (``{level: {target: [per fitted horizon]}}``, per
    :meth:`~prorsa.forecast.base.Forecaster.live_scale` and per second for sums) is
    updated in place; missing entries start at 0. ``horizons`` are the model's fitted
    horizons, in order: the lists are indexed by position, and ``results`` must have been
    forecast at all of them. ``results`` is a
    :func:`~prorsa.forecast.backtest.backtest` frame with candidates (its ``raw:q{level}``
    and ``live_scale`` columns): per level, target and horizon the score of a tick is how
    far the outcome lands above the model's quantile, in the model's units, and the shift
    moves by the split-conformal offset of those scores. Ticks the drift fallback
    forecast are left out (the fallback's quantiles are not the model's). On the scored
    rows its ``q{level}`` columns and the ``forecast:median`` candidate are rewritten as
    :meth:`~prorsa.forecast.base.Forecaster.predict` hands the moved quantiles out
    (floored at 0, levels ordered); the ``forecast`` column (the point chosen before) is
    not. Returns ``{level: {"moved_by": {target: [...]},
    "coverage_before": {...}, "coverage_after": {...}}}`` (None where a horizon has no
    scorable tick; coverage of the quantiles as handed out).
    """
    from prorsa.forecast.base import ordered_levels
    from prorsa.forecast.types import QUANTILES, SUM_TARGETS, TARGETS

    levels = [q for q in QUANTILES if np.isfinite(results.get(f"raw:q{q:g}", [])).any()]
    if not levels:
        return {}
    stale = [
        f"{level}/{target}"
        for level, per_target in shifts.items()
        for target, per_h in per_target.items()
        if len(per_h) != len(horizons)
    ]
    forecast_at = set(np.unique(results["horizon_s"].to_numpy(float)).tolist())
    if stale or not forecast_at <= {float(h) for h in horizons}:
        raise ConfigError(
            f"shifts {stale or ''} or the backtest's horizons {sorted(forecast_at)} do not "
            f"match the fitted horizons {list(horizons)}",
            hint="backtest at the model's fitted horizons and pass them in order",
        )
    actual = results["actual"].to_numpy(float)
    usable = ~results["fallback"].to_numpy(bool) & np.isfinite(actual)
    target_of = results["target"].to_numpy()
    horizon_of = results["horizon_s"].to_numpy(float)
    per_second = np.where(np.isin(target_of, SUM_TARGETS), horizon_of, 1.0)
    unit = results["live_scale"].to_numpy(float) * per_second
    raw = {q: results[f"raw:q{q:g}"].to_numpy(float) for q in levels}
    scored = usable & np.isfinite(unit) & (unit > 0)
    for q in levels:
        scored &= np.isfinite(raw[q])
    moved = {q: raw[q].copy() for q in levels}
    groups = {
        (target, j): scored & (target_of == target) & np.isclose(horizon_of, h)
        for target in TARGETS
        for j, h in enumerate(horizons)
    }
    report: dict[str, dict[str, dict[str, list[float | None]]]] = {}
    for q in levels:
        table = shifts.setdefault(f"{q:g}", {})
        by_target: dict[str, list[float | None]] = {}
        for (target, j), rows in groups.items():
            per_h = table.setdefault(target, [0.0] * len(horizons))
            by_target.setdefault(target, [None] * len(horizons))
            if not rows.any():
                continue
            scores = (actual[rows] - raw[q][rows]) / unit[rows]
            delta = conformal_offset(scores, np.zeros_like(scores), q)
            per_h[j] = float(per_h[j] + delta)
            moved[q][rows] += delta * unit[rows]
            by_target[target][j] = round(float(delta), 6)
        report[f"{q:g}"] = {"moved_by": by_target}
    handed_out = ordered_levels(moved)
    # Copies: ``to_numpy`` may hand out a view of the frame, which the loop below rewrites.
    before = {q: results[f"q{q:g}"].to_numpy(float, copy=True) for q in levels}
    for q in levels:
        results.loc[scored, f"q{q:g}"] = handed_out[q][scored]
        entry = report[f"{q:g}"]
        entry["coverage_before"] = _coverage_table(actual, before[q], groups, horizons)
        entry["coverage_after"] = _coverage_table(actual, handed_out[q], groups, horizons)
    if 0.5 in handed_out and "forecast:median" in results:
        median = scored & np.isfinite(results["forecast:median"].to_numpy(float))
        results.loc[median, "forecast:median"] = handed_out[0.5][median]
    return report


def _coverage_table(
    actual: np.ndarray, quantile: np.ndarray, groups: dict, horizons: Sequence[float]
) -> dict[str, list[float | None]]:
    """``{target: [coverage per horizon]}`` over each group's rows (None if empty)."""
    out: dict[str, list[float | None]] = {}
    for (target, j), rows in groups.items():
        per_h = out.setdefault(target, [None] * len(horizons))
        if rows.any():
            per_h[j] = round(coverage(actual[rows], quantile[rows]), 4)
    return out
