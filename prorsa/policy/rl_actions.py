"""What the learned policy chooses: a target mode/split, and the rule that keeps it calm.

The agent does not nudge slots one at a time; each action names a *target* (hold the
current one, colocate every slot, or split with a prefill fraction from a small grid).
Fractions, not slot counts, keep one action set meaningful on any cluster size.

:class:`SwitchGuard` is the safety rule between the agent and the cluster: after a target
change the next one waits ``min_hold_s``, and changes are rationed to
``max_changes_per_min`` on average (with one change of credit at the start), so even a
restless agent cannot flap.
"""

from __future__ import annotations

from dataclasses import dataclass

from prorsa.errors import ConfigError


@dataclass(frozen=True)
class Target:
    """One action: ``mode`` is ``"hold"``, ``"colocated"`` or ``"split"``.

    ``layout`` is the hook for when the action space gains parallel layouts (a layout name
    per role); every target today keeps the cluster's configured layout.
    """

    mode: str
    prefill_fraction: float | None = None
    layout: str | None = None

    @property
    def label(self) -> str:
        if self.mode == "split":
            return f"split p={self.prefill_fraction:g}"
        return self.mode

    def prefill_slots(self, num_slots: int) -> int:
        """Prefill slots of a split on ``num_slots`` slots (at least one of each role)."""
        if self.mode != "split" or self.prefill_fraction is None:
            raise ConfigError(f"target '{self.label}' is not a split")
        return min(max(round(self.prefill_fraction * num_slots), 1), num_slots - 1)


# Seconds between the agent's decisions (controller ticks in between hold the target).
# Decision points where the safety rule would refuse a change are skipped altogether, so
# the agent is asked about once per half minute at most.
DECISION_INTERVAL_S = 30.0

HOLD = Target("hold")
COLOCATED = Target("colocated")
# The grid covers every split a best-static search chose in the policy benchmark (1/8 to
# 3/8 on dense models, 1/4 and 1/2 on the MoE model) with one step of margin.
SPLIT_FRACTIONS = (0.125, 0.25, 0.375, 0.5, 0.625)
TARGETS: tuple[Target, ...] = (
    HOLD,
    COLOCATED,
    *(Target("split", f) for f in SPLIT_FRACTIONS),
)


@dataclass
class SwitchGuard:
    """Rations target changes: none within ``min_hold_s`` of the last one, and a token
    bucket refilled at ``max_changes_per_min`` that holds at most one change (full at the
    start), so a run of ``m`` minutes sees at most ``1 + m * max_changes_per_min``."""

    min_hold_s: float = 30.0
    max_changes_per_min: float = 1.0

    def __post_init__(self) -> None:
        if self.min_hold_s < 0:
            raise ConfigError("min_hold_s must be >= 0")
        if self.max_changes_per_min <= 0:
            raise ConfigError("max_changes_per_min must be > 0")
        self.reset(0.0)

    def reset(self, start_s: float) -> None:
        """Start a run at ``start_s``; the initial layout counts as the last change."""
        self.last_change_s = start_s
        self.changes = 0
        self._tokens = 1.0
        self._tokens_at_s = start_s

    def _tokens_now(self, now_s: float) -> float:
        refill = self.max_changes_per_min * max(now_s - self._tokens_at_s, 0.0) / 60.0
        return min(self._tokens + refill, 1.0)

    def allows(self, now_s: float) -> bool:
        """True when a target change at ``now_s`` respects both limits."""
        if now_s - self.last_change_s < self.min_hold_s - 1e-9:
            return False
        return self._tokens_now(now_s) >= 1.0 - 1e-9

    def record(self, now_s: float) -> None:
        self._tokens = self._tokens_now(now_s) - 1.0
        self._tokens_at_s = now_s
        self.last_change_s = now_s
        self.changes += 1

    def since_change_s(self, now_s: float) -> float:
        return now_s - self.last_change_s
