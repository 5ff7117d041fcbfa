"""One incremental lifecycle tracker: events in, per-trajectory and cluster state out.

The tracker consumes lifecycle events in time order (``update(rows)``) and, at each control
tick (``tick(t)``), records what the cluster looks like. Offline datasets are built by
replaying telemetry through it tick by tick and the online provider feeds it the same way,
so features are identical in both and cannot look ahead: the tracker only ever sees the
events it has been given.

Per-trajectory state lives in numpy arrays indexed by a slot (not one Python object per
trajectory) so that a snapshot over 10,000 live trajectories is a handful of vector ops.
When a turn arrives (its first ``prefill_queued``) the tracker also *freezes* a row of
turn-arrival features (see :data:`EVENT_FEATURES`); per-trajectory models are evaluated on
that row once, when it is frozen, instead of on every trajectory at every tick, and their
predictions are conditioned analytically on elapsed time afterwards.

Tokens decoded so far in a running decode are not in the events (only ``decode_start`` /
``decode_end``); the tracker estimates them as elapsed decode time x the recent
per-sequence decode rate of completed decodes (tokens / decode seconds over the last
``rate_window`` completions).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa

from prorsa.forecast.events import Events, as_batch, gpus_in_detail
from prorsa.telemetry.columns import EventBatch
from prorsa.telemetry.schema import CLUSTER_EVENT_KINDS, FIELDS
from prorsa.telemetry.views import STATES

STATE_CODE: dict[str, int] = {s: i for i, s in enumerate(STATES)}
QUEUED, PREFILLING, TRANSFERRING, DECODING, IN_TOOL, DONE = range(6)


def waiting_mask(state: np.ndarray, is_open: np.ndarray) -> np.ndarray:
    """Rows whose current turn waits for its decode: queued, prefilling, moving its KV,
    or decoding a turn not yet open."""
    waiting = (state == QUEUED) | (state == PREFILLING) | (state == TRANSFERRING)
    return waiting | ((state == DECODING) & ~is_open)


#: Features frozen when a turn arrives (one row per turn).
EVENT_FEATURES: tuple[str, ...] = (
    "task",
    "turn",
    "context_tokens",
    "turn_new_tokens",
    "age_s",
    "turns_done",
    "output_mean",
    "output_last",
    "new_mean",
    "new_last",
    "tool_mean_s",
    "tool_last_s",
    "group_members",
    "group_done_frac",
    "group_final_turns_mean",
    "group_turn_mean",
    "group_output_mean",
    "group_tool_mean_s",
    "group_new_mean",
    "turn_rel",
)
_NAN = float("nan")
_TIME, _TRAJ, _GROUP, _TASK, _TURN, _KIND, _ENG, _CTX, _NEW, _OUT, _DETAIL = (
    FIELDS.index(f)
    for f in (
        "time",
        "trajectory_id",
        "group_id",
        "task",
        "turn",
        "kind",
        "engine_id",
        "context_tokens",
        "new_tokens",
        "output_tokens",
        "detail",
    )
)


def rows_of(events: EventBatch | pa.Table | pd.DataFrame | Sequence[tuple]) -> Iterable[tuple]:
    """Events as tuples in ``FIELDS`` order (tables are converted column-wise, once)."""
    if isinstance(events, EventBatch):
        return list(events.rows())
    if isinstance(events, pa.Table):
        cols = [events.column(f).to_pylist() for f in FIELDS]
        return zip(*cols, strict=True)
    if isinstance(events, pd.DataFrame):
        cols = [
            events[f].astype(str).tolist() if f == "kind" else events[f].tolist() for f in FIELDS
        ]
        return zip(*cols, strict=True)
    return events


class _Ring:
    """Sums over the last ``size`` (numerator, denominator) pairs.

    The window is kept as two arrays and summed when read, so adding pairs one at a time
    or many at once leaves exactly the same window and ratio.
    """

    __slots__ = ("_ratio", "den", "i", "n", "num", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.num = np.zeros(size)
        self.den = np.zeros(size)
        self.i = 0
        self.n = 0
        self._ratio: float | None = None

    def add(self, num: float, den: float) -> None:
        self.num[self.i] = num
        self.den[self.i] = den
        self.i = (self.i + 1) % self.size
        self.n = min(self.n + 1, self.size)
        self._ratio = None

    def add_many(self, num: np.ndarray, den: np.ndarray) -> None:
        """Add pairs in order (only the last ``size`` can stay in the window)."""
        k = len(num)
        if not k:
            return
        keep = min(k, self.size)
        at = (self.i + k - keep + np.arange(keep)) % self.size
        self.num[at] = num[k - keep :]
        self.den[at] = den[k - keep :]
        self.i = (self.i + k) % self.size
        self.n = min(self.n + k, self.size)
        self._ratio = None

    def ratio(self, default: float) -> float:
        if self._ratio is None:
            total = float(self.den.sum())
            self._ratio = float(self.num.sum()) / total if self.n and total > 1e-9 else _NAN
        return default if self._ratio != self._ratio else self._ratio


class LifecycleTracker:
    """Incremental lifecycle state of one run.

    Args:
        tasks: task vocabulary (codes 0..n-1; anything else is ``len(tasks)``, "other").
        lags_s: look-back windows (seconds) of the lagged observables.
        rate_window: completed decodes (and first decode starts) averaged for the
            per-sequence decode rate and the time to first token.
        default_decode_rate: tokens/s per sequence before any decode has completed.
        default_ttft_s: queue-to-decode time before any has been seen.
        record_event_rows: keep every frozen event row with its keys (dataset building).
        history_ticks: ticks of history kept (online trimming).
    """

    def __init__(
        self,
        tasks: Sequence[str] = (),
        *,
        lags_s: Sequence[float] = (1.0, 2.0, 5.0, 10.0, 30.0),
        rate_window: int = 64,
        default_decode_rate: float = 50.0,
        default_ttft_s: float = 1.0,
        record_event_rows: bool = False,
        history_ticks: int = 512,
    ) -> None:
        self.tasks = tuple(tasks)
        self.task_code = {t: i for i, t in enumerate(self.tasks)}
        self.lags_s = tuple(float(h) for h in lags_s)
        self.default_decode_rate = default_decode_rate
        self.default_ttft_s = default_ttft_s
        self.record_event_rows = record_event_rows
        self.history_ticks = max(int(history_ticks), int(max(self.lags_s, default=1)) + 8)
        self._slot: dict[str, int] = {}
        self._key_source: list | None = None
        self._key_slot = np.full(0, -1, np.int64)
        self._free: list[int] = []
        self._freed_later: list[int] = []
        self._cap = 0
        self._n_slots = 0
        self._extra: dict[str, float] = {}
        self.ids: np.ndarray = np.empty(0, object)
        self._grow(256)
        self._group: dict[str, int] = {}
        self._gcap = 0
        self._grow_groups(64)
        self.rate = _Ring(rate_window)
        self.ttft = _Ring(rate_window)
        self.first_time: float | None = None
        self.last_event_time = -math.inf
        self.cum_prefill = 0.0
        #: Of which first turns' prompts: a sync step queues all of them at its launch, a
        #: burst that says nothing about the demand that follows (see the features).
        self.cum_first_prefill = 0.0
        self.out_completed = 0.0
        self.counts = dict.fromkeys(("turns", "starts", "ends", "decode_ends", "tool_ends"), 0)
        self.pending: list[int] = []
        self.event_rows: list[tuple] = []
        self.history: dict[str, list[float]] = {k: [] for k in _HISTORY}
        self.peak_live = 0
        #: The cluster's GPUs as its latest ``allocation`` event states (runtimes record
        #: one at start): what per-GPU load features divide by (0 while unknown).
        self.gpus = 0
        self.time_s: float | None = None
        self.snapshot: dict[str, np.ndarray] = {}
        #: The cohort of the oldest live trajectory, at the last tick: seconds since it
        #: started, and the fraction ended of the trajectories started since. A sync
        #: step reads as its own age and progress whichever step of a run it is (time
        #: since the run began, and ends over all starts, grow step after step, out of
        #: the range a model trained on single steps knows); async load reads as steady.
        self.cohort_age_s = 0.0
        self.cohort_done = 0.0
        self._ended_starts: list[float] = []  # start times of ended trajectories (a heap)

    # ------------------------------------------------------------------ storage
    def _grow(self, cap: int) -> None:
        old = self._cap

        def grow(arr: np.ndarray | None, fill: object, dtype: object) -> np.ndarray:
            new = np.full(cap, fill, dtype=dtype)
            if arr is not None and old:
                new[:old] = arr[:old]
            return new

        g = self.__dict__.get
        self.alive = grow(g("alive"), False, bool)
        self.state = grow(g("state"), DONE, np.int8)
        self.turn = grow(g("turn"), 0, np.int32)
        self.started_turn = grow(g("started_turn"), -1, np.int32)
        self.task = grow(g("task"), 0, np.int16)
        self.group = grow(g("group"), -1, np.int32)
        for name in (
            "start_s",
            "state_since",
            "queued_s",
            "ctx",
            "turn_new",
            "dec_done",
            "turns_done",
            "out_sum",
            "new_sum",
            "new_n",
            "tool_sum",
            "tool_n",
        ):
            setattr(self, name, grow(g(name), 0.0, float))
        for name in ("dec_open", "tool_start", "out_last", "new_last", "tool_last"):
            setattr(self, name, grow(g(name), _NAN, float))
        ids = np.empty(cap, object)
        ids[:old] = self.ids[:old]
        self.ids = ids
        frozen = np.full((cap, len(EVENT_FEATURES)), _NAN)
        if old:
            frozen[:old] = self.frozen[:old]
        self.frozen = frozen
        for name, fill in self._extra.items():
            setattr(self, name, grow(g(name), fill, float))
        self._cap = cap

    def add_slot_array(self, name: str, fill: float = _NAN) -> np.ndarray:
        """Register a per-slot float array (kept in step with the tracker's capacity)."""
        self._extra[name] = fill
        arr = np.full(self._cap, fill)
        setattr(self, name, arr)
        return arr

    def slot_array(self, name: str) -> np.ndarray:
        return getattr(self, name)

    def _grow_groups(self, cap: int) -> None:
        old = self._gcap
        for name in GROUP_ARRAYS:
            new = np.zeros(cap)
            prev = self.__dict__.get(name)
            if prev is not None and old:
                new[:old] = prev[:old]
            setattr(self, name, new)
        self._gcap = cap

    def new_slot(
        self, tid: str, group_id: str, task: str, time_s: float, add_member: bool = True
    ) -> tuple[int, int]:
        """Start tracking trajectory ``tid`` at ``time_s``: (its slot, its group or -1).

        ``add_member=False`` leaves the group's member count to the caller (the vectorised
        ingestion adds it in event order with the other group statistics).
        """
        if self._free:
            slot = self._free.pop()
        else:
            if self._n_slots == self._cap:
                self._grow(self._cap * 2)
            slot = self._n_slots
            self._n_slots += 1
        self._slot[tid] = slot
        self.ids[slot] = tid
        self.alive[slot] = True
        self.state[slot] = QUEUED
        self.turn[slot] = 0
        self.started_turn[slot] = -1
        self.task[slot] = self.task_code.get(task, len(self.tasks))
        self.start_s[slot] = time_s
        self.state_since[slot] = time_s
        self.queued_s[slot] = time_s
        for name in _ZERO_ON_START:
            getattr(self, name)[slot] = 0.0
        for name in _NAN_ON_START:
            getattr(self, name)[slot] = _NAN
        self.frozen[slot] = _NAN
        for name, fill in self._extra.items():
            getattr(self, name)[slot] = fill
        g = -1
        if group_id:
            g = self._group.get(group_id, -1)
            if g < 0:
                g = len(self._group)
                if g == self._gcap:
                    self._grow_groups(self._gcap * 2)
                self._group[group_id] = g
            if add_member:
                self.g_members[g] += 1
        self.group[slot] = g
        self.counts["starts"] += 1
        return slot, g

    def new_slots(
        self, tids: list[str], group_ids: list[str], tasks: list[str], times_s: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`new_slot` for many trajectories at once, in order, leaving the groups'
        member counts to the caller: (slots, groups or -1)."""
        k = len(tids)
        take = min(k, len(self._free))
        reused = self._free[len(self._free) - take :][::-1]  # what k pops would give
        del self._free[len(self._free) - take :]
        fresh = k - take
        while self._n_slots + fresh > self._cap:
            self._grow(self._cap * 2)
        slots = np.asarray(reused + list(range(self._n_slots, self._n_slots + fresh)), np.int64)
        self._n_slots += fresh
        self._slot.update(zip(tids, slots.tolist(), strict=True))
        self.ids[slots] = tids
        self.alive[slots] = True
        self.state[slots] = QUEUED
        self.turn[slots] = 0
        self.started_turn[slots] = -1
        code, other = self.task_code, len(self.tasks)
        self.task[slots] = [code.get(t, other) for t in tasks]
        for name in ("start_s", "state_since", "queued_s"):
            getattr(self, name)[slots] = times_s
        for name in _ZERO_ON_START:
            getattr(self, name)[slots] = 0.0
        for name in _NAN_ON_START:
            getattr(self, name)[slots] = _NAN
        self.frozen[slots] = _NAN
        for name, fill in self._extra.items():
            getattr(self, name)[slots] = fill
        groups = np.full(k, -1, np.int64)
        known = self._group
        for i, gid in enumerate(group_ids):
            if gid:
                g = known.get(gid, -1)
                if g < 0:
                    g = known[gid] = len(known)
                    if g == self._gcap:
                        self._grow_groups(self._gcap * 2)
                groups[i] = g
        self.group[slots] = groups
        self.counts["starts"] += k
        return slots, groups

    def slot_of(self, tid: str) -> int | None:
        """Slot of a live trajectory, None if it is not tracked (not started or ended)."""
        return self._slot.get(tid)

    def key_slots(self, keys: list[tuple[str, str, str]]) -> np.ndarray:
        """Key -> slot cache (-1: not known yet) for the key space ``keys`` of an event log.

        A batch from another log (another ``keys`` list) starts a fresh cache; its
        trajectories are then found by id.
        """
        if keys is not self._key_source:
            self._key_source = keys
            self._key_slot = np.full(max(len(keys), 64), -1, np.int64)
        elif len(self._key_slot) < len(keys):
            grown = np.full(max(len(keys), 2 * len(self._key_slot)), -1, np.int64)
            grown[: len(self._key_slot)] = self._key_slot
            self._key_slot = grown
        return self._key_slot

    def end_slots(self, slots: np.ndarray, keys: np.ndarray) -> None:
        """Forget ended trajectories' ids and keys; ``release_slots`` frees the slots."""
        for tid in self.ids[slots].tolist():
            del self._slot[tid]
        self._key_slot[keys] = -1

    def release_slots(self, slots: np.ndarray) -> None:
        """Slots of ended trajectories, in end order: reused after the next tick (pending
        model evaluations may still read them)."""
        self._freed_later.extend(slots.tolist())

    def add_group_stats(self, groups: np.ndarray, values: np.ndarray) -> None:
        """Add ``values`` [events, GROUP_ARRAYS] to the groups' statistics, in event order."""
        n = len(self._group)
        for j, name in enumerate(GROUP_ARRAYS):
            column = values[:, j]
            if column.any():
                # bincount adds in event order within each group (like one by one).
                getattr(self, name)[:n] += np.bincount(groups, weights=column, minlength=n)[:n]

    # ------------------------------------------------------------------ events
    def update(self, events: Events) -> None:
        """Consume events in time order: an ``EventBatch`` (or log, table, frame, rows).

        Vectorised (:mod:`prorsa.forecast.ingest`); anything but a batch is converted once.
        """
        from prorsa.forecast.ingest import apply_batch

        batch = as_batch(events)
        if len(batch):
            apply_batch(self, batch)

    def update_sequential(self, rows: pa.Table | pd.DataFrame | Sequence[tuple]) -> None:
        """The per-event reference of :meth:`update` (one Python step per event; slow).

        Kept so the vectorised path can be checked against it event for event.
        """
        slots = self._slot
        for row in rows_of(rows):
            kind = row[_KIND]
            if kind in CLUSTER_EVENT_KINDS:
                if kind == "allocation":
                    self.gpus = gpus_in_detail(row[_DETAIL]) or self.gpus
                continue
            t = row[_TIME]
            if self.first_time is None:
                self.first_time = t
            self.last_event_time = t
            tid = row[_TRAJ]
            slot = slots.get(tid)
            if slot is None:
                if kind == "traj_end":
                    continue  # a trajectory that ended before we joined
                slot, _ = self.new_slot(tid, row[_GROUP], row[_TASK], row[_TIME])
            ctx = row[_CTX]
            if ctx > self.ctx[slot]:
                self.ctx[slot] = ctx
            if kind == "prefill_queued":
                self._on_queued(slot, t, row)
            elif kind == "prefill_start":
                self._set_state(slot, PREFILLING, t)
            elif kind == "prefill_end":
                self._set_state(slot, TRANSFERRING, t)
            elif kind == "kv_transfer_start":
                self._close_segment(slot, t)
                self._set_state(slot, TRANSFERRING, t)
            elif kind == "kv_transfer_end":
                self._set_state(slot, DECODING, t)
            elif kind == "decode_start":
                self._on_decode_start(slot, t)
            elif kind == "decode_end":
                self._on_decode_end(slot, t, row[_OUT])
            elif kind == "tool_start":
                self.tool_start[slot] = t
                self._set_state(slot, IN_TOOL, t)
            elif kind == "tool_end":
                self._on_tool_end(slot, t)
            elif kind == "traj_end":
                self._on_end(slot, tid)
            elif kind == "traj_start":
                pass  # the slot was created above

    def _set_state(self, slot: int, state: int, t: float) -> None:
        if self.state[slot] != state:
            self.state[slot] = state
            self.state_since[slot] = t

    def _close_segment(self, slot: int, t: float) -> None:
        start = self.dec_open[slot]
        if start == start:  # not NaN: a segment is open
            self.dec_done[slot] += t - start
            self.dec_open[slot] = _NAN

    def _on_queued(self, slot: int, t: float, row: tuple) -> None:
        new = row[_NEW]
        turn = row[_TURN]
        self.cum_prefill += new
        if turn == 0:
            self.cum_first_prefill += new
        self._close_segment(slot, t)  # a preempted decode is re-queued
        self._set_state(slot, QUEUED, t)
        if turn == self.started_turn[slot]:
            return
        self.started_turn[slot] = turn
        self.turn[slot] = turn
        self.queued_s[slot] = t
        self.turn_new[slot] = new
        self.dec_done[slot] = 0.0
        self.counts["turns"] += 1
        g = self.group[slot]
        if turn > 0:
            self.new_sum[slot] += new
            self.new_n[slot] += 1
            self.new_last[slot] = new
            if g >= 0:
                self.g_new_sum[g] += new
                self.g_new_n[g] += 1
        if g >= 0:
            self.g_turn_sum[g] += 1
        self._freeze(slot, t)
        self.pending.append(slot)

    def _on_decode_start(self, slot: int, t: float) -> None:
        if self.dec_open[slot] == self.dec_open[slot]:
            self._close_segment(slot, t)
        elif self.dec_done[slot] == 0.0:
            self.ttft.add(t - self.queued_s[slot], 1.0)
        self.dec_open[slot] = t
        self._set_state(slot, DECODING, t)

    def _on_decode_end(self, slot: int, t: float, out: int) -> None:
        self._close_segment(slot, t)
        dur = self.dec_done[slot]
        if dur > 0:
            self.rate.add(out, dur)
        self.dec_done[slot] = 0.0
        self.out_completed += out
        self.turns_done[slot] += 1
        self.out_sum[slot] += out
        self.out_last[slot] = out
        g = self.group[slot]
        if g >= 0:
            self.g_out_sum[g] += out
            self.g_out_n[g] += 1
        self.counts["decode_ends"] += 1
        self._set_state(slot, IN_TOOL, t)

    def _on_tool_end(self, slot: int, t: float) -> None:
        start = self.tool_start[slot]
        if start == start:
            dur = t - start
            self.tool_sum[slot] += dur
            self.tool_n[slot] += 1
            self.tool_last[slot] = dur
            g = self.group[slot]
            if g >= 0:
                self.g_tool_sum[g] += dur
                self.g_tool_n[g] += 1
        self.tool_start[slot] = _NAN
        self.counts["tool_ends"] += 1
        self._set_state(slot, QUEUED, t)

    def _on_end(self, slot: int, tid: str) -> None:
        self.alive[slot] = False
        self.state[slot] = DONE
        self.counts["ends"] += 1
        g = self.group[slot]
        if g >= 0:
            self.g_done[g] += 1
            self.g_final_sum[g] += self.turn[slot] + 1
        del self._slot[tid]
        self._key_source = None  # the key -> slot cache may hold this slot
        # Reuse the slot only after pending model evaluations have been taken.
        self._freed_later.append(slot)

    def _freeze(self, slot: int, t: float) -> None:
        """Write the turn-arrival feature row of ``slot`` (see EVENT_FEATURES)."""
        done = self.turns_done[slot]
        new_n = self.new_n[slot]
        tool_n = self.tool_n[slot]
        g = self.group[slot]
        turn = self.turn[slot]
        if g >= 0:
            members = self.g_members[g]
            gdone = self.g_done[g]
            final = self.g_final_sum[g] / gdone if gdone else _NAN
            gturn = self.g_turn_sum[g] / members if members else _NAN
            gout = self.g_out_sum[g] / self.g_out_n[g] if self.g_out_n[g] else _NAN
            gtool = self.g_tool_sum[g] / self.g_tool_n[g] if self.g_tool_n[g] else _NAN
            gnew = self.g_new_sum[g] / self.g_new_n[g] if self.g_new_n[g] else _NAN
            done_frac = gdone / members if members else _NAN
        else:
            members = 0.0
            done_frac = final = gturn = gout = gtool = gnew = _NAN
        row = (
            self.task[slot],
            turn,
            self.ctx[slot],
            self.turn_new[slot],
            t - self.start_s[slot],
            done,
            self.out_sum[slot] / done if done else _NAN,
            self.out_last[slot],
            self.new_sum[slot] / new_n if new_n else _NAN,
            self.new_last[slot],
            self.tool_sum[slot] / tool_n if tool_n else _NAN,
            self.tool_last[slot],
            members,
            done_frac,
            final,
            gturn,
            gout,
            gtool,
            gnew,
            (turn + 1) / final if final == final and final > 0 else _NAN,
        )
        self.frozen[slot] = row
        if self.record_event_rows:
            self.event_rows.append((self.ids[slot], int(turn), t, row))

    def take_pending(self) -> np.ndarray:
        """Slots whose turn-arrival rows were frozen since the last call (each once)."""
        slots = np.unique(np.fromiter(self.pending, np.int64, len(self.pending)))
        self.pending.clear()
        return slots

    # ------------------------------------------------------------------ ticks
    @property
    def decode_rate(self) -> float:
        """Recent tokens/s per decoding sequence (completed decodes)."""
        return self.rate.ratio(self.default_decode_rate)

    @property
    def ttft_s(self) -> float:
        """Recent time from a turn's arrival to its first decode step."""
        return self.ttft.ratio(self.default_ttft_s)

    def tick(self, time_s: float) -> None:
        """Record the cluster at control tick ``time_s`` (after all events up to it)."""
        if self.time_s is not None and time_s < self.time_s:
            from prorsa.errors import InputError

            raise InputError(f"tick at {time_s} s is before the previous tick at {self.time_s} s")
        self.time_s = float(time_s)
        if self.first_time is None:
            self.first_time = float(time_s)
        for slot in self._freed_later:
            heapq.heappush(self._ended_starts, float(self.start_s[slot]))
        self._free.extend(self._freed_later)
        self._freed_later.clear()
        live = np.flatnonzero(self.alive[: self._n_slots])
        self._tick_cohort(live, float(time_s))
        state = self.state[live]
        open_start = self.dec_open[live]
        is_open = open_start == open_start
        dec_elapsed = self.dec_done[live] + np.where(is_open, time_s - open_start, 0.0)
        rate = self.decode_rate
        decoded = np.where(state == DECODING, dec_elapsed * rate, 0.0)
        tool_start = self.tool_start[live]
        self.snapshot = {
            "slot": live,
            "state": state,
            "open": is_open,
            "ctx": self.ctx[live],
            "turn_new": self.turn_new[live],
            "since_queued": time_s - self.queued_s[live],
            "in_state": time_s - self.state_since[live],
            "decode_elapsed": dec_elapsed,
            "decoded": decoded,
            "tool_elapsed": np.where(tool_start == tool_start, time_s - tool_start, _NAN),
            "turn": self.turn[live],
            "task": self.task[live],
            "out_last": self.out_last[live],
        }
        self.peak_live = max(self.peak_live, len(live))
        kv = float(np.sum((self.ctx[live] + decoded)[is_open]))
        values = {
            "time": self.time_s,
            "cum_prefill": self.cum_prefill,
            "cum_first_prefill": self.cum_first_prefill,
            "cum_decode": self.out_completed + float(decoded[is_open].sum()),
            "decodes": float(is_open.sum()),
            "kv": kv,
            "turns": self.counts["turns"],
            "starts": self.counts["starts"],
            "ends": self.counts["ends"],
            "decode_ends": self.counts["decode_ends"],
            "tool_ends": self.counts["tool_ends"],
            "live": float(len(live)),
            "waiting": float(waiting_mask(state, is_open).sum()),
        }
        hist = self.history
        for key, value in values.items():
            hist[key].append(value)
        if len(hist["time"]) > 2 * self.history_ticks:
            # Keep enough for the longest look-back whatever the tick spacing.
            horizon = self.time_s - max(self.lags_s, default=1.0) - 1.0
            cut = min(
                len(hist["time"]) - self.history_ticks, bisect.bisect_left(hist["time"], horizon)
            )
            if cut > 0:
                for key in hist:
                    del hist[key][:cut]

    def _tick_cohort(self, live: np.ndarray, time_s: float) -> None:
        oldest = float(self.start_s[live].min()) if len(live) else time_s
        ended = self._ended_starts
        while ended and ended[0] < oldest:
            heapq.heappop(ended)
        self.cohort_age_s = time_s - oldest
        cohort = len(live) + len(ended)
        self.cohort_done = len(ended) / cohort if cohort else 0.0

    # ------------------------------------------------------------- observed
    def _value_before(self, key: str, t: float) -> tuple[float, float]:
        """(time, value) of the latest history point at or before ``t``.

        Before the first tick the counters were zero at the first event (the tracker is
        fed a run from its start).
        """
        times = self.history["time"]
        i = bisect.bisect_right(times, t + 1e-9) - 1
        if i < 0:
            start = self.first_time if self.first_time is not None else t
            return start, 0.0
        return times[i], self.history[key][i]

    def observed_sum(self, key: str, window_s: float) -> float:
        """Growth of cumulative ``key`` over the last ``window_s``, as a per-second rate.

        When less history than the window exists, the rate over what exists is used.
        """
        now = self.time_s
        hist = self.history[key]
        if now is None or not hist:
            return 0.0
        t0, v0 = self._value_before(key, now - window_s)
        span = now - t0
        return (hist[-1] - v0) / span if span > 1e-9 else 0.0

    def observed_growth(self, key: str, window_s: float) -> float:
        """Growth of cumulative ``key`` over the last ``window_s``: :meth:`observed_sum`'s
        rate over ``window_s`` where the history covers it, all of the growth where less
        history exists (not its rate stretched to the window)."""
        now = self.time_s
        hist = self.history[key]
        if now is None or not hist:
            return 0.0
        t0, v0 = self._value_before(key, now - window_s)
        growth, span = hist[-1] - v0, now - t0
        return growth * min(1.0, window_s / span) if span > 1e-9 else growth

    def observed_mean(self, key: str, window_s: float) -> float:
        """Average of tick samples of ``key`` in (now - window_s, now]."""
        now = self.time_s
        times = self.history["time"]
        if now is None or not times:
            return 0.0
        i = bisect.bisect_right(times, now - window_s + 1e-9)
        vals = self.history[key][i:] or self.history[key][-1:]
        return float(sum(vals) / len(vals))

    @property
    def turn_start_rate(self) -> float:
        """Turns per second whose decode began over the last :data:`START_RATE_WINDOW_S`,
        counting only the time a turn was waiting (NaN before any has been seen to start).

        Turns leave the wait at this rate, so a turn with ``k`` others queued before it
        starts in about ``k / rate`` seconds. Idle time is left out because a sync step
        launches after a pause, and the pause says nothing about how fast its queue drains.
        """
        times, waiting, turns = self.history["time"], self.history["waiting"], self.history["turns"]
        if len(times) < 2:
            return _NAN
        i = max(bisect.bisect_left(times, times[-1] - START_RATE_WINDOW_S), 0)
        busy = started = 0.0
        for k in range(i + 1, len(times)):
            # An interval counts, time and starts together, when it began with a queue:
            # the launch interval of a sync step (queue formed part-way through it) would
            # add its starts without the part of its time that had a queue.
            if waiting[k - 1] > 0:
                busy += times[k] - times[k - 1]
                # Turns that arrived, less the growth of those still waiting, started.
                started += (turns[k] - turns[k - 1]) - (waiting[k] - waiting[k - 1])
        return started / busy if busy > 1e-9 and started > 0 else _NAN

    def live_count(self) -> int:
        return int(self.alive[: self._n_slots].sum())


_ZERO_ON_START = (
    "ctx",
    "turn_new",
    "dec_done",
    "turns_done",
    "out_sum",
    "new_sum",
    "new_n",
    "tool_sum",
    "tool_n",
)
_NAN_ON_START = ("dec_open", "tool_start", "out_last", "new_last", "tool_last")
_HISTORY = (
    "time",
    "cum_prefill",
    "cum_first_prefill",
    "cum_decode",
    "decodes",
    "kv",
    "turns",
    "starts",
    "ends",
    "decode_ends",
    "tool_ends",
    "live",
    "waiting",
)
#: Look-back (seconds) of :attr:`LifecycleTracker.turn_start_rate`: long enough to hold
#: a few dozen decode starts at a light load, short enough to follow a sync step's
#: launch burst as it drains.
START_RATE_WINDOW_S = 5.0
#: How :attr:`LifecycleTracker.turn_start_rate` is counted, recorded in datasets that
#: store it: 2 counts an interval's starts only with its time (intervals begun with a
#: queue); 1 (unrecorded) added the starts of the interval a queue formed in.
START_RATE_VERSION = 2
#: Per-group statistics of the GRPO siblings (one array each, indexed by group).
GROUP_ARRAYS = (
    "g_members",
    "g_done",
    "g_final_sum",
    "g_turn_sum",
    "g_out_sum",
    "g_out_n",
    "g_tool_sum",
    "g_tool_n",
    "g_new_sum",
    "g_new_n",
)
