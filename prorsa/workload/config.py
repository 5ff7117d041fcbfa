"""What to roll out: one workload configuration for the simulator, sweeps and real runs.

Field help drives the CLI.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prorsa.errors import ConfigError

MODES = ("sync", "async")


@dataclass
class WorkloadConfig:
    """A scenario or a replayed trace, in sync or async RL mode."""

    scenario: str | None = field(
        default="swe",
        metadata={"help": "workload scenario: swe, search, math-tool, mixed, tau2"},
    )
    trace: str | None = field(
        default=None, metadata={"help": "replay an imported trace (.parquet) instead"}
    )
    mode: str = field(
        default="sync", metadata={"help": "sync: steps of a batch | async: a stream in flight"}
    )
    trajectories: int = field(
        default=256, metadata={"help": "trajectories per sync step, or in total (async)"}
    )
    group_size: int = field(default=8, metadata={"help": "GRPO samples per prompt"})
    steps: int = field(default=1, metadata={"help": "sync RL steps"})
    max_in_flight: int = field(
        default=128, metadata={"help": "async: trajectories kept in flight", "cli": "in-flight"}
    )
    max_staleness: int | None = field(
        default=None, metadata={"help": "async: trainer steps generation may run ahead"}
    )
    train_step_s: float = field(
        default=0.0, metadata={"help": "async: seconds one trainer step takes"}
    )
    seed: int = field(
        default=0,
        metadata={
            "help": "seeds the sampled trajectories (a trace: 0 replays it in order, any "
            "other seed draws its trajectories with replacement)"
        },
    )

    def validate(self) -> None:
        """Raise :class:`ConfigError` for settings that cannot work."""
        if (self.scenario is None) == (self.trace is None):
            raise ConfigError("give exactly one of a scenario or a trace")
        if self.mode not in MODES:
            raise ConfigError(f"mode must be sync or async, not '{self.mode}'")
        if self.trajectories < 1 or self.group_size < 1 or self.steps < 1:
            raise ConfigError("trajectories, group_size and steps must be >= 1")
        if self.max_in_flight < 1:
            raise ConfigError("max_in_flight must be >= 1")
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0, got {self.seed}")
        if not 0 <= self.train_step_s < math.inf:  # NaN fails both
            raise ConfigError(f"train_step_s must be a finite number >= 0, got {self.train_step_s}")

    @property
    def label(self) -> str:
        """The scenario or trace name."""
        return self.scenario or self.trace or "?"
