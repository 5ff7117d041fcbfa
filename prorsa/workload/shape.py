"""A workload's expected shape (:class:`~prorsa.policy.types.WorkloadShape`), known before
a run starts.

For a scenario it is measured on a reference sample drawn with its own fixed seed, never
on the batch being run, so a policy that reads it learns what an RL trainer knows from
its earlier steps of the same task mix, not the batch's realised outputs. For a replayed
trace it is the trace's own means (the dataset a trainer replays).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from prorsa.policy.types import WorkloadShape
from prorsa.workload.spec import TrajectorySpec

#: Reference sample behind a scenario's shape: its size and seed (apart from every run's).
REFERENCE_TRAJECTORIES = 512
REFERENCE_SEED = 7_919_003


def shape_of(specs: Sequence[TrajectorySpec]) -> WorkloadShape:
    """Means over ``specs`` (at least one)."""
    if not specs:
        raise ValueError("shape_of needs at least one trajectory spec")
    turns = np.array([s.num_turns for s in specs], float)
    prompt = np.array([s.new_tokens[0] for s in specs], float)
    new = np.array([s.total_new_tokens for s in specs], float)
    out = np.array([s.total_output_tokens for s in specs], float)
    tool = np.array([s.total_tool_s for s in specs], float)
    later_turns = max(float((turns - 1).sum()), 1.0)  # the last turn calls no tool
    return WorkloadShape(
        turns_per_trajectory=float(turns.mean()),
        prompt_tokens=float(prompt.mean()),
        new_tokens_per_turn=float((new - prompt).sum() / later_turns),
        output_tokens_per_turn=float(out.sum() / turns.sum()),
        tool_s_per_call=float(tool.sum() / later_turns),
        final_context_tokens=float((new + out).mean()),
    )


def reference_sample(scenario: str) -> list[TrajectorySpec]:
    """The trajectories behind ``scenario``'s shape (its own size and seed)."""
    from prorsa.workload.scenarios import get_scenario

    profile = get_scenario(scenario)
    return profile.sample(REFERENCE_TRAJECTORIES, REFERENCE_SEED, id_prefix="shape")


@functools.lru_cache(maxsize=64)
def scenario_shape(scenario: str) -> WorkloadShape:
    """The shape of ``scenario``, from its reference sample."""
    return shape_of(reference_sample(scenario))


@functools.lru_cache(maxsize=16)
def _trace_shape(path: str, mtime_ns: int) -> WorkloadShape:
    from prorsa.workload.replay import specs_from_trace

    return shape_of(specs_from_trace(path))


def trace_shape(path: str | Path) -> WorkloadShape:
    """The shape of the trajectories in an imported trace (.parquet)."""
    path = Path(path)
    return _trace_shape(str(path), path.stat().st_mtime_ns)
