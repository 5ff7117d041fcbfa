"""The adapter the controller calls: observations in, :class:`Forecast` out.

``make_provider(name_or_path)`` resolves, in order: a saved model folder (a path with a
``manifest.json``), a shipped model ``models/<name>/``, or a registered forecaster that
needs no training data (``last-value``, ``ewma``, ``kalman``, ``oracle``). The provider
keeps the forecaster's stream: at every tick it feeds the tracker the events recorded
since the previous tick and forecasts from there.

In the simulator the events are ``obs.live.rows`` (``obs.live`` is the ``SimCluster``), so
the run must record telemetry. The oracle is additionally given the cluster itself, from
which it reads the live trajectories' ground-truth specs.
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

logger = logging.getLogger(__name__)


def models_dir() -> Path:
    """The repository's shipped ``models/`` folder (override with ``PRORSA_MODELS``)."""
    env = os.environ.get("PRORSA_MODELS")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "models"


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
        fitted = forecaster.horizons_
        self.horizons = fitted if horizons is None else check_horizons(horizons)
        unknown = [h for h in self.horizons if h not in fitted]
        if unknown:
            raise ConfigError(
                f"horizon(s) {unknown} not fitted by '{forecaster.name}' ({list(fitted)})"
            )
        self._seen = 0
        self._source: object | None = None

    def forecast(self, obs: ClusterObservation) -> Forecast | None:
        live = obs.live
        rows = getattr(live, "rows", None)
        if rows is None:
            raise ConfigError(
                "the forecast provider needs the run's lifecycle events (obs.live.rows); "
                "this observation carries none",
                hint="run the simulator with telemetry recording on",
            )
        if not getattr(live, "record", True):
            raise ConfigError(
                "this run records no telemetry, so the forecaster has nothing to read",
                hint="simulate with record=True (the default) when using a forecaster",
            )
        if live is not self._source:
            # A new run (or the first tick): start the stream from its first event.
            self._source = live
            self._seen = 0
            self.forecaster.reset()
            if self.forecaster.needs_future:
                self.forecaster.attach_live(live)  # type: ignore[attr-defined]
        new = rows[self._seen :]
        self._seen = len(rows)
        self.forecaster.update(new, obs.time_s)
        return self.forecaster.predict(self.horizons)


def make_provider(
    name_or_path: str | os.PathLike[str], horizons: Sequence[float] | None = None
) -> ForecastProvider:
    """A :class:`ForecastProvider` for a model folder, shipped model or data-free forecaster."""
    return ForecastProvider(resolve_forecaster(name_or_path), horizons=horizons)
