"""The control loop's configuration: which policy decides, with what, and how often.

One set of defaults for every entry point (``prorsa simulate``, ``compare``, ``tune``,
forecast shipping, the Ray runtime); field help drives the CLI.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prorsa.errors import ConfigError

#: Shortest control interval accepted: a tick costs a forecast and a decision, and a real
#: control plane cannot act faster than its engines report (vLLM logs stats per step).
MIN_INTERVAL_S = 0.01


@dataclass
class ControlConfig:
    """The policy, its forecaster and the control loop's timing."""

    policy: str = field(
        default="colocate", metadata={"help": "allocation policy (see `prorsa policies`)"}
    )
    policy_params: dict[str, object] = field(
        default_factory=dict,
        metadata={"help": "policy parameter key=value (repeatable)", "cli": "param"},
    )
    forecaster: str | None = field(
        default=None,
        metadata={"help": "forecaster or model folder for predictive / mpc policies"},
    )
    interval_s: float = field(default=1.0, metadata={"help": "control interval, seconds"})
    min_dwell_s: float = field(
        default=10.0, metadata={"help": "minimum time between switches of one slot, seconds"}
    )

    def validate(self) -> None:
        """Raise :class:`ConfigError` for timings that cannot work."""
        if not math.isfinite(self.interval_s) or self.interval_s < MIN_INTERVAL_S:
            raise ConfigError(
                f"interval_s must be a finite number >= {MIN_INTERVAL_S}, not {self.interval_s}",
                hint="the controller ticks every interval_s seconds",
            )
        if not math.isfinite(self.min_dwell_s) or self.min_dwell_s < 0:
            raise ConfigError(f"min_dwell_s must be a finite number >= 0, not {self.min_dwell_s}")
