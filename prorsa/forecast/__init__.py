"""Forecasting prefill and decode demand from lifecycle telemetry.

Heavy dependencies (lightgbm, torch, mlflow) are imported where they are used, so importing
this package (which registers the built-in forecasters) stays cheap.
"""

from prorsa.forecast import aggregate, baselines, gru, oracle, per_target, trajectory  # noqa: F401
from prorsa.forecast.base import FORECASTERS, Forecaster, load_forecaster
from prorsa.forecast.dataset import ForecastDataset, build_dataset
from prorsa.forecast.features import LifecycleFeatures
from prorsa.forecast.targets import demand_targets
from prorsa.forecast.tracker import LifecycleTracker
from prorsa.forecast.types import DEFAULT_HORIZONS, QUANTILES, TARGETS, Forecast

__all__ = [
    "DEFAULT_HORIZONS",
    "FORECASTERS",
    "QUANTILES",
    "TARGETS",
    "Forecast",
    "ForecastDataset",
    "Forecaster",
    "LifecycleFeatures",
    "LifecycleTracker",
    "build_dataset",
    "demand_targets",
    "load_forecaster",
    "make_forecaster",
]


def make_forecaster(name: str, **params: object) -> Forecaster:
    """Instantiate the forecaster registered as ``name`` with ``params``."""
    return FORECASTERS.get(name)(**params)
