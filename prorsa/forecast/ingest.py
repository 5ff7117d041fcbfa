"""Vectorised ingestion: a tick's events applied to the tracker's per-trajectory arrays.

:meth:`LifecycleTracker.update <prorsa.forecast.tracker.LifecycleTracker.update>` hands the
events of one control tick here as an :class:`~prorsa.telemetry.columns.EventBatch`. The
result is the same as applying them one by one in time order (the per-event reference,
``LifecycleTracker.update_sequential``; ``tests/test_forecast_ingest.py`` compares both on
simulated runs), at a cost that grows with the number of *rounds* rather than events:

* events are mapped to slots (a key -> slot cache; a dict look-up only for keys not seen
  before) and grouped by slot, keeping their order;
* round ``r`` takes every slot's ``r``-th event of the tick. The slots of a round are
  distinct, so each event kind's handler is a handful of fancy-indexed array operations
  over all its events at once; a tick with 23,000 events over 10,000 trajectories is ~10
  rounds, not 23,000 Python iterations;
* what couples trajectories is deferred and replayed in event order at the end: the GRPO
  group statistics a turn-arrival row reads (cumulative sums per group up to the event),
  the rings of recent decode rates and times to first token, and the turn-arrival rows
  kept for datasets.

A trajectory that ends and reappears within one batch (same id) is split into two passes,
so a pass never sees events after a trajectory's end.
"""

from __future__ import annotations

import numpy as np

from prorsa.forecast import ingest_kernel
from prorsa.forecast.events import FIRST_CLUSTER_KIND, allocated_gpus
from prorsa.forecast.tracker import GROUP_ARRAYS, LifecycleTracker
from prorsa.telemetry.columns import KIND_CODE, EventBatch

_NAN = float("nan")
_QUEUED_K = KIND_CODE["prefill_queued"]
_END_K = KIND_CODE["traj_end"]
_N_KINDS = FIRST_CLUSTER_KIND
#: Use the compiled kernel (:mod:`prorsa.forecast.ingest_kernel`) when numba is installed;
#: tests switch it off to check the numpy path too.
COMPILED = ingest_kernel.AVAILABLE

# Deferred group contributions are [events, GROUP_ARRAYS] columns, in the tracker's order.
_G = {name: i for i, name in enumerate(GROUP_ARRAYS)}


def apply_batch(tracker: LifecycleTracker, batch: EventBatch) -> None:
    """Apply ``batch`` (events in time order) to ``tracker``; see the module doc."""
    is_traj = np.asarray(batch.kind) < FIRST_CLUSTER_KIND
    pos = np.flatnonzero(is_traj)
    if len(pos) < len(batch):
        tracker.gpus = allocated_gpus(batch) or tracker.gpus
    if not len(pos):
        return
    times = batch.time
    if tracker.first_time is None:
        tracker.first_time = float(times[pos[0]])
    tracker.last_event_time = float(times[pos[-1]])
    while True:
        split = _rebirth(batch.key[pos], batch.kind[pos])
        if split is None:
            _Pass(tracker, batch, pos).run()
            return
        # Everything before the reappearing trajectory's first new event, then the rest.
        _Pass(tracker, batch, pos[:split]).run()
        pos = pos[split:]


def _rebirth(key: np.ndarray, kind: np.ndarray) -> int | None:
    """Index of the first event whose trajectory already ended earlier in the batch."""
    ends = np.flatnonzero(kind == _END_K)
    if not len(ends):
        return None
    # Only the events of trajectories that end here can come after an end.
    ending = np.zeros(int(key.max()) + 1, bool)
    ending[key[ends]] = True
    cand = np.flatnonzero(ending[key])
    if len(cand) == len(ends):
        return None  # each ending trajectory's only event here is its end
    end_keys, first = np.unique(key[ends], return_index=True)
    first_end = ends[first]
    at = np.searchsorted(end_keys, key[cand])
    after = cand > first_end[at]
    if not after.any():
        return None
    return int(cand[np.argmax(after)])


def stable_order(keys: np.ndarray) -> np.ndarray:
    """``argsort(keys, kind="stable")``; through 16-bit keys (a radix sort, ~15x faster)
    when the non-negative keys fit."""
    if len(keys) and keys.min() >= 0 and keys.max() < 65536:
        keys = keys.astype(np.uint16)
    return np.argsort(keys, kind="stable")


class _Pass:
    """One pass over events (positions ``pos`` of ``batch``) with no trajectory rebirth."""

    def __init__(self, tracker: LifecycleTracker, batch: EventBatch, pos: np.ndarray) -> None:
        self.tr = tracker
        self.batch = batch
        self.pos = pos
        # Deferred, replayed in event order after the rounds.
        self.contrib_pos: list[np.ndarray] = []
        self.contrib_group: list[np.ndarray] = []
        self.contrib_values: list[np.ndarray] = []
        self.rate: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.ttft: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.freeze: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self.ended: list[tuple[np.ndarray, np.ndarray]] = []

    # ---------------------------------------------------------------- driver
    def run(self) -> None:
        batch, pos = self.batch, self.pos
        key = batch.key[pos].astype(np.int64)
        kind = batch.kind[pos]
        slot, born = self._slots(key, kind)
        keep = slot >= 0
        if not keep.all():
            pos, key, kind, slot, born = pos[keep], key[keep], kind[keep], slot[keep], born[keep]
        if not len(pos):
            return
        if COMPILED:
            self._run_compiled(pos, key, slot, born)
            return
        if born.any():
            at = np.flatnonzero(born)
            values = np.zeros((len(at), len(GROUP_ARRAYS)))
            values[:, _G["g_members"]] = 1.0
            self._defer(pos[at], self.tr.group[slot[at]], values)
        self.slot = slot
        self.key = key
        self.kind = kind
        self.time = batch.time[pos]
        self.turn = batch.turn[pos]
        self.ctx = batch.context_tokens[pos].astype(float)
        self.new = batch.new_tokens[pos]
        self.out = batch.output_tokens[pos]
        self.order = pos  # batch positions: the event order that deferred work replays
        for events, code in _round_groups(slot, kind):
            s = slot[events]
            tr = self.tr
            tr.ctx[s] = np.maximum(tr.ctx[s], self.ctx[events])
            _HANDLERS[code](self, events, s)
        self._finish()

    def _run_compiled(
        self, pos: np.ndarray, key: np.ndarray, slot: np.ndarray, born: np.ndarray
    ) -> None:
        """The whole pass in the compiled kernel; Python finishes what needs objects."""
        tr = self.tr
        done = ingest_kernel.run(tr, slot, born, self.batch, pos)
        for name in ("turns", "decode_ends", "tool_ends", "ends"):
            tr.counts[name] += done["counts"][name]
        frozen_slots = slot[done["frozen_event"]]
        tr.pending.extend(frozen_slots.tolist())
        if tr.record_event_rows:
            rows = done["rows"]
            times = self.batch.time[pos[done["frozen_event"]]]
            tr.event_rows.extend(
                zip(
                    tr.ids[frozen_slots].tolist(),
                    rows[:, 1].astype(np.int64).tolist(),
                    times.tolist(),
                    map(tuple, rows.tolist()),
                    strict=True,
                )
            )
        tr.rate.add_many(*done["rate"])
        tr.ttft.add_many(done["ttft"], np.ones(len(done["ttft"])))
        ended = done["ended_event"]
        if len(ended):
            tr.end_slots(slot[ended], key[ended])
            tr.release_slots(slot[ended])

    def _slots(self, key: np.ndarray, kind: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Slot of each event (new trajectories get one at their first event, -1 = drop)
        and whether the event is the one that created its slot."""
        tr = self.tr
        cache = tr.key_slots(self.batch.keys)
        slot = cache[key]
        born_at = np.zeros(len(key), bool)
        unknown = np.flatnonzero(slot < 0)
        if not len(unknown):
            return slot, born_at
        new_keys, first = np.unique(key[unknown], return_index=True)
        order = np.argsort(unknown[first], kind="stable")
        keys = self.batch.keys
        born: list[tuple[int, int, tuple[str, str, str]]] = []  # (key, index, ids)
        for k, at in zip(new_keys[order].tolist(), unknown[first][order].tolist(), strict=True):
            ident = keys[k]
            found = tr.slot_of(ident[0])
            if found is not None:
                cache[k] = found
            elif kind[at] != _END_K:  # else: ended before we joined (its only event here)
                born.append((k, at, ident))
        if born:
            at = np.fromiter((b[1] for b in born), np.int64, len(born))
            tids, group_ids, tasks = (list(c) for c in zip(*(b[2] for b in born), strict=True))
            slots, _ = tr.new_slots(tids, group_ids, tasks, self.batch.time[self.pos[at]])
            cache[np.fromiter((b[0] for b in born), np.int64, len(born))] = slots
            born_at[at] = True
        return cache[key], born_at

    # --------------------------------------------------------------- helpers
    def _set_state(self, s: np.ndarray, state: int, ev: np.ndarray) -> None:
        tr = self.tr
        changed = tr.state[s] != state
        if changed.all():
            tr.state[s] = state
            tr.state_since[s] = self.time[ev]
        elif changed.any():
            sc = s[changed]
            tr.state[sc] = state
            tr.state_since[sc] = self.time[ev[changed]]

    def _close_segment(self, s: np.ndarray, ev: np.ndarray) -> None:
        tr = self.tr
        start = tr.dec_open[s]
        is_open = start == start
        if is_open.any():
            so = s[is_open]
            tr.dec_done[so] += self.time[ev[is_open]] - start[is_open]
            tr.dec_open[so] = _NAN

    def _defer(self, at: np.ndarray, group: np.ndarray, values: np.ndarray) -> None:
        """Group-statistic increments ``values`` [events, GROUP_ARRAYS] at event ``at``."""
        grouped = group >= 0
        if grouped.any():
            self.contrib_pos.append(at[grouped])
            self.contrib_group.append(group[grouped])
            self.contrib_values.append(values[grouped])

    # -------------------------------------------------------------- handlers
    def _queued(self, ev: np.ndarray, s: np.ndarray) -> None:
        tr = self.tr
        new = self.new[ev]
        turn = self.turn[ev]
        tr.cum_prefill += float(new.sum())
        tr.cum_first_prefill += float(new[turn == 0].sum())
        self._close_segment(s, ev)  # a preempted decode is re-queued
        self._set_state(s, 0, ev)
        starts = turn != tr.started_turn[s]
        if not starts.any():
            return
        ev, s, turn, new = ev[starts], s[starts], turn[starts], new[starts]
        t = self.time[ev]
        tr.started_turn[s] = turn
        tr.turn[s] = turn
        tr.queued_s[s] = t
        tr.turn_new[s] = new
        tr.dec_done[s] = 0.0
        tr.counts["turns"] += len(ev)
        g = tr.group[s]
        later = turn > 0
        if later.any():
            sl, nl = s[later], new[later].astype(float)
            tr.new_sum[sl] += nl
            tr.new_n[sl] += 1.0
            tr.new_last[sl] = nl
        values = np.zeros((len(ev), len(GROUP_ARRAYS)))
        values[:, _G["g_turn_sum"]] = 1.0
        values[later, _G["g_new_sum"]] = new[later]
        values[later, _G["g_new_n"]] = 1.0
        self._defer(self.order[ev], g, values)
        self.freeze.append((self.order[ev], s, t, _own_columns(tr, s, t)))
        tr.pending.extend(s.tolist())

    def _prefill_start(self, ev: np.ndarray, s: np.ndarray) -> None:
        self._set_state(s, 1, ev)

    def _prefill_end(self, ev: np.ndarray, s: np.ndarray) -> None:
        self._set_state(s, 2, ev)

    def _kv_start(self, ev: np.ndarray, s: np.ndarray) -> None:
        self._close_segment(s, ev)
        self._set_state(s, 2, ev)

    def _kv_end(self, ev: np.ndarray, s: np.ndarray) -> None:
        self._set_state(s, 3, ev)

    def _decode_start(self, ev: np.ndarray, s: np.ndarray) -> None:
        tr = self.tr
        is_open = tr.dec_open[s] == tr.dec_open[s]
        if is_open.any():
            self._close_segment(s[is_open], ev[is_open])
        first = ~is_open & (tr.dec_done[s] == 0.0)
        if first.any():
            t = self.time[ev[first]]
            self.ttft.append((self.order[ev[first]], t - tr.queued_s[s[first]], np.ones(len(t))))
        tr.dec_open[s] = self.time[ev]
        self._set_state(s, 3, ev)

    def _decode_end(self, ev: np.ndarray, s: np.ndarray) -> None:
        tr = self.tr
        self._close_segment(s, ev)
        out = self.out[ev].astype(float)
        dur = tr.dec_done[s]
        timed = dur > 0
        if timed.any():
            self.rate.append((self.order[ev[timed]], out[timed], dur[timed]))
        tr.dec_done[s] = 0.0
        tr.out_completed += float(out.sum())
        tr.turns_done[s] += 1.0
        tr.out_sum[s] += out
        tr.out_last[s] = out
        values = np.zeros((len(ev), len(GROUP_ARRAYS)))
        values[:, _G["g_out_sum"]] = out
        values[:, _G["g_out_n"]] = 1.0
        self._defer(self.order[ev], tr.group[s], values)
        tr.counts["decode_ends"] += len(ev)
        self._set_state(s, 4, ev)

    def _tool_start(self, ev: np.ndarray, s: np.ndarray) -> None:
        self.tr.tool_start[s] = self.time[ev]
        self._set_state(s, 4, ev)

    def _tool_end(self, ev: np.ndarray, s: np.ndarray) -> None:
        tr = self.tr
        start = tr.tool_start[s]
        known = start == start
        if known.any():
            sk, ek = s[known], ev[known]
            dur = self.time[ek] - start[known]
            tr.tool_sum[sk] += dur
            tr.tool_n[sk] += 1.0
            tr.tool_last[sk] = dur
            values = np.zeros((len(ek), len(GROUP_ARRAYS)))
            values[:, _G["g_tool_sum"]] = dur
            values[:, _G["g_tool_n"]] = 1.0
            self._defer(self.order[ek], tr.group[sk], values)
        tr.tool_start[s] = _NAN
        tr.counts["tool_ends"] += len(ev)
        self._set_state(s, 0, ev)

    def _traj_end(self, ev: np.ndarray, s: np.ndarray) -> None:
        tr = self.tr
        tr.alive[s] = False
        tr.state[s] = 5
        tr.counts["ends"] += len(ev)
        values = np.zeros((len(ev), len(GROUP_ARRAYS)))
        values[:, _G["g_done"]] = 1.0
        values[:, _G["g_final_sum"]] = tr.turn[s] + 1.0
        self._defer(self.order[ev], tr.group[s], values)
        tr.end_slots(s, self.key[ev])
        self.ended.append((self.order[ev], s))

    def _traj_start(self, ev: np.ndarray, s: np.ndarray) -> None:
        pass  # the slot was created with the trajectory's first event

    # ---------------------------------------------------------------- finish
    def _finish(self) -> None:
        tr = self.tr
        if self.ended:
            at = np.concatenate([e[0] for e in self.ended])
            tr.release_slots(np.concatenate([e[1] for e in self.ended])[stable_order(at)])
        for ring, items in ((tr.rate, self.rate), (tr.ttft, self.ttft)):
            if items:
                at = np.concatenate([i[0] for i in items])
                order = stable_order(at)
                ring.add_many(
                    np.concatenate([i[1] for i in items])[order],
                    np.concatenate([i[2] for i in items])[order],
                )
        freeze = None
        if self.freeze:
            at = np.concatenate([f[0] for f in self.freeze])
            order = stable_order(at)
            freeze = (
                at[order],
                np.concatenate([f[1] for f in self.freeze])[order],
                np.concatenate([f[2] for f in self.freeze])[order],
                np.concatenate([f[3] for f in self.freeze])[order],
            )
        if self.contrib_pos:
            c_pos = np.concatenate(self.contrib_pos)
            c_group = np.concatenate(self.contrib_group)
            c_values = np.concatenate(self.contrib_values)
            if freeze is not None:
                stats = self._group_stats_at(
                    freeze[0], tr.group[freeze[1]], c_pos, c_group, c_values
                )
            order = stable_order(c_pos)
            tr.add_group_stats(c_group[order], c_values[order])
        elif freeze is not None:
            stats = _prior_stats(tr, tr.group[freeze[1]])
        if freeze is not None:
            self._write_frozen(freeze, stats)

    def _group_stats_at(
        self,
        q_pos: np.ndarray,
        q_group: np.ndarray,
        c_pos: np.ndarray,
        c_group: np.ndarray,
        c_values: np.ndarray,
    ) -> np.ndarray:
        """Group statistics [queries, GROUP_ARRAYS] as of each query's event (inclusive)."""
        prior = _prior_stats(self.tr, q_group)
        nq, nc = len(q_pos), len(c_pos)
        groups = np.concatenate([c_group, q_group])
        at = np.concatenate([c_pos, q_pos])
        is_query = np.concatenate([np.zeros(nc, np.int8), np.ones(nq, np.int8)])
        # Contributions at an event come before that event's own query (inclusive).
        order = np.lexsort((is_query, at, groups))
        values = np.concatenate([c_values, np.zeros((nq, c_values.shape[1]))])[order]
        running = np.cumsum(values, axis=0)
        g_sorted = groups[order]
        first = np.ones(len(order), bool)
        first[1:] = g_sorted[1:] != g_sorted[:-1]
        base = (running - values)[first]
        within = running - base[np.cumsum(first) - 1]
        out = np.empty_like(prior)
        queries = is_query[order] == 1
        out[order[queries] - nc] = within[queries]
        grouped = q_group >= 0
        out[~grouped] = 0.0
        return prior + out

    def _write_frozen(self, freeze: tuple, stats: np.ndarray) -> None:
        tr = self.tr
        _, slots, times, own = freeze
        rows = np.concatenate([own, _group_columns(stats, own, tr.group[slots])], axis=1)
        # The last row of a slot stays frozen (a slot may start two turns in one tick).
        last = len(slots) - 1 - np.unique(slots[::-1], return_index=True)[1]
        tr.frozen[slots[last]] = rows[last]
        if tr.record_event_rows:
            ids = tr.ids[slots]
            turns = rows[:, 1].astype(np.int64).tolist()
            tr.event_rows.extend(
                zip(ids.tolist(), turns, times.tolist(), map(tuple, rows.tolist()), strict=True)
            )


_HANDLERS = {
    KIND_CODE["traj_start"]: _Pass._traj_start,
    KIND_CODE["prefill_queued"]: _Pass._queued,
    KIND_CODE["prefill_start"]: _Pass._prefill_start,
    KIND_CODE["prefill_end"]: _Pass._prefill_end,
    KIND_CODE["kv_transfer_start"]: _Pass._kv_start,
    KIND_CODE["kv_transfer_end"]: _Pass._kv_end,
    KIND_CODE["decode_start"]: _Pass._decode_start,
    KIND_CODE["decode_end"]: _Pass._decode_end,
    KIND_CODE["tool_start"]: _Pass._tool_start,
    KIND_CODE["tool_end"]: _Pass._tool_end,
    KIND_CODE["traj_end"]: _Pass._traj_end,
}
_HANDLERS = [_HANDLERS[k] for k in range(_N_KINDS)]  # type: ignore[assignment]


def _round_groups(slot: np.ndarray, kind: np.ndarray) -> list[tuple[np.ndarray, int]]:
    """(event indices, kind) per round and kind, rounds in order.

    Round r holds every slot's r-th event; within a round, slots are distinct, so the
    events of one kind are handled at once (in event order, which deferred work keeps).
    Updating a slot's context before each group equals doing it before each event: only
    the slot's own earlier events have touched it.
    """
    n = len(slot)
    order = stable_order(slot)
    s_sorted = slot[order]
    starts = np.ones(n, bool)
    starts[1:] = s_sorted[1:] != s_sorted[:-1]
    first = np.flatnonzero(starts)
    rank = np.empty(n, np.int64)
    rank[order] = np.arange(n) - np.repeat(first, np.diff(np.append(first, n)))
    group = rank * _N_KINDS + kind
    by_group = stable_order(group)  # stable: event order within a group
    g_sorted = group[by_group]
    cuts = np.flatnonzero(g_sorted[1:] != g_sorted[:-1]) + 1
    bounds = [0, *cuts.tolist(), n]
    codes = (g_sorted[bounds[:-1]] % _N_KINDS).tolist()
    return [
        (by_group[lo:hi], code) for lo, hi, code in zip(bounds[:-1], bounds[1:], codes, strict=True)
    ]


def _own_columns(tr: LifecycleTracker, s: np.ndarray, t: np.ndarray) -> np.ndarray:
    """The trajectory's own part of its turn-arrival row (EVENT_FEATURES 0-11)."""
    done = tr.turns_done[s]
    new_n = tr.new_n[s]
    tool_n = tr.tool_n[s]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.column_stack(
            [
                tr.task[s],
                tr.turn[s],
                tr.ctx[s],
                tr.turn_new[s],
                t - tr.start_s[s],
                done,
                np.where(done > 0, tr.out_sum[s] / done, _NAN),
                tr.out_last[s],
                np.where(new_n > 0, tr.new_sum[s] / new_n, _NAN),
                tr.new_last[s],
                np.where(tool_n > 0, tr.tool_sum[s] / tool_n, _NAN),
                tr.tool_last[s],
            ]
        ).astype(float)


def _prior_stats(tr: LifecycleTracker, groups: np.ndarray) -> np.ndarray:
    """Group statistics before the pass [rows, GROUP_ARRAYS] (zeros for ungrouped rows)."""
    g = np.maximum(groups, 0)
    out = np.column_stack([getattr(tr, name)[g] for name in GROUP_ARRAYS])
    out[groups < 0] = 0.0
    return out


def _group_columns(stats: np.ndarray, own: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """EVENT_FEATURES 12-19 (the GRPO siblings) from the group statistics at the event."""
    members = stats[:, _G["g_members"]]
    done = stats[:, _G["g_done"]]

    def ratio(num: str, den: np.ndarray) -> np.ndarray:
        return np.where(den > 0, stats[:, _G[num]] / np.where(den > 0, den, 1.0), _NAN)

    final = ratio("g_final_sum", done)
    turn = own[:, 1]
    with np.errstate(invalid="ignore", divide="ignore"):
        cols = np.column_stack(
            [
                members,
                np.where(members > 0, done / np.where(members > 0, members, 1.0), _NAN),
                final,
                ratio("g_turn_sum", members),
                ratio("g_out_sum", stats[:, _G["g_out_n"]]),
                ratio("g_tool_sum", stats[:, _G["g_tool_n"]]),
                ratio("g_new_sum", stats[:, _G["g_new_n"]]),
                np.where((final == final) & (final > 0), (turn + 1) / final, _NAN),
            ]
        )
    ungrouped = groups < 0
    if ungrouped.any():
        cols[ungrouped] = _NAN
        cols[ungrouped, 0] = 0.0
    return cols
