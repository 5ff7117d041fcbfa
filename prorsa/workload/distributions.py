"""Seeded, JSON-serialisable length and latency distributions used by task profiles.

All are log-normal because token counts and tool latencies in agent traces are strictly
positive and heavy-tailed; each is clipped to a range so a sample never leaves what the
model or the tools can produce.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from prorsa.errors import ConfigError


@dataclass
class LogNormal:
    """``exp(mu + sigma * z)`` clipped to ``[low, high]``."""

    mu: float
    sigma: float
    low: float
    high: float

    def __post_init__(self) -> None:
        if self.sigma < 0 or not self.low <= self.high or self.low < 0:
            raise ConfigError(
                f"invalid log-normal {asdict(self)}: need sigma >= 0, 0 <= low <= high"
            )

    def draw(self, z: np.ndarray) -> np.ndarray:
        """Map standard normal draws ``z`` to values."""
        return np.clip(np.exp(self.mu + self.sigma * z), self.low, self.high)

    @property
    def median(self) -> float:
        return float(np.clip(np.exp(self.mu), self.low, self.high))

    @classmethod
    def fit(cls, values: np.ndarray, *, margin: float = 1.0) -> LogNormal:
        """Maximum-likelihood fit on positive values; the clip range is the observed range."""
        values = np.asarray(values, dtype=float)
        values = values[np.isfinite(values) & (values > 0)]
        if len(values) == 0:
            raise ConfigError("cannot fit a log-normal to no positive values")
        logs = np.log(values)
        return cls(
            mu=float(logs.mean()),
            sigma=float(logs.std()),
            low=float(values.min()) / margin,
            high=float(values.max()) * margin,
        )


@dataclass
class PerTurnLogNormal:
    """Per-turn lengths with a per-trajectory level and a trend over turns.

    ``log x[k] = mu + trend_per_turn * k + sigma_between * u + sigma_within * e_k``, where
    ``u`` is the trajectory's (group-correlated) level and ``e_k`` is turn noise. Separating
    the two variances keeps a verbose trajectory verbose across its turns, as in real traces.
    """

    mu: float
    sigma_between: float
    sigma_within: float
    low: float
    high: float
    trend_per_turn: float = 0.0

    def __post_init__(self) -> None:
        if min(self.sigma_between, self.sigma_within) < 0 or not 0 <= self.low <= self.high:
            raise ConfigError(f"invalid per-turn log-normal {asdict(self)}")

    def draw(self, level: float, turns: int, rng: np.random.Generator) -> np.ndarray:
        k = np.arange(turns)
        logs = (
            self.mu
            + self.trend_per_turn * k
            + self.sigma_between * level
            + self.sigma_within * rng.standard_normal(turns)
        )
        return np.clip(np.exp(logs), self.low, self.high)

    @classmethod
    def fit(cls, values: np.ndarray, trajectory: np.ndarray, turn: np.ndarray) -> PerTurnLogNormal:
        """Fit the trend by least squares on logs, then split residual variance between and
        within trajectories (one-way random-effects ANOVA estimator)."""
        values = np.asarray(values, dtype=float)
        keep = np.isfinite(values) & (values > 0)
        values, trajectory, turn = (
            values[keep],
            np.asarray(trajectory)[keep],
            np.asarray(turn)[keep],
        )
        if len(values) < 2:
            raise ConfigError("need at least two positive per-turn values to fit")
        logs = np.log(values)
        turn = turn.astype(float)
        if np.ptp(turn) > 0:
            slope, intercept = np.polyfit(turn, logs, 1)
        else:
            slope, intercept = 0.0, float(logs.mean())
        resid = logs - (intercept + slope * turn)
        _, inverse, counts = np.unique(trajectory, return_inverse=True, return_counts=True)
        means = np.bincount(inverse, weights=resid) / counts
        within = resid - means[inverse]
        dof_within = max(len(resid) - len(counts), 1)
        var_within = float((within**2).sum() / dof_within)
        n_bar = float(len(resid) / len(counts))
        var_between = max(float(means.var()) - var_within / n_bar, 0.0) if len(counts) > 1 else 0.0
        return cls(
            mu=float(intercept),
            sigma_between=float(np.sqrt(var_between)),
            sigma_within=float(np.sqrt(var_within)),
            low=float(values.min()),
            high=float(values.max()),
            trend_per_turn=float(slope),
        )
