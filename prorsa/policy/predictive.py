"""Prorsa's predictive policy: size prefill and decode to the forecast demand of the next
horizon, and switch only when the gain outweighs the cost of switching."""

from __future__ import annotations

from collections.abc import Sequence

from prorsa.errors import ConfigError
from prorsa.policy.base import POLICIES, ClusterSpec, ModeChoosingPolicy
from prorsa.policy.demand import (
    PrefillWorkMeter,
    Sizing,
    agreed_mode,
    band_levels,
    best_split,
    busier_utilisation,
    check_quantile,
    choose_mode,
    current_load,
    decode_demand,
    decode_drain_s,
    forecast_rate,
    kv_capacity_per_slot,
    paying_s,
    resize_rebuild_s,
    split_shortage,
)
from prorsa.policy.types import Allocation, ClusterObservation, Forecast

_SIZING = object()  # needs(): the policy's own sizing quantile


@POLICIES.register("predictive")
class PredictivePolicy(ModeChoosingPolicy):
    """Proportional sizing on forecast demand with switch-cost hysteresis.

    Each tick: prefill need = forecast prefill tokens over ``horizon_s`` (at ``quantile``
    when the forecaster gives quantiles) plus the backlog, over prefill throughput; decode
    need = forecast live sequences and KV over decode capacity. The split is the one whose
    busier side is least utilised (:func:`prorsa.policy.demand.best_split`, as in the
    resize that :func:`~prorsa.policy.demand.choose_mode` weighs a mode change against); it
    is applied only if it lowers the busier side's utilisation by at least
    ``min_gain`` and the slot-seconds it saves over ``payback_s`` exceed
    ``switch_cost_weight`` times those a switch costs: the switching slots' service, plus
    the prefill needed to rebuild the contexts the moved slots hold or cache that prefill
    would have read (:func:`prorsa.policy.demand.resize_rebuild_s`). Decode need counts
    those cached contexts (trajectories between turns) too, except while no split's
    prefill could clear the backlog within the horizon: then
    decode is sized for the KV of what decodes (:func:`prorsa.policy.demand.decode_demand`).

    Colocation is part of the action space: with every slot colocated the cluster pools
    its capacity (prefill costing ``prefill_interference`` times its work under data-parallel
    attention), and the policy moves between colocation and a split when the same
    savings-versus-cost test says so (:func:`prorsa.policy.demand.choose_mode`). Every
    switch's savings are counted on the demand forecast over the payback window (the
    longest forecast horizon within ``payback_s``), from the moment the switch completes
    (a 20 s reshard saves over ``payback_s - 20`` only); the split it sizes to comes from
    ``horizon_s``. A mode change that dwell times hold back is finished before the split
    is tuned again.

    Args:
        horizon_s: forecast horizon used for sizing (must be one the forecaster predicts).
        quantile: demand quantile to size for (None: point forecast).
        min_gain: minimum drop in the busier side's utilisation worth a switch.
        switch_cost_weight: how heavily to weigh slot-seconds lost while switching.
        payback_s: how long the sized demand is assumed to last when weighing a switch's
            savings against its one-time cost.
        start: ``"colocated"`` (start colocated, disaggregate once a forecast shows it
            pays), ``"split"`` (start at ``prefill_fraction``), or ``"auto"``: colocated
            unless colocated engines use data-parallel attention.
        prefill_fraction: split used until the first forecast arrives.
        local_prefill_threshold: if set, applied on every tick.
        target_batch_per_gpu, kv_target_fraction, prefill_target_util: sizing knobs.
        robust: a switch must pay back at both ends of the forecast's P10-P90 band, not
            only at the sizing quantile (forecasters without quantiles: the point). On by
            default, as MPC's: on the held-out regime map it keeps splits that sizing at
            the P90 alone left on a sync step's opening burst (six regimes up, by up to
            9%; two down, by at most 0.4%; docs/decisions.md).
    """

    needs_forecast = True

    def __init__(
        self,
        horizon_s: float = 5.0,
        quantile: float | None = 0.9,
        min_gain: float = 0.15,
        switch_cost_weight: float = 1.0,
        payback_s: float = 30.0,
        start: str = "auto",
        prefill_fraction: float = 0.25,
        local_prefill_threshold: int | None = None,
        target_batch_per_gpu: float = 64.0,
        kv_target_fraction: float = 0.85,
        prefill_target_util: float = 0.8,
        robust: bool = True,
    ) -> None:
        self.horizon_s = horizon_s
        self.quantile = quantile
        self.min_gain = min_gain
        self.switch_cost_weight = switch_cost_weight
        self.payback_s = payback_s
        self.start = start
        self.prefill_fraction = prefill_fraction
        self.local_prefill_threshold = local_prefill_threshold
        self.target_batch_per_gpu = target_batch_per_gpu
        self.kv_target_fraction = kv_target_fraction
        self.prefill_target_util = prefill_target_util
        self.robust = robust

    @classmethod
    def search_space(cls, trial) -> dict:
        return {
            "horizon_s": trial.suggest_categorical("horizon_s", [2.0, 5.0, 10.0]),
            "quantile": trial.suggest_categorical("quantile", [0.5, 0.9]),
            "min_gain": trial.suggest_float("min_gain", 0.0, 0.5),
            "switch_cost_weight": trial.suggest_float("switch_cost_weight", 0.0, 3.0),
            "payback_s": trial.suggest_float("payback_s", 5.0, 120.0, log=True),
            "target_batch_per_gpu": trial.suggest_float(
                "target_batch_per_gpu", 16.0, 256.0, log=True
            ),
            "prefill_target_util": trial.suggest_float("prefill_target_util", 0.4, 0.95),
            "robust": trial.suggest_categorical("robust", [True, False]),
            **cls.start_space(trial),
        }

    def reset(self, cluster: ClusterSpec, seed: int = 0) -> None:
        super().reset(cluster, seed)
        if self.horizon_s <= 0:
            raise ConfigError("predictive: horizon_s must be > 0")
        if self.min_gain < 0 or self.switch_cost_weight < 0 or self.payback_s <= 0:
            raise ConfigError(
                "predictive: min_gain, switch_cost_weight >= 0 and payback_s > 0 required"
            )
        check_quantile("predictive", self.quantile)
        self.sizing_ = Sizing(
            self.target_batch_per_gpu, self.kv_target_fraction, self.prefill_target_util
        )
        # The work ratio is per token, not per slot: a lost engine keeps it.
        self.work_ = self.kept_on_resize("work_", PrefillWorkMeter())

    def needs(
        self,
        obs: ClusterObservation,
        forecast: Forecast,
        work_ratio: float | None = None,
        horizon_s: float | None = None,
        quantile: float | object | None = _SIZING,
    ) -> tuple[float, float]:
        """(prefill slots, decode slots) the forecast demand over ``horizon_s`` (default:
        the sizing horizon) at ``quantile`` (default: the sizing quantile) calls for, with
        engines computing ``work_ratio`` tokens per appended token (default: as measured
        now)."""
        spec = self.cluster_
        q = self.quantile if quantile is _SIZING else quantile
        h = self.horizon_s if horizon_s is None else horizon_s
        load = current_load(obs)
        # Forecasts count appended tokens; engines compute what caches miss of them.
        ratio = self.work_.ratio if work_ratio is None else work_ratio
        rate = forecast_rate(forecast, "prefill_tokens", h, q) * ratio
        prefill = self.sizing_.prefill_slots_needed(spec, rate, load.prefill_backlog_tokens, h)
        use_q = q is not None and q in forecast.quantiles
        seqs = forecast.at("decode_sequences", h, q if use_q else None)
        kv = forecast.at("decode_kv_tokens", h, q if use_q else None)
        bound = self.sizing_.prefill_bound(spec, load, h)
        seqs, kv = decode_demand(load, seqs, kv, bound)
        decode = self.sizing_.decode_slots_needed(spec, seqs, kv, kv_capacity_per_slot(obs))
        return prefill, decode

    def forecast_horizons(self, fitted: Sequence[float]) -> tuple[float, ...]:
        """The sizing horizon and the payback horizon (see :func:`payback_horizon_s`)."""
        window = payback_horizon_s(fitted, self.horizon_s, self.payback_s)
        return tuple(sorted({self.horizon_s, window}))

    def decide(self, obs: ClusterObservation, forecast: Forecast | None) -> Allocation:
        slots = self.cluster_.num_slots
        load = current_load(obs)
        current = load.prefill_slots
        self.work_.update(obs)
        if forecast is None:
            return self.before_forecast(obs, current, "predictive")
        need_p, need_d = self.needs(obs, forecast)
        # A switch is paid once and pays back over ``payback_s``: its savings are judged on
        # the demand forecast over that window, not on the sizing horizon, where a sync
        # step's opening burst looks like lasting demand. With ``robust``, at both ends of
        # the forecast's band (see :meth:`window_needs`).
        window = payback_horizon_s(forecast, self.horizon_s, self.payback_s)
        ends = self.window_needs(obs, forecast, window, need_p, need_d)
        modes = [
            choose_mode(
                obs,
                self.cluster_,
                window_p,
                window_d,
                current_prefill=max(current, 1),
                payback_s=self.payback_s,
                switch_cost_weight=self.switch_cost_weight,
                prefill_target_util=self.sizing_.prefill_target_util,
                colocated_need_p=colocated_p,
            )
            for window_p, window_d, colocated_p in ends
        ]
        mode = agreed_mode(modes)
        changed = self.apply_mode(obs, mode, "predictive", f" (need {need_p:.1f}P/{need_d:.1f}D)")
        if changed is not None:
            return changed
        target = best_split(slots, need_p, need_d)
        if target == current:
            return self.split(current, "predictive: balanced")
        gain = busier_utilisation(current, slots, need_p, need_d) - busier_utilisation(
            target, slots, need_p, need_d
        )
        # Between prefill and decode of different layouts a slot reshards; it serves its
        # new role (and saves anything) only once that is done.
        old, new = ("decode", "prefill") if target > current else ("prefill", "decode")
        latency = self.cluster_.switch_latency_between(old, new)
        # Decode slots serve prefill only once their running sequences have drained.
        done_s = latency + decode_drain_s(obs, self.cluster_, target - current)
        paying = paying_s(self.payback_s, done_s)
        if target > current and self.sizing_.prefill_bound(
            self.cluster_, load, self.payback_s + done_s
        ):
            # A backlog no split clears by then keeps prefill short after the switch
            # completes: the move saves a whole window, however long it takes.
            paying = self.payback_s
        saved = min(
            (
                split_shortage(current, slots, window_p, window_d)
                - split_shortage(target, slots, window_p, window_d)
            )
            * paying
            for window_p, window_d, _ in ends
        )
        # A switch costs the slots' service while they switch, and throws away the contexts
        # the moved slots cache that prefill would read again (re-prefilled next turn).
        rebuild = resize_rebuild_s(
            obs, self.cluster_, current, target, self.sizing_.prefill_target_util
        )
        lost = self.switch_cost_weight * (abs(target - current) * latency + rebuild)
        # Strictly: a switch that saves nothing (saved == lost == 0) still drains its slots.
        if gain >= self.min_gain and saved > lost:
            return self.split(target, f"predictive: need {need_p:.1f}P/{need_d:.1f}D")
        return self.split(
            current,
            f"predictive: hold (need {need_p:.1f}P/{need_d:.1f}D; gain below switch cost)",
        )

    def window_needs(
        self,
        obs: ClusterObservation,
        forecast: Forecast,
        window: float,
        need_p: float,
        need_d: float,
    ) -> list[tuple[float, float, float]]:
        """(prefill, decode, prefill were the slots colocated) needs over the payback
        window: at the sizing quantile, and with ``robust`` also at the other end of the
        forecast's band (``ROBUST_QUANTILES``), so that a switch must pay back whichever
        end the demand takes. A sync step's prefill comes in waves; on a forecast whose
        P10 and P90 differ 2.4x (Qwen3-235B-A22B search sync 64/GPU at 9 s), sizing at the
        P90 alone resized a 4-slot split back and forth four times (0.98x against the
        1.19x of holding it). The band cuts both ways: under a backlog of hours (235B swe
        sync 64/GPU) it once held back the one move back to prefill that the run needed
        (1.15x -> 0.78x, when the forecaster's P10 of prefill there was 0); on the
        held-out map it costs that regime 0.2%."""
        ends = []
        levels = band_levels(forecast, self.quantile, self.robust)
        # Colocation is priced at the work ratio measured colocated (the same one unless a
        # split measured its own, see PrefillWorkMeter).
        colocated_ratio = self.work_.ratio_for(colocated=True)
        for q in levels:
            if window == self.horizon_s and q == self.quantile:
                window_p, window_d = need_p, need_d
            else:
                window_p, window_d = self.needs(obs, forecast, horizon_s=window, quantile=q)
            colocated_p = (
                window_p
                if colocated_ratio == self.work_.ratio
                else self.needs(obs, forecast, colocated_ratio, horizon_s=window, quantile=q)[0]
            )
            ends.append((window_p, window_d, colocated_p))
        return ends


def payback_horizon_s(
    forecast: Forecast | Sequence[float], sizing_s: float, payback_s: float
) -> float:
    """The forecast horizon a switch's savings are judged on: the longest one within the
    payback window, and no shorter than the sizing horizon. ``forecast``: a forecast or
    its horizons."""
    horizons = forecast.horizons_s if isinstance(forecast, Forecast) else forecast
    within = [h for h in horizons if sizing_s <= h <= payback_s]
    return max(within) if within else sizing_s
