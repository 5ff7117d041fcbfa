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

import numpy as np

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
