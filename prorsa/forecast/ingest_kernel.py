"""Compiled ingestion: a tick's events applied one by one in time order, in machine code.

The per-event rules are those of the reference path (``update_sequential`` in
:mod:`prorsa.forecast.tracker`), written once more as a numba kernel over the tracker's
arrays. Python keeps what needs Python objects (mapping trajectory ids to slots, creating
slots, forgetting ended ids, the decode-rate rings); the kernel does the rest in one loop.
At 10,000 live trajectories a tick's ~15,000 events take ~1.5 ms in the kernel and ~4-6 ms
in all, against ~8 ms for the round-based numpy path (:mod:`prorsa.forecast.ingest`),
which stays as the fallback where numba is not installed. ``tests/test_forecast_ingest.py``
checks both against the reference.

numba is an optional dependency (the ``fast`` extra; vLLM installs it too). The kernel is
compiled on first use and cached next to this file, so only the first process on a machine
pays the compilation (a few seconds).
"""

from __future__ import annotations

import math

import numpy as np

try:  # numba is optional: without it the numpy path in ingest.py is used.
    from numba import njit
except ImportError:  # pragma: no cover - exercised only where numba is absent
    njit = None

from prorsa.forecast.tracker import GROUP_ARRAYS
from prorsa.telemetry.columns import KIND_CODE

#: True when the compiled kernel can be used.
AVAILABLE = njit is not None

# Kind codes as module constants: numba freezes them into the machine code.
_QUEUED = KIND_CODE["prefill_queued"]
_PREFILL_START = KIND_CODE["prefill_start"]
_PREFILL_END = KIND_CODE["prefill_end"]
_KV_START = KIND_CODE["kv_transfer_start"]
_KV_END = KIND_CODE["kv_transfer_end"]
_DECODE_START = KIND_CODE["decode_start"]
_DECODE_END = KIND_CODE["decode_end"]
_TOOL_START = KIND_CODE["tool_start"]
_TOOL_END = KIND_CODE["tool_end"]
_TRAJ_END = KIND_CODE["traj_end"]

#: Per-slot tracker arrays the kernel reads and writes, in argument order.
SLOT_ARRAYS = (
    "state",
    "state_since",
    "ctx",
    "dec_open",
    "dec_done",
    "started_turn",
    "turn",
    "queued_s",
    "turn_new",
    "new_sum",
    "new_n",
    "new_last",
    "group",
    "tool_start",
    "tool_sum",
    "tool_n",
    "tool_last",
    "turns_done",
    "out_sum",
    "out_last",
    "alive",
    "task",
    "start_s",
    "frozen",
)
#: Layout of the kernel's counter output.
COUNTERS = ("turns", "decode_ends", "tool_ends", "ends", "frozen", "rates", "ttfts")


def _kernel(
    slot, born, kind, time, turn, ctx, new, out,  # events
    state, state_since, s_ctx, dec_open, dec_done, started_turn, s_turn, queued_s,
    turn_new, new_sum, new_n, new_last, group, tool_start, tool_sum, tool_n, tool_last,
    turns_done, out_sum, out_last, alive, task, start_s, frozen,  # per slot
    g_members, g_done, g_final_sum, g_turn_sum, g_out_sum, g_out_n,
    g_tool_sum, g_tool_n, g_new_sum, g_new_n,  # per group
    totals,  # [cum_prefill, out_completed, cum_first_prefill], updated in place
    frozen_event, rows_out, rate_num, rate_den, ttft_s, ended_event, counters,  # outputs
):  # fmt: skip
    """Apply events ``slot``/``born``/``kind``/... (one entry each, in time order) to the
    tracker's arrays in place; samples and counts go to the output arrays (see :func:`run`)."""
    nan = math.nan
    n_turns = n_dec = n_tool = n_end = n_frozen = n_rate = n_ttft = 0
    cum_prefill, out_completed, cum_first_prefill = totals[0], totals[1], totals[2]
    record = rows_out.shape[0] > 0
    for i in range(slot.shape[0]):
        s = slot[i]
        t = time[i]
        k = kind[i]
        g = group[s]
        if born[i] and g >= 0:
            g_members[g] += 1.0
        c = ctx[i]
        if c > s_ctx[s]:
            s_ctx[s] = c
        if k == _QUEUED:
            nw = new[i]
            cum_prefill += nw
            tn = turn[i]
            if tn == 0:
                cum_first_prefill += nw
            _close_segment(dec_open, dec_done, s, t)  # a preempted decode is re-queued
            _to_state(state, state_since, s, 0, t)
            if tn != started_turn[s]:
                started_turn[s] = tn
                s_turn[s] = tn
                queued_s[s] = t
                turn_new[s] = nw
                dec_done[s] = 0.0
                n_turns += 1
                if tn > 0:
                    _observe(new_sum, new_n, new_last, g_new_sum, g_new_n, s, g, nw)
                if g >= 0:
                    g_turn_sum[g] += 1.0
                _freeze(
                    s, t, g, frozen, task, s_turn, s_ctx, turn_new, start_s, turns_done,
                    out_sum, out_last, new_sum, new_n, new_last, tool_sum, tool_n, tool_last,
                    g_members, g_done, g_final_sum, g_turn_sum, g_out_sum, g_out_n,
                    g_tool_sum, g_tool_n, g_new_sum, g_new_n,
                )  # fmt: skip
                if record:
                    rows_out[n_frozen, :] = frozen[s, :]
                frozen_event[n_frozen] = i
                n_frozen += 1
        elif k == _PREFILL_START:
            _to_state(state, state_since, s, 1, t)
        elif k == _PREFILL_END:
            _to_state(state, state_since, s, 2, t)
        elif k == _KV_START:
            _close_segment(dec_open, dec_done, s, t)
            _to_state(state, state_since, s, 2, t)
        elif k == _KV_END:
            _to_state(state, state_since, s, 3, t)
        elif k == _DECODE_START:
            if dec_open[s] == dec_open[s]:
                _close_segment(dec_open, dec_done, s, t)
            elif dec_done[s] == 0.0:
                ttft_s[n_ttft] = t - queued_s[s]
                n_ttft += 1
            dec_open[s] = t
            _to_state(state, state_since, s, 3, t)
        elif k == _DECODE_END:
            _close_segment(dec_open, dec_done, s, t)
            o = out[i]
            dur = dec_done[s]
            if dur > 0:
                rate_num[n_rate] = o
                rate_den[n_rate] = dur
                n_rate += 1
            dec_done[s] = 0.0
            out_completed += o
            _observe(out_sum, turns_done, out_last, g_out_sum, g_out_n, s, g, o)
            n_dec += 1
            _to_state(state, state_since, s, 4, t)
        elif k == _TOOL_START:
            tool_start[s] = t
            _to_state(state, state_since, s, 4, t)
        elif k == _TOOL_END:
            st = tool_start[s]
            if st == st:
                _observe(tool_sum, tool_n, tool_last, g_tool_sum, g_tool_n, s, g, t - st)
            tool_start[s] = nan
            n_tool += 1
            _to_state(state, state_since, s, 0, t)
        elif k == _TRAJ_END:
            alive[s] = False
            state[s] = 5
            n_end += 1
            if g >= 0:
                g_done[g] += 1.0
                g_final_sum[g] += s_turn[s] + 1.0
            ended_event[n_end - 1] = i
        # traj_start: the slot was created with the trajectory's first event.
    totals[0] = cum_prefill
    totals[1] = out_completed
    totals[2] = cum_first_prefill
    counters[0] = n_turns
    counters[1] = n_dec
    counters[2] = n_tool
    counters[3] = n_end
    counters[4] = n_frozen
    counters[5] = n_rate
    counters[6] = n_ttft


def _to_state(state, state_since, s, value, t):
    """Move slot ``s`` to ``value``, noting when it changed."""
    if state[s] != value:
        state[s] = value
        state_since[s] = t


def _close_segment(dec_open, dec_done, s, t):
    """End slot ``s``'s open decode segment (if any), adding its length to ``dec_done``."""
    if dec_open[s] == dec_open[s]:  # not NaN: a segment is open
        dec_done[s] += t - dec_open[s]
        dec_open[s] = math.nan


def _observe(sums, counts, lasts, g_sums, g_counts, s, g, value):
    """One more observation ``value`` of a per-turn quantity of slot ``s`` (and its group)."""
    sums[s] += value
    counts[s] += 1.0
    lasts[s] = value
    if g >= 0:
        g_sums[g] += value
        g_counts[g] += 1.0


def _freeze(
    s, t, g, frozen, task, s_turn, s_ctx, turn_new, start_s, turns_done,
    out_sum, out_last, new_sum, new_n, new_last, tool_sum, tool_n, tool_last,
    g_members, g_done, g_final_sum, g_turn_sum, g_out_sum, g_out_n,
    g_tool_sum, g_tool_n, g_new_sum, g_new_n,
):  # fmt: skip
    """Write slot ``s``'s turn-arrival row (``EVENT_FEATURES`` order) into ``frozen``."""
    nan = math.nan
    done = turns_done[s]
    nn = new_n[s]
    tn = tool_n[s]
    turn = s_turn[s]
    row = frozen[s]
    row[0] = task[s]
    row[1] = turn
    row[2] = s_ctx[s]
    row[3] = turn_new[s]
    row[4] = t - start_s[s]
    row[5] = done
    row[6] = out_sum[s] / done if done != 0 else nan
    row[7] = out_last[s]
    row[8] = new_sum[s] / nn if nn != 0 else nan
    row[9] = new_last[s]
    row[10] = tool_sum[s] / tn if tn != 0 else nan
    row[11] = tool_last[s]
    if g >= 0:
        members = g_members[g]
        gdone = g_done[g]
        final = g_final_sum[g] / gdone if gdone != 0 else nan
        row[12] = members
        row[13] = gdone / members if members != 0 else nan
        row[14] = final
        row[15] = g_turn_sum[g] / members if members != 0 else nan
        row[16] = g_out_sum[g] / g_out_n[g] if g_out_n[g] != 0 else nan
        row[17] = g_tool_sum[g] / g_tool_n[g] if g_tool_n[g] != 0 else nan
        row[18] = g_new_sum[g] / g_new_n[g] if g_new_n[g] != 0 else nan
        row[19] = (turn + 1) / final if final == final and final > 0 else nan
    else:
        row[12] = 0.0
        for j in range(13, 20):
            row[j] = nan


def _jit(fn):
    """Compile ``fn`` lazily, cached on disk where numba finds a writable place for it
    (next to this file, else the user's cache directory); compiled per process if none."""
    try:
        return njit(cache=True, nogil=True)(fn)
    except RuntimeError:  # numba: "no locator available" for a read-only install
        return njit(nogil=True)(fn)


if AVAILABLE:
    _to_state = _jit(_to_state)
    _close_segment = _jit(_close_segment)
    _observe = _jit(_observe)
    _freeze = _jit(_freeze)
    _kernel = _jit(_kernel)


def run(tracker, slot: np.ndarray, born: np.ndarray, batch, pos: np.ndarray) -> dict:
    """Apply events ``pos`` of ``batch`` (slots ``slot``; ``born``: the event that created
    its slot) to ``tracker``. Returns what Python finishes: counts and, in event order,
    the frozen events and rows, the decode-rate and time-to-first-token samples and the
    ended events."""
    n = len(pos)
    kind = batch.kind[pos]
    record = tracker.record_event_rows
    n_queued = int(np.count_nonzero(kind == _QUEUED))
    rows_out = np.empty((n_queued if record else 0, tracker.frozen.shape[1]))
    frozen_event = np.empty(n_queued, np.int64)
    rate_num, rate_den, ttft = np.empty(n), np.empty(n), np.empty(n)
    ended_event = np.empty(n, np.int64)
    counters = np.zeros(len(COUNTERS), np.int64)
    totals = np.array([tracker.cum_prefill, tracker.out_completed, tracker.cum_first_prefill])
    _kernel(
        slot,
        born,
        kind,
        batch.time[pos],
        batch.turn[pos],
        batch.context_tokens[pos].astype(np.float64),
        batch.new_tokens[pos].astype(np.float64),
        batch.output_tokens[pos].astype(np.float64),
        *(getattr(tracker, name) for name in SLOT_ARRAYS),
        *(getattr(tracker, name) for name in GROUP_ARRAYS),
        totals,
        frozen_event,
        rows_out,
        rate_num,
        rate_den,
        ttft,
        ended_event,
        counters,
    )
    tracker.cum_prefill, tracker.out_completed = float(totals[0]), float(totals[1])
    tracker.cum_first_prefill = float(totals[2])
    c = dict(zip(COUNTERS, counters.tolist(), strict=True))
    return {
        "counts": c,
        "frozen_event": frozen_event[: c["frozen"]],
        "rows": rows_out[: c["frozen"]],
        "rate": (rate_num[: c["rates"]], rate_den[: c["rates"]]),
        "ttft": ttft[: c["ttfts"]],
        "ended_event": ended_event[: c["ends"]],
    }
