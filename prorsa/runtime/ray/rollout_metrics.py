"""Rollout metrics from lifecycle telemetry alone, so real and simulated runs compare 1:1.

Everything here is a pure function of an event table (the per-turn and per-trajectory
views), which is what lets the fidelity benchmark apply the same code to the real
runtime's telemetry and to the simulator's.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow as pa

from prorsa.telemetry.views import to_frame, trajectory_table, turn_table

#: Stage name -> (start event, end event) in the per-turn view.
STAGES: dict[str, tuple[str, str]] = {
    "queue": ("prefill_queued", "prefill_start"),
    "prefill": ("prefill_start", "prefill_end"),
    "transfer": ("kv_transfer_start", "kv_transfer_end"),
    "decode": ("decode_start", "decode_end"),
    "tool": ("tool_start", "tool_end"),
}


def _pct(values: pd.Series | np.ndarray, q: float) -> float | None:
    arr = np.asarray(values, dtype=float)
    arr = arr[np.isfinite(arr)]
    return float(np.percentile(arr, q)) if len(arr) else None


def stage_times(events: pa.Table | pd.DataFrame) -> dict[str, dict[str, float | int | None]]:
    """Per stage: turns that went through it, total and mean seconds, p50 and p99.

    ``ttft`` (queued to first decoded token) is included as a stage too.
    """
    turns = turn_table(events)
    out: dict[str, dict[str, float | int | None]] = {}
    spans = {name: turns[end] - turns[start] for name, (start, end) in STAGES.items()}
    spans["ttft"] = turns["ttft_s"]
    for name, span in spans.items():
        values = span.to_numpy(dtype=float)
        values = values[np.isfinite(values)]
        out[name] = {
            "turns": len(values),
            "total_s": float(values.sum()),
            "mean_s": float(values.mean()) if len(values) else None,
            "p50_s": _pct(values, 50),
            "p99_s": _pct(values, 99),
        }
    return out


def switch_summary(events: pa.Table | pd.DataFrame) -> dict[str, object]:
    """Role switches started, completed (no error) and their total seconds."""
    df = to_frame(events)
    ends = df[df["kind"] == "role_switch_end"]
    details = [json.loads(d) if d else {} for d in ends["detail"]]
    done = [d for d in details if not d.get("error") and not d.get("skipped")]
    return {
        "switches_started": int((df["kind"] == "role_switch_start").sum()),
        "switches_completed": len(done),
        "switch_s_total": float(sum(d.get("total_s", 0.0) for d in done)),
        "switch_aborted_legs": int(sum(d.get("aborted", 0) for d in done)),
    }


def rollout_metrics(events: pa.Table | pd.DataFrame, mode: str = "sync") -> dict[str, object]:
    """Makespan (sync) or throughput (async), TTFT/TPOT, stage times, tokens and switches.

    A partial run is flagged, not hidden: ``run_complete`` is False with the reasons in
    ``partial_reasons`` (:func:`~prorsa.telemetry.manifest.check_complete` on the table),
    and trajectories whose ``traj_end`` says they were interrupted or failed do not count
    as completed.
    """
    from prorsa.telemetry.manifest import check_complete

    completeness = check_complete(events, allow_partial=True)
    turns = turn_table(events)
    trajs = trajectory_table(events)
    if len(trajs):
        trajs = trajs.assign(done=trajs["done"] & ~_cut_short(events, trajs))
    done = trajs[trajs["done"]] if len(trajs) else trajs
    start = float(trajs["start_s"].min()) if len(trajs) else 0.0
    end = float(done["end_s"].max()) if len(done) else start
    span = max(end - start, 0.0)
    decode_tokens = int(turns["output_tokens"].sum()) if len(turns) else 0
    paths = _paths(events)
    metrics: dict[str, object] = {
        "mode": mode,
        "trajectories_started": len(trajs),
        "trajectories_completed": len(done),
        "turns": len(turns),
        "prefill_tokens_computed": int(turns["new_tokens"].sum()) if len(turns) else 0,
        "prefill_tokens_cached": int(turns["cached_tokens"].sum()) if len(turns) else 0,
        "decode_tokens": decode_tokens,
        "ttft_s_p50": _pct(turns["ttft_s"], 50),
        "ttft_s_p99": _pct(turns["ttft_s"], 99),
        "tpot_s_p50": _pct(turns["tpot_s"], 50),
        "tpot_s_p99": _pct(turns["tpot_s"], 99),
        "completion_s_p50": _pct(done["completion_s"], 50),
        "completion_s_p99": _pct(done["completion_s"], 99),
        "turn_paths": paths,
        "stages": stage_times(events),
        **switch_summary(events),
        "run_complete": completeness.complete,
        "partial_reasons": completeness.reasons,
    }
    if mode == "sync":
        metrics["makespan_s"] = span
    metrics["throughput_traj_per_hour"] = len(done) / span * 3600 if span > 0 else 0.0
    metrics["decode_tokens_per_s"] = decode_tokens / span if span > 0 else 0.0
    return metrics


def _cut_short(events: pa.Table | pd.DataFrame, trajs: pd.DataFrame) -> pd.Series:
    """Per row of ``trajs``: its ``traj_end`` says ``interrupted`` or ``failed``."""
    from prorsa.telemetry.manifest import INCOMPLETE_TRAJECTORY_STATUSES

    df = to_frame(events)
    ends = df[df["kind"] == "traj_end"]
    cut = {
        (run, traj)
        for run, traj, detail in zip(
            ends["run_id"], ends["trajectory_id"], ends["detail"], strict=True
        )
        if detail and (json.loads(detail).get("status") in INCOMPLETE_TRAJECTORY_STATUSES)
    }
    keys = zip(trajs["run_id"], trajs["trajectory_id"], strict=True)
    return pd.Series([key in cut for key in keys], index=trajs.index, dtype=bool)


def _paths(events: pa.Table | pd.DataFrame) -> dict[str, int]:
    df = to_frame(events)
    ends = df[df["kind"] == "decode_end"]["detail"]
    out: dict[str, int] = {}
    for detail in ends:
        path = (json.loads(detail) if detail else {}).get("path", "unknown")
        out[path] = out.get(path, 0) + 1
    return out
