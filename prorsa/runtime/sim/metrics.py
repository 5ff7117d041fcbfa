"""Run metrics from simulator telemetry and engine accounting."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pyarrow as pa

from prorsa.policy.types import ROLES, SWITCHING
from prorsa.runtime.sim.cluster import SimCluster
from prorsa.runtime.sim.drivers import DriverResult
from prorsa.telemetry.views import trajectory_table, turn_table


def _pct(values: pd.Series | np.ndarray, q: float) -> float | None:
    arr = np.asarray(values, dtype=float)
    arr = arr[np.isfinite(arr)]
    return float(np.percentile(arr, q)) if len(arr) else None


def role_intervals(cluster: SimCluster, end_s: float):
    """``(start_s, end_s, role, gpus)`` for every stretch a slot spent in one role."""
    for slot in cluster.slots:
        marks = [*slot.history, (end_s, None)]
        for (t0, role), (t1, _) in itertools.pairwise(marks):
            yield t0, min(t1, end_s), role, slot.gpus


def role_gpu_seconds(cluster: SimCluster, end_s: float) -> dict[str, float]:
    """GPU-seconds each role (and switching) held over ``[0, end_s]``."""
    out = dict.fromkeys((*ROLES, SWITCHING), 0.0)
    for t0, t1, role, gpus in role_intervals(cluster, end_s):
        out[role] += max(t1 - t0, 0.0) * gpus
    return out


def busy_fractions(cluster: SimCluster, end_s: float) -> dict[str, float | None]:
    """Share of each role's GPU-time spent executing steps (draining counts as switching)."""
    busy = dict(cluster.tally.busy_carry_s)
    for slot in cluster.slots:
        if slot.role in ROLES:
            for engine in slot.engines:
                busy[slot.role] += engine.busy_s * engine.tp
    held = role_gpu_seconds(cluster, end_s)
    return {r: (busy[r] / held[r] if held[r] > 0 else None) for r in ROLES}


def compute_metrics(
    cluster: SimCluster, driver: DriverResult, telemetry: pa.Table | None = None
) -> dict[str, object]:
    """The numbers `prorsa simulate` reports, from the cluster's running tallies.

    ``telemetry`` is not needed (kept for callers that pass it); :func:`telemetry_metrics`
    recomputes the per-turn numbers from events, and a test checks the two agree.
    """
    end_s = driver.end_s or cluster.env.now
    tally = cluster.tally
    metrics: dict[str, object] = {
        "mode": driver.mode,
        "end_s": end_s,
        "trajectories_started": driver.started,
        "trajectories_completed": driver.completed,
        "switches_started": tally.switches,
        "switches_completed": sum(
            1 for s in cluster.slots for _, r in s.history[1:] if r != SWITCHING
        ),
        "preemptions": tally.preemptions,
        "migrations": tally.migrations,
        "recompute_tokens": sum(
            e.recompute_tokens for e in [*cluster.engines.values(), *cluster.retired]
        ),
        "busy_fraction": busy_fractions(cluster, end_s),
        "gpu_seconds_by_role": role_gpu_seconds(cluster, end_s),
        "turns": tally.turns_done,
        "prefill_tokens_computed": tally.prefill_tokens_computed,
        "prefill_tokens_cached": tally.prefill_tokens_cached,
        "decode_tokens": tally.decode_tokens,
        "completion_s_p50": _pct(tally.completion_s, 50),
        "completion_s_p99": _pct(tally.completion_s, 99),
        "ttft_s_p50": _pct(tally.ttft_s, 50),
        "ttft_s_p99": _pct(tally.ttft_s, 99),
        "tpot_s_p50": _pct(tally.tpot_s, 50),
        "tpot_s_p99": _pct(tally.tpot_s, 99),
        "reuse_mode": cluster.config.reuse_mode,
    }
    store = cluster.kv_store
    if store is not None:
        metrics["kv_store_hit_rate"] = store.hit_rate
        metrics["kv_store_hit_tokens"] = store.hit_tokens
    if driver.mode == "sync":
        metrics["makespan_s"] = float(sum(driver.step_makespans_s))
        metrics["step_makespans_s"] = list(driver.step_makespans_s)
    else:
        metrics["throughput_traj_per_hour"] = driver.completed / end_s * 3600 if end_s > 0 else 0.0
        metrics["trainer_steps"] = driver.trainer_steps
        metrics["decode_tokens_per_s"] = tally.decode_tokens / end_s if end_s > 0 else 0.0
    return metrics


def telemetry_metrics(telemetry: pa.Table) -> dict[str, object]:
    """Per-turn metrics recomputed from lifecycle events alone (the views)."""
    turns = turn_table(telemetry)
    trajs = trajectory_table(telemetry)
    done = trajs[trajs["done"]]
    return {
        "turns": len(turns),
        "prefill_tokens_computed": int(turns["new_tokens"].sum()),
        "prefill_tokens_cached": int(turns["cached_tokens"].sum()),
        "decode_tokens": int(turns["output_tokens"].sum()),
        "completion_s_p50": _pct(done["completion_s"], 50),
        "completion_s_p99": _pct(done["completion_s"], 99),
        "ttft_s_p50": _pct(turns["ttft_s"], 50),
        "ttft_s_p99": _pct(turns["ttft_s"], 99),
        "tpot_s_p50": _pct(turns["tpot_s"], 50),
        "tpot_s_p99": _pct(turns["tpot_s"], 99),
    }
