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
from prorsa.forecast.base import (
    Forecaster,
    Point,
    Quantiles,
    denormalise,
    ordered_levels,
    register,
)
from prorsa.forecast.conformal import conformal_offset, held_out_runs
from prorsa.forecast.dataset import ForecastDataset
from prorsa.forecast.features import aggregate_feature_names
from prorsa.forecast.model_folder import model_file, state_field
from prorsa.forecast.types import DEFAULT_HORIZONS, QUANTILES, TARGETS

#: (key suffix, LightGBM objective, quantile level)
LOSSES = (
    ("mean", "regression", None),
    ("q0.1", "quantile", 0.1),
    ("q0.5", "quantile", 0.5),
    ("q0.9", "quantile", 0.9),
)


#: What a learned forecaster's point forecast may be, chosen per target and horizon on
#: held-out runs (:func:`choose_points`): the squared-error model, the median model, the
#: offset the trees correct, or (lightgbm-trajectory) the raw bottom-up sum, skipping the
#: calibration. Demand is heavy-tailed (a sync launch queues every prompt at once): a
#: squared-error model fitted with those bursts put burst-sized leaves under ordinary
#: states of a cluster it had not seen (prefill WAPE 6-13 on the held-out 235B cell, where
#: its median scored 0.6-0.9), while for decode it was the better of the two; and on cells
#: the training never saw the raw sum beat every calibrated decode point
#: (docs/results.md, "Forecasting"). Which wins is a question of transfer, so the shipped
#: recipe answers it on cells of their own (:mod:`prorsa.forecast.validation_fit`).
POINT_CHOICES = ("mean", "median", "offset", "bottom-up")
#: The quantile level of the ``median`` point.
POINT_LEVEL = 0.5


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


#: Share of the training runs (by source) held out to measure the conformal shifts.
CONFORMAL_FRACTION = 0.2


def conformal_rows(run_of_row: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Rows of the runs :func:`fit_target_models` holds out to measure conformal shifts
    (a boolean mask): anything else fitted on the same data must leave them out too."""
    held = held_out_runs(sorted(set(run_of_row.tolist())), fraction, seed)
    return np.isin(run_of_row, list(held)) if held else np.zeros(len(run_of_row), bool)


def fit_target_models(
    xs: np.ndarray,
    ys: np.ndarray,
    run_of_row: np.ndarray,
    horizon_of_row: np.ndarray,
    horizons: Sequence[float],
    train,
    seed: int,
    *,
    init: np.ndarray | None = None,
    prefix: str = "",
    held_out_fraction: float = CONFORMAL_FRACTION,
) -> tuple[dict[str, object], dict[str, dict[str, list[float]]], dict[str, list[str]]]:
    """One booster per target and loss of :data:`LOSSES`, quantiles split-conformal, and
    the point forecast chosen per target and horizon (:data:`POINT_CHOICES`).

    ``ys`` [rows, targets]; ``train(x, y, objective, alpha, init_score)`` fits one
    booster; ``init`` [rows, targets] is an offset the trees correct. The models learn
    from all but a seeded fifth of the runs; on that fifth each quantile's conformal
    shift per target and horizon is measured (see :mod:`prorsa.forecast.conformal`) and
    the point is chosen as the candidate of least WAPE there. Returns (boosters keyed
    ``{prefix}{target}:{loss}``, shifts ``{level: {target: [per horizon]}}``, point
    choices ``{target: [per horizon]}``).
    """
    is_cal = conformal_rows(run_of_row, held_out_fraction, seed)
    fit_rows = ~is_cal
    boosters: dict[str, object] = {}
    shifts: dict[str, dict[str, list[float]]] = {}
    points: dict[str, list[str]] = {}
    for i, target in enumerate(TARGETS):
        offset = init[:, i] if init is not None else None
        held: dict[str, np.ndarray] = {}  # each candidate point on the held-out rows
        lower: dict[float, np.ndarray] = {}  # the quantiles up to the median, held-out rows
        for key, objective, alpha in LOSSES:
            booster = train(
                xs[fit_rows],
                ys[fit_rows, i],
                objective,
                alpha,
                None if offset is None else offset[fit_rows],
            )
            boosters[f"{prefix}{target}:{key}"] = booster
            if not is_cal.any():
                if alpha is not None:
                    shifts.setdefault(f"{alpha:g}", {})[target] = [0.0] * len(horizons)
                continue
            pred = lgbm.predict(booster, xs[is_cal])
            if offset is not None:
                pred = pred + offset[is_cal]
            if alpha is None:
                held["mean"] = pred
                continue
            per_h = [0.0] * len(horizons)
            for j, h in enumerate(horizons):
                at = np.isclose(horizon_of_row[is_cal], h)
                per_h[j] = conformal_offset(ys[is_cal, i][at], pred[at], alpha)
            shifts.setdefault(f"{alpha:g}", {})[target] = per_h
            if alpha <= POINT_LEVEL:
                lower[alpha] = (
                    pred + np.array(per_h)[_horizon_index(horizon_of_row[is_cal], horizons)]
                )
        if POINT_LEVEL in lower:
            held["median"] = ordered_median(lower)
        if offset is not None and is_cal.any():
            held["offset"] = offset[is_cal]
        points[target] = choose_points(ys[is_cal, i], held, horizon_of_row[is_cal], horizons)
    return boosters, shifts, points


def _horizon_index(horizon_of_row: np.ndarray, horizons: Sequence[float]) -> np.ndarray:
    return np.argmin(np.abs(horizon_of_row[:, None] - np.asarray(horizons)[None, :]), axis=1)


def choose_points(
    y: np.ndarray,
    candidates: dict[str, np.ndarray],
    horizon_of_row: np.ndarray,
    horizons: Sequence[float],
    default: Sequence[str] | None = None,
) -> list[str]:
    """Per horizon, the candidate point (:data:`POINT_CHOICES`) of least WAPE on the
    held-out rows ``y``; where they cannot tell (no rows, or no demand), ``default``'s
    choice at that horizon (``"mean"`` if none)."""
    out = []
    for j, h in enumerate(horizons):
        wape = {k: point_wape(y, v, horizon_of_row, h) for k, v in candidates.items()}
        if not candidates or None in wape.values():
            out.append(default[j] if default is not None else "mean")
            continue
        out.append(min(POINT_CHOICES, key=lambda k: wape.get(k, np.inf)))
    return out


def point_wape(
    y: np.ndarray, forecast: np.ndarray, horizon_of_row: np.ndarray, h: float
) -> float | None:
    """WAPE at horizon ``h`` of a point floored at 0, as ``predict`` hands it out (None
    where those rows hold no demand)."""
    at = np.isclose(horizon_of_row, h)
    total = float(np.abs(y[at]).sum())
    if total <= 0:
        return None
    return float(np.abs(y[at] - np.maximum(forecast[at], 0.0)).sum()) / total


def read_points(
    state: dict, source: str, n_horizons: int, offered: Sequence[str] = POINT_CHOICES
) -> dict[str, list[str]]:
    """``state.point`` of a saved model, checked against the choices the model
    ``offered`` (absent or empty, as in older folders and uncalibrated models: the
    mean)."""
    from prorsa.errors import InputError

    offered = tuple(offered) or ("mean",)
    points = state.get("point") or {t: ["mean"] * n_horizons for t in TARGETS}
    for target in TARGETS:
        choice = points.get(target) if isinstance(points, dict) else None
        if (
            not isinstance(choice, list)
            or len(choice) != n_horizons
            or any(c not in offered for c in choice)
        ):
            raise InputError(
                f"must list one of {offered} per horizon, got {choice!r}",
                source=source,
                field=f"state.point.{target}",
            )
    return {t: list(points[t]) for t in TARGETS}


def skip_target(point: Point, quantiles: Quantiles, target: str, n_horizons: int) -> None:
    """Forecast ``target`` as 0 at every horizon and level: a target no caller reads
    (:attr:`~prorsa.forecast.base.Forecaster.targets_read`), whose models are not run."""
    zeros = np.zeros(n_horizons)
    point[target] = zeros
    for level in quantiles:
        quantiles[level][target] = zeros


def ordered_median(by_level: dict[float, np.ndarray]) -> np.ndarray:
    """The median as :meth:`~prorsa.forecast.base.Forecaster.predict` reports it
    (:func:`~prorsa.forecast.base.ordered_levels`), so the point chosen as "median" is
    the P50 the forecast hands out."""
    return ordered_levels(by_level)[POINT_LEVEL]


def pick_point(
    points: dict[str, list[str]],
    target: str,
    fitted: Sequence[float],
    horizons: Sequence[float],
    candidates: dict[str, np.ndarray],
) -> np.ndarray:
    """The point of ``target`` at ``horizons`` from ``candidates`` (each per horizon)."""
    choice = [points[target][list(fitted).index(h)] for h in horizons]
    return np.array([candidates[c][j] for j, c in enumerate(choice)])


def conformal_shift(
    shifts: dict,
    alpha: float | None,
    target: str,
    fitted: Sequence[float],
    horizons: Sequence[float],
) -> np.ndarray | float:
    """The conformal shift of quantile ``alpha`` at ``horizons`` (0 for the mean)."""
    if alpha is None or not shifts:
        return 0.0
    table = shifts.get(f"{alpha:g}", {}).get(target)
    if table is None:
        return 0.0
    return np.array([table[list(fitted).index(h)] for h in horizons])


def read_conformal(state: dict, path: Path, n_horizons: int) -> dict:
    """The ``conformal`` shifts of a saved model, checked (absent in older folders: none)."""
    from prorsa.errors import InputError
    from prorsa.forecast.model_folder import MANIFEST

    shifts = state.get("conformal", {})
    levels = {f"{q:g}" for q in QUANTILES}
    ok = isinstance(shifts, dict) and all(
        level in levels
        and isinstance(per_target, dict)
        and all(
            target in TARGETS
            and isinstance(v, list)
            and len(v) == n_horizons
            and all(
                isinstance(x, int | float) and not isinstance(x, bool) and np.isfinite(x) for x in v
            )
            for target, v in per_target.items()
        )
        for level, per_target in shifts.items()
    )
    if not ok:
        raise InputError(
            f"must map quantile levels {sorted(levels)} to lists per target of "
            f"{list(TARGETS)}, one finite shift per horizon",
            source=str(path / MANIFEST),
            field="state.conformal",
        )
    return shifts


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
        ys = np.stack([y[:, i, :].T.reshape(-1) for i in range(len(TARGETS))], axis=1)
        runs = np.tile(data.ticks["run_id"].to_numpy(), len(self.horizons_))
        keep = subsample(len(xs), self.max_rows, self.seed)
        names = [*data.feature_names, "horizon_s"]

        def train(xk, yk, objective, alpha, init):
            return lgbm.train(
                xk,
                yk,
                objective=objective,
                alpha=alpha,
                seed=self.seed,
                n_estimators=self.n_estimators,
                learning_rate=self.learning_rate,
                num_leaves=self.num_leaves,
                min_child_samples=self.min_child_samples,
                feature_names=names,
            )

        self.boosters_, self.conformal_, self.points_ = fit_target_models(
            xs[keep], ys[keep], runs[keep], xs[keep, -1], self.horizons_, train, self.seed
        )

    def point_choices(self) -> tuple[str, ...]:
        return ("mean", "median")

    def _predict(self, horizons: tuple[float, ...]) -> tuple[Point, Quantiles]:
        x = stack_horizons(self.current_features()[None, :], horizons)
        scale = self.live_scale()
        point: Point = {}
        quantiles: Quantiles = {q: {} for q in QUANTILES}
        for target in TARGETS:
            if not self._reads(target):
                skip_target(point, quantiles, target, len(horizons))
                continue
            for key, _, alpha in LOSSES:
                raw = lgbm.predict(self.boosters_[f"{target}:{key}"], x)
                raw = raw + conformal_shift(
                    self.conformal_, alpha, target, self.horizons_, horizons
                )
                values = denormalise(raw, target, horizons, scale)
                if alpha is None:
                    point[target] = values
                else:
                    quantiles[alpha][target] = values
            median = ordered_median({q: quantiles[q][target] for q in QUANTILES})
            candidates = {"mean": point[target], "median": median}
            self._candidates[target] = candidates
            point[target] = pick_point(self.points_, target, self.horizons_, horizons, candidates)
        return point, quantiles

    def _get_state(self, path: Path) -> dict:
        return {
            "boosters": lgbm.save_boosters(self.boosters_, path / "boosters.json.gz"),
            "conformal": self.conformal_,
            "point": self.points_,
        }

    def _set_state(self, state: dict, path: Path) -> None:
        name = state_field(state, "boosters", str, source=path)
        required = tuple(f"{t}:{key}" for t in TARGETS for key, _, _ in LOSSES)
        self.boosters_ = lgbm.load_boosters(
            model_file(path, name, field="state.boosters"), required
        )
        self.conformal_ = read_conformal(state, path, len(self.horizons_))
        self.points_ = read_points(state, str(path), len(self.horizons_), self.point_choices())
        width = len(aggregate_feature_names(self.lags_, self.tasks_)) + 1
        for booster in self.boosters_.values():
            lgbm.check_width(booster, width, source=str(path / state["boosters"]))
