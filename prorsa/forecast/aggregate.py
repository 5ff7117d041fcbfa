"""``lightgbm-aggregate``: direct multi-horizon LightGBM on the aggregate features.

One model per target and loss (mean, p50, p90), shared across horizons with the horizon as
a feature ("direct" strategy: no recursion over forecasts). Targets are normalised per
live trajectory (and per second for sums), which keeps the trees meaningful on clusters
larger than the ones they were trained on.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from prorsa.forecast import lgbm
from prorsa.forecast.base import Forecaster, Point, Quantiles, denormalise, register
from prorsa.forecast.dataset import ForecastDataset
from prorsa.forecast.features import aggregate_feature_names
from prorsa.forecast.model_folder import model_file, state_field
from prorsa.forecast.types import DEFAULT_HORIZONS, QUANTILES, TARGETS

#: (key suffix, LightGBM objective, quantile level)
LOSSES = (("mean", "regression", None), ("q0.5", "quantile", 0.5), ("q0.9", "quantile", 0.9))


def stack_horizons(x: np.ndarray, horizons: Sequence[float]) -> np.ndarray:
    """Rows of ``x`` once per horizon, with the horizon appended as the last column."""
    n = len(x)
    reps = np.repeat(np.asarray(horizons, float), n)
    return np.column_stack([np.tile(x, (len(horizons), 1)), reps])


def subsample(n: int, max_rows: int, seed: int) -> np.ndarray:
    """Sorted row indices, all of them or a seeded sample of ``max_rows``."""
    if n <= max_rows:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, max_rows, replace=False))


@register("lightgbm-aggregate")
class LightGBMAggregateForecaster(Forecaster):
    """Direct multi-horizon gradient boosting on aggregate features, point and p50/p90.

    Args:
        n_estimators / learning_rate / num_leaves / min_child_samples: LightGBM settings.
        max_rows: training rows (ticks x horizons) kept, sampled with ``seed``.
    """

    provides_quantiles = True

    def __init__(
        self,
        horizons: Sequence[float] = DEFAULT_HORIZONS,
        seed: int = 0,
        n_estimators: int = 150,
        learning_rate: float = 0.05,
        num_leaves: int = 15,
        min_child_samples: int = 20,
        max_rows: int = 200_000,
    ) -> None:
        super().__init__(horizons, seed)
        self.n_estimators = n_estimators
        self.learning_rate = learning_rate
        self.num_leaves = num_leaves
        self.min_child_samples = min_child_samples
        self.max_rows = max_rows

    def _fit(self, data: ForecastDataset | None) -> None:
        x = data.ticks[data.feature_names].to_numpy(float)
        xs = stack_horizons(x, self.horizons_)
        y = self._targets_matrix(data.ticks, self.horizons_)  # rows x targets x horizons
        keep = subsample(len(xs), self.max_rows, self.seed)
        names = [*data.feature_names, "horizon_s"]
        self.boosters_ = {}
        for i, target in enumerate(TARGETS):
            yt = y[:, i, :].T.reshape(-1)  # horizon-major, like stack_horizons
            for key, objective, alpha in LOSSES:
                self.boosters_[f"{target}:{key}"] = lgbm.train(
                    xs[keep],
                    yt[keep],
                    objective=objective,
                    alpha=alpha,
                    seed=self.seed,
                    n_estimators=self.n_estimators,
                    learning_rate=self.learning_rate,
                    num_leaves=self.num_leaves,
                    min_child_samples=self.min_child_samples,
                    feature_names=names,
                )

    def _predict(self, horizons: tuple[float, ...]) -> tuple[Point, Quantiles]:
        x = stack_horizons(self.current_features()[None, :], horizons)
        scale = float(max(self.tracker_.peak_live, 1))
        point: Point = {}
        quantiles: Quantiles = {q: {} for q in QUANTILES}
        for target in TARGETS:
            for key, _, alpha in LOSSES:
                raw = lgbm.predict(self.boosters_[f"{target}:{key}"], x)
                values = np.array(
                    [denormalise(v, target, h, scale) for v, h in zip(raw, horizons, strict=True)]
                )
                if alpha is None:
                    point[target] = values
                else:
                    quantiles[alpha][target] = values
        return point, quantiles

    def _get_state(self, path: Path) -> dict:
        return {"boosters": lgbm.save_boosters(self.boosters_, path / "boosters.json.gz")}

    def _set_state(self, state: dict, path: Path) -> None:
        name = state_field(state, "boosters", str, source=path)
        required = tuple(f"{t}:{key}" for t in TARGETS for key, _, _ in LOSSES)
        self.boosters_ = lgbm.load_boosters(
            model_file(path, name, field="state.boosters"), required
        )
        width = len(aggregate_feature_names(self.lags_, self.tasks_)) + 1
        for booster in self.boosters_.values():
            lgbm.check_width(booster, width, source=str(path / state["boosters"]))
