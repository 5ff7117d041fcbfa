"""The controller holds automatic garbage collection off during a tick, and only then."""

from __future__ import annotations

import gc

import pytest

from prorsa.policy.base import Policy
from prorsa.policy.types import Allocation
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.sim.drivers import SyncDriver
from prorsa.runtime.sim.simulation import Simulation
from tests.sim_helpers import profile, random_specs


class RecordsCollector(Policy):
    """Keeps the cluster colocated and records whether the collector is on at each tick."""

    def __init__(self) -> None:
        self.enabled: list[bool] = []

    def decide(self, obs, forecast):
        self.enabled.append(gc.isenabled())
        return Allocation(gpus={"colocated": obs.total_gpus}, reason="keep")


def _run(gc_between_ticks: bool) -> RecordsCollector:
    """Simulate a short run; the policy's records after its first decision (taken when
    the simulation starts, before the controller ticks) are the ticks'."""
    policy = RecordsCollector()
    sim = Simulation(
        ClusterConfig(profile="test-tp1", num_slots=2),
        policy,
        SyncDriver([random_specs(40, seed=1, turns=(3, 6))]),
        profiles={1: profile(1)},
    )
    sim.start()
    sim.controller.gc_between_ticks = gc_between_ticks
    sim.advance()
    sim.finish()
    policy.enabled = policy.enabled[1:]
    return policy


@pytest.fixture
def collector_on():
    """The collector on for the test, and as it was afterwards (whatever the test did)."""
    was = gc.isenabled()
    gc.enable()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_collection_is_held_off_during_ticks_and_resumes_after(collector_on):
    policy = _run(True)
    assert len(policy.enabled) > 5
    assert not any(policy.enabled)
    assert gc.isenabled()


def test_the_collector_is_left_alone_when_asked(collector_on):
    policy = _run(False)
    assert len(policy.enabled) > 5 and all(policy.enabled)


def test_a_collector_the_caller_disabled_stays_disabled(collector_on):
    gc.disable()
    policy = _run(True)
    assert not any(policy.enabled)
    assert not gc.isenabled()
