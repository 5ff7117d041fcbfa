"""Simulator behaviour: determinism, conservation, switching, memory pressure, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from prorsa.errors import ConfigError
from prorsa.policy import Allocation, Policy, make_policy
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.sim.core import Environment
from prorsa.runtime.sim.drivers import AsyncDriver, SyncDriver
from prorsa.runtime.sim.simulation import Simulation
from prorsa.telemetry.validation import validate_table
from prorsa.telemetry.views import turn_table
from prorsa.workload.spec import TrajectorySpec
from tests.sim_helpers import profile, random_specs, run


class FlipPolicy(Policy):
    """Alternates the prefill share every ``period_s`` to force many switches."""

    def __init__(self, period_s: float = 3.0) -> None:
        self.period_s = period_s

    def decide(self, obs, forecast):
        slots, size = len(obs.slots), obs.slots[0].gpus
        phase = int(obs.time_s // self.period_s) % 2
        prefill = max(slots // 4, 1) if phase == 0 else slots // 2
        if prefill == slots // 2 and phase == 0:
            prefill = 0  # two slots: flip between 0P2D and 1P1D
        gpus = {"prefill": prefill * size, "decode": (slots - prefill) * size}
        return Allocation(gpus=gpus, reason="flip")


def _conservation(result, specs):
    table = result.telemetry
    validate_table(table)
    turns = turn_table(table).set_index(["trajectory_id", "turn"])
    df = table.to_pandas()
    df["kind"] = df["kind"].astype(str)
    ends = df[df.kind == "decode_end"].groupby(["trajectory_id", "turn"]).size()
    assert (ends == 1).all(), "a turn was decoded twice or not at all"
    assert len(ends) == sum(s.num_turns for s in specs)
    for spec in specs:
        ctx = spec.context_by_turn
        for k in range(spec.num_turns):
            row = turns.loc[(spec.trajectory_id, k)]
            assert row.output_tokens == spec.output_tokens[k]
            assert row.context_tokens == ctx[k]
    starts = df[df.kind == "prefill_start"]
    first = starts.groupby(["trajectory_id", "turn"]).head(1)
    # The first prefill of every turn computes exactly what was not cached.
    assert (first.new_tokens + first.cached_tokens == first.context_tokens).all()
    recomputed = starts.drop(first.index)
    assert int(recomputed.new_tokens.sum()) <= result.metrics["recompute_tokens"]
    assert result.metrics["trajectories_completed"] == len(specs)


@pytest.mark.parametrize("policy", ["colocate", "static"])
def test_same_seed_same_telemetry_and_no_shared_state(policy):
    specs = random_specs(24, seed=1)
    a = run(specs, policy, slots=4)
    b = run(random_specs(30, seed=9), policy, slots=3)  # a different run in between
    c = run(specs, policy, slots=4)
    assert a.telemetry.equals(c.telemetry)
    assert not a.telemetry.equals(b.telemetry)


def test_environments_are_independent():
    e1, e2 = Environment(1), Environment(1)
    log = []
    e1.schedule(1.0, log.append, "e1")
    e2.schedule(0.5, log.append, "e2")
    e1.run()
    assert log == ["e1"] and e2.peek() == 0.5 and e1.now == 1.0 and e2.now == 0.0
    assert e1.next_id("x") == 0 and e1.next_id("x") == 1 and e2.next_id("x") == 0


@pytest.mark.parametrize("policy", ["colocate", "static"])
@pytest.mark.parametrize("reuse", ["reprefill", "pull"])
def test_conservation(policy, reuse):
    specs = random_specs(40, seed=2)
    res = run(specs, policy, slots=4, reuse_mode=reuse, local_prefill_threshold=100)
    _conservation(res, specs)


@pytest.mark.parametrize("mode", ["drain", "migrate"])
def test_role_switches_lose_and_duplicate_nothing(mode):
    specs = random_specs(60, seed=3, turns=(3, 10))
    res = run(
        specs, FlipPolicy(2.0), slots=4, switch_mode=mode, switch_latency_s=0.5, drain_timeout_s=1.0
    )
    assert res.metrics["switches_completed"] >= 4
    _conservation(res, specs)
    df = res.telemetry.to_pandas()
    df["kind"] = df["kind"].astype(str)
    stages = [json.loads(d)["stage"] for d in df[df.kind.str.startswith("role_switch")].detail]
    assert stages.count("stop_new_work") == res.metrics["switches_started"]
    assert stages.count("serving") == res.metrics["switches_completed"]
    if mode == "migrate":
        assert res.metrics["migrations"] > 0


def test_switch_with_different_parallelism_costs_resharding():
    specs = random_specs(20, seed=4, turns=(8, 14))
    common = dict(
        slots=2,
        switch_latency_s=1.0,
        reshard_latency_s=3.0,
        role_tp={"prefill": 2, "decode": 1, "colocated": 1},
    )
    res = run(specs, FlipPolicy(2.0), **common)
    df = res.telemetry.to_pandas()
    df["kind"] = df["kind"].astype(str)
    details = [json.loads(d) for d in df[df.kind == "role_switch_end"].detail]
    assert details and all(d["total_s"] >= 4.0 - 1e-9 for d in details)
    # A 2-GPU slot hosts one TP2 prefill engine or two TP1 decode engines.
    engines = set(df[df.kind == "prefill_start"].engine_id) | set(
        df[df.kind == "decode_start"].engine_id
    )
    assert engines <= {0, 1, 2, 3}
    _conservation(res, specs)


def test_kv_pressure_preempts_and_recomputes():
    from prorsa.workload.spec import TrajectorySpec

    specs = [TrajectorySpec(f"k{i}", [300, 50], [400, 300], [0.5, 0.0]) for i in range(20)]
    p = profile(kv_capacity_tokens=6000, max_batch=64)
    res = run(specs, "colocate", slots=1, prof=p)
    assert res.metrics["preemptions"] > 0 and res.metrics["recompute_tokens"] > 0
    _conservation(res, specs)
    # A preempted turn still decodes every remaining token after it is admitted again.
    df = res.telemetry.to_pandas()
    df["kind"] = df["kind"].astype(str)
    checked = 0
    for (traj, turn), rows in df.groupby(["trajectory_id", "turn"]):
        preempts = rows[(rows.kind == "prefill_queued") & (rows.detail != "")]
        if preempts.empty:
            continue
        last = json.loads(preempts.detail.iloc[-1])
        context = int(rows[rows.kind == "prefill_start"].context_tokens.iloc[0])
        output = int(rows[rows.kind == "decode_end"].output_tokens.iloc[0])
        remaining = output - (last["recompute_tokens"] - context)
        restart = rows[(rows.kind == "decode_start") & (rows.time >= preempts.time.iloc[-1])]
        span = rows[rows.kind == "decode_end"].time.iloc[0] - restart.time.iloc[0]
        assert span >= remaining * p.decode_base_s - 1e-9, (traj, turn)
        checked += 1
    assert checked > 0


def test_async_driver_keeps_concurrency_and_staleness():
    specs = iter(random_specs(200, seed=6))
    driver = AsyncDriver(
        specs, total=60, max_in_flight=8, batch_size=8, train_step_s=5.0, max_staleness=1
    )
    res = run(None, "colocate", slots=2, driver=driver)
    assert res.metrics["trajectories_completed"] == 60
    assert res.metrics["throughput_traj_per_hour"] > 0
    df = res.telemetry.to_pandas()
    df["kind"] = df["kind"].astype(str)
    starts = np.sort(df[df.kind == "traj_start"].time.to_numpy())
    ends = np.sort(df[df.kind == "traj_end"].time.to_numpy())
    for t in np.linspace(0, res.metrics["end_s"], 50):
        in_flight = (starts <= t).sum() - (ends <= t).sum()
        assert in_flight <= 8


def test_bad_configs_have_clear_errors():
    with pytest.raises(ConfigError, match="num_slots"):
        ClusterConfig(num_slots=0).validate()
    with pytest.raises(ConfigError, match="KV tokens"):
        run(random_specs(2, seed=0), slots=1, prof=profile(kv_capacity_tokens=100))
    with pytest.raises(ConfigError, match="unknown cost profile"):
        from prorsa.policy import make_policy
        from prorsa.runtime.sim.simulation import Simulation

        Simulation(
            ClusterConfig(profile="nope-tp1"),
            make_policy("colocate"),
            SyncDriver([random_specs(1, 0)]),
        )
    with pytest.raises(ConfigError, match="reuse_mode"):
        ClusterConfig(reuse_mode="teleport").validate()
    with pytest.raises(ConfigError, match="at least one"):
        SyncDriver([])


def _decode_end(result, traj):
    from prorsa.telemetry.views import turn_table

    t = turn_table(result.telemetry)
    return float(t.loc[t.trajectory_id == traj, "decode_end"].iloc[0])


def test_dp_attention_prefill_stalls_decode_on_every_rank():
    from prorsa.workload.spec import TrajectorySpec
    from tests.sim_helpers import arrivals

    a = TrajectorySpec("a", [100], [300], [0.0])
    b = TrajectorySpec("b", [100], [300], [0.0])
    c = TrajectorySpec("c", [6000], [1], [0.0])
    p = profile(max_step_tokens=2048)
    dp = dict(
        slots=1, prof=p, dp_attention_ranks=2, role_tp={"prefill": 2, "decode": 1, "colocated": 1}
    )
    separate = dict(slots=2, prof=p)
    # Without DP attention, b sits on its own engine: c's prefill (on a's engine) leaves it alone.
    quiet = arrivals([a, b], [0.0, 0.0], **separate)
    busy = arrivals([a, b, c], [0.0, 0.0, 0.5], **separate)
    assert _decode_end(busy, "b") == pytest.approx(_decode_end(quiet, "b"))
    assert _decode_end(busy, "a") > _decode_end(quiet, "a")
    # With DP attention the ranks step in lock-step: every rank waits for c's prefill.
    quiet = arrivals([a, b], [0.0, 0.0], **dp)
    busy = arrivals([a, b, c], [0.0, 0.0, 0.5], **dp)
    assert _decode_end(busy, "b") > _decode_end(quiet, "b") + 0.05
    assert _decode_end(busy, "a") > _decode_end(quiet, "a") + 0.05


@pytest.mark.parametrize("policy", ["colocate", "static"])
def test_running_tallies_match_metrics_from_telemetry(policy):
    from prorsa.runtime.sim.metrics import telemetry_metrics

    res = run(random_specs(40, seed=8), policy, slots=4, local_prefill_threshold=100)
    from_events = telemetry_metrics(res.telemetry)
    for key, value in from_events.items():
        assert res.metrics[key] == pytest.approx(value, rel=1e-9), key


def test_controller_never_double_switches_a_slot():
    specs = random_specs(60, seed=10, turns=(3, 10))
    res = run(
        specs, FlipPolicy(1.0), slots=6, switch_latency_s=1.5, min_dwell_s=0.0, interval_s=0.5
    )
    df = res.telemetry.to_pandas()
    df["kind"] = df["kind"].astype(str)
    events = df[df.kind.str.startswith("role_switch")]
    assert len(events) >= 6
    in_progress: set[int] = set()
    for detail in events.detail:
        d = json.loads(detail)
        if d["stage"] == "stop_new_work":
            assert d["slot"] not in in_progress, "a switching slot was switched again"
            in_progress.add(d["slot"])
        elif d["stage"] == "serving":
            in_progress.discard(d["slot"])


class ColocateThenSplit(Policy):
    """All colocated, then at t >= 2 s one slot prefill and the rest decode."""

    def decide(self, obs, forecast):
        n = len(obs.slots)
        if obs.time_s < 2.0:
            return Allocation(gpus={"colocated": n})
        return Allocation(gpus={"prefill": 1, "decode": n - 1})


def test_colocated_to_decode_is_an_instant_relabel():
    specs = random_specs(40, seed=11, turns=(3, 8))
    res = run(specs, ColocateThenSplit(), slots=3, switch_latency_s=5.0)
    df = res.telemetry.to_pandas()
    df["kind"] = df["kind"].astype(str)
    ends = [json.loads(d) for d in df[df.kind == "role_switch_end"].detail]
    relabels = [d for d in ends if d.get("relabel")]
    real = [d for d in ends if not d.get("relabel")]
    assert len(relabels) == 2 and all(d["to"] == "decode" and d["total_s"] == 0 for d in relabels)
    assert len(real) == 1 and real[0]["to"] == "prefill" and real[0]["total_s"] >= 5.0
    _conservation(res, specs)
    busy = res.metrics["busy_fraction"]
    assert busy["colocated"] is not None and busy["decode"] is not None


class FlipEverySecond(Policy):
    """Alternates 1P2D and 2P1D every second: most of the run is spent switching."""

    def decide(self, obs, forecast):
        prefill = 1 + int(obs.time_s) % 2
        return Allocation(gpus={"prefill": prefill, "decode": len(obs.slots) - prefill})


def test_busy_fraction_never_exceeds_one_while_switching():
    # Work a draining engine finishes belongs to the switching time, not its old role's.
    rng = np.random.default_rng(5)
    specs = [
        TrajectorySpec(
            f"t{i:03d}",
            rng.integers(50, 400, 4),
            rng.integers(300, 800, 4),  # long decodes: a decode slot drains for seconds
            np.full(4, 0.2),
            task="test",
        )
        for i in range(48)
    ]
    res = run(specs, FlipEverySecond(), slots=3, switch_latency_s=0.2)
    assert res.metrics["switches_completed"] >= 4
    busy = res.metrics["busy_fraction"]
    assert busy["prefill"] is not None and busy["decode"] is not None
    assert all(v is None or 0.0 <= v <= 1.0 + 1e-9 for v in busy.values()), busy
    _conservation(res, specs)


def test_telemetry_table_is_built_once_from_the_run_events_only():
    from prorsa.telemetry.columns import CLUSTER_KEY, KIND_CODE

    specs = random_specs(12, seed=3)
    result = run(specs, "static", slots=2)
    events = len(result.events)
    assert result.event_count == events > 0
    # Whatever the log gets after the run is not the run's, before or after the table.
    result.events.append(1e6, CLUSTER_KEY, 0, KIND_CODE["allocation"])
    table = result.telemetry
    assert table.num_rows == events
    assert table.schema.metadata[b"prorsa.source"] == b"simulator"
    assert result.telemetry is table  # built once
    again = run(specs, "static", slots=2)
    assert again.telemetry.equals(table)


def test_a_run_without_recording_has_no_telemetry():
    sim = Simulation(
        ClusterConfig(profile="test-tp1", num_slots=2),
        make_policy("colocate"),
        SyncDriver([random_specs(4, seed=3)]),
        profiles={1: profile(1)},
        record=False,
    )
    result = sim.run()
    assert result.events is None and result.telemetry is None
    assert result.metrics["trajectories_completed"] == 4
