"""Split-conformal calibration of quantile forecasts.

A quantile model fitted by pinball loss is calibrated on the data it was trained on, which
makes its intervals too narrow on new data. Split conformal fixes that without
assumptions on the model: hold out whole runs, measure on them how far the outcome lands
above each predicted quantile, and shift the quantile by that amount's empirical quantile
at the same level. On exchangeable data the shifted level-``a`` quantile then covers the
outcome with probability about ``a`` (slightly more: the order statistic is rounded
outward, the finite-sample correction).
"""

from __future__ import annotations

import logging
import math

import numpy as np

logger = logging.getLogger(__name__)


def held_out_runs(runs: list[str], fraction: float, seed: int) -> set[str]:
    """A seeded share of the runs (at least one when there are two or more, never all).

    With one run nothing is held out: the quantiles keep the quantile models' own
    in-sample fit, too narrow on new data (logged)."""
    if fraction <= 0:
        return set()
    if len(runs) < 2:
        logger.warning(
            "one training run: none is held out to calibrate the quantiles, which stay "
            "in-sample (too narrow on new data); train on several runs for coverage"
        )
        return set()
    k = min(len(runs) - 1, max(1, round(fraction * len(runs))))
    chosen = np.random.default_rng(seed).choice(len(runs), k, replace=False)
    return {runs[i] for i in sorted(chosen)}


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
