"""A compact statistical summary of an event table (what ``prorsa traces summary`` prints).

Built on the per-turn and per-trajectory views, so it describes recorded, simulated and
imported telemetry alike. Percentiles use numpy's default (linear interpolation).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from prorsa.telemetry.views import to_frame, trajectory_table, turn_table

TOKEN_COLUMNS: tuple[str, ...] = ("context_tokens", "new_tokens", "cached_tokens", "output_tokens")


def summarize(table: pa.Table | pd.DataFrame) -> dict[str, Any]:
    """Summary statistics of ``table`` (lifecycle events) as a JSON-ready dict.

    Keys: ``events``, ``trajectories``, ``trajectories_unfinished`` (no ``traj_end``),
    ``turns``, ``turns_per_trajectory`` (mean, p50, p90,
    max), per-turn token columns (p50, p90), ``cache_hit_ratio`` (cached / context
    tokens), ``tool_latency_s`` (count, p50, p90, p99 over turns followed by a tool),
    ``completion_s`` (per finished trajectory: p50, p90, max), ``span_s`` (first to last
    event) and ``tasks`` (trajectories per task). Statistics of empty sets are ``None``.
    """
    events = to_frame(table)
    turns = turn_table(events)
    trajectories = trajectory_table(events)
    per_trajectory = trajectories["turns"].to_numpy(dtype=float) if len(trajectories) else []
    tool = turns["tool_latency_s"].to_numpy(dtype=float) if len(turns) else np.array([])
    tool = tool[np.isfinite(tool)]
    completion = (
        trajectories["completion_s"].dropna().to_numpy(dtype=float) if len(trajectories) else []
    )
    context_sum = float(turns["context_tokens"].sum()) if len(turns) else 0.0
    summary: dict[str, Any] = {
        "events": len(events),
        "trajectories": len(trajectories),
        "trajectories_unfinished": int((~trajectories["done"].astype(bool)).sum())
        if len(trajectories)
        else 0,
        "turns": len(turns),
        "turns_per_trajectory": {
            "mean": _round(np.mean(per_trajectory)) if len(per_trajectory) else None,
            **_percentiles(per_trajectory, (50, 90)),
            "max": int(np.max(per_trajectory)) if len(per_trajectory) else None,
        },
    }
    for column in TOKEN_COLUMNS:
        values = turns[column].to_numpy(dtype=float) if len(turns) else []
        summary[column] = _percentiles(values, (50, 90))
    summary["cache_hit_ratio"] = (
        _round(turns["cached_tokens"].sum() / context_sum) if context_sum else None
    )
    summary["tool_latency_s"] = {"count": len(tool), **_percentiles(tool, (50, 90, 99))}
    summary["completion_s"] = {
        **_percentiles(completion, (50, 90)),
        "max": _round(np.max(completion)) if len(completion) else None,
    }
    times = events["time"].to_numpy(dtype=float)
    summary["span_s"] = _round(times.max() - times.min()) if len(times) else 0.0
    tasks = trajectories.groupby("task").size() if len(trajectories) else pd.Series(dtype=int)
    summary["tasks"] = {str(task): int(n) for task, n in tasks.items()}
    return summary


def _percentiles(values: Any, quantiles: tuple[int, ...]) -> dict[str, float | None]:
    values = np.asarray(values, dtype=float)
    if not len(values):
        return {f"p{q}": None for q in quantiles}
    points = np.percentile(values, quantiles)
    return {f"p{q}": _round(v) for q, v in zip(quantiles, points, strict=True)}


def _round(value: float) -> float:
    # Three decimals: milliseconds for times, and token percentiles stay readable.
    return round(float(value), 3)
