"""Assertions shared by the agent-loop and rollout tests."""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from prorsa.workload.spec import TrajectorySpec


def check_turns(table: pa.Table, specs: Sequence[TrajectorySpec]) -> None:
    """Every turn queued with its spec's new tokens and decoded exactly once with its
    spec's output; a tool call between turns."""
    rows = table.to_pylist()
    by_traj: dict[str, list[dict]] = {}
    for row in rows:
        by_traj.setdefault(row["trajectory_id"], []).append(row)
    assert set(by_traj) - {""} == {s.trajectory_id for s in specs}
    for spec in specs:
        mine = by_traj[spec.trajectory_id]
        kinds = [r["kind"] for r in mine]
        assert kinds[0] == "traj_start" and kinds[-1] == "traj_end", kinds
        ends = [r for r in mine if r["kind"] == "decode_end"]
        assert [r["turn"] for r in ends] == list(range(spec.num_turns))
        assert [r["output_tokens"] for r in ends] == spec.output_tokens.tolist()
        assert kinds.count("tool_start") == kinds.count("tool_end") == spec.num_turns - 1
        # prefill_queued counts appended tokens as the simulator does (forecasters read it).
        queued = [r["new_tokens"] for r in mine if r["kind"] == "prefill_queued"]
        assert queued == spec.new_tokens.tolist()
