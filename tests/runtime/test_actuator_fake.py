"""The controller drives live role switches through RayActuator (fake engines)."""

from __future__ import annotations

import asyncio

from prorsa.policy.base import ClusterSpec
from prorsa.policy.baselines import StaticPolicy
from prorsa.policy.types import ROLES
from prorsa.runtime.controller import Controller
from prorsa.runtime.ray.actuator import AsyncioClock, RayActuator
from prorsa.runtime.ray.pools import Role, RolePools
from prorsa.runtime.ray.router import PDRouter, RouterConfig, TurnRequest
from prorsa.telemetry import Recorder, read_telemetry
from tests.policy_helpers import spec
from tests.runtime.fakes import FakeEngine, expected_tokens


def make(roles, recorder=None):
    engines = [FakeEngine(i, step_s=0.003) for i in range(len(roles))]
    pools = RolePools(engines, dict(enumerate(roles)))
    return PDRouter(pools, RouterConfig(route_timeout_s=5), recorder=recorder), engines


def test_apply_switches_only_what_differs_and_never_interrupts():
    router, _ = make(["prefill", "decode", "decode", "colocated"])

    async def run():
        actuator = RayActuator(router, spec(4), drain_timeout_s=1)
        started = actuator.apply({0: "prefill", 1: "prefill", 3: "decode"})
        again = actuator.apply({1: "colocated"})  # engine 1 is switching: left alone
        during = actuator.observe()
        results = await actuator.wait()
        return started, again, during, results, actuator.observe()

    started, again, during, results, after = asyncio.run(run())
    assert started == [1, 3] and again == []
    assert {s.slot_id: s.role for s in during.slots}[1] == "switching"
    assert {s.slot_id: s.target_role for s in during.slots}[1] == "prefill"
    assert {s.slot_id: s.source_role for s in during.slots}[1] == "decode"
    assert all(s.source_role is None and s.drained_s is None for s in after.slots)
    assert sorted(r["engine_id"] for r in results) == [1, 3]
    assert router.pools.roles() == {
        0: Role.PREFILL,
        1: Role.PREFILL,
        2: Role.DECODE,
        3: Role.DECODE,
    }
    assert after.gpus_by_role(include_target=False) == {
        "prefill": 2,
        "decode": 2,
        "colocated": 0,
        "switching": 0,
    }


def test_controller_tick_on_wall_clock_moves_roles_under_load(tmp_path):
    recorder = Recorder(tmp_path / "tel", run_id="ctl")
    router, _ = make(["colocated"] * 4, recorder)
    prompts = {f"t{i}": [i + 1] * (10 + i) for i in range(6)}

    async def run():
        actuator = RayActuator(router, spec(4), drain_timeout_s=0.01)
        policy = StaticPolicy(prefill_gpus=1)
        policy.reset(ClusterSpec(4, 1, dict.fromkeys(ROLES, 1), 1.0, 1.0, 0.0, 0.0))
        controller = Controller(policy, actuator, AsyncioClock(), interval_s=0.02, min_dwell_s=0)
        tasks = [
            asyncio.ensure_future(router.generate(TurnRequest(t, p, 30)))
            for t, p in prompts.items()
        ]
        await asyncio.sleep(0.01)
        controller.start()
        results = await asyncio.gather(*tasks)
        await asyncio.sleep(0.1)
        controller.stop()
        await actuator.wait()
        return results, controller.decisions

    results, decisions = asyncio.run(run())
    recorder.close()
    assert decisions and decisions[0].switches
    for r in results:
        assert r.output_token_ids == expected_tokens(prompts[r.trajectory_id], 30)
    assert sorted(router.pools.roles().values()).count(Role.PREFILL) == 1
    table, _ = read_telemetry(tmp_path / "tel", validate=True)
    kinds = table.column("kind").to_pylist()
    assert "allocation" in kinds and "role_switch_end" in kinds
