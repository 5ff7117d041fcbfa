"""Demand targets computed from telemetry alone (what every forecaster is scored against).

At a control tick ``t`` and horizon ``h`` (seconds), per run:

* ``prefill_tokens`` — the sum of ``new_tokens`` over ``prefill_queued`` events with time in
  (t, t+h]. Demand is counted at *arrival*, not at ``prefill_start``: when a prefill starts
  depends on how many engines serve prefill, so a target measured there would shrink
  whenever a policy under-provisions prefill and the forecaster would learn the policy's
  own queueing instead of the workload. ``new_tokens`` at arrival is the turn's tokens to
  prefill as known then (the simulator records the tokens the turn appends; imported
  traces record the provider's uncached tokens). A preempted turn is re-queued with
  ``new_tokens = 0``, so recomputation never counts as new demand.
* ``decode_tokens`` — tokens generated in (t, t+h], each turn's ``output_tokens`` (from its
  ``decode_end``) spread uniformly over its decode time. Decode time is the union of the
  turn's decode segments: a segment opens at ``decode_start`` and closes at the
  trajectory's next event that leaves the decoding state (``decode_end``, a preemption's
  ``prefill_queued``, a migration's ``kv_transfer_start``...). A zero-length decode puts
  all its tokens at its end instant.
* ``decode_sequences`` — the time average over (t, t+h] of the number of open decode
  segments.
* ``decode_kv_tokens`` — the time average over (t, t+h] of the KV tokens of decoding
  sequences: the turn's context at ``decode_start`` (the trajectory's running maximum of
  ``context_tokens``) plus the tokens generated so far in the turn (uniform, as above).

Windows that run past the end of the telemetry count nothing there (true for a completed
run). A decode segment still open at the end of the telemetry counts as a sequence with
its context until the end, but its tokens are unknown and not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa

from prorsa.errors import InputError
from prorsa.forecast.types import TARGETS, check_horizons, target_column
from prorsa.telemetry.schema import CLUSTER_EVENT_KINDS, FIELDS, EventKind, conform
from prorsa.telemetry.views import STATE_AFTER

# Kinds after which a trajectory is (still) decoding; any other event closes a segment.
_DECODING_KINDS = frozenset(k for k, s in STATE_AFTER.items() if s == "decoding")


def event_frame(
    events: pa.Table | pd.DataFrame,
    *,
    source: str = "<telemetry>",
    keep_allocations: bool = False,
) -> pd.DataFrame:
    """Trajectory events as a frame sorted by (run, time), recorded order kept for ties.

    ``keep_allocations`` keeps the ``allocation`` events too (what a tracker replaying the
    run reads its GPU count from; :func:`trajectory_events` drops them again for targets).
    Raises :class:`InputError` for empty telemetry or missing columns.
    """
    if isinstance(events, pd.DataFrame):
        missing = [f for f in FIELDS if f not in events.columns]
        if missing:
            raise InputError(
                f"missing column(s) {', '.join(missing)}",
                source=source,
                field=missing[0],
                hint="telemetry needs the columns of prorsa.telemetry.schema.FIELDS",
            )
        df = events[list(FIELDS)].copy()
    else:
        df = conform(events, source=source).to_pandas()
    if df.empty:
        raise InputError("telemetry is empty (no events)", source=source)
    df["kind"] = df["kind"].astype(str)
    cluster = df["kind"].isin(CLUSTER_EVENT_KINDS)
    if cluster.all():
        raise InputError("telemetry holds no trajectory events", source=source)
    if keep_allocations:
        cluster &= df["kind"] != EventKind.ALLOCATION
    df = df[~cluster]
    if not np.isfinite(df["time"].to_numpy(float)).all():
        raise InputError("non-finite event time", source=source, field="time")
    df = df.reset_index(drop=True)
    df["_order"] = np.arange(len(df))
    return df.sort_values(["run_id", "time", "_order"], kind="stable").reset_index(drop=True)


def trajectory_events(run_events: pd.DataFrame) -> pd.DataFrame:
    """``run_events`` without its ``allocation`` events (see :func:`event_frame`)."""
    is_allocation = run_events["kind"] == EventKind.ALLOCATION
    return run_events[~is_allocation] if is_allocation.any() else run_events


@dataclass
class DecodeSegments:
    """Decode segments of one run (numpy columns, one entry per segment)."""

    trajectory_id: np.ndarray  # object
    turn: np.ndarray  # int
    start_s: np.ndarray
    end_s: np.ndarray  # end of telemetry for open segments
    context_tokens: np.ndarray  # KV tokens when the segment starts
    tokens: np.ndarray  # tokens generated in the segment (0 when unknown)
    closed: np.ndarray  # bool: closed by an event (False: open at the end)


def decode_segments(run_events: pd.DataFrame) -> DecodeSegments:
    """Decode segments of one run's events (as returned by :func:`event_frame`)."""
    df = run_events.sort_values(["trajectory_id", "time", "_order"], kind="stable")
    kind = df["kind"].to_numpy()
    times = df["time"].to_numpy(float)
    traj = df["trajectory_id"].to_numpy()
    turn = df["turn"].to_numpy(np.int64)
    ctx = df.groupby("trajectory_id", sort=False)["context_tokens"].cummax().to_numpy(float)
    n = len(df)
    end_of_run = float(times.max()) if n else 0.0
    closing = ~np.isin(kind, list(_DECODING_KINDS))
    # Position of the first closing event strictly after each position.
    pos = np.where(closing, np.arange(n), n)
    next_close = np.minimum.accumulate(pos[::-1])[::-1]
    next_close = np.append(next_close[1:], n)
    starts = np.flatnonzero(kind == EventKind.DECODE_START)
    close = next_close[starts]
    has_close = close < n
    same = np.zeros(len(starts), bool)
    same[has_close] = traj[close[has_close]] == traj[starts[has_close]]
    # A second decode_start before any closing event ends the first segment there.
    nxt_start = np.append(starts[1:], n)
    restarted = (nxt_start < np.where(same, close, n)) & (nxt_start < n)
    restarted &= np.append(traj[starts[1:]] == traj[starts[:-1]], False)
    end_pos = np.where(restarted, nxt_start, np.where(same, close, -1))
    closed = end_pos >= 0
    start_s = times[starts]
    end_s = np.where(closed, times[np.maximum(end_pos, 0)], end_of_run)
    seg_traj, seg_turn = traj[starts], turn[starts]
    seg_ctx = ctx[starts]

    # Output tokens of each (trajectory, turn): from its last decode_end.
    ends = df[kind == EventKind.DECODE_END]
    out = ends.groupby(["trajectory_id", "turn"], sort=False)["output_tokens"].last()
    seg = pd.DataFrame(
        {"trajectory_id": seg_traj, "turn": seg_turn, "dur": end_s - start_s, "closed": closed}
    )
    seg["out"] = out.reindex(pd.MultiIndex.from_arrays([seg_traj, seg_turn])).to_numpy(float)
    # Tokens are known only for turns that reached decode_end with every segment closed.
    grp = seg.groupby(["trajectory_id", "turn"], sort=False)
    total = grp["dur"].transform("sum").to_numpy(float)
    before = (grp["dur"].cumsum() - seg["dur"]).to_numpy(float)
    known = grp["closed"].transform("all").to_numpy(bool) & np.isfinite(seg["out"].to_numpy())
    o = np.where(known, seg["out"].to_numpy(float), 0.0)
    is_last = ~seg.duplicated(["trajectory_id", "turn"], keep="last").to_numpy()
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(total > 0, seg["dur"].to_numpy() / total, is_last.astype(float))
        done_before = np.where(total > 0, before / total, 0.0)
    return DecodeSegments(
        trajectory_id=seg_traj,
        turn=seg_turn,
        start_s=start_s,
        end_s=end_s,
        context_tokens=seg_ctx + o * done_before,
        tokens=o * share,
        closed=closed,
    )


class _Cumulative:
    """Running integrals of decode activity: tokens D(t), sequence-seconds and KV-seconds."""

    def __init__(self, seg: DecodeSegments) -> None:
        s, e = seg.start_s, seg.end_s
        dur = e - s
        ramp = dur > 0
        rate = np.where(ramp, seg.tokens / np.where(ramp, dur, 1.0), 0.0)
        # On [s, e): count +1, KV level c + r (u - s) = (c - r s) + r u.
        a0 = np.where(ramp, seg.context_tokens - rate * s, 0.0)
        points = np.concatenate([s, e])
        d_count = np.concatenate([ramp.astype(float), -ramp.astype(float)])
        d_rate = np.concatenate([rate, -rate])
        d_a = np.concatenate([a0, -a0])
        jump = np.concatenate([np.zeros(len(s)), np.where(ramp, 0.0, seg.tokens)])
        order = np.argsort(points, kind="stable")
        points = points[order]
        bp, inv = np.unique(points, return_inverse=True)
        m = len(bp)

        def per_point(x: np.ndarray) -> np.ndarray:
            return np.bincount(inv, weights=x[order], minlength=m)

        count = np.cumsum(per_point(d_count))
        rate_b = np.cumsum(per_point(d_rate))
        a_b = np.cumsum(per_point(d_a))
        jumps = per_point(jump)
        dt = np.diff(bp)
        tok = np.concatenate([[0.0], rate_b[:-1] * dt]) + jumps
        seq = np.concatenate([[0.0], count[:-1] * dt])
        kv = np.concatenate([[0.0], a_b[:-1] * dt + rate_b[:-1] * (bp[1:] ** 2 - bp[:-1] ** 2) / 2])
        self.bp, self.count, self.rate, self.a = bp, count, rate_b, a_b
        self.c_tok, self.c_seq, self.c_kv = np.cumsum(tok), np.cumsum(seq), np.cumsum(kv)

    def at(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens generated, sequence-seconds, KV token-seconds) accumulated up to ``q``."""
        q = np.asarray(q, float)
        if len(self.bp) == 0:
            z = np.zeros_like(q)
            return z, z, z
        k = np.searchsorted(self.bp, q, side="right") - 1
        before = k < 0
        k = np.maximum(k, 0)
        b = self.bp[k]
        dq = q - b
        tok = self.c_tok[k] + self.rate[k] * dq
        seq = self.c_seq[k] + self.count[k] * dq
        kv = self.c_kv[k] + self.a[k] * dq + self.rate[k] * (q**2 - b**2) / 2
        return (np.where(before, 0.0, tok), np.where(before, 0.0, seq), np.where(before, 0.0, kv))


def tick_times(run_events: pd.DataFrame, tick_s: float = 1.0) -> np.ndarray:
    """Control ticks of one run: ``tick_s, 2 tick_s, ...`` up to its last event."""
    last = float(run_events["time"].max())
    n = int(np.floor(last / tick_s + 1e-9))
    return tick_s * np.arange(1, n + 1, dtype=float)


def run_targets(
    run_events: pd.DataFrame, times: np.ndarray, horizons: tuple[float, ...]
) -> dict[str, np.ndarray]:
    """Target columns (``target_column`` names) of one run at ``times``."""
    queued = run_events[run_events["kind"] == EventKind.PREFILL_QUEUED]
    q_times = queued["time"].to_numpy(float)
    q_cum = np.cumsum(queued["new_tokens"].to_numpy(float))
    cum = _Cumulative(decode_segments(run_events))

    def prefill_at(x: np.ndarray) -> np.ndarray:
        k = np.searchsorted(q_times, x, side="right")
        return np.where(k > 0, q_cum[np.maximum(k - 1, 0)], 0.0) if len(q_cum) else 0.0 * x

    times = np.asarray(times, float)
    p0 = prefill_at(times)
    tok0, seq0, kv0 = cum.at(times)
    out: dict[str, np.ndarray] = {}
    for h in horizons:
        tok1, seq1, kv1 = cum.at(times + h)
        values = {
            "prefill_tokens": prefill_at(times + h) - p0,
            "decode_tokens": tok1 - tok0,
            "decode_sequences": (seq1 - seq0) / h,
            "decode_kv_tokens": (kv1 - kv0) / h,
        }
        for target in TARGETS:
            # Clip float dust from differencing large running sums.
            out[target_column(target, h)] = np.maximum(values[target], 0.0)
    return out


def demand_targets(
    events: pa.Table | pd.DataFrame,
    horizons: tuple[float, ...] | list[float] = (1.0, 2.0, 5.0, 10.0, 30.0),
    *,
    tick_s: float = 1.0,
    times: dict[str, np.ndarray] | None = None,
) -> pd.DataFrame:
    """One row per (run, tick) with every target at every horizon (see the module doc).

    ``times`` maps a run id to its ticks (default: every ``tick_s`` up to the run's last
    event). Columns: ``run_id``, ``time`` and ``y_<target>_h<h>``.
    """
    horizons = check_horizons(horizons)
    df = event_frame(events)
    frames = []
    for run_id, run in df.groupby("run_id", sort=True):
        ticks = times.get(str(run_id)) if times is not None else tick_times(run, tick_s)
        if ticks is None or len(ticks) == 0:
            continue
        cols = run_targets(run, np.asarray(ticks, float), horizons)
        frames.append(pd.DataFrame({"run_id": str(run_id), "time": ticks, **cols}))
    if not frames:
        raise InputError(f"telemetry is shorter than one tick ({tick_s} s)")
    return pd.concat(frames, ignore_index=True)
