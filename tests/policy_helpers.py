"""Synthetic observations and forecasts for policy tests."""

from __future__ import annotations

import numpy as np

from prorsa.policy import ClusterObservation, ClusterSpec, Forecast, SlotView
from prorsa.telemetry.views import STATES

HORIZONS = (1.0, 2.0, 5.0, 10.0, 30.0)


def spec(num_slots: int = 8, slot_gpus: int = 1) -> ClusterSpec:
    return ClusterSpec(
        num_slots=num_slots,
        slot_gpus=slot_gpus,
        role_tp={"prefill": slot_gpus, "decode": slot_gpus, "colocated": slot_gpus},
        prefill_tokens_per_s_per_gpu=20_000.0,
        decode_tokens_per_s_per_gpu=5_000.0,
        switch_latency_s=2.0,
        min_dwell_s=5.0,
    )


def observation(
    t: float,
    roles: list[str],
    *,
    prefill_queue: int = 0,
    decoding: int = 100,
    decode_kv: int = 500_000,
    kv_capacity: int = 1_000_000,
    since: float = -100.0,
    switching: dict[int, str] | None = None,
) -> ClusterObservation:
    switching = switching or {}
    prefill_slots = [i for i, r in enumerate(roles) if r == "prefill"]
    decode_slots = [i for i, r in enumerate(roles) if r == "decode"] or [0]
    slots = []
    for i, role in enumerate(roles):
        is_prefill = role == "prefill"
        slots.append(
            SlotView(
                slot_id=i,
                role="switching" if i in switching else role,
                target_role=switching.get(i),
                gpus=1,
                engines=1,
                queued_prefill_tokens=prefill_queue // max(len(prefill_slots), 1)
                if is_prefill
                else 0,
                running_sequences=0 if is_prefill else decoding // len(decode_slots),
                kv_used_tokens=0 if is_prefill else decode_kv // len(decode_slots),
                kv_capacity_tokens=kv_capacity,
                busy=True,
                since_s=since,
            )
        )
    state = dict.fromkeys(STATES, 0)
    tokens = dict.fromkeys(STATES, 0)
    state["decoding"], tokens["decoding"] = decoding, decode_kv
    return ClusterObservation(
        time_s=t,
        slots=tuple(slots),
        trajectory_state=state,
        trajectory_tokens=tokens,
        prefill_tokens_per_s={"prefill": 20_000.0},
        decode_tokens_per_s={"decode": 5_000.0},
    )


def forecast(
    t: float, prefill_rate: float, *, decoding: float = 100, kv: float = 500_000
) -> Forecast:
    h = np.asarray(HORIZONS)
    point = {
        "prefill_tokens": prefill_rate * h,
        "decode_tokens": 50.0 * decoding * h,
        "decode_sequences": np.full(len(h), float(decoding)),
        "decode_kv_tokens": np.full(len(h), float(kv)),
    }
    return Forecast(
        time_s=t,
        horizons_s=HORIZONS,
        point=point,
        quantiles={0.5: point, 0.9: {k: v * 1.1 for k, v in point.items()}},
    )
