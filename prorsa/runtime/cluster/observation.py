"""The observation both runtimes hand the controller, built one way.

:class:`TrajectoryStates` keeps how many live trajectories are in each lifecycle state
(and their context tokens), updated as events happen; :func:`build_observation` turns the
slots' views and those counts into a :class:`ClusterObservation` of plain values. The
per-role throughput numbers come from the :class:`~prorsa.policy.base.ClusterSpec`, the
same in both runtimes.
"""

from __future__ import annotations

from collections.abc import Sequence

from prorsa.policy.base import ClusterSpec
from prorsa.policy.types import ClusterObservation, SlotView, WorkloadShape
from prorsa.telemetry.views import STATES


class TrajectoryStates:
    """Live trajectories per lifecycle state, with the sum of their context tokens."""

    __slots__ = ("counts", "tokens")

    def __init__(self) -> None:
        self.counts: dict[str, int] = dict.fromkeys(STATES, 0)
        self.tokens: dict[str, int] = dict.fromkeys(STATES, 0)

    def enter(self, state: str, tokens: int) -> None:
        """A trajectory appears in ``state``."""
        self.counts[state] += 1
        self.tokens[state] += tokens

    def move(self, old: str, old_tokens: int, new: str, new_tokens: int) -> None:
        """A trajectory moves from ``old`` (holding ``old_tokens``) to ``new``."""
        counts, tokens = self.counts, self.tokens
        counts[old] -= 1
        tokens[old] -= old_tokens
        counts[new] += 1
        tokens[new] += new_tokens

    def leave(self, state: str, tokens: int) -> None:
        """A trajectory in ``state`` is forgotten (ended, or dropped by the runtime)."""
        self.counts[state] -= 1
        self.tokens[state] -= tokens


class PrefillWork:
    """Running totals of prefill: tokens turns appended, tokens engines computed.

    Their ratio is what a forecast of appended tokens costs in prefill work: about one
    when prefix caches hold earlier context, many times more when caches are evicted
    or a prefill engine lacks the trajectory's context.
    """

    __slots__ = ("appended_tokens", "computed_tokens")

    def __init__(self) -> None:
        self.appended_tokens = 0
        self.computed_tokens = 0


def build_observation(
    time_s: float,
    slots: Sequence[SlotView],
    states: TrajectoryStates,
    spec: ClusterSpec,
    *,
    completed: int,
    total: int | None,
    local_prefill_threshold: int,
    work: PrefillWork | None = None,
    workload: WorkloadShape | None = None,
) -> ClusterObservation:
    """The cluster at ``time_s`` as policies see it (plain values only)."""
    work = work or PrefillWork()
    return ClusterObservation(
        time_s=time_s,
        slots=tuple(slots),
        trajectory_state=dict(states.counts),
        trajectory_tokens=dict(states.tokens),
        prefill_tokens_per_s={"prefill": spec.prefill_tokens_per_s_per_gpu},
        decode_tokens_per_s={"decode": spec.decode_tokens_per_s_per_gpu},
        completed_trajectories=completed,
        total_trajectories=total,
        local_prefill_threshold=local_prefill_threshold,
        prefill_tokens_appended_total=work.appended_tokens,
        prefill_tokens_computed_total=work.computed_tokens,
        workload=workload,
    )
