"""Role switches in the simulator: the shared state machine run on simulated time.

Rules and stages are :mod:`prorsa.runtime.cluster.switching`'s; this module only wires
them to simulator events: queued work is re-routed when a slot stops taking new work,
in-flight decodes drain (or migrate), the switch latency elapses as a scheduled event, and
the slot's engines are rebuilt for the new role.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from prorsa.errors import ConfigError
from prorsa.policy.types import ROLES, SWITCHING, switch_latency_s
from prorsa.runtime.cluster.switching import (
    RoleSwitch,
    SwitchKind,
    classify_switch,
    strands_decode,
)
from prorsa.runtime.sim.core import PRIORITY_COMPLETE
from prorsa.runtime.sim.topology import Slot, build_engines

if TYPE_CHECKING:
    from prorsa.runtime.sim.cluster import SimCluster
    from prorsa.runtime.sim.engine import SimEngine

logger = logging.getLogger(__name__)


class SlotSwitcher:
    """Starts, advances and finishes role switches of a :class:`SimCluster`'s slots."""

    def __init__(self, cluster: SimCluster) -> None:
        self.cluster = cluster
        self.config = cluster.config
        self.env = cluster.env

    def switch(self, slot_id: int, new_role: str) -> bool:
        """Begin moving ``slot_id`` to ``new_role``. Returns False if refused (logged)."""
        if new_role not in ROLES:
            raise ConfigError(f"unknown role '{new_role}'")
        cluster, cfg = self.cluster, self.config
        slot = cluster.slots[slot_id]
        if slot.role == SWITCHING:
            logger.debug("slot %d is already switching; ignored", slot_id)
            return False
        kind = classify_switch(slot.role, new_role, cfg.role_layouts)
        if kind is SwitchKind.NONE:
            return False
        now = self.env.now
        if kind is SwitchKind.RELABEL:
            self._relabel(slot, new_role)
            return True
        left = sum(1 for e in cluster.decode_side if e.slot_id != slot_id)
        if strands_decode(slot.role, left):
            logger.info("refused: switching slot %d would leave no decode-side engine", slot_id)
            return False
        old_role = slot.role
        switch = RoleSwitch(slot_id, old_role, new_role, cfg.switch_mode, now)
        slot.switch = switch
        slot.role = SWITCHING
        slot.target_role = new_role
        slot.since_s = now
        slot.history.append((now, SWITCHING))
        cluster.tally.switches += 1
        # Work done from here on is draining, in GPU-time the slot holds as switching.
        self._close_busy(slot, old_role)
        for engine in slot.engines:
            engine.accepting = False
        cluster.refresh_routing()
        cluster.telemetry.switch_event(now, switch, "stop_new_work", slot.engines[0].engine_id)
        switch.begin_moving_work()
        for engine in slot.engines:
            for req in engine.take_queued_prefills():
                cluster.reroute_queued(req)
            for req in engine.take_incoming():
                cluster.redirect_incoming(req)
            if cfg.switch_mode == "migrate":
                engine.request_migration()
        if cfg.switch_mode == "drain" and cfg.drain_timeout_s < float("inf"):
            self.env.schedule(now + cfg.drain_timeout_s, self._drain_timeout, slot, switch)
        self.check(slot)
        return True

    def _relabel(self, slot: Slot, new_role: str) -> None:
        now = self.env.now
        cluster = self.cluster
        switch = RoleSwitch(slot.slot_id, slot.role, new_role, self.config.switch_mode, now)
        switch.relabel = True
        cluster.tally.switches += 1
        engine_id = slot.engines[0].engine_id
        for stage in ("stop_new_work", "drained", "serving"):
            cluster.telemetry.switch_event(now, switch, stage, engine_id)
        old_role = slot.role
        slot.role = new_role
        slot.since_s = now
        slot.history.append((now, new_role))
        self._close_busy(slot, old_role)
        for engine in slot.engines:
            engine.role = new_role
        cluster.refresh_routing()

    def _close_busy(self, slot: Slot, role: str) -> None:
        """Book the slot's busy GPU-seconds so far to ``role`` and restart its count."""
        carry = self.cluster.tally.busy_carry_s
        for engine in slot.engines:
            carry[role] += engine.busy_s * engine.tp
            engine.busy_s = 0.0

    def _drain_timeout(self, slot: Slot, switch: RoleSwitch) -> None:
        if slot.switch is not switch or switch.drained_s is not None:
            return
        switch.migrate_rest()
        for engine in slot.engines:
            engine.request_migration()

    def engine_settled(self, engine: SimEngine) -> None:
        """An engine went idle or handed work away: its slot may be drained now."""
        slot = self.cluster.slots[engine.slot_id]
        if slot.role == SWITCHING:
            self.check(slot)

    def check(self, slot: Slot) -> None:
        """Finish draining ``slot`` once all its engines are empty."""
        switch = slot.switch
        if switch is None or switch.drained_s is not None:
            return
        if not all(e.is_empty() for e in slot.engines):
            return
        now = self.env.now
        switch.mark_drained(now)
        self.cluster.telemetry.switch_event(now, switch, "drained", slot.engines[0].engine_id)
        cfg = self.config
        latency = switch_latency_s(
            switch.from_role,
            switch.to_role,
            cfg.role_layouts,
            base_s=cfg.switch_latency_s,
            reshard_s=cfg.reshard_latency_s,
        )
        self.env.schedule(now + latency, self._finish, slot, priority=PRIORITY_COMPLETE)

    def _finish(self, slot: Slot) -> None:
        cluster, cfg = self.cluster, self.config
        switch = slot.switch
        now = self.env.now
        old = slot.engines
        self._close_busy(slot, SWITCHING)
        cluster.retire(old)
        slot.role = switch.to_role
        slot.target_role = None
        slot.switch = None
        slot.since_s = now
        slot.history.append((now, slot.role))
        slot.engines = build_engines(slot, cfg, cluster.profiles, self.env, cluster)
        cluster.adopt(slot.engines)
        layouts = cfg.role_layouts
        same_layout = layouts[switch.from_role] == layouts[switch.to_role]
        if same_layout and not cfg.switch_drops_prefix_cache:
            for new, prev in zip(slot.engines, old, strict=True):
                new.cache = prev.cache
        cluster.refresh_routing()
        switch.mark_serving(now)
        cluster.telemetry.switch_event(now, switch, "serving", slot.engines[0].engine_id)
