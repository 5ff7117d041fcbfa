"""Running totals of one simulation, kept as events happen so metrics need no pass over
the telemetry (a test checks both agree)."""

from __future__ import annotations

from prorsa.policy.types import ROLES, SWITCHING


class RunTally:
    """Counts and per-turn / per-trajectory samples of one simulated run."""

    __slots__ = (
        "busy_carry_s",
        "completed",
        "completion_s",
        "decode_tokens",
        "migrations",
        "preemptions",
        "prefill_tokens_cached",
        "prefill_tokens_computed",
        "switches",
        "tpot_s",
        "ttft_s",
        "turns_done",
    )

    def __init__(self) -> None:
        self.completed = 0
        self.switches = 0
        self.preemptions = 0
        self.migrations = 0
        self.turns_done = 0
        self.prefill_tokens_computed = 0
        self.prefill_tokens_cached = 0
        self.decode_tokens = 0
        self.ttft_s: list[float] = []
        self.tpot_s: list[float] = []
        self.completion_s: list[float] = []
        # GPU-busy seconds booked when a slot changes role (busy while draining: "switching").
        self.busy_carry_s: dict[str, float] = dict.fromkeys((*ROLES, SWITCHING), 0.0)
