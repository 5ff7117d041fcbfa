"""Agent loop, observation and controller on fake engines (milliseconds, no Ray)."""

from __future__ import annotations

import asyncio
import json

import pytest

from prorsa.policy import make_policy
from prorsa.policy.base import ClusterSpec
from prorsa.policy.types import ROLES
from prorsa.runtime.controller import Controller
from prorsa.runtime.ray.actuator import AsyncioClock, RayActuator
from prorsa.runtime.ray.agent import AgentLoop
from prorsa.runtime.ray.monitor import LoadMonitor
from prorsa.runtime.ray.pools import RolePools
from prorsa.runtime.ray.router import PDRouter, RouterConfig
from prorsa.runtime.ray.specs import TokenSource, fit_specs
from prorsa.runtime.ray.tools import make_tools
from prorsa.telemetry import Recorder, read_telemetry
from prorsa.telemetry.schema import FIELDS
from prorsa.workload import get_scenario
from tests.policy_helpers import spec
from tests.runtime.checks import check_turns
from tests.runtime.fakes import FakeEngine

SPEC = ClusterSpec(3, 1, dict.fromkeys(ROLES, 1), 20_000.0, 2_000.0, 0.05, 0.0)


class _Chars:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 500 + 3 for c in text]


class LoadReportingFake(FakeEngine):
    """A fake that answers ``load`` like ``EngineServer`` (fixed capacity, use by leg)."""

    async def load(self) -> dict:
        self._check()
        used = 64 * len(self.in_flight)
        return {
            "kv_capacity_tokens": 4096,
            "kv_used_tokens": used,
            "kv_usage": used / 4096,
            "running": len(self.in_flight),
            "waiting": 0,
            "steps": 1,
        }


def workload(n: int = 6, seed: int = 0):
    raw = get_scenario("search").sample(n, seed, group_size=3)
    return fit_specs(
        raw, max_context_tokens=400, max_output_tokens=8, max_turns=3, tool_time_scale=0.01
    )


def build(roles, recorder=None, engine_cls=FakeEngine, prefill_s_per_token=0.0):
    engines = [engine_cls(i, 0.002, prefill_s_per_token) for i in range(len(roles))]
    pools = RolePools(engines, dict(enumerate(roles)))
    router = PDRouter(
        pools,
        RouterConfig(route_timeout_s=10, drain_timeout_s=0.05),
        recorder=recorder,
    )
    tools = make_tools()
    agent = AgentLoop(
        router,
        TokenSource(_Chars(), tools["search"].index.documents),
        tools,
        vocabulary=tools["search"].index.vocabulary,
    )
    return router, agent, engines


def test_agent_loop_runs_multi_turn_with_tools_and_live_rows(tmp_path):
    recorder = Recorder(tmp_path / "tel", run_id="agent")
    router, agent, _ = build(["prefill", "decode", "decode"], recorder)
    specs = workload()

    async def run():
        actuator = RayActuator(router, spec(3), total_trajectories=len(specs))
        task = asyncio.gather(*(agent.run(s) for s in specs))
        await asyncio.sleep(0.005)
        during = actuator.observe()
        return await task, during, actuator.observe()

    outcomes, during, after = asyncio.run(run())
    recorder.close()
    table, _ = read_telemetry(tmp_path / "tel", validate=True)
    check_turns(table, specs)
    assert [o.turns for o in outcomes] == [s.num_turns for s in specs]
    assert all(o.error is None for o in outcomes)
    # The in-memory event log holds exactly the recorded events: forecasters read it as-is.
    log = router.telemetry.log
    assert len(log) == table.num_rows
    assert log.rows(0, 1)[0] == tuple(table.slice(0, 1).to_pylist()[0][f] for f in FIELDS)
    assert sum(during.trajectory_state.values()) == len(specs)
    assert sum(after.trajectory_state.values()) == 0
    assert after.completed_trajectories == len(specs)
    assert after.total_trajectories == len(specs)
    assert {s.kv_capacity_tokens for s in during.slots} == {0}  # fakes report no capacity


def test_observation_uses_vllm_load_when_engines_report_it():
    router, agent, _ = build(["prefill", "decode", "decode"], engine_cls=LoadReportingFake)
    specs = workload(3)

    async def run():
        monitor = LoadMonitor(router.pools, interval_s=0.002)
        actuator = RayActuator(router, spec(3), monitor=monitor)
        monitor.start()
        task = asyncio.gather(*(agent.run(s) for s in specs))
        await router.pools.wait_until(lambda: any(e.leases for e in router.pools.engines()), 5)
        await asyncio.sleep(0.01)
        obs = actuator.observe()
        await task
        await monitor.stop()
        return obs, actuator.kv_sources

    obs, sources = asyncio.run(run())
    assert set(sources.values()) == {"vllm"}
    assert {s.kv_capacity_tokens for s in obs.slots} == {4096}
    assert sum(s.kv_used_tokens for s in obs.slots) > 0


def test_threshold_policy_switches_roles_mid_rollout_without_losing_turns(tmp_path):
    recorder = Recorder(tmp_path / "tel", run_id="threshold")
    # Prefill takes time here, so the controller sees a backlog to react to.
    router, agent, _ = build(["prefill", "decode", "decode"], recorder, prefill_s_per_token=2e-4)
    specs = workload(9, seed=1)
    # Any prefill backlog grows prefill; decode never counts as hot.
    policy = make_policy(
        "threshold", prefill_wait_high_s=1e-6, prefill_wait_low_s=5e-7, batch_high=1e9, kv_high=1.0
    )
    policy.reset(SPEC)

    async def run():
        actuator = RayActuator(router, spec(len(router.pools.engines())), drain_timeout_s=0.05)
        controller = Controller(policy, actuator, AsyncioClock(), interval_s=0.005, min_dwell_s=0)
        controller.start()
        outcomes = await asyncio.gather(*(agent.run(s) for s in specs))
        controller.stop()
        await actuator.wait()
        return outcomes, actuator.results

    outcomes, switches = asyncio.run(run())
    recorder.close()
    table, _ = read_telemetry(tmp_path / "tel", validate=True)
    check_turns(table, specs)
    assert [o.turns for o in outcomes] == [s.num_turns for s in specs]
    done = [s for s in switches if s.get("error") is None and not s.get("skipped")]
    assert done, "the tiny thresholds should have moved at least one engine"
    rows = table.to_pylist()
    start = min(r["time"] for r in rows if r["kind"] == "traj_start")
    end = max(r["time"] for r in rows if r["kind"] == "traj_end")
    ends = [r for r in rows if r["kind"] == "role_switch_end"]
    assert any(start < r["time"] < end for r in ends)
    assert all(not json.loads(r["detail"]).get("error") for r in ends)


def test_predictive_policy_runs_on_the_live_event_stream():
    provider_module = pytest.importorskip("prorsa.runtime.forecast_provider")
    router, agent, _ = build(["prefill", "decode", "decode"])
    specs = workload(6, seed=2)
    policy = make_policy("predictive", horizon_s=1.0, quantile=None)
    policy.reset(SPEC)
    provider = provider_module.make_provider("ewma", horizons=[1.0])

    async def run():
        actuator = RayActuator(router, spec(len(router.pools.engines())), drain_timeout_s=0.05)
        controller = Controller(
            policy,
            actuator,
            AsyncioClock(),
            interval_s=0.01,
            min_dwell_s=0,
            forecaster=provider,
            keep_forecasts=True,
        )
        controller.start()
        await asyncio.gather(*(agent.run(s) for s in specs))
        controller.stop()
        await actuator.wait()
        return controller.decisions

    decisions = asyncio.run(run())
    assert decisions and any(d.forecast is not None for d in decisions)
