"""Trajectory specs: the ground truth of what one trajectory will ask of the cluster."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from prorsa.errors import ConfigError


@dataclass(frozen=True)
class TrajectorySpec:
    """Per-turn demand of one trajectory.

    Turn ``k`` prefills ``new_tokens[k]`` tokens on top of everything before it (the
    previous turns' contexts and outputs), decodes ``output_tokens[k]`` tokens, then waits
    ``tool_latency_s[k]`` seconds for its tool before turn ``k + 1``. ``new_tokens[0]`` is
    the prompt; the last turn has no tool call (``tool_latency_s[-1] == 0``).
    """

    trajectory_id: str
    new_tokens: np.ndarray
    output_tokens: np.ndarray
    tool_latency_s: np.ndarray
    group_id: str = ""
    task: str = ""
    # Leading prompt tokens shared with the other members of the GRPO group.
    shared_prompt_tokens: int = 0
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        new = np.asarray(self.new_tokens, dtype=np.int64)
        out = np.asarray(self.output_tokens, dtype=np.int64)
        tool = np.asarray(self.tool_latency_s, dtype=np.float64)
        if new.ndim != 1 or len(new) == 0:
            raise ConfigError(f"trajectory {self.trajectory_id}: needs at least one turn")
        if not len(new) == len(out) == len(tool):
            raise ConfigError(
                f"trajectory {self.trajectory_id}: new_tokens, output_tokens and tool_latency_s "
                f"must have one entry per turn (got {len(new)}, {len(out)}, {len(tool)})"
            )
        if (new < 0).any() or (out < 1).any():
            raise ConfigError(
                f"trajectory {self.trajectory_id}: new_tokens must be >= 0 and output_tokens >= 1"
            )
        if not np.isfinite(tool).all() or (tool < 0).any():
            raise ConfigError(f"trajectory {self.trajectory_id}: tool_latency_s must be >= 0")
        tool = tool.copy()
        tool[-1] = 0.0
        for name, arr in (("new_tokens", new), ("output_tokens", out), ("tool_latency_s", tool)):
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)

    @property
    def num_turns(self) -> int:
        return len(self.new_tokens)

    def context_tokens(self, turn: int) -> int:
        """Context length at turn ``turn``'s prefill (everything before, plus its new tokens)."""
        return int(self.new_tokens[: turn + 1].sum() + self.output_tokens[:turn].sum())

    @property
    def context_by_turn(self) -> np.ndarray:
        """Context length at each turn's prefill."""
        prev_out = np.concatenate([[0], np.cumsum(self.output_tokens)[:-1]])
        return np.cumsum(self.new_tokens) + prev_out

    @property
    def final_context_tokens(self) -> int:
        """The KV the trajectory holds by its end: every turn's new and output tokens."""
        return int(self.new_tokens.sum() + self.output_tokens.sum())

    @property
    def total_new_tokens(self) -> int:
        return int(self.new_tokens.sum())

    @property
    def total_output_tokens(self) -> int:
        return int(self.output_tokens.sum())

    @property
    def total_tool_s(self) -> float:
        return float(self.tool_latency_s.sum())

    def to_dict(self) -> dict:
        return {
            "trajectory_id": self.trajectory_id,
            "group_id": self.group_id,
            "task": self.task,
            "shared_prompt_tokens": self.shared_prompt_tokens,
            "new_tokens": self.new_tokens.tolist(),
            "output_tokens": self.output_tokens.tolist(),
            "tool_latency_s": self.tool_latency_s.tolist(),
        }

    @classmethod
    def from_dict(cls, data: dict) -> TrajectorySpec:
        return cls(
            trajectory_id=data["trajectory_id"],
            group_id=data.get("group_id", ""),
            task=data.get("task", ""),
            shared_prompt_tokens=int(data.get("shared_prompt_tokens", 0)),
            new_tokens=np.asarray(data["new_tokens"]),
            output_tokens=np.asarray(data["output_tokens"]),
            tool_latency_s=np.asarray(data["tool_latency_s"]),
        )


def spec_totals(specs: Sequence[TrajectorySpec]) -> dict[str, float]:
    """Aggregate demand of a spec list (handy for conservation checks)."""
    return {
        "trajectories": len(specs),
        "turns": sum(s.num_turns for s in specs),
        "new_tokens": sum(s.total_new_tokens for s in specs),
        "output_tokens": sum(s.total_output_tokens for s in specs),
        "tool_s": sum(s.total_tool_s for s in specs),
    }
