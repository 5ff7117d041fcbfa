"""Reference baselines, the choices of reactive autoscalers: last value, EWMA, Kalman.

All three watch four per-tick series kept by the tracker, in target units: the prefill
token arrival rate and the (estimated) decode token rate over the last tick interval, the
number of open decodes and their KV tokens. Sums over (t, t+h] are forecast as rate x h,
averages as the level. They need no training data (``fit(None)`` works); given a dataset,
``ewma`` and ``kalman`` pick their smoothing from a small grid by training WAPE.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from prorsa.forecast.base import Forecaster, Point, Quantiles, register
from prorsa.forecast.dataset import ForecastDataset
from prorsa.forecast.fallback import SERIES, last_value_point
from prorsa.forecast.model_folder import positive_state_field
from prorsa.forecast.types import DEFAULT_HORIZONS, SUM_TARGETS, TARGETS, target_column

# The same series in a dataset: lag features over one tick, times the run's scale.
_LAG_PREFIX = {
    "prefill_tokens": "lag_prefill_rate_",
    "decode_tokens": "lag_decode_rate_",
    "decode_sequences": "lag_decodes_",
    "decode_kv_tokens": "lag_kv_tokens_",
}


def series_value(tracker, target: str) -> float:
    """This tick's value of ``target``'s series (rate over the last tick, or level)."""
    key = SERIES[target]
    hist = tracker.history
    if target in SUM_TARGETS:
        times = hist["time"]
        if len(times) >= 2:
            dt = times[-1] - times[-2]
            return (hist[key][-1] - hist[key][-2]) / dt if dt > 0 else 0.0
        span = times[-1] - (tracker.first_time or 0.0)
        return hist[key][-1] / span if span > 0 else 0.0
    return float(hist[key][-1])


def dataset_series(data: ForecastDataset) -> dict[str, list[np.ndarray]] | None:
    """Per-run series of each target rebuilt from one-tick lag features (None if absent)."""
    tick = float(data.meta.get("tick_s", 1.0))
    names = {t: f"{_LAG_PREFIX[t]}{tick:g}" for t in TARGETS}
    if any(n not in data.ticks.columns for n in names.values()):
        return None
    out: dict[str, list[np.ndarray]] = {t: [] for t in TARGETS}
    for _, run in data.ticks.groupby("run_id", sort=True):
        scale = run["scale"].to_numpy(float)
        for t in TARGETS:
            out[t].append(run[names[t]].to_numpy(float) * scale)
    return out


def _wape_of(data: ForecastDataset, horizons: Sequence[float], predict_run: callable) -> float:
    """Mean WAPE over targets and horizons of ``predict_run(series, target, h)``."""
    series = dataset_series(data)
    if series is None:
        return np.nan
    scores = []
    runs = [r for _, r in data.ticks.groupby("run_id", sort=True)]
    for target in TARGETS:
        for h in horizons:
            err = tot = 0.0
            for i, run in enumerate(runs):
                y = run[target_column(target, h)].to_numpy(float)
                yhat = predict_run(series[target][i], target, h)
                err += float(np.abs(y - yhat).sum())
                tot += float(np.abs(y).sum())
            scores.append(err / tot if tot > 0 else 0.0)
    return float(np.mean(scores))


@register("last-value")
class LastValueForecaster(Forecaster):
    """The last h seconds repeat: sums as their observed rate x h, averages as observed."""

    requires_data = False

    def __init__(self, horizons: Sequence[float] = DEFAULT_HORIZONS, seed: int = 0) -> None:
        super().__init__(horizons, seed)

    def _fit(self, data: ForecastDataset | None) -> None:
        pass

    def _predict(self, horizons: tuple[float, ...]) -> tuple[Point, Quantiles]:
        return last_value_point(self.tracker_, horizons), {}


_HALFLIVES_S = (1.0, 2.0, 5.0, 10.0, 20.0, 60.0)


@register("ewma")
class EWMAForecaster(Forecaster):
    """Exponentially weighted level of each series.

    Args:
        halflife_s: smoothing half-life in seconds; None picks it from
            (1, 2, 5, 10, 20, 60) s by training WAPE (5 s without data).
    """

    requires_data = False

    def __init__(
        self,
        horizons: Sequence[float] = DEFAULT_HORIZONS,
        seed: int = 0,
        halflife_s: float | None = None,
    ) -> None:
        super().__init__(horizons, seed)
        self.halflife_s = halflife_s

    def _fit(self, data: ForecastDataset | None) -> None:
        if self.halflife_s is not None:
            self.halflife_s_ = float(self.halflife_s)
            return
        self.halflife_s_ = 5.0
        if data is None:
            return
        tick = float(data.meta.get("tick_s", 1.0))
        scores = {
            hl: _wape_of(data, self.horizons_, _ewma_run(_alpha(tick, hl))) for hl in _HALFLIVES_S
        }
        scores = {k: v for k, v in scores.items() if np.isfinite(v)}
        if scores:
            self.halflife_s_ = min(scores, key=scores.get)
            self.metrics_["train_wape_mean"] = scores[self.halflife_s_]

    def _reset_stream(self) -> None:
        self._level: dict[str, float] = {}
        self._last_time: float | None = None

    def _update(self) -> None:
        now = self.tracker_.time_s
        dt = now - self._last_time if self._last_time is not None else self.tick_s_
        self._last_time = now
        a = _alpha(dt, self.halflife_s_)
        for target in TARGETS:
            x = series_value(self.tracker_, target)
            level = self._level.get(target)
            self._level[target] = x if level is None else level + a * (x - level)

    def _predict(self, horizons: tuple[float, ...]) -> tuple[Point, Quantiles]:
        point = {}
        for target in TARGETS:
            level = self._level[target]
            per = np.asarray(horizons) if target in SUM_TARGETS else np.ones(len(horizons))
            point[target] = level * per
        return point, {}

    def _get_state(self, path) -> dict:
        return {"halflife_s": self.halflife_s_}

    def _set_state(self, state: dict, path) -> None:
        self.halflife_s_ = positive_state_field(state, "halflife_s", source=Path(path))


def _alpha(dt: float, halflife_s: float) -> float:
    return 1.0 - 0.5 ** (max(dt, 0.0) / halflife_s)


def _ewma_run(alpha: float):
    def predict(x: np.ndarray, target: str, h: float) -> np.ndarray:
        from scipy.signal import lfilter

        if not len(x):
            return x
        level, _ = lfilter([alpha], [1.0, alpha - 1.0], x, zi=[(1.0 - alpha) * x[0]])
        return level * (h if target in SUM_TARGETS else 1.0)

    return predict


_OBS_NOISE = (0.3, 1.0, 3.0, 10.0, 30.0, 100.0)


class _LocalTrend:
    """Kalman filter of a local linear trend. Gains depend only on noise *ratios*, so the
    filter is the same whatever the series' units (a diffuse prior starts it)."""

    __slots__ = ("b", "l", "p", "q_level", "q_trend", "r")

    def __init__(self, q_trend: float, r: float) -> None:
        self.q_level, self.q_trend, self.r = 1.0, q_trend, r
        self.l = self.b = 0.0
        self.p: list[float] | None = None  # [p00, p01, p11]

    def step(self, x: float, dt: float) -> None:
        if self.p is None:
            self.l, self.b, self.p = x, 0.0, [self.r, 0.0, self.r]
            return
        p00, p01, p11 = self.p
        # Predict: level += trend * dt.
        l_pred = self.l + self.b * dt
        p00 = p00 + 2 * dt * p01 + dt * dt * p11 + self.q_level * dt
        p01 = p01 + dt * p11
        p11 = p11 + self.q_trend * dt
        s = p00 + self.r
        k0, k1 = p00 / s, p01 / s
        innov = x - l_pred
        self.l = l_pred + k0 * innov
        self.b = self.b + k1 * innov
        self.p = [(1 - k0) * p00, (1 - k0) * p01, p11 - k1 * p01]

    def integral(self, h: float) -> float:
        """∫_0^h max(level + trend τ, 0) dτ."""
        return positive_integral(self.l, self.b, h)


def positive_integral(level: float, trend: float, h: float) -> float:
    """∫_0^h max(level + trend τ, 0) dτ for a straight line."""
    end = level + trend * h
    if level >= 0 and end >= 0:
        return (level + end) / 2 * h
    if level <= 0 and end <= 0:
        return 0.0
    cross = -level / trend
    return level * cross / 2 if level > 0 else end * (h - cross) / 2


@register("kalman")
class KalmanForecaster(Forecaster):
    """Level + trend Kalman filter per series, extrapolated linearly (clipped at zero).

    Args:
        obs_noise: measurement noise relative to the level's process noise; None picks it
            from (0.3 ... 100) by training WAPE (10 without data).
        trend_noise: trend process noise relative to the level's.
    """

    requires_data = False

    def __init__(
        self,
        horizons: Sequence[float] = DEFAULT_HORIZONS,
        seed: int = 0,
        obs_noise: float | None = None,
        trend_noise: float = 0.01,
    ) -> None:
        super().__init__(horizons, seed)
        self.obs_noise = obs_noise
        self.trend_noise = trend_noise

    def _fit(self, data: ForecastDataset | None) -> None:
        if self.obs_noise is not None:
            self.obs_noise_ = float(self.obs_noise)
            return
        self.obs_noise_ = 10.0
        if data is None:
            return
        tick = float(data.meta.get("tick_s", 1.0))
        scores = {
            r: _wape_of(data, self.horizons_, self._run_predictor(r, tick)) for r in _OBS_NOISE
        }
        scores = {k: v for k, v in scores.items() if np.isfinite(v)}
        if scores:
            self.obs_noise_ = min(scores, key=scores.get)
            self.metrics_["train_wape_mean"] = scores[self.obs_noise_]

    def _run_predictor(self, r: float, tick: float):
        def predict(x: np.ndarray, target: str, h: float) -> np.ndarray:
            f = _LocalTrend(self.trend_noise, r)
            out = np.empty(len(x))
            per = 1.0 if target in SUM_TARGETS else h
            for i, v in enumerate(x):
                f.step(float(v), tick)
                out[i] = f.integral(h) / per
            return out

        return predict

    def _reset_stream(self) -> None:
        self._filters = {t: _LocalTrend(self.trend_noise, self.obs_noise_) for t in TARGETS}
        self._last_time: float | None = None

    def _update(self) -> None:
        now = self.tracker_.time_s
        dt = now - self._last_time if self._last_time is not None else self.tick_s_
        self._last_time = now
        for target in TARGETS:
            self._filters[target].step(series_value(self.tracker_, target), max(dt, 1e-9))

    def _predict(self, horizons: tuple[float, ...]) -> tuple[Point, Quantiles]:
        point = {}
        for target in TARGETS:
            f = self._filters[target]
            # Sums integrate the rate over (t, t+h]; averages divide that by h.
            point[target] = np.array(
                [f.integral(h) / (1.0 if target in SUM_TARGETS else h) for h in horizons]
            )
        return point, {}

    def _get_state(self, path) -> dict:
        return {"obs_noise": self.obs_noise_}

    def _set_state(self, state: dict, path) -> None:
        self.obs_noise_ = positive_state_field(state, "obs_noise", source=Path(path))
