"""The role-switch state machine both runtimes run, and its latency rule.

A unit (a simulator slot of GPUs, or one real engine) moves between roles in typed stages::

    serving -> stop_new_work -> draining | migrating -> reconfiguring -> serving

* ``stop_new_work``: the router sends it nothing new; queued work not yet started is
  re-routed at once.
* ``draining``: in-flight work finishes where it is (after ``drain_timeout_s`` the rest is
  migrated or aborted and re-served elsewhere); ``migrating``: in-flight decodes move to
  peers now.
* ``reconfiguring``: nothing runs for the switch latency (a restart with another parallel
  layout costs the reshard latency on top); the real runtime pauses, resets the prefix
  cache and resumes here.

Decode and colocated engines at the same layout are one engine (vLLM's ``kv_both``) used
differently by the router, so a switch between them is a *relabel*: no drain, no latency.
A switch in progress is never interrupted, and a switch that would leave no decode-side
engine is refused.

Telemetry marks three moments with the schema's two kinds: ``role_switch_start``
(``stage: stop_new_work``), ``role_switch_start`` (``stage: drained``) and
``role_switch_end`` (``stage: serving``); :func:`switch_detail` builds their ``detail``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from prorsa.runtime.cluster.routing import DECODE_SIDE

SWITCH_MODES: tuple[str, ...] = ("drain", "migrate")


class SwitchStage(StrEnum):
    """Where a unit is in a role switch."""

    SERVING = "serving"
    STOP_NEW_WORK = "stop_new_work"
    DRAINING = "draining"
    MIGRATING = "migrating"
    RECONFIGURING = "reconfiguring"


class SwitchKind(StrEnum):
    """What a requested role change amounts to."""

    NONE = "none"  # already in that role
    RELABEL = "relabel"  # decode <-> colocated at one layout: the router's view only
    RECONFIGURE = "reconfigure"  # stop, drain or migrate, reconfigure, serve


def classify_switch(old_role: str, new_role: str, role_layouts: Mapping[str, object]) -> SwitchKind:
    """What moving a unit from ``old_role`` to ``new_role`` takes (``role_layouts``: the
    parallel layout of each role, any comparable value)."""
    if old_role == new_role:
        return SwitchKind.NONE
    same_layout = role_layouts.get(old_role) == role_layouts.get(new_role)
    if old_role in DECODE_SIDE and new_role in DECODE_SIDE and same_layout:
        return SwitchKind.RELABEL
    return SwitchKind.RECONFIGURE


def strands_decode(unit_role: str, decode_side_units_left: int) -> bool:
    """True when moving a ``unit_role`` unit away would leave no decode-side unit serving."""
    return unit_role in DECODE_SIDE and decode_side_units_left == 0


@dataclass
class RoleSwitch:
    """One switch of one unit, from ``stop_new_work`` to ``serving``."""

    unit_id: int
    from_role: str
    to_role: str
    mode: str
    started_s: float
    stage: SwitchStage = SwitchStage.STOP_NEW_WORK
    drained_s: float | None = None
    finished_s: float | None = None
    relabel: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in SWITCH_MODES:
            raise ValueError(f"switch mode must be one of {SWITCH_MODES}, not {self.mode!r}")

    def begin_moving_work(self) -> None:
        """Enter ``draining`` or ``migrating`` (by mode)."""
        self._expect(SwitchStage.STOP_NEW_WORK)
        self.stage = SwitchStage.MIGRATING if self.mode == "migrate" else SwitchStage.DRAINING

    def migrate_rest(self) -> None:
        """A drain timed out: what is left is migrated (or aborted and re-served)."""
        self._expect(SwitchStage.DRAINING, SwitchStage.MIGRATING)
        self.stage = SwitchStage.MIGRATING

    def mark_drained(self, now_s: float) -> None:
        """No work of the old role is left: reconfigure."""
        self._expect(SwitchStage.DRAINING, SwitchStage.MIGRATING, SwitchStage.STOP_NEW_WORK)
        self.drained_s = now_s
        self.stage = SwitchStage.RECONFIGURING

    def mark_serving(self, now_s: float) -> None:
        """The unit serves its new role."""
        self._expect(SwitchStage.RECONFIGURING)
        self.finished_s = now_s
        self.stage = SwitchStage.SERVING

    @property
    def in_progress(self) -> bool:
        return self.stage is not SwitchStage.SERVING

    def _expect(self, *stages: SwitchStage) -> None:
        if self.stage not in stages:
            allowed = ", ".join(s.value for s in stages)
            raise RuntimeError(
                f"switch of unit {self.unit_id} is at {self.stage.value}, expected {allowed}"
            )


def switch_detail(switch: RoleSwitch, event_stage: str, **extra: Any) -> dict[str, Any]:
    """The ``detail`` of a switch event at ``event_stage`` (``stop_new_work``, ``drained``
    or ``serving``). ``slot`` is the switching unit (a slot of GPUs, or one engine)."""
    detail: dict[str, Any] = {
        "slot": switch.unit_id,
        "from": switch.from_role,
        "to": switch.to_role,
        "stage": event_stage,
    }
    if switch.relabel:
        detail["relabel"] = True
        detail["total_s"] = 0.0
    elif event_stage == "stop_new_work":
        detail["mode"] = switch.mode
    elif event_stage == "drained" and switch.drained_s is not None:
        detail["drain_s"] = switch.drained_s - switch.started_s
    elif event_stage == "serving" and switch.finished_s is not None:
        detail["total_s"] = switch.finished_s - switch.started_s
    detail.update(extra)
    return detail
