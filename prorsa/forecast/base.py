"""The forecaster base class (fit / update / predict, save / load) and the registry.

sktime-style: the public methods validate their input and keep the bookkeeping, then call
small private hooks that a subclass writes (``_fit``, ``_update``, ``_predict``,
``_get_state`` / ``_set_state``). A forecaster is a streaming object: after ``fit`` it owns
a :class:`~prorsa.forecast.tracker.LifecycleTracker`; ``update(rows, time_s)`` feeds it
the events since the last tick and marks a control tick; ``predict(horizons)`` forecasts
from that tick. ``reset()`` starts a new run with the same fitted model.

Saved models are folders ``models/<name>/`` with ``manifest.json`` (forecaster name,
parameters, data hash, metrics, package versions, fitted state) and whatever the
forecaster's hook writes beside it: files, or whole model folders of the members of a
composite (:mod:`prorsa.forecast.per_target`).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import platform
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pandas as pd

from prorsa.errors import ConfigError, InputError, NotFittedError, ProrsaError
from prorsa.forecast.dataset import ForecastDataset
from prorsa.forecast.events import Events
from prorsa.forecast.fallback import FALLBACK, last_value_point
from prorsa.forecast.features import (
    DRIFT_FEATURES,
    aggregate_feature_names,
    aggregate_features,
)
from prorsa.forecast.model_folder import MANIFEST, check_files, entry_sha256, read_manifest
from prorsa.forecast.tracker import LifecycleTracker
from prorsa.forecast.types import (
    DEFAULT_HORIZONS,
    SUM_TARGETS,
    TARGETS,
    Forecast,
    check_horizons,
    target_column,
)
from prorsa.io import atomic_write_text
from prorsa.registry import Registry

logger = logging.getLogger(__name__)

Point = dict[str, np.ndarray]
Quantiles = dict[float, dict[str, np.ndarray]]

_VERSIONED = ("prorsa", "numpy", "pandas", "pyarrow", "scikit-learn", "lightgbm", "torch")


class Forecaster(ABC):
    """Forecasts the demand targets at the last tick for horizons in seconds.

    Args:
        horizons: horizons (seconds) the forecaster is fitted for; ``predict`` accepts any
            subset of them.
        seed: seed of every random choice in ``fit`` (same seed, same model).
    """

    #: Registry name (set by ``FORECASTERS.register``).
    name: ClassVar[str] = ""
    #: False for forecasters that can be fitted without data (``fit(None)``).
    requires_data: ClassVar[bool] = True
    #: True when ``predict`` returns p50 and p90 besides the point forecast.
    provides_quantiles: ClassVar[bool] = False
    #: True for the oracle: it must be shown the future (see ``attach``).
    needs_future: ClassVar[bool] = False
    #: ``update`` takes an :class:`~prorsa.telemetry.columns.EventBatch` as it is.
    accepts_batches: ClassVar[bool] = True

    def __init__(self, horizons: Sequence[float] = DEFAULT_HORIZONS, seed: int = 0) -> None:
        self.horizons = horizons
        self.seed = seed

    # ----------------------------------------------------------------- params
    @classmethod
    def _param_names(cls) -> list[str]:
        # Like scikit-learn: every constructor argument is a parameter stored under its name.
        params = inspect.signature(cls.__init__).parameters.values()
        return [
            p.name
            for p in params
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]

    def get_params(self) -> dict[str, Any]:
        """Constructor parameters (scikit-learn style), JSON-friendly."""
        out = {}
        for name in self._param_names():
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else value
        return out

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"{type(self).__name__}({args})"

    # -------------------------------------------------------------------- fit
    def fit(self, data: ForecastDataset | None = None) -> Forecaster:
        """Fit on a dataset built by :func:`~prorsa.forecast.dataset.build_dataset`."""
        horizons = check_horizons(self.horizons)
        if not isinstance(self.seed, int | np.integer):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        if data is None:
            if self.requires_data:
                raise InputError(
                    f"forecaster '{self.name}' needs a dataset to fit",
                    hint="build one with `prorsa forecast dataset`",
                )
            self.lags_ = horizons
            self.tasks_: tuple[str, ...] = ()
            self.tick_s_ = 1.0
            self.data_hash_: str | None = None
        else:
            if not isinstance(data, ForecastDataset):
                raise InputError(
                    f"fit expects a ForecastDataset, got {type(data).__name__}",
                    hint="build one with prorsa.forecast.build_dataset(telemetry)",
                )
            data.validate(horizons)
            self.lags_ = data.horizons
            self.tasks_ = data.tasks
            self.tick_s_ = float(data.meta.get("tick_s", 1.0))
            self.data_hash_ = data.data_hash()
        self.horizons_ = horizons
        self.metrics_: dict[str, float] = {}
        self.feature_ranges_ = (
            feature_ranges(data.ticks) if data is not None and self.requires_data else {}
        )
        self._fit(data)
        self.fitted_ = True
        self.reset()
        return self

    @abstractmethod
    def _fit(self, data: ForecastDataset | None) -> None:
        """Learn from ``data`` (None only when ``requires_data`` is False)."""

    # ---------------------------------------------------------------- stream
    def _check_fitted(self) -> None:
        if not getattr(self, "fitted_", False):
            raise NotFittedError(
                f"forecaster '{self.name}' is not fitted; call fit(dataset) first "
                "(or load a saved model)"
            )

    def make_tracker(self) -> LifecycleTracker:
        """A fresh tracker with this forecaster's task vocabulary and look-back windows."""
        return LifecycleTracker(self.tasks_, lags_s=self.lags_)

    def reset(self) -> Forecaster:
        """Forget the stream (start of a new run); the fitted model is kept."""
        self._check_fitted()
        self._start_stream(self.make_tracker())
        return self

    def _start_stream(self, tracker: LifecycleTracker) -> None:
        """Start a new run reading ``tracker`` (its own, or one a composite feeds for
        several members: :mod:`prorsa.forecast.per_target`)."""
        self.tracker_ = tracker
        self._ticks = 0
        self._fallback_ticks = 0
        self._drift_logged: tuple[str, ...] = ()  # the drift last logged (() once back)
        self._reset_stream()

    def _reset_stream(self) -> None:  # noqa: B027  (optional hook)
        """Hook: clear per-run state kept beside the tracker."""

    def update(self, events: Events, time_s: float) -> Forecaster:
        """Feed the events since the last call (time order) and mark a tick at ``time_s``.

        ``events`` is best an :class:`~prorsa.telemetry.columns.EventBatch` (what the
        runtimes hand over each tick); tables, data frames and row tuples are converted.
        No refit: the model stays as fitted; only the stream state advances.
        """
        self._check_fitted()
        if not np.isfinite(time_s):
            raise InputError(f"tick time must be finite, got {time_s}")
        self.tracker_.update(events)
        self.tracker_.tick(float(time_s))
        self._ticks += 1
        self._update()
        # Turns frozen this tick that the hook did not take: no model reads them later,
        # and a long run would keep one entry per turn.
        self.tracker_.pending.clear()
        return self

    def _update(self) -> None:  # noqa: B027  (optional hook)
        """Hook: called after each tick (the tracker holds the new state)."""

    def current_features(self) -> np.ndarray:
        """Aggregate features at the last tick (read-only).

        Computed once per tick: the drift check and the model both read them, and at
        10,000 live trajectories each computation costs about 0.6 ms of the tick.
        """
        key = (self.tracker_, self._ticks)
        cached = getattr(self, "_features_at", None)
        if cached is None or cached[0] != key:
            features = aggregate_features(self.tracker_)
            features.setflags(write=False)
            cached = self._features_at = (key, features)
        return cached[1]

    def live_scale(self) -> float:
        """The unit the learned models normalise by (:func:`normalise`): the peak number of
        live trajectories so far, at least 1. Quantile shifts are stored per this unit,
        so one shift serves clusters of any size."""
        return float(max(self.tracker_.peak_live, 1))

    # --------------------------------------------------------------- predict
    def predict(self, horizons: Sequence[float] | None = None) -> Forecast:
        """Forecast every target at ``horizons`` (default: all fitted) from the last tick."""
        self._check_fitted()
        if self._ticks == 0:
            raise InputError(
                f"forecaster '{self.name}' has seen no tick yet",
                hint="call update(rows, time_s) with the events up to the current time first",
            )
        hs = self.horizons_ if horizons is None else check_horizons(horizons)
        unknown = [h for h in hs if h not in self.horizons_]
        if unknown:
            raise ConfigError(
                f"horizon(s) {unknown} not fitted; '{self.name}' was fitted for "
                f"{list(self.horizons_)}"
            )
        self._candidates = {}
        self._raw_quantiles: Quantiles = {}
        drift = self.drifting_features()
        if drift:
            return self._fallback(hs, drift)
        if self._drift_logged:
            logger.info(
                "%s: live features back in the training range at t=%.1f s",
                self.name,
                self.tracker_.time_s,
            )
            self._drift_logged = ()
        point, quantiles = self._predict(hs)
        self._raw_quantiles = quantiles
        fixed: Quantiles = {level: {} for level in quantiles}
        for t in TARGETS:
            for level, values in ordered_levels({q: quantiles[q][t] for q in quantiles}).items():
                fixed[level][t] = values
        point = {t: np.maximum(np.asarray(point[t], float), 0.0) for t in TARGETS}
        return Forecast(
            time_s=float(self.tracker_.time_s),
            horizons_s=hs,
            point=point,
            quantiles=fixed,
            fallback_ticks=self._fallback_ticks,
        )

    def point_choices(self) -> tuple[str, ...]:
        """The candidate points this fitted model offers
        (:data:`~prorsa.forecast.aggregate.POINT_CHOICES`); () for a single point."""
        return ()

    def point_candidates(self) -> dict[str, dict[str, np.ndarray]]:
        """The points the last :meth:`predict` could have handed out, in tokens per
        horizon: ``{target: {choice: values}}`` (choices of
        :data:`~prorsa.forecast.aggregate.POINT_CHOICES`, before the floor at 0); empty
        for forecasters with one point and for a tick the drift fallback forecast. What
        :mod:`~prorsa.forecast.validation_fit` chooses from."""
        return getattr(self, "_candidates", {})

    def quantile_shifts(self) -> dict | None:
        """The conformal shifts of its quantiles (``{level: {target: [per fitted
        horizon]}}``, per :meth:`live_scale`) that
        :func:`~prorsa.forecast.validation_fit.fit_on_validation` moves, or None for a
        model whose quantiles have none (baselines, an uncalibrated lightgbm-trajectory)."""
        return getattr(self, "conformal_", None) if self.provides_quantiles else None

    def raw_quantiles(self) -> Quantiles:
        """The last :meth:`predict`'s quantiles as the model made them, before the floor
        at 0 and the ordering of levels (empty for a tick the drift fallback forecast):
        what :func:`~prorsa.forecast.conformal.recalibrate_on_backtest` moves."""
        return getattr(self, "_raw_quantiles", {})

    #: Targets the caller reads from :meth:`predict` (None: all). A composite sets it on
    #: its members (:mod:`~prorsa.forecast.per_target`) so that each runs only the
    #: models of the targets it serves; a model that honours it forecasts the others as
    #: 0 (run-time setting, like the drift check: it changes nothing learned).
    targets_read: frozenset[str] | None = None

    def _reads(self, target: str) -> bool:
        """Whether the caller reads ``target`` (see :attr:`targets_read`)."""
        return self.targets_read is None or target in self.targets_read

    # ----------------------------------------------------------------- drift
    # Whether ``predict`` falls back to a baseline when the live features leave the
    # training range: a run-time setting, not a parameter (it changes nothing learned).
    _check_drift: bool = True

    def set_drift_check(self, enabled: bool) -> Forecaster:
        """Turn the drift fallback on (the default) or off; returns self."""
        self._check_drift = bool(enabled)
        return self

    def drifting_features(self) -> tuple[str, ...]:
        """Features now outside the range seen in training (empty for baselines).

        The range is the training data's 0.1-99.9th percentiles widened by a tenth of its
        width on each side, so that only a regime the model never saw trips it. A checked
        feature that cannot be computed (NaN: the per-GPU features of telemetry without
        an ``allocation`` event, which names the GPUs) counts as outside: the models never
        saw it missing, and LightGBM would read it as 0 (an empty cluster).
        """
        ranges = getattr(self, "feature_ranges_", None)
        if not ranges or not self._check_drift:
            return ()
        index = getattr(self, "_drift_index", None)
        if index is None:
            names = aggregate_feature_names(self.lags_, self.tasks_)
            index = self._drift_index = {n: names.index(n) for n in ranges if n in names}
        features = self.current_features()
        out = []
        for name, (lo, hi) in ranges.items():
            value = features[index[name]] if name in index else float("nan")
            margin = 0.1 * (hi - lo) + 1e-9
            if name in index and not (lo - margin <= value <= hi + margin):
                out.append(name)  # (NaN compares false)
        return tuple(out)

    def _fallback(self, hs: tuple[float, ...], drift: tuple[str, ...]) -> Forecast:
        self._fallback_ticks += 1
        if not self._drift_logged:  # each time the features leave the range
            logger.warning(
                "%s: live features %s missing or outside the training range at t=%.1f s; "
                "forecasting with %s while they stay out (%d such ticks so far)",
                self.name,
                ", ".join(drift),
                self.tracker_.time_s,
                FALLBACK,
                self._fallback_ticks,
            )
            self._drift_logged = drift
        point = last_value_point(self.tracker_, hs)
        return Forecast(
            time_s=float(self.tracker_.time_s),
            horizons_s=hs,
            point={t: np.maximum(point[t], 0.0) for t in TARGETS},
            fallback=FALLBACK,
            drift=drift,
            fallback_ticks=self._fallback_ticks,
        )

    @abstractmethod
    def _predict(self, horizons: tuple[float, ...]) -> tuple[Point, Quantiles]:
        """(point, quantiles) per target as arrays over ``horizons``; quantiles may be {}."""

    # ------------------------------------------------------------ save/load
    def save(
        self,
        path: str | os.PathLike[str],
        *,
        metrics: dict | None = None,
        extra: dict | None = None,
    ) -> Path:
        """Write ``path/manifest.json`` and the model files; returns the folder.

        The model files are written beside the folder first; then the old manifest is
        removed, the files moved in, and the new manifest written last, holding each
        file's SHA-256. A save cut short leaves no manifest (loading says so) rather
        than an old manifest beside new weights. ``extra`` adds top-level manifest fields (a
        training recipe, say). Other files in the folder are left alone.
        """
        self._check_fitted()
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if metrics is not None:
            self.metrics_ = dict(metrics)
        with tempfile.TemporaryDirectory(prefix=".saving-", dir=path) as staging:
            state = self._get_state(Path(staging))
            # The old manifest goes first: one saved before manifests listed their files
            # would otherwise load beside the new weights if this save stopped half-way.
            (path / MANIFEST).unlink(missing_ok=True)
            files = {}
            for file in sorted(Path(staging).iterdir()):
                files[file.name] = entry_sha256(file)
                if file.is_dir() and (path / file.name).is_dir():
                    shutil.rmtree(path / file.name)  # a member saved here before
                os.replace(file, path / file.name)
        manifest = {
            "format": "prorsa-forecaster/1",
            "name": self.name,
            "class": f"{type(self).__module__}.{type(self).__qualname__}",
            "params": self.get_params(),
            "fitted": {
                "horizons": list(self.horizons_),
                "lags": list(self.lags_),
                "tasks": list(self.tasks_),
                "tick_s": self.tick_s_,
                "feature_ranges": getattr(self, "feature_ranges_", {}),
            },
            "data_hash": self.data_hash_,
            "metrics": self.metrics_,
            "versions": package_versions(),
            "state": state,
            "files": files,
            **(extra or {}),
        }
        atomic_write_text(path / MANIFEST, json.dumps(manifest, indent=2, default=_json) + "\n")
        return path

    def _get_state(self, path: Path) -> dict:
        """Hook: JSON-able fitted state; may write files under ``path``."""
        return {}

    def _set_state(self, state: dict, path: Path) -> None:  # noqa: B027  (optional hook)
        """Hook: restore what ``_get_state`` saved."""

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Forecaster:
        """Load a saved forecaster (any registered kind when called on the base class)."""
        model = load_forecaster(path)
        if cls is not Forecaster and not isinstance(model, cls):
            raise ConfigError(f"{path} holds a '{model.name}' forecaster, not {cls.__name__}")
        return model

    # --------------------------------------------------------------- helpers
    @staticmethod
    def _targets_matrix(ticks: pd.DataFrame, horizons: Sequence[float]) -> np.ndarray:
        """Normalised targets [rows, targets, horizons] of a tick table (see :func:`normalise`)."""
        scale = ticks["scale"].to_numpy(float)
        out = np.empty((len(ticks), len(TARGETS), len(horizons)))
        for i, target in enumerate(TARGETS):
            for j, h in enumerate(horizons):
                y = ticks[target_column(target, h)].to_numpy(float)
                out[:, i, j] = normalise(y, target, h, scale)
        return out


def ordered_levels(by_level: dict[float, np.ndarray]) -> dict[float, np.ndarray]:
    """One target's quantiles as :meth:`Forecaster.predict` reports them: non-negative
    and non-decreasing in the level (a level crossing below the one under it is lifted
    to it)."""
    out: dict[float, np.ndarray] = {}
    below = None
    for level in sorted(by_level):
        values = np.maximum(np.asarray(by_level[level], float), 0.0)
        out[level] = below = values if below is None else np.maximum(values, below)
    return out


def feature_ranges(ticks: pd.DataFrame) -> dict[str, tuple[float, float]]:
    """0.1th and 99.9th percentiles of the drift-checked features in training ticks."""
    out = {}
    for name in DRIFT_FEATURES:
        if name in ticks.columns:
            values = ticks[name].to_numpy(float)
            values = values[np.isfinite(values)]
            if len(values):
                lo, hi = np.quantile(values, [0.001, 0.999])
                out[name] = (float(lo), float(hi))
    return out


def normalise(values: np.ndarray, target: str, h: float, scale: np.ndarray | float) -> np.ndarray:
    """Target in model units: per live trajectory (``scale``), and per second for sums."""
    per = h if target in SUM_TARGETS else 1.0
    return np.asarray(values, float) / (np.asarray(scale, float) * per)


def denormalise(
    values: np.ndarray, target: str, h: float | Sequence[float], scale: float
) -> np.ndarray:
    """Model units back to tokens (inverse of :func:`normalise`); ``h`` is one horizon or
    one per value."""
    per = np.asarray(h, float) if target in SUM_TARGETS else 1.0
    return np.asarray(values, float) * scale * per


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in _VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def _json(obj: Any) -> Any:
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


FORECASTERS: Registry[type[Forecaster]] = Registry("forecaster")


def register(name: str):
    """Class decorator: register a forecaster under ``name`` (duplicates are an error)."""

    def add(cls: type[Forecaster]) -> type[Forecaster]:
        cls.name = name
        FORECASTERS.register(name, cls)
        return cls

    return add


def load_forecaster(path: str | os.PathLike[str]) -> Forecaster:
    """Load a folder written by :meth:`Forecaster.save`.

    Raises:
        InputError: the folder is missing, damaged or not a model folder; the message
            names the file and the field (``prorsa.forecast.model_folder`` checks them).
    """
    import prorsa.forecast  # noqa: F401  (registers the built-ins)

    path = Path(path)
    manifest = read_manifest(path)
    source = str(path / MANIFEST)
    name = manifest["name"]
    if name not in FORECASTERS:
        raise InputError(
            f"unknown forecaster {name!r}",
            source=source,
            field="name",
            hint=f"registered: {', '.join(FORECASTERS.names())}",
        )
    klass = FORECASTERS.get(name)
    model = klass(**_checked_params(klass, manifest.get("params", {}), source))
    fitted = manifest["fitted"]
    model.horizons_ = tuple(float(h) for h in fitted["horizons"])
    model.lags_ = tuple(float(h) for h in fitted["lags"])
    model.tasks_ = tuple(fitted["tasks"])
    model.tick_s_ = float(fitted["tick_s"])
    model.feature_ranges_ = {k: tuple(v) for k, v in fitted.get("feature_ranges", {}).items()}
    model.data_hash_ = manifest.get("data_hash")
    model.metrics_ = manifest.get("metrics", {})
    model.manifest_ = manifest
    check_files(manifest, path)
    try:
        model._set_state(manifest.get("state", {}), path)
        model.fitted_ = True
        model.reset()
    except ProrsaError:
        raise
    except Exception as exc:  # a damaged folder must never surface as a traceback
        raise InputError(
            f"cannot restore the '{name}' model: {type(exc).__name__}: {exc}",
            source=str(path),
            field="state",
            hint="the folder is damaged or from another version of prorsa: regenerate it "
            "(`prorsa forecast ship`) or retrain it",
        ) from None
    return model


def _checked_params(klass: type[Forecaster], params: dict, source: str) -> dict:
    """Manifest parameters checked against the constructor (names, and types by default)."""
    signature = inspect.signature(klass.__init__).parameters
    known = set(klass._param_names())
    out = {}
    for key, value in params.items():
        if key not in known:
            raise InputError(
                f"unknown parameter {key!r} for '{klass.name}'",
                source=source,
                field=f"params.{key}",
                hint=f"its parameters: {', '.join(sorted(known))}",
            )
        default = signature[key].default
        if not _same_kind(default, value):
            raise InputError(
                f"must be like {default!r}, got {value!r}",
                source=source,
                field=f"params.{key}",
            )
        out[key] = value
    return out


def _same_kind(default: Any, value: Any) -> bool:
    """Whether a manifest value may stand where the constructor's default stands."""
    if default is inspect.Parameter.empty or default is None or value is None:
        return True
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(default, bool) and isinstance(value, bool)
    if isinstance(default, int | float):
        return isinstance(value, int | float) and np.isfinite(value)
    if isinstance(default, tuple | list):
        return isinstance(value, list | tuple) and all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in value
        )
    return isinstance(value, type(default))
