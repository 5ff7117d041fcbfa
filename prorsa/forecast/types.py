"""The forecast a forecaster hands to a policy, and the names shared by the forecast layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from prorsa.errors import ConfigError

#: Demand targets per horizon h (seconds), see the design's section 7 and
#: :mod:`prorsa.forecast.targets` for their exact definitions.
TARGETS = ("prefill_tokens", "decode_tokens", "decode_sequences", "decode_kv_tokens")
#: Targets that are sums over (t, t+h]; the others are time averages over it.
SUM_TARGETS = ("prefill_tokens", "decode_tokens")
DEFAULT_HORIZONS: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0, 30.0)
#: Quantile levels the probabilistic forecasters provide (P10, P50, P90).
QUANTILES: tuple[float, ...] = (0.1, 0.5, 0.9)


def check_horizons(horizons: object, *, name: str = "horizons") -> tuple[float, ...]:
    """Horizons as a sorted tuple of distinct positive floats, or a ConfigError naming the fault."""
    try:
        values = [float(h) for h in horizons]  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ConfigError(
            f"{name} must be a sequence of numbers (seconds), got {horizons!r}"
        ) from None
    if not values:
        raise ConfigError(f"{name} is empty", hint="give at least one horizon, e.g. 1,5,30")
    bad = [h for h in values if not np.isfinite(h) or h <= 0]
    if bad:
        raise ConfigError(f"{name} must be positive seconds; got {bad}")
    return tuple(sorted(set(values)))


def target_column(target: str, horizon_s: float) -> str:
    """Column name of ``target`` at ``horizon_s`` in a dataset, e.g. ``y_prefill_tokens_h5``."""
    return f"y_{target}_h{horizon_s:g}"


@dataclass(frozen=True)
class Forecast:
    """Forecast demand: ``point[target][i]`` for ``horizons_s[i]``; optional quantiles.

    Targets (per horizon h): ``prefill_tokens`` arriving in (t, t+h], ``decode_tokens``
    generated in (t, t+h], ``decode_sequences`` and ``decode_kv_tokens`` averaged over it.
    ``quantiles`` maps a level (0.1, 0.5, 0.9) to the same layout as ``point``, calibrated
    so that about that share of outcomes falls below; empty when the forecaster gives point
    forecasts only (or fell back to a baseline).

    ``fallback`` names the baseline that produced this forecast instead of the model when
    the live features left the model's training range (``drift`` lists those features);
    ``fallback_ticks`` counts such ticks in the run so far.
    """

    time_s: float
    horizons_s: tuple[float, ...]
    point: dict[str, np.ndarray]
    quantiles: dict[float, dict[str, np.ndarray]] = field(default_factory=dict)
    fallback: str = ""
    drift: tuple[str, ...] = ()
    fallback_ticks: int = 0

    def at(self, target: str, horizon_s: float, quantile: float | None = None) -> float:
        try:
            i = self.horizons_s.index(horizon_s)
        except ValueError:
            raise ConfigError(f"horizon {horizon_s} not in forecast {self.horizons_s}") from None
        table = self.point if quantile is None else self.quantiles[quantile]
        return float(table[target][i])
