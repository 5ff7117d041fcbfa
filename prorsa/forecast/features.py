"""Aggregate features of the cluster at a tick, and the scikit-learn style feature pipeline.

Aggregate features are scale-free: counts, token sums and rates are divided by the run's
peak number of live trajectories so far (``scale``), so models trained on 8-engine
simulations still mean something on a 512-engine cluster. The scale itself is known
online (a running maximum) and is how forecasters turn normalised predictions back into
tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import pyarrow as pa

from prorsa.errors import ConfigError, NotFittedError
from prorsa.forecast.events import as_batch, slice_batch
from prorsa.forecast.tracker import IN_TOOL, PREFILLING, QUEUED, LifecycleTracker
from prorsa.forecast.types import DEFAULT_HORIZONS, check_horizons

#: Load per GPU: what sets the queueing regime, and what lets one model serve clusters of
#: any size and layout (a TP1 engine, a TP4 engine or an 8-GPU data-parallel-attention
#: engine alike). The GPU count is the latest ``allocation`` event's (runtimes record one
#: at start); NaN while unknown (imported traces without one).
PER_GPU_FEATURES = (
    "live_per_gpu",
    "queued_per_gpu",
    "decoding_per_gpu",
    "backlog_ktokens_per_gpu",
    "kv_ktokens_per_gpu",
)


#: Features whose training range a learned forecaster checks live (see
#: ``Forecaster.drifting_features``): the load regime, decode speed, queueing and context.
DRIFT_FEATURES = (
    *PER_GPU_FEATURES,
    "decode_rate_per_seq",
    "ttft_s",
    "mean_context_ktokens",
)


def aggregate_feature_names(lags_s: Sequence[float], tasks: Sequence[str]) -> list[str]:
    """Names of :func:`aggregate_features`, in order."""
    names = [
        "live",
        "queued",
        "prefilling",
        "transferring",
        "decoding",
        "in_tool",
        "active_decodes",
        "queued_new_tokens",
        "queued_context_tokens",
        "decode_kv_tokens",
        "tool_context_tokens",
        "turn_rate_5",
        "start_rate_5",
        "end_rate_5",
        "decode_end_rate_5",
        "tool_end_rate_5",
    ]
    for h in lags_s:
        names += [
            f"lag_prefill_rate_{h:g}",
            f"lag_decode_rate_{h:g}",
            f"lag_decodes_{h:g}",
            f"lag_kv_tokens_{h:g}",
            f"lag_first_prefill_rate_{h:g}",
        ]
    names += [
        "decode_rate_per_seq",
        "ttft_s",
        "cohort_age_s",
        "cohort_done",
        "mean_turn",
        "mean_context_ktokens",
        "tool_elapsed_mean_s",
        "decode_elapsed_mean_s",
        "decoded_mean_tokens",
        *PER_GPU_FEATURES,
    ]
    names += [f"task_{t}" for t in tasks] + ["task_other"]
    return names


def _mean(values: np.ndarray) -> float:
    return float(values.mean()) if len(values) else 0.0


def aggregate_features(tracker: LifecycleTracker) -> np.ndarray:
    """Feature vector of the tracker's last tick (see :func:`aggregate_feature_names`)."""
    snap = tracker.snapshot
    if not snap:
        raise ConfigError("the tracker has not ticked yet: call tick(t) first")
    scale = float(max(tracker.peak_live, 1))
    state = snap["state"]
    live = len(state)
    counts = np.bincount(state, minlength=6).astype(float)
    is_open = snap["open"]
    waiting = (state == QUEUED) | (state == PREFILLING)
    in_tool = state == IN_TOOL
    kv = snap["ctx"] + snap["decoded"]
    obs_sum, obs_mean = tracker.observed_sum, tracker.observed_mean
    values = [
        live / scale,
        *(counts[:5] / scale),
        is_open.sum() / scale,
        snap["turn_new"][waiting].sum() / scale,
        snap["ctx"][waiting].sum() / scale,
        kv[is_open].sum() / scale,
        snap["ctx"][in_tool].sum() / scale,
        obs_sum("turns", 5.0) / scale,
        obs_sum("starts", 5.0) / scale,
        obs_sum("ends", 5.0) / scale,
        obs_sum("decode_ends", 5.0) / scale,
        obs_sum("tool_ends", 5.0) / scale,
    ]
    for h in tracker.lags_s:
        values += [
            obs_sum("cum_prefill", h) / scale,
            obs_sum("cum_decode", h) / scale,
            obs_mean("decodes", h) / scale,
            obs_mean("kv", h) / scale,
            obs_sum("cum_first_prefill", h) / scale,
        ]
    values += [
        tracker.decode_rate,
        tracker.ttft_s,
        tracker.cohort_age_s,
        tracker.cohort_done,
        _mean(snap["turn"].astype(float)),
        _mean(snap["ctx"]) / 1000.0,
        _mean(snap["tool_elapsed"][in_tool]),
        _mean(snap["decode_elapsed"][is_open]),
        _mean(snap["decoded"][is_open]),
    ]
    gpus = float(tracker.gpus) if tracker.gpus > 0 else float("nan")
    values += [
        live / gpus,
        counts[QUEUED] / gpus,
        is_open.sum() / gpus,
        snap["turn_new"][waiting].sum() / gpus / 1000.0,
        kv[is_open].sum() / gpus / 1000.0,
    ]
    mix = np.bincount(snap["task"], minlength=len(tracker.tasks) + 1)[: len(tracker.tasks) + 1]
    values += list(mix / max(live, 1))
    return np.asarray(values, dtype=float)


def top_tasks(events: pd.DataFrame, max_tasks: int) -> list[str]:
    """The ``max_tasks`` tasks with the most distinct trajectories in ``events`` (a frame
    with ``task`` and ``trajectory_id`` columns; repeated pairs count once), sorted by name."""
    per_task = events.groupby("task")["trajectory_id"].nunique().sort_values(ascending=False)
    return sorted(per_task.index[:max_tasks].astype(str))


class LifecycleFeatures:
    """Feature pipeline: learns the task vocabulary, then replays telemetry into features.

    Args:
        lags_s: look-back windows (seconds) of the lagged-target features.
        max_tasks: tasks kept by name in the task mix (most trajectories first); the rest
            count as "other".
        tick_s: control interval of the offline replay.

    Fitted attributes: ``tasks_`` and ``feature_names_``.
    """

    def __init__(
        self,
        lags_s: Sequence[float] = DEFAULT_HORIZONS,
        max_tasks: int = 8,
        tick_s: float = 1.0,
    ) -> None:
        self.lags_s = lags_s
        self.max_tasks = max_tasks
        self.tick_s = tick_s

    def fit(self, events: pa.Table | pd.DataFrame) -> LifecycleFeatures:
        """Learn the task vocabulary from ``events``."""
        from prorsa.forecast.targets import event_frame

        check_horizons(self.lags_s, name="lags_s")
        if self.tick_s <= 0:
            raise ConfigError(f"tick_s must be > 0, got {self.tick_s}")
        return self.set_tasks(top_tasks(event_frame(events), self.max_tasks))

    def set_tasks(self, tasks: Sequence[str]) -> LifecycleFeatures:
        """Fit from a known vocabulary (e.g. a saved model's)."""
        self.tasks_ = tuple(tasks)
        self.lags_ = check_horizons(self.lags_s, name="lags_s")
        self.feature_names_ = aggregate_feature_names(self.lags_, self.tasks_)
        return self

    def make_tracker(self, **kwargs: object) -> LifecycleTracker:
        """A fresh tracker configured like this pipeline."""
        if not hasattr(self, "tasks_"):
            raise NotFittedError("LifecycleFeatures is not fitted; call fit(events) first")
        return LifecycleTracker(self.tasks_, lags_s=self.lags_, **kwargs)  # type: ignore[arg-type]

    def transform(self, events: pa.Table | pd.DataFrame) -> pd.DataFrame:
        """Aggregate features per (run, tick), replaying each run through a fresh tracker."""
        from prorsa.forecast.targets import event_frame, tick_times

        if not hasattr(self, "tasks_"):
            raise NotFittedError("LifecycleFeatures is not fitted; call fit(events) first")
        frames = []
        for run_id, run in event_frame(events, keep_allocations=True).groupby("run_id", sort=True):
            tracker = self.make_tracker()
            ticks = tick_times(run, self.tick_s)
            rows = replay(tracker, run, ticks)
            frame = pd.DataFrame(rows, columns=self.feature_names_)
            frame.insert(0, "time", ticks)
            frame.insert(0, "run_id", str(run_id))
            frames.append(frame)
        return pd.concat(frames, ignore_index=True)

    def fit_transform(self, events: pa.Table | pd.DataFrame) -> pd.DataFrame:
        return self.fit(events).transform(events)


def replay(
    tracker: LifecycleTracker,
    run: pd.DataFrame,
    ticks: np.ndarray,
    on_tick: object = None,
) -> np.ndarray:
    """Feed one run's events (sorted by time) tick by tick; aggregate features per tick.

    ``on_tick(tracker, i)`` is called after each tick (dataset building hooks in here).
    """
    batch = as_batch(run)  # once per run; each tick takes a slice
    ends = np.searchsorted(batch.time, np.asarray(ticks, float), side="right")
    out = np.empty((len(ticks), len(aggregate_feature_names(tracker.lags_s, tracker.tasks))))
    start = 0
    for i, (t, end) in enumerate(zip(ticks, ends, strict=True)):
        tracker.update(slice_batch(batch, start, end))
        start = end
        tracker.tick(float(t))
        out[i] = aggregate_features(tracker)
        if on_tick is not None:
            on_tick(tracker, i)  # type: ignore[operator]
    return out
