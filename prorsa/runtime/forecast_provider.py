"""The adapter the controller calls: observations in, :class:`Forecast` out.

``make_provider(name_or_path)`` resolves, in order: a saved model folder (a path with a
``manifest.json``), a shipped model ``models/<name>/``, or a registered forecaster that
needs no training data (``last-value``, ``ewma``, ``kalman``, ``oracle``). The provider
keeps the forecaster's stream: at every tick it feeds the forecaster the events recorded
since the previous tick and forecasts from there.

A runtime attaches its event log before the run (:meth:`ForecastProvider.attach`), so the
run must record telemetry; in a simulation it also attaches the ground-truth port, which
only the oracle reads. The observation itself carries no events.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from prorsa.errors import ConfigError
from prorsa.forecast import FORECASTERS, Forecaster, load_forecaster
from prorsa.forecast.base import MANIFEST
from prorsa.forecast.types import Forecast, check_horizons
from prorsa.policy.types import ClusterObservation
from prorsa.runtime.sim.version import models_dir
from prorsa.telemetry.columns import EventLog
from prorsa.workload.truth import GroundTruth

logger = logging.getLogger(__name__)


def resolve_forecaster(name_or_path: str | os.PathLike[str]) -> Forecaster:
    """A fitted forecaster from a model folder, a shipped model name or a data-free name."""
    path = Path(name_or_path)
    if (path / MANIFEST).exists():
        return load_forecaster(path)
    name = str(name_or_path)
    shipped = models_dir() / name
    if (shipped / MANIFEST).exists():
        return load_forecaster(shipped)
    if name in FORECASTERS:
        klass = FORECASTERS.get(name)
        if klass.requires_data:
            raise ConfigError(
                f"forecaster '{name}' must be trained first and no shipped model {shipped} exists",
                hint=f"prorsa forecast train --model {name} --data DATA.parquet "
                f"--out models/{name}",
            )
        return klass().fit(None)
    choices = ", ".join(FORECASTERS.names())
    raise ConfigError(
        f"unknown forecaster or model folder '{name}'",
        hint=f"give a model folder, a shipped model under {models_dir()}, or one of: {choices}",
    )


class ForecastProvider:
    """Feeds a forecaster the telemetry recorded since the last tick; see the module doc.

    Args:
        forecaster: a fitted forecaster (the provider resets its stream).
        horizons: horizons to forecast (default: all the forecaster was fitted for).
    """

    def __init__(self, forecaster: Forecaster, horizons: Sequence[float] | None = None) -> None:
        self.forecaster = forecaster.reset()
        self.horizons: tuple[float, ...] = forecaster.horizons_
        if horizons is not None:
            self.use_horizons(horizons)
        self._seen = 0
        self._events: EventLog | None = None

    def use_horizons(self, horizons: Sequence[float]) -> None:
        """Forecast ``horizons`` (fitted ones) from now on; the controller narrows the
        provider to the horizons its policy reads."""
        fitted = self.forecaster.horizons_
        wanted = check_horizons(horizons)
        unknown = [h for h in wanted if h not in fitted]
        if unknown:
            raise ConfigError(
                f"horizon(s) {unknown} not fitted by '{self.forecaster.name}' ({list(fitted)})"
            )
        self.horizons = wanted

    def attach(self, events: EventLog, truth: GroundTruth | None = None) -> None:
        """Start a new stream from a run's event log (and ground truth, for the oracle)."""
        self._events = events
        self._seen = 0
        self.forecaster.reset()
        if self.forecaster.needs_future:
            if truth is None:
                raise ConfigError(
                    f"forecaster '{self.forecaster.name}' reads the future, which only a "
                    "simulation provides",
                    hint="use a forecaster that learns from the past on real engines",
                )
            self.forecaster.attach_truth(truth)  # type: ignore[attr-defined]

    @property
    def rows_read(self) -> int:
        """Rows of the attached event log read so far (the rest of its life, the log
        may let go of them)."""
        return self._seen

    def forecast(self, obs: ClusterObservation) -> Forecast | None:
        events = self._events
        if events is None:
            raise ConfigError(
                "the forecast provider has no event stream",
                hint="the runtime must call attach(event_log) before the first tick",
            )
        batch = events.batch(self._seen)
        self._seen = batch.stop
        if getattr(self.forecaster, "accepts_batches", False):
            self.forecaster.update(batch, obs.time_s)
        else:
            self.forecaster.update(list(batch.rows()), obs.time_s)
        return self.forecaster.predict(self.horizons)


def make_provider(
    name_or_path: str | os.PathLike[str], horizons: Sequence[float] | None = None
) -> ForecastProvider:
    """A :class:`ForecastProvider` for a model folder, shipped model or data-free forecaster."""
    return ForecastProvider(resolve_forecaster(name_or_path), horizons=horizons)
