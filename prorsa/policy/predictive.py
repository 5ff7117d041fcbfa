"""Prorsa's predictive policy: size prefill and decode to the forecast demand of the next
horizon, and switch only when the gain outweighs the cost of switching."""

from __future__ import annotations

from prorsa.errors import ConfigError
from prorsa.policy.base import POLICIES, ClusterSpec, SplitPolicy
from prorsa.policy.demand import (
    Sizing,
    current_load,
    forecast_rate,
    kv_capacity_per_slot,
    split_slots,
)
from prorsa.policy.types import Allocation, ClusterObservation, Forecast


@POLICIES.register("predictive")
class PredictivePolicy(SplitPolicy):
    """Proportional sizing on forecast demand with switch-cost hysteresis.

    Each tick: prefill need = forecast prefill tokens over ``horizon_s`` (at ``quantile``
    when the forecaster gives quantiles) plus the backlog, over prefill throughput; decode
    need = forecast live sequences and KV over decode capacity. The split equalises the two
    utilisations; it is applied only if it lowers the busier side's utilisation by at least
    ``min_gain`` and the slot-seconds it saves over the horizon exceed
    ``switch_cost_weight`` times those lost to switching.

    Args:
        horizon_s: forecast horizon used for sizing (must be one the forecaster predicts).
        quantile: demand quantile to size for (None: point forecast).
        min_gain: minimum drop in the busier side's utilisation worth a switch.
        switch_cost_weight: how heavily to weigh slot-seconds lost while switching.
        prefill_fraction: split used until the first forecast arrives.
        local_prefill_threshold: if set, applied on every tick.
        target_batch_per_gpu, kv_target_fraction, prefill_target_util: sizing knobs.
    """

    needs_forecast = True

    def __init__(
        self,
        horizon_s: float = 5.0,
        quantile: float | None = 0.9,
        min_gain: float = 0.15,
        switch_cost_weight: float = 1.0,
        prefill_fraction: float = 0.25,
        local_prefill_threshold: int | None = None,
        target_batch_per_gpu: float = 64.0,
        kv_target_fraction: float = 0.85,
        prefill_target_util: float = 0.8,
    ) -> None:
        self.horizon_s = horizon_s
        self.quantile = quantile
        self.min_gain = min_gain
        self.switch_cost_weight = switch_cost_weight
        self.prefill_fraction = prefill_fraction
        self.local_prefill_threshold = local_prefill_threshold
        self.target_batch_per_gpu = target_batch_per_gpu
        self.kv_target_fraction = kv_target_fraction
        self.prefill_target_util = prefill_target_util

    @classmethod
    def search_space(cls, trial) -> dict:
        return {
            "horizon_s": trial.suggest_categorical("horizon_s", [2.0, 5.0, 10.0]),
            "quantile": trial.suggest_categorical("quantile", [0.5, 0.9]),
            "min_gain": trial.suggest_float("min_gain", 0.0, 0.5),
            "switch_cost_weight": trial.suggest_float("switch_cost_weight", 0.0, 3.0),
            "target_batch_per_gpu": trial.suggest_float(
                "target_batch_per_gpu", 16.0, 256.0, log=True
            ),
            "prefill_target_util": trial.suggest_float("prefill_target_util", 0.4, 0.95),
        }

    def reset(self, cluster: ClusterSpec, seed: int = 0) -> None:
        super().reset(cluster, seed)
        if self.horizon_s <= 0:
            raise ConfigError("predictive: horizon_s must be > 0")
        if self.min_gain < 0 or self.switch_cost_weight < 0:
            raise ConfigError("predictive: min_gain and switch_cost_weight must be >= 0")
        self.sizing_ = Sizing(
            self.target_batch_per_gpu, self.kv_target_fraction, self.prefill_target_util
        )

    def needs(self, obs: ClusterObservation, forecast: Forecast) -> tuple[float, float]:
        """(prefill slots, decode slots) the forecast demand calls for."""
        spec, h, q = self.cluster_, self.horizon_s, self.quantile
        load = current_load(obs)
        rate = forecast_rate(forecast, "prefill_tokens", h, q)
        prefill = self.sizing_.prefill_slots_needed(spec, rate, load.prefill_backlog_tokens, h)
        use_q = q is not None and q in forecast.quantiles
        seqs = forecast.at("decode_sequences", h, q if use_q else None)
        kv = forecast.at("decode_kv_tokens", h, q if use_q else None)
        decode = self.sizing_.decode_slots_needed(
            spec,
            max(seqs, load.decode_sequences),
            max(kv, load.decode_kv_tokens),
            kv_capacity_per_slot(obs),
        )
        return prefill, decode

    def decide(self, obs: ClusterObservation, forecast: Forecast | None) -> Allocation:
        slots = self.cluster_.num_slots
        current = current_load(obs).prefill_slots
        if forecast is None or current == 0:
            return self.split(
                current or self.initial_prefill_slots(), "predictive: no forecast yet"
            )
        need_p, need_d = self.needs(obs, forecast)
        target = split_slots(slots, need_p, need_d)
        if target == current:
            return self.split(current, "predictive: balanced")
        gain = _max_util(current, slots, need_p, need_d) - _max_util(target, slots, need_p, need_d)
        saved = (
            _shortage(current, slots, need_p, need_d) - _shortage(target, slots, need_p, need_d)
        ) * self.horizon_s
        lost = self.switch_cost_weight * abs(target - current) * self.cluster_.switch_latency_s
        if gain >= self.min_gain and saved >= lost:
            return self.split(target, f"predictive: need {need_p:.1f}P/{need_d:.1f}D")
        return self.split(current, "predictive: hold (gain below switch cost)")


def _max_util(prefill: int, slots: int, need_p: float, need_d: float) -> float:
    return max(need_p / prefill, need_d / (slots - prefill))


def _shortage(prefill: int, slots: int, need_p: float, need_d: float) -> float:
    return max(need_p - prefill, 0.0) + max(need_d - (slots - prefill), 0.0)
