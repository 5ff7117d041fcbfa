"""The last-value forecast from a tracker: the ``last-value`` baseline, and what a learned
forecaster falls back to when its live features leave the range it was trained on."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from prorsa.forecast.tracker import LifecycleTracker
from prorsa.forecast.types import SUM_TARGETS, TARGETS

#: Tracker history key of each target's series; sums are read as growth per second.
SERIES = {
    "prefill_tokens": "cum_prefill",
    "decode_tokens": "cum_decode",
    "decode_sequences": "decodes",
    "decode_kv_tokens": "kv",
}
#: Name of the baseline a drifting forecaster falls back to.
FALLBACK = "last-value"


def last_value_point(tracker: LifecycleTracker, horizons: Sequence[float]) -> dict[str, np.ndarray]:
    """The last ``h`` seconds repeat: sums as their growth over the last ``h`` seconds,
    averages as observed. With less than ``h`` seconds of history the growth is what
    exists (the counters were zero before the run's first event), not its rate scaled up
    to ``h``: a sync step's launch, thousands of prompts queued in its first second,
    would otherwise read as that many per second for the whole horizon."""
    point = {}
    for target in TARGETS:
        key = SERIES[target]
        if target in SUM_TARGETS:
            point[target] = np.array([tracker.observed_growth(key, h) for h in horizons])
        else:
            point[target] = np.array([tracker.observed_mean(key, h) for h in horizons])
    return point
