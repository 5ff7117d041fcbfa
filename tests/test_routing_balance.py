"""Decode placement: sticky by default, load-balanced past the cache-aware routers'
thresholds, in the simulator as in the shared rule."""

from __future__ import annotations

from dataclasses import dataclass

from prorsa.runtime.cluster.routing import (
    BALANCE_ABS_THRESHOLD,
    DecodePlacement,
    overloaded,
)


@dataclass(eq=False)
class Engine:
    engine_id: int
    role: str = "colocated"
    accepting: bool = True
    owned: int = 0
    queued_prefill_tokens: int = 0


def placed(engines, counts):
    placement = DecodePlacement()
    placement.refresh(engines)
    for engine, n in zip(engines, counts, strict=True):
        for _ in range(n):
            placement.move(None, engine)
    return placement


def test_overloaded_needs_both_thresholds():
    assert not overloaded(BALANCE_ABS_THRESHOLD, 0)  # not more than 64 over
    assert overloaded(BALANCE_ABS_THRESHOLD + 1, 0)
    assert not overloaded(400, 300)  # 100 over, but only 1.33x
    assert overloaded(460, 300)


def test_sticky_engine_kept_until_imbalance_then_least_owned():
    a, b = Engine(0), Engine(1)
    placement = placed([a, b], [100, 60])
    assert placement.choose(a) is a  # 40 over: cache affinity wins
    c = Engine(2)  # a slot joins the decode side empty
    placement.refresh([a, b, c])
    assert placement.choose(a) is c and placement.choose(b) is b
    moved = 0
    while placement.choose(a) is not a:
        placement.move(a, placement.choose(a))
        moved += 1
    assert moved > 0 and not overloaded(a.owned, min(b.owned, c.owned))
    assert a.owned + b.owned + c.owned == 160


def test_simulated_trajectories_spread_onto_slots_that_join_the_decode_side():
    """A split of one prefill and one decode slot relabelled to colocation: the old
    prefill slot takes trajectories from the decode slot at their next turns."""
    from prorsa.policy.base import Policy
    from prorsa.policy.types import Allocation
    from prorsa.runtime.cluster.config import ClusterConfig
    from prorsa.runtime.sim.drivers import ArrivalDriver
    from prorsa.runtime.sim.simulation import Simulation
    from prorsa.workload import get_scenario
    from tests.sim_helpers import profile

    class SplitThenColocate(Policy):
        def decide(self, obs, forecast):
            if obs.time_s < 5.0:
                return Allocation(slot_roles={0: "prefill", 1: "decode"}, reason="split")
            return Allocation(slot_roles={0: "colocated", 1: "colocated"}, reason="colocate")

    specs = get_scenario("swe").sample(200, 0, group_size=8)
    sim = Simulation(
        ClusterConfig(profile="test-tp1", num_slots=2, kv_capacity_tokens=50_000_000),
        SplitThenColocate(),
        ArrivalDriver(specs, [0.0] * len(specs)),
        profiles={1: profile(1)},
        interval_s=1.0,
        min_dwell_s=0.0,
    )
    result = sim.run()
    events = result.telemetry.to_pandas()
    events = events.assign(kind=events["kind"].astype(str))
    late = events[(events.kind == "decode_start") & (events.time > 30.0)]
    per_engine = late.groupby("engine_id").size()
    assert len(per_engine) == 2, per_engine  # both slots decode after the relabel
    assert per_engine.min() > 0.25 * per_engine.sum()
