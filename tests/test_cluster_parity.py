"""One cluster model, two runtimes: the simulator and the Ray router decide alike.

The same short workload runs through the simulator (hand-set cost profile) and through the
Ray router over fake engines of fixed step costs, in the simulator's order of arrivals,
ends and switches. Turn arrivals are spaced so no decision depends on timing; then every
routing decision (path, prefill engine, decode engine), every role-switch stage, and every
field of the observation at a quiet moment must agree.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import numpy as np
import pytest

from prorsa.policy.base import Policy
from prorsa.policy.types import Allocation, ClusterObservation
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.ray.actuator import RayActuator
from prorsa.runtime.ray.pools import RolePools
from prorsa.runtime.ray.router import PDRouter, RouterConfig, TurnRequest
from prorsa.runtime.sim.drivers import ArrivalDriver
from prorsa.runtime.sim.simulation import Simulation
from prorsa.telemetry.schema import EventKind
from prorsa.workload.shape import shape_of
from prorsa.workload.spec import TrajectorySpec
from tests.runtime.fakes import FakeEngine
from tests.sim_helpers import profile

ROLES = ["prefill", "prefill", "decode", "decode"]
KV_CAPACITY = 1_000_000
THRESHOLD = 64
QUIET_AT_S = 9.0  # every trajectory started so far is in its first tool call
LATE_AT_S = 30.0  # four trajectories have finished; the last is in its second tool call
# The last trajectory arrives after the first switch, on the slot that became decode.
ARRIVALS_S = [0.0, 2.5, 5.0, 7.5, 16.0]
# (time, slot, role): a real switch (prefill -> decode), then a relabel (decode -> colocated)
SCRIPT = [(14.0, 1, "decode"), (26.0, 3, "colocated")]


class Scripted(Policy):
    """The starting roles, then the scripted switches."""

    def decide(self, obs: ClusterObservation, forecast) -> Allocation:
        roles = dict(enumerate(ROLES))
        for at, slot, role in SCRIPT:
            if obs.time_s >= at:
                roles[slot] = role
        return Allocation(slot_roles=roles, reason="script")


def workload() -> list[TrajectorySpec]:
    rng = np.random.default_rng(7)
    return [
        TrajectorySpec(
            f"t{i}",
            np.array([int(rng.integers(200, 400)), 40, int(rng.integers(150, 250))]),
            np.array([20, 10, 15]),
            np.array([10.0, 10.0, 0.0]),
            task="parity",
        )
        for i in range(5)
    ]


def run_sim(specs):
    config = ClusterConfig(
        profile="test-tp1",
        num_slots=len(ROLES),
        local_prefill_threshold=THRESHOLD,
        switch_latency_s=0.5,
        kv_capacity_tokens=KV_CAPACITY,
    )
    driver = ArrivalDriver(specs, ARRIVALS_S)
    driver.shape = shape_of(specs)
    sim = Simulation(
        config,
        Scripted(),
        driver,
        profiles={1: profile(1)},
        interval_s=1.0,
        min_dwell_s=0.0,
    )
    sim.start()
    sim.advance(QUIET_AT_S)
    quiet = sim.actuator.observe()
    sim.advance(LATE_AT_S)
    late = sim.actuator.observe()
    cache_total = sum(e.cache.total for e in sim.cluster.engines.values())
    sim.advance()
    return sim.finish().telemetry.to_pandas(), (quiet, late, cache_total), sim.spec


def run_ray(specs, sim_events, spec):
    engines = [FakeEngine(i, step_s=0.0005) for i in range(len(ROLES))]
    limits = {i: {"kv_capacity_tokens": KV_CAPACITY} for i in range(len(ROLES))}
    pools = RolePools(engines, dict(enumerate(ROLES)), limits)
    router = PDRouter(pools, RouterConfig(local_prefill_threshold_tokens=THRESHOLD))
    actuator = RayActuator(router, spec, total_trajectories=len(specs), workload=shape_of(specs))
    by_id = {s.trajectory_id: s for s in specs}
    prompts: dict[str, list[int]] = {}

    async def replay():
        quiet = late = None
        for event in sim_events.itertuples():
            if quiet is None and event.time > QUIET_AT_S:
                quiet = actuator.observe()
            if late is None and event.time > LATE_AT_S:
                late = actuator.observe()
            traj, turn, kind = event.trajectory_id, int(event.turn), event.kind
            if kind == "traj_start":
                router.trajectory_event(EventKind.TRAJ_START, traj, 0, task="parity")
            elif kind == "prefill_queued":
                s = by_id[traj]
                # Distinct per trajectory: the fake engines cache prefixes across requests.
                start = 7 * turn + 61 * int(traj[1:])
                new = [(start + j) % 500 + 1 for j in range(int(s.new_tokens[turn]))]
                prompts[traj] = prompts.get(traj, []) + new
                out = int(s.output_tokens[turn])
                request = TurnRequest(traj, prompts[traj], out, turn=turn, task="parity")
                result = await router.generate(request)
                prompts[traj] = prompts[traj] + result.output_token_ids
            elif kind == "traj_end":
                router.trajectory_event(EventKind.TRAJ_END, traj, turn, task="parity")
            elif (
                kind == "role_switch_start" and json.loads(event.detail)["stage"] == "stop_new_work"
            ):
                detail = json.loads(event.detail)
                await router.switch_role(detail["slot"], detail["to"], drain_timeout_s=5)
        return quiet, late

    quiet = asyncio.run(replay())
    return router.telemetry.log.to_table().to_pandas(), quiet


def decisions(events):
    """(trajectory, turn) -> (first prefill engine, decode engine) from lifecycle events."""
    events = events.assign(kind=events["kind"].astype(str))
    prefill = events[events.kind == "prefill_start"].groupby(["trajectory_id", "turn"]).first()
    decode = events[events.kind == "decode_start"].groupby(["trajectory_id", "turn"]).first()
    return {
        key: (int(prefill.loc[key, "engine_id"]), int(decode.loc[key, "engine_id"]))
        for key in decode.index
    }


def switch_stages(events):
    events = events.assign(kind=events["kind"].astype(str))
    rows = events[events.kind.str.startswith("role_switch")]
    return [(json.loads(d)["slot"], json.loads(d)["stage"]) for d in rows.detail]


@pytest.fixture(scope="module")
def both():
    specs = workload()
    sim_events, (sim_quiet, sim_late, sim_cache_total), spec = run_sim(specs)
    ordered = sim_events.assign(kind=sim_events["kind"].astype(str))
    ray_events, (ray_quiet, ray_late) = run_ray(specs, ordered, spec)
    late = (sim_late, ray_late, sim_cache_total)
    return specs, sim_events, sim_quiet, ray_events, ray_quiet, late


def test_same_routing_decisions(both):
    specs, sim_events, _, ray_events, _, _ = both
    sim, ray = decisions(sim_events), decisions(ray_events)
    assert len(sim) == sum(s.num_turns for s in specs)
    assert ray == sim
    paths = {"local" if p == d else "remote" for p, d in sim.values()}
    assert paths == {"local", "remote"}  # both rules were exercised
    assert len({d for _, d in sim.values()}) >= 3  # placement spread, and the new decode slot


def test_same_switch_stages(both):
    _, sim_events, _, ray_events, _, _ = both
    stages = switch_stages(sim_events)
    assert stages == [
        (1, "stop_new_work"),
        (1, "drained"),
        (1, "serving"),
        (3, "stop_new_work"),
        (3, "drained"),
        (3, "serving"),
    ]
    assert switch_stages(ray_events) == stages


def test_same_observation_every_field_filled(both):
    _, _, sim_quiet, _, ray_quiet, _ = both
    clock_fields = {"time_s"}
    for field in dataclasses.fields(ClusterObservation):
        if field.name in clock_fields or field.name == "slots":
            continue
        a, b = getattr(sim_quiet, field.name), getattr(ray_quiet, field.name)
        assert a == b, field.name
        assert a is not None, field.name
    assert sim_quiet.trajectory_state["in_tool"] == 4
    assert sim_quiet.prefill_tokens_appended_total > 0  # the first turns' prompts
    assert sim_quiet.prefill_tokens_computed_total > 0
    assert len(sim_quiet.slots) == len(ray_quiet.slots) == len(ROLES)
    for s, r in zip(sim_quiet.slots, ray_quiet.slots, strict=True):
        for field in dataclasses.fields(s):
            if field.name == "since_s":
                continue  # simulated vs wall-clock seconds
            assert getattr(s, field.name) == getattr(r, field.name), field.name
    assert sum(s.cached_tokens for s in sim_quiet.slots) > 0  # filled on both sides
    assert ray_quiet.time_s > 0 and sim_quiet.time_s > 0


def test_finished_trajectories_leave_the_cached_count(both):
    # The simulator's engines still hold the finished trajectories' contexts (evictable,
    # as a real engine's do), but no turn will read them: a switch that drops them loses
    # nothing, so neither side counts them in a slot's cached tokens.
    *_, (sim_late, ray_late, sim_cache_total) = both
    assert sim_late.completed_trajectories == ray_late.completed_trajectories == 4
    assert [s.cached_tokens for s in sim_late.slots] == [s.cached_tokens for s in ray_late.slots]
    assert sum(s.cached_tokens for s in sim_late.slots) > 0  # the live trajectory's context
    assert sim_cache_total > sum(s.cached_tokens for s in sim_late.slots)


def test_a_switching_slot_says_where_it_comes_from_and_when_it_drained():
    # The simulator's side (the Ray side: tests/runtime/test_actuator_fake.py). Slot 1
    # leaves prefill for decode at 14 s with nothing to drain; it serves 0.5 s later.
    specs = workload()
    config = ClusterConfig(
        profile="test-tp1", num_slots=len(ROLES), switch_latency_s=0.5,
        kv_capacity_tokens=KV_CAPACITY,
    )  # fmt: skip
    sim = Simulation(
        config, Scripted(), ArrivalDriver(specs, ARRIVALS_S), profiles={1: profile(1)},
        interval_s=1.0, min_dwell_s=0.0,
    )  # fmt: skip
    sim.start()
    sim.advance(14.2)
    slot = sim.actuator.observe().slots[1]
    assert (slot.role, slot.target_role, slot.source_role) == ("switching", "decode", "prefill")
    assert slot.drained_s == pytest.approx(14.0)
    sim.advance(15.0)
    slot = sim.actuator.observe().slots[1]
    assert (slot.role, slot.source_role, slot.drained_s) == ("decode", None, None)
