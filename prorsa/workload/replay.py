"""Replay of real trajectories: specs built directly from an imported trace."""

from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pyarrow as pa

from prorsa.errors import InputError
from prorsa.workload.profile import _appended_tokens, _turn_frame
from prorsa.workload.spec import TrajectorySpec


def specs_from_trace(
    trace: pa.Table | pd.DataFrame | str | os.PathLike[str], *, task: str | None = None
) -> list[TrajectorySpec]:
    """One spec per trajectory of ``trace``, turn by turn as it really happened.

    New tokens per turn are the context growth (what a cluster without the source's cache
    state would have to handle); tool latency is the trace's (possibly derived) value.
    """
    turns = _turn_frame(trace).sort_values(["run_id", "trajectory_id", "turn"], kind="stable")
    turns = turns.reset_index(drop=True)
    appended = _appended_tokens(turns)
    turns = turns.assign(appended=appended)
    specs = []
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
    return specs
