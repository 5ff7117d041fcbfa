"""The forecast a forecaster hands to a policy."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from prorsa.errors import ConfigError

#: Demand targets per horizon h (seconds), see the design's section 7.
TARGETS = ("prefill_tokens", "decode_tokens", "decode_sequences", "decode_kv_tokens")


@dataclass(frozen=True)
class Forecast:
    """Forecast demand: ``point[target][i]`` for ``horizons_s[i]``; optional quantiles.

    Targets (per horizon h): ``prefill_tokens`` arriving in (t, t+h], ``decode_tokens``
    generated in (t, t+h], ``decode_sequences`` and ``decode_kv_tokens`` averaged over it.
    """

    time_s: float
    horizons_s: tuple[float, ...]
    point: dict[str, np.ndarray]
    quantiles: dict[float, dict[str, np.ndarray]] = field(default_factory=dict)

    def at(self, target: str, horizon_s: float, quantile: float | None = None) -> float:
        try:
            i = self.horizons_s.index(horizon_s)
        except ValueError:
            raise ConfigError(f"horizon {horizon_s} not in forecast {self.horizons_s}") from None
        table = self.point if quantile is None else self.quantiles[quantile]
        return float(table[target][i])
