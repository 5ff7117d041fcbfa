"""The control loop: observe -> forecast -> decide -> actuate, on an injected clock.

The same :class:`Controller` drives the simulator and the Ray + vLLM runtime; only the
clock and the actuator differ. It never reads the wall clock and never sleeps: the clock
calls it back. It turns a policy's :class:`Allocation` into per-slot switch orders,
respecting a minimum dwell time and never touching a slot that is already switching.
"""

from __future__ import annotations

import gc
import logging
import math
from collections.abc import Callable, MutableSequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from prorsa.errors import ConfigError
from prorsa.policy.base import Policy
from prorsa.policy.demand import donor_order, may_move
from prorsa.policy.types import ROLES, Allocation, ClusterObservation, Forecast
from prorsa.telemetry.columns import EventLog
from prorsa.workload.truth import GroundTruth

logger = logging.getLogger(__name__)


class Clock(Protocol):
    """Simulated or wall time, and a way to be called back later."""

    def now(self) -> float: ...

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> None: ...


class Actuator(Protocol):
    """The only thing that changes the cluster (simulator or Ray runtime).

    ``events`` is the run's event log and ``truth`` its ground-truth port (simulation
    only, else None): the controller hands both to its forecaster.
    """

    events: EventLog
    truth: GroundTruth | None

    def observe(self) -> ClusterObservation: ...

    def switch(self, slot_id: int, role: str) -> bool: ...

    def set_local_prefill_threshold(self, tokens: int) -> None: ...

    def note_allocation(self, gpus: dict[str, int], reason: str) -> None: ...


class ForecastSource(Protocol):
    """Forecasts demand at each tick from the run's event stream (keeps its own history).

    The controller calls :meth:`attach` once with its actuator's event log (and, in a
    simulation, the ground-truth port the oracle reads), then :meth:`forecast` every tick.
    """

    def attach(self, events: EventLog, truth: GroundTruth | None = None) -> None: ...

    def forecast(self, obs: ClusterObservation) -> Forecast | None: ...


@dataclass
class Decision:
    """One tick's outcome, kept for reports and plots."""

    time_s: float
    gpus_now: dict[str, int]
    gpus_target: dict[str, int]
    switches: list[tuple[int, str]]
    forecast: Forecast | None = field(default=None, repr=False)
    reason: str = ""


def plan_switches(
    obs: ClusterObservation, alloc: Allocation, *, min_dwell_s: float
) -> list[tuple[int, str]]:
    """Slot switch orders that move the cluster toward ``alloc``.

    Pure. Slots already switching count toward their target and are never re-ordered;
    slots that entered their role less than ``min_dwell_s`` ago stay put; among eligible
    donors the least loaded switch first.
    """
    if alloc.slot_roles is not None:
        ids = {s.slot_id for s in obs.slots if may_move(s, obs.time_s, min_dwell_s)}
        return sorted(
            (sid, role)
            for sid, role in alloc.slot_roles.items()
            if sid in ids and next(s.role for s in obs.slots if s.slot_id == sid) != role
        )
    target = {role: alloc.gpus.get(role, 0) for role in ROLES}
    total = obs.total_gpus
    if sum(target.values()) != total:
        raise ConfigError(f"allocation {target} does not add up to the cluster's {total} GPUs")
    current = obs.gpus_by_role(include_target=True)
    slot_gpus = obs.slots[0].gpus
    # Whole slots only: round each role's deficit down so a policy asking for a fraction of
    # a slot does not make slots oscillate.
    need = {r: math.floor((target[r] - current[r]) / slot_gpus) for r in ROLES}
    if all(n <= 0 for n in need.values()):
        return []  # most ticks: ranking 512 donors costs ~0.5 ms for nothing
    surplus = {r: math.floor((current[r] - target[r]) / slot_gpus) for r in ROLES}
    movable = [s for s in obs.slots if may_move(s, obs.time_s, min_dwell_s)]
    donors = {r: sorted((s for s in movable if s.role == r), key=donor_order) for r in ROLES}
    orders: list[tuple[int, str]] = []
    for receiver in ROLES:
        for _ in range(max(need[receiver], 0)):
            donor_role = max(
                (r for r in ROLES if surplus[r] > 0 and donors[r]),
                key=lambda r: (surplus[r], -ROLES.index(r)),
                default=None,
            )
            if donor_role is None:
                break
            slot = donors[donor_role].pop(0)
            surplus[donor_role] -= 1
            orders.append((slot.slot_id, receiver))
    return orders


def roles_for_allocation(alloc: Allocation, num_slots: int, slot_gpus: int) -> list[str]:
    """Initial role of every slot for ``alloc`` (no switching: the cluster starts this way)."""
    if alloc.slot_roles is not None:
        missing = set(range(num_slots)) - set(alloc.slot_roles)
        if missing:
            raise ConfigError(f"initial allocation leaves slots {sorted(missing)} without a role")
        return [alloc.slot_roles[i] for i in range(num_slots)]
    counts = {r: alloc.gpus.get(r, 0) for r in ROLES}
    if sum(counts.values()) != num_slots * slot_gpus:
        raise ConfigError(
            f"allocation {counts} does not add up to the cluster's {num_slots * slot_gpus} GPUs"
        )
    roles: list[str] = []
    for role in ("prefill", "decode", "colocated"):
        roles += [role] * (counts[role] // slot_gpus)
    if len(roles) != num_slots:
        raise ConfigError(f"allocation {counts} is not a whole number of {slot_gpus}-GPU slots")
    return roles


class Controller:
    """Runs a policy every ``interval_s`` on an injected clock against an actuator.

    ``gc_between_ticks`` holds Python's automatic garbage collection off during a tick
    (see :meth:`tick`); pass False to leave the collector alone. ``keep_running``: a tick
    that raises is logged and counted (:attr:`failed_ticks`, :attr:`last_error`) and the
    loop goes on (a live service must not lose its control loop to one bad tick); the
    simulator leaves it off, so an error ends the run where it happened.
    """

    def __init__(
        self,
        policy: Policy,
        actuator: Actuator,
        clock: Clock,
        *,
        interval_s: float = 1.0,
        min_dwell_s: float = 10.0,
        forecaster: ForecastSource | None = None,
        keep_forecasts: bool = False,
        gc_between_ticks: bool = True,
        keep_running: bool = False,
    ) -> None:
        if interval_s <= 0:
            raise ConfigError("control interval_s must be > 0")
        if min_dwell_s < 0:
            raise ConfigError("min_dwell_s must be >= 0")
        if policy.needs_forecast and forecaster is None:
            raise ConfigError(
                f"policy {type(policy).__name__} needs a forecaster",
                hint="pass --forecaster NAME (see `prorsa forecast list`)",
            )
        self.policy = policy
        self.actuator = actuator
        self.clock = clock
        self.interval_s = interval_s
        self.min_dwell_s = min_dwell_s
        self.forecaster = forecaster
        if forecaster is not None:
            forecaster.attach(actuator.events, actuator.truth)
            # Forecast only the horizons the policy reads, unless every forecast is kept.
            narrow = getattr(forecaster, "use_horizons", None)
            if narrow is not None and not keep_forecasts:
                wanted = policy.forecast_horizons(forecaster.horizons)  # type: ignore[attr-defined]
                if wanted is not None:
                    narrow(wanted)
        self.keep_forecasts = keep_forecasts
        self.gc_between_ticks = gc_between_ticks
        self.keep_running = keep_running
        self.failed_ticks = 0
        self.last_error: str | None = None
        self.decisions: MutableSequence[Decision] = []
        self._stopped = False

    def start(self) -> None:
        self._stopped = False
        self.clock.call_later(self.interval_s, self._tick_and_reschedule)

    def stop(self) -> None:
        self._stopped = True

    def _tick_and_reschedule(self) -> None:
        if self._stopped:
            return
        try:
            self.tick()
        except Exception as exc:
            if not self.keep_running:
                raise
            self.failed_ticks += 1
            error = f"{type(exc).__name__}: {exc}"
            if error != self.last_error:  # the traceback once, not every interval
                logger.exception("control tick failed (%d so far); ticking on", self.failed_ticks)
            self.last_error = error
        self.clock.call_later(self.interval_s, self._tick_and_reschedule)

    def tick(self) -> Decision:
        """One observe -> forecast -> decide -> actuate round.

        With ``gc_between_ticks`` (the default) Python's automatic garbage collection is
        held off while the tick runs and resumes when it returns: a full collection over
        a large simulation's heap takes 50-150 ms, and landing inside a decision it would
        set the tick's tail latency. The work is not skipped, only moved to between ticks.
        """
        if not self.gc_between_ticks or not gc.isenabled():
            return self._tick()
        gc.disable()
        try:
            return self._tick()
        finally:
            gc.enable()

    def _tick(self) -> Decision:
        obs = self.actuator.observe()
        self._fit_policy_to(obs)
        forecast = self.forecaster.forecast(obs) if self.forecaster is not None else None
        alloc = self.policy.decide(obs, forecast)
        if alloc.local_prefill_threshold is not None:
            self.actuator.set_local_prefill_threshold(alloc.local_prefill_threshold)
        orders = plan_switches(obs, alloc, min_dwell_s=self.min_dwell_s)
        target = alloc.gpus if alloc.gpus is not None else _gpus_of(obs, alloc.slot_roles)
        done: list[tuple[int, str]] = []
        reason = alloc.reason
        try:
            for sid, role in orders:
                if self.actuator.switch(sid, role):
                    done.append((sid, role))
        except Exception as exc:
            reason = f"{reason}; switching failed after {len(done)}: {exc}"
            raise
        finally:
            # Switches already started are recorded even when a later one fails: the
            # allocation note is what forecasters read the GPUs per role from.
            if done:
                self.actuator.note_allocation(dict(target), reason)
            decision = Decision(
                time_s=obs.time_s,
                gpus_now=obs.gpus_by_role(include_target=False),
                gpus_target=dict(target),
                switches=done,
                forecast=forecast if self.keep_forecasts else None,
                reason=reason,
            )
            self.decisions.append(decision)
        return decision

    def _fit_policy_to(self, obs: ClusterObservation) -> None:
        """Size the policy to the slots the cluster has now. An engine that dies leaves
        the observation; a policy still sizing for the cluster it started with asks for
        GPUs no longer there, and every later tick would be refused."""
        spec = getattr(self.policy, "cluster_", None)
        if spec is None or not obs.slots or spec.num_slots == len(obs.slots):
            return
        logger.warning(
            "the cluster has %d slots, the policy was sized for %d: resizing it",
            len(obs.slots),
            spec.num_slots,
        )
        try:
            self.policy.resize(replace(spec, num_slots=len(obs.slots)))
        except Exception:
            self.policy.cluster_ = spec  # half reset: the next tick tries again
            raise


def _gpus_of(obs: ClusterObservation, slot_roles: dict[int, str]) -> dict[str, int]:
    out = dict.fromkeys(ROLES, 0)
    for s in obs.slots:
        out[slot_roles.get(s.slot_id, s.target_role or s.role)] += s.gpus
    return out
