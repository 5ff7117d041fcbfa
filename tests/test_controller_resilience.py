"""The control loop outlives a bad tick where asked to, and follows a cluster that shrinks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from prorsa.policy import make_policy
from prorsa.policy.base import Policy
from prorsa.policy.types import Allocation
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.sim.drivers import SyncDriver
from prorsa.runtime.sim.simulation import Simulation
from tests.sim_helpers import profile, random_specs


class FailsOnce(Policy):
    """Colocated throughout; the third tick raises."""

    def __init__(self) -> None:
        self.ticks = 0

    def decide(self, obs, forecast):
        self.ticks += 1
        if self.ticks == 4:  # the first decision is the start's, then ticks
            raise RuntimeError("bad tick")
        return Allocation(gpus={"colocated": obs.total_gpus}, reason="keep")


def _sim(policy, slots: int = 2) -> Simulation:
    sim = Simulation(
        ClusterConfig(profile="test-tp1", num_slots=slots),
        policy,
        SyncDriver([random_specs(40, seed=1, turns=(3, 6))]),
        profiles={1: profile(1)},
    )
    sim.start()
    return sim


def test_a_failing_tick_ends_a_simulation_but_not_a_live_control_loop():
    sim = _sim(FailsOnce())
    with pytest.raises(RuntimeError, match="bad tick"):
        sim.advance()
    policy = FailsOnce()
    sim = _sim(policy)
    sim.controller.keep_running = True  # as the Ray runtime and the service run it
    sim.advance()
    assert sim.done and policy.ticks > 5  # it kept ticking after the failure
    assert sim.controller.failed_ticks == 1 and "bad tick" in sim.controller.last_error


def test_the_policy_is_resized_when_the_cluster_loses_a_slot():
    # Found by review: an engine that died left the observation, the split policies kept
    # sizing for the cluster they started with, and every later tick was refused.
    policy = make_policy("threshold")
    sim = _sim(policy, slots=4)
    observe = sim.actuator.observe
    sim.actuator.observe = lambda: replace(observe(), slots=observe().slots[:3])
    sim.advance()
    assert sim.done and sim.controller.failed_ticks == 0
    assert policy.cluster_.num_slots == 3
    assert all(sum(d.gpus_target.values()) == 3 for d in sim.controller.decisions)


class SplitsAtOnce(Policy):
    """Starts colocated, then asks for three of four slots on prefill."""

    def __init__(self) -> None:
        self.calls = 0

    def decide(self, obs, forecast):
        self.calls += 1
        if self.calls == 1:  # the start's decision
            return Allocation(gpus={"colocated": obs.total_gpus}, reason="start")
        return Allocation(gpus={"prefill": 3, "decode": 1}, reason="split")


def test_switches_started_before_a_failing_one_are_recorded():
    # Found by review: the first switches of a tick had started when a later one raised,
    # and neither the decision nor the allocation note (what forecasters read the GPUs
    # per role from) was recorded.
    sim = Simulation(
        ClusterConfig(profile="test-tp1", num_slots=4),
        SplitsAtOnce(),
        SyncDriver([random_specs(40, seed=1, turns=(3, 6))]),
        profiles={1: profile(1)},
        min_dwell_s=0.0,
    )
    sim.start()
    notes, started = [], []
    switch = sim.actuator.switch

    def second_fails(slot_id, role):
        if started:
            raise RuntimeError("engine refused")
        started.append(slot_id)
        return switch(slot_id, role)

    sim.actuator.switch = second_fails
    sim.actuator.note_allocation = lambda gpus, reason: notes.append(reason)
    before = len(sim.controller.decisions)
    with pytest.raises(RuntimeError, match="engine refused"):
        sim.controller.tick()
    decision = sim.controller.decisions[-1]
    assert len(sim.controller.decisions) == before + 1 and len(decision.switches) == 1
    assert notes and "switching failed after 1" in notes[0]
