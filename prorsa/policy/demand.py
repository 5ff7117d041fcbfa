"""Turning observations and forecasts into capacity needs, in slots.

Everything here is pure arithmetic over the cost profile's throughput numbers (as in
Dynamo's planner): how many slots prefill needs to serve the tokens arriving over a
horizon plus the backlog, and how many slots decode needs to hold the live sequences'
KV and keep batches at a target size.
"""

from __future__ import annotations

from dataclasses import dataclass

from prorsa.policy.base import ClusterSpec
from prorsa.policy.types import SWITCHING, ClusterObservation, Forecast


@dataclass(frozen=True)
class Load:
    """What the cluster carries right now."""

    prefill_backlog_tokens: float  # queued on prefill slots (not yet computed)
    decode_sequences: float  # decoding or waiting to decode
    decode_kv_tokens: float  # KV held by decoding trajectories
    prefill_slots: int
    decode_slots: int


def current_load(obs: ClusterObservation) -> Load:
    """Backlog, live decode sequences and KV, and the slots per role (switching slots
    counted toward their target)."""
    backlog = sum(s.queued_prefill_tokens for s in obs.slots if s.role == "prefill")
    prefill = sum(
        1 for s in obs.slots if (s.target_role if s.role == SWITCHING else s.role) == "prefill"
    )
    decode_side = len(obs.slots) - prefill
    states = obs.trajectory_state
    tokens = obs.trajectory_tokens
    return Load(
        prefill_backlog_tokens=float(backlog),
        decode_sequences=float(states.get("decoding", 0) + states.get("transferring", 0)),
        decode_kv_tokens=float(tokens.get("decoding", 0) + tokens.get("transferring", 0)),
        prefill_slots=prefill,
        decode_slots=decode_side,
    )


@dataclass(frozen=True)
class Sizing:
    """Knobs that turn demand into slot counts."""

    target_batch_per_gpu: float = 64.0  # decode sequences per GPU before TPOT suffers
    kv_target_fraction: float = 0.85  # plan decode KV to this share of capacity
    prefill_target_util: float = 0.8  # plan prefill GPUs to this utilisation

    def prefill_slots_needed(
        self, spec: ClusterSpec, tokens_per_s: float, backlog_tokens: float, horizon_s: float
    ) -> float:
        """Slots to serve ``tokens_per_s`` arriving plus drain the backlog within the horizon."""
        per_slot = spec.prefill_tokens_per_s_per_gpu * spec.slot_gpus * self.prefill_target_util
        return (tokens_per_s + backlog_tokens / max(horizon_s, 1e-9)) / per_slot

    def decode_slots_needed(
        self, spec: ClusterSpec, sequences: float, kv_tokens: float, kv_capacity_per_slot: float
    ) -> float:
        """Slots to hold ``kv_tokens`` and keep batches at the target size."""
        by_batch = sequences / (self.target_batch_per_gpu * spec.slot_gpus)
        by_kv = kv_tokens / max(kv_capacity_per_slot * self.kv_target_fraction, 1.0)
        return max(by_batch, by_kv)


def kv_capacity_per_slot(obs: ClusterObservation) -> float:
    """KV tokens one slot holds (decode-side slots, as observed)."""
    caps = [s.kv_capacity_tokens for s in obs.slots if s.role in ("decode", "colocated")]
    caps = caps or [s.kv_capacity_tokens for s in obs.slots]
    return max(sum(caps) / len(caps), 1.0)


def forecast_rate(
    forecast: Forecast, target: str, horizon_s: float, quantile: float | None
) -> float:
    """Per-second rate of a cumulative target over ``horizon_s`` (quantile when available)."""
    use_q = quantile is not None and quantile in forecast.quantiles
    return forecast.at(target, horizon_s, quantile if use_q else None) / horizon_s


def split_slots(total: int, prefill_need: float, decode_need: float) -> int:
    """Prefill slots out of ``total`` in proportion to the needs (at least one each side)."""
    need = prefill_need + decode_need
    share = 0.5 if need <= 0 else prefill_need / need
    return int(min(max(round(total * share), 1), total - 1))
