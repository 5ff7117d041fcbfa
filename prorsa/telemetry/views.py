"""Derived views over an event table: per turn, per trajectory, and cluster state at t.

Pure functions of the event table (Arrow or pandas); nothing here reads files or clocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa

from prorsa.telemetry.schema import CLUSTER_EVENT_KINDS, EventKind

STAGE_KINDS: tuple[str, ...] = (
    EventKind.PREFILL_QUEUED,
    EventKind.PREFILL_START,
    EventKind.PREFILL_END,
    EventKind.KV_TRANSFER_START,
    EventKind.KV_TRANSFER_END,
    EventKind.DECODE_START,
    EventKind.DECODE_END,
    EventKind.TOOL_START,
    EventKind.TOOL_END,
)

#: Lifecycle state a trajectory is in right after an event of each kind.
STATE_AFTER: dict[str, str] = {
    EventKind.TRAJ_START: "queued",
    EventKind.PREFILL_QUEUED: "queued",
    EventKind.PREFILL_START: "prefilling",
    EventKind.PREFILL_END: "transferring",
    EventKind.KV_TRANSFER_START: "transferring",
    EventKind.KV_TRANSFER_END: "decoding",
    EventKind.DECODE_START: "decoding",
    EventKind.DECODE_END: "in_tool",
    EventKind.TOOL_START: "in_tool",
    EventKind.TOOL_END: "queued",
    EventKind.TRAJ_END: "done",
}
STATES: tuple[str, ...] = ("queued", "prefilling", "transferring", "decoding", "in_tool", "done")

_KEY = ["run_id", "trajectory_id"]


def to_frame(events: pa.Table | pd.DataFrame) -> pd.DataFrame:
    """Events as a pandas frame with ``kind`` as plain strings, in recorded order."""
    df = events.to_pandas() if isinstance(events, pa.Table) else events.copy()
    df["kind"] = df["kind"].astype(str)
    return df.reset_index(drop=True)


def trajectory_events(events: pa.Table | pd.DataFrame) -> pd.DataFrame:
    """Events that belong to a trajectory (cluster events such as role switches removed)."""
    df = to_frame(events)
    return df[~df["kind"].isin(CLUSTER_EVENT_KINDS)]


def turn_table(events: pa.Table | pd.DataFrame) -> pd.DataFrame:
    """One row per (run, trajectory, turn) with each stage's time and the turn's tokens.

    Stage columns are named after the event kind (``prefill_start``, ``decode_end``...), NaN
    where the stage did not happen. A recomputed prefill (preemption) shows as
    ``prefill_attempts > 1``; stage starts keep the first time, stage ends the last.
    """
    df = trajectory_events(events)
    key = [*_KEY, "turn"]
    if df.empty:
        columns = [*key, "group_id", "task", *STAGE_KINDS]
        return pd.DataFrame(columns=columns)
    stages = df[df["kind"].isin(STAGE_KINDS)]
    first = stages.pivot_table(index=key, columns="kind", values="time", aggfunc="min")
    last = stages.pivot_table(index=key, columns="kind", values="time", aggfunc="max")
    times = first.copy()
    for col in times.columns:
        if col.endswith("_end"):
            times[col] = last[col]
    times = times.reindex(columns=list(STAGE_KINDS))

    meta = df.groupby(key, sort=False).agg(group_id=("group_id", "first"), task=("task", "first"))
    prefill = df[df["kind"].isin([EventKind.PREFILL_START, EventKind.PREFILL_QUEUED])]
    prefill = prefill.sort_values("kind", kind="stable", ascending=False)  # prefer prefill_start
    prefill_first = prefill.groupby(key, sort=False).agg(
        context_tokens=("context_tokens", "first"),
        new_tokens=("new_tokens", "first"),
        cached_tokens=("cached_tokens", "first"),
    )
    starts = df[df["kind"] == EventKind.PREFILL_START]
    attempts = starts.groupby(key, sort=False).size().rename("prefill_attempts")
    prefill_engine = starts.groupby(key, sort=False)["engine_id"].last().rename("prefill_engine")
    decode = df[df["kind"] == EventKind.DECODE_END].groupby(key, sort=False)
    decode_cols = decode.agg(
        output_tokens=("output_tokens", "last"), decode_engine=("engine_id", "last")
    )

    out = meta.join([prefill_first, times, attempts, prefill_engine, decode_cols], how="left")
    for col in (
        "context_tokens",
        "new_tokens",
        "cached_tokens",
        "output_tokens",
        "prefill_attempts",
    ):
        out[col] = out[col].fillna(0).astype(np.int64)
    for col in ("prefill_engine", "decode_engine"):
        out[col] = out[col].fillna(-1).astype(np.int64)
    out["tool_latency_s"] = out[EventKind.TOOL_END] - out[EventKind.TOOL_START]
    out["ttft_s"] = out[EventKind.DECODE_START] - out[EventKind.PREFILL_QUEUED].fillna(
        out[EventKind.PREFILL_START]
    )
    decode_span = out[EventKind.DECODE_END] - out[EventKind.DECODE_START]
    out["tpot_s"] = decode_span / out["output_tokens"].where(out["output_tokens"] > 0)
    out = out.reset_index().sort_values(key, kind="stable").reset_index(drop=True)
    out.columns.name = None
    return out


def trajectory_table(events: pa.Table | pd.DataFrame) -> pd.DataFrame:
    """One row per (run, trajectory): start, end, completion time, turns and token totals."""
    df = trajectory_events(events)
    if df.empty:
        return pd.DataFrame(
            columns=[*_KEY, "group_id", "task", "start_s", "end_s", "completion_s", "turns"]
        )
    turns = turn_table(df)
    grouped = df.groupby(_KEY, sort=False)
    base = grouped.agg(
        group_id=("group_id", "first"),
        task=("task", "first"),
        start_s=("time", "min"),
        last_event_s=("time", "max"),
    )
    ends = df[df["kind"] == EventKind.TRAJ_END].groupby(_KEY, sort=False)["time"].max()
    base["end_s"] = ends.reindex(base.index)
    base["done"] = base["end_s"].notna()
    base["completion_s"] = base["end_s"] - base["start_s"]
    per_turn = turns.groupby(_KEY, sort=False).agg(
        turns=("turn", "nunique"),
        new_tokens=("new_tokens", "sum"),
        cached_tokens=("cached_tokens", "sum"),
        output_tokens=("output_tokens", "sum"),
        final_context_tokens=("context_tokens", "max"),
        tool_time_s=("tool_latency_s", "sum"),
        prefill_attempts=("prefill_attempts", "sum"),
    )
    out = base.join(per_turn, how="left").reset_index()
    return out


@dataclass(frozen=True)
class StateCount:
    """Trajectories in one lifecycle state and the sum of their current context lengths."""

    count: int
    context_tokens: int


def cluster_state_at(events: pa.Table | pd.DataFrame, t: float) -> dict[str, StateCount]:
    """How many trajectories are queued / prefilling / transferring / decoding / in a tool /
    done at time ``t`` (events at exactly ``t`` count as happened), with context-token sums.

    Trajectories that have not started by ``t`` are not counted.
    """
    df = trajectory_events(events)
    result = {state: StateCount(0, 0) for state in STATES}
    if df.empty:
        return result
    # Context only grows within a trajectory; carrying its running max forward gives every
    # event (decode_end, tool_start...) the context of the turn it belongs to.
    df = df.assign(context_so_far=df.groupby(_KEY, sort=False)["context_tokens"].cummax())
    past = df[df["time"] <= t]
    if past.empty:
        return result
    # Stable sort by time keeps recorded order for ties, so the last row is the latest event.
    latest = past.sort_values("time", kind="stable").groupby(_KEY, sort=False).tail(1)
    states = latest["kind"].map(STATE_AFTER)
    summary = latest.assign(state=states).groupby("state")["context_so_far"].agg(["count", "sum"])
    for state, row in summary.iterrows():
        result[str(state)] = StateCount(int(row["count"]), int(row["sum"]))
    return result
