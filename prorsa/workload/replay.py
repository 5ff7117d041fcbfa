"""Replay of real trajectories: specs (and arrival times) built directly from a trace.

A trace is lifecycle telemetry (an imported public trace or a recorded run). Loading it
is whole-table work, never a loop of data-frame look-ups per trajectory: the events are
encoded and sorted once by (run, trajectory, turn) with Arrow and NumPy, every per-turn
quantity is a segmented reduction over that order, and only building the
:class:`TrajectorySpec` objects themselves is per trajectory. Their inputs are checked in
bulk first, so each spec is assembled from read-only views of the shared column arrays
without its per-object checks (those cost more than everything else together on a
request trace of thousands of single-turn requests).

Per turn (as :func:`prorsa.telemetry.views.turn_table` defines it): the context and new
tokens of the first ``prefill_start`` (else the first ``prefill_queued``), the output of
the last ``decode_end``, and the tool time from the first ``tool_start`` to the last
``tool_end``. A spec's new tokens are the context growth beyond the previous output (what
a cluster without the source's cache state has to prefill); its tool latency is the
trace's (possibly derived) value; the order of the specs is by run and trajectory id.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from prorsa.errors import InputError
from prorsa.telemetry.schema import CLUSTER_EVENT_KINDS, EVENT_KINDS, FIELDS
from prorsa.workload.spec import TrajectorySpec

_KINDS = pa.array(EVENT_KINDS, pa.string())
_CODE = {k: i for i, k in enumerate(EVENT_KINDS)}
_FIRST_CLUSTER = min(_CODE[k] for k in CLUSTER_EVENT_KINDS)
_NONE = np.iinfo(np.int64).max


@dataclass(frozen=True)
class TraceReplay:
    """Specs of a trace's trajectories and when each arrived (seconds from the trace's
    first event); ``ArrivalDriver(replay.specs, replay.arrival_s)`` replays it open-loop."""

    specs: list[TrajectorySpec]
    arrival_s: np.ndarray


def specs_from_trace(
    trace: pa.Table | pd.DataFrame | str | os.PathLike[str], *, task: str | None = None
) -> list[TrajectorySpec]:
    """One spec per trajectory of ``trace``, turn by turn as it really happened.

    ``task`` replaces the trace's task names. Raises :class:`InputError` for a trace
    without trajectory turns or with negative token counts.
    """
    return load_replay(trace, task=task).specs


def arrivals_from_trace(
    trace: pa.Table | pd.DataFrame | str | os.PathLike[str], *, task: str | None = None
) -> TraceReplay:
    """Specs and arrival times of ``trace``'s trajectories, for open-loop replay.

    A trajectory arrives at its first event; times count from the trace's first event.
    """
    return load_replay(trace, task=task)


def load_replay(
    trace: pa.Table | pd.DataFrame | str | os.PathLike[str], *, task: str | None = None
) -> TraceReplay:
    """What :func:`specs_from_trace` and :func:`arrivals_from_trace` return, in one pass."""
    source = "trace"
    if isinstance(trace, str | os.PathLike):
        from prorsa.telemetry.reader import read_telemetry

        source = os.fspath(trace)
        trace, _ = read_telemetry(trace, validate=True)
    if isinstance(trace, pd.DataFrame):
        if "tool_latency_s" in trace.columns:  # already a turn table
            return _from_turn_frame(trace, task)
        trace = pa.Table.from_pandas(trace[list(FIELDS)], preserve_index=False)
    turns = _turns(trace, source)
    return _build(turns, task)


# ------------------------------------------------------------------------- turns
@dataclass
class _Turns:
    """Per-turn columns sorted by (run, trajectory, turn), plus trajectory boundaries."""

    run_id: list[str]  # per trajectory
    trajectory_id: list[str]
    group_id: list[str]
    task: list[str]
    first: np.ndarray  # first turn row of each trajectory (and the end as last entry)
    arrival_s: np.ndarray  # per trajectory
    context: np.ndarray  # per turn, int64
    output: np.ndarray
    tool_s: np.ndarray


def _codes(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, list, np.ndarray]:
    """(code per row, distinct values, sort rank of each code by value)."""
    encoded = pc.dictionary_encode(column)
    if isinstance(encoded, pa.ChunkedArray):
        encoded = encoded.combine_chunks()
    values = encoded.dictionary
    rank = np.empty(len(values), np.int64)
    rank[np.asarray(pc.array_sort_indices(values))] = np.arange(len(values))
    return encoded.indices.to_numpy(zero_copy_only=False), values.to_pylist(), rank


def _turns(table: pa.Table, source: str) -> _Turns:
    missing = [f for f in FIELDS if f not in table.column_names]
    if missing:
        raise InputError(f"missing column(s) {', '.join(missing)}", source=source)
    kind_col = table.column("kind")
    if pa.types.is_dictionary(kind_col.type):
        kind_col = kind_col.cast(pa.string())
    codes = pc.index_in(kind_col, value_set=_KINDS)
    if codes.null_count:
        bad = int(np.flatnonzero(codes.is_null().to_numpy(zero_copy_only=False))[0])
        raise InputError(
            f"unknown event kind {kind_col[bad].as_py()!r}", source=source, record=bad, field="kind"
        )
    kind = codes.to_numpy(zero_copy_only=False).astype(np.int64)
    keep = kind < _FIRST_CLUSTER
    if not keep.any():
        raise InputError("trace holds no trajectory turns", source=source)
    if not keep.all():
        idx = pa.array(np.flatnonzero(keep))
        table, kind = table.take(idx), kind[keep]
    run, runs, run_rank = _codes(table.column("run_id"))
    traj, trajs, traj_rank = _codes(table.column("trajectory_id"))
    turn = np.asarray(table.column("turn").to_numpy(), np.int64)
    time = np.asarray(table.column("time").to_numpy(), float)
    n = len(kind)
    # Stable: events of one turn keep their recorded order ("first" and "last" below).
    order = np.lexsort((np.arange(n), turn, traj_rank[traj], run_rank[run]))
    run, traj, turn, kind, time = run[order], traj[order], turn[order], kind[order], time[order]
    new_turn = np.ones(n, bool)
    new_turn[1:] = (run[1:] != run[:-1]) | (traj[1:] != traj[:-1]) | (turn[1:] != turn[:-1])
    seg = np.flatnonzero(new_turn)
    pos = np.arange(n)

    def first_of(code: int) -> np.ndarray:
        return np.minimum.reduceat(np.where(kind == code, pos, _NONE), seg)

    def last_of(code: int) -> np.ndarray:
        return np.maximum.reduceat(np.where(kind == code, pos, -1), seg)

    prefill = first_of(_CODE["prefill_start"])
    queued = first_of(_CODE["prefill_queued"])
    prefill = np.where(prefill == _NONE, queued, prefill)
    ctx_col = np.asarray(table.column("context_tokens").to_numpy(), np.int64)[order]
    out_col = np.asarray(table.column("output_tokens").to_numpy(), np.int64)[order]
    has_prefill = prefill != _NONE
    context = np.where(has_prefill, ctx_col[np.where(has_prefill, prefill, 0)], 0)
    decode = last_of(_CODE["decode_end"])
    output = np.where(decode >= 0, out_col[np.maximum(decode, 0)], 0)
    tool_start = np.minimum.reduceat(np.where(kind == _CODE["tool_start"], time, np.inf), seg)
    tool_end = np.maximum.reduceat(np.where(kind == _CODE["tool_end"], time, -np.inf), seg)
    tool = np.where(np.isfinite(tool_start) & np.isfinite(tool_end), tool_end - tool_start, 0.0)
    if (context < 0).any() or (output < 0).any():
        bad = int(np.flatnonzero((context < 0) | (output < 0))[0])
        raise InputError(
            "negative token count",
            source=source,
            record=trajs[traj[seg[bad]]],
            field="context_tokens" if context[bad] < 0 else "output_tokens",
        )
    t_seg_run, t_seg_traj = run[seg], traj[seg]
    new_traj = np.ones(len(seg), bool)
    new_traj[1:] = (t_seg_run[1:] != t_seg_run[:-1]) | (t_seg_traj[1:] != t_seg_traj[:-1])
    first = np.flatnonzero(new_traj)
    head = seg[first]  # first event of each trajectory (its first turn, recorded order)
    inverse = order[head]  # its row in the (filtered) table, for group and task
    take = pa.array(inverse)
    arrival = np.minimum.reduceat(time, seg[first]) - float(time.min())
    return _Turns(
        run_id=[runs[i] for i in run[head].tolist()],
        trajectory_id=[trajs[i] for i in traj[head].tolist()],
        group_id=table.column("group_id").take(take).to_pylist(),
        task=table.column("task").take(take).to_pylist(),
        first=np.append(first, len(seg)),
        arrival_s=arrival,
        context=context,
        output=output,
        tool_s=tool,
    )


# ------------------------------------------------------------------------- specs
def _build(turns: _Turns, task: str | None) -> TraceReplay:
    first = turns.first
    starts = np.zeros(len(turns.context), bool)
    starts[first[:-1]] = True
    prev_context = np.roll(turns.context, 1)
    prev_output = np.roll(turns.output, 1)
    new = np.where(starts, turns.context, np.maximum(turns.context - prev_context - prev_output, 0))
    output = np.maximum(turns.output, 1)
    tool = np.nan_to_num(turns.tool_s, nan=0.0).clip(min=0.0)
    tool[first[1:] - 1] = 0.0  # the last turn has no tool call
    for arr in (new, output, tool):
        arr.setflags(write=False)  # every spec holds read-only views of these
    specs = []
    bounds = first.tolist()
    for i, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        specs.append(
            _checked_spec(
                turns.trajectory_id[i],
                new[lo:hi],
                output[lo:hi],
                tool[lo:hi],
                turns.group_id[i],
                task or turns.task[i],
                {"run_id": turns.run_id[i], "replayed": True},
            )
        )
    return TraceReplay(specs=specs, arrival_s=turns.arrival_s)


def _checked_spec(
    trajectory_id: str,
    new_tokens: np.ndarray,
    output_tokens: np.ndarray,
    tool_latency_s: np.ndarray,
    group_id: str,
    task: str,
    meta: dict,
) -> TrajectorySpec:
    """A spec from arrays already validated in bulk (see the module doc): the fields that
    ``TrajectorySpec.__post_init__`` would set, without repeating its checks."""
    spec = object.__new__(TrajectorySpec)
    spec.__dict__.update(
        trajectory_id=trajectory_id,
        new_tokens=new_tokens,
        output_tokens=output_tokens,
        tool_latency_s=tool_latency_s,
        group_id=group_id,
        task=task,
        shared_prompt_tokens=0,
        meta=meta,
    )
    return spec


def _from_turn_frame(turns: pd.DataFrame, task: str | None) -> TraceReplay:
    """Specs from a turn table (:func:`~prorsa.telemetry.views.turn_table` columns)."""
    from prorsa.workload.profile import _appended_tokens

    turns = turns.sort_values(["run_id", "trajectory_id", "turn"], kind="stable")
    turns = turns.reset_index(drop=True).assign(appended=lambda f: _appended_tokens(f))
    specs, arrival = [], []
    for (run_id, traj_id), rows in turns.groupby(["run_id", "trajectory_id"], sort=False):
        if rows["turn"].duplicated().any():
            raise InputError("duplicate turn", source=str(run_id), record=traj_id, field="turn")
        tool = rows["tool_latency_s"].to_numpy(dtype=float)
        specs.append(
            TrajectorySpec(
                trajectory_id=str(traj_id),
                group_id=str(rows["group_id"].iloc[0]),
                task=task or str(rows["task"].iloc[0]),
                new_tokens=rows["appended"].to_numpy().astype(np.int64),
                output_tokens=np.maximum(rows["output_tokens"].to_numpy(), 1),
                tool_latency_s=np.nan_to_num(tool, nan=0.0).clip(min=0.0),
                meta={"run_id": str(run_id), "replayed": True},
            )
        )
        arrival.append(_first_time(rows))
    times = np.asarray(arrival, float)
    return TraceReplay(specs=specs, arrival_s=times - (times.min() if len(times) else 0.0))


def _first_time(rows: pd.DataFrame) -> float:
    """Earliest stage time of a trajectory's turn rows (0 when the table has none)."""
    stages = [c for c in EVENT_KINDS if c in rows.columns]
    value = rows[stages].min().min() if stages else np.nan
    return float(value) if np.isfinite(value) else 0.0
