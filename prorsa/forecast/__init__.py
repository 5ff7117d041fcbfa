"""Forecasting prefill and decode demand from lifecycle telemetry."""

from prorsa.forecast.types import TARGETS, Forecast

__all__ = ["TARGETS", "Forecast"]
