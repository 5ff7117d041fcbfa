"""The event queue's ordering and the engine's decode-series arithmetic, against plain
references (a sorted list of ``(time, priority, order)``; the cost profile's closed form)."""

from __future__ import annotations

import heapq
import math

import numpy as np
import pytest

from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.cluster.spec import load_profiles
from prorsa.runtime.sim.core import PRIORITY_COMPLETE, PRIORITY_PLAN, Environment
from prorsa.runtime.sim.engine import StepCosts


@pytest.mark.parametrize("seed", range(5))
def test_events_run_in_time_priority_then_scheduling_order(seed):
    """Many ties (times from a small grid), events scheduled from inside callbacks too,
    some at the current instant; the reference replays the same events on a heap of
    ``(time, priority, sequence)`` tuples."""
    rng = np.random.default_rng(seed)
    env = Environment()
    ran: list[int] = []
    event_of: dict[int, tuple[float, int, int]] = {}
    children: dict[int, list[int]] = {}

    def add(time: float, priority: int) -> int:
        ident = len(event_of)
        event_of[ident] = (time, priority, ident)
        env.schedule(time, fire, ident, priority=priority)
        return ident

    def fire(ident: int) -> None:
        ran.append(ident)
        assert env.now == event_of[ident][0]
        if len(event_of) < 400:
            children[ident] = [
                add(env.now + float(rng.choice([0.0, 0.0, 0.5, 1.0, 2.5])), int(rng.integers(4)))
                for _ in range(rng.integers(0, 3))
            ]

    roots = [add(float(rng.choice([0.0, 0.5, 1.0, 3.0])), int(rng.integers(4))) for _ in range(30)]
    env.run()

    heap = [event_of[i] for i in roots]
    heapq.heapify(heap)
    reference = []
    while heap:
        _, _, ident = heapq.heappop(heap)
        reference.append(ident)
        for kid in children.get(ident, ()):
            heapq.heappush(heap, event_of[kid])
    assert ran == reference and len(ran) == len(event_of)
    assert env.pending == 0


def test_withdrawn_event_never_runs_and_is_skipped():
    env = Environment()
    ran = []
    keep = (PRIORITY_COMPLETE, ran.append, ("kept",))
    gone = (PRIORITY_COMPLETE, ran.append, ("withdrawn",))
    env.push(2.0, gone)
    env.push(3.0, keep)
    env.withdraw(2.0, gone)
    assert env.peek() == 3.0
    env.run()
    assert ran == ["kept"] and env.now == 3.0
    # A tie is not withdrawn (its callback must recognise itself as stale).
    first = (PRIORITY_PLAN, ran.append, ("a",))
    second = (PRIORITY_COMPLETE, ran.append, ("b",))
    env.push(4.0, first)
    env.push(4.0, second)
    env.withdraw(4.0, first)
    env.run()
    assert ran[1:] == ["b", "a"]


def test_run_until_stops_before_later_events():
    env = Environment()
    ran = []
    env.schedule(1.0, ran.append, 1)
    env.schedule(5.0, ran.append, 5)
    assert env.run(until=2.0) == 2.0 and ran == [1]
    env.run()
    assert ran == [1, 5]


@pytest.fixture(scope="module")
def costs() -> StepCosts:
    profile = load_profiles(ClusterConfig(profile="h200-qwen2.5-7b-tp1"))[1]
    return StepCosts(profile)


def test_run_time_is_the_profiles_closed_form_bit_for_bit(costs):
    rng = np.random.default_rng(0)
    profile = costs.profile
    for _ in range(5000):
        batch = int(rng.integers(1, 300))
        ctx = int(rng.integers(0, 3_000_000))
        k = int(rng.integers(0, 5000))
        assert costs.run_time(batch, ctx, k) == profile.decode_run_time_s(batch, ctx, k)


def test_cut_is_the_first_step_not_done_and_its_end(costs):
    """``cut`` against its definition: the smallest k with run_time(k) > elapsed (+1e-12),
    capped at k_max, and that k's run time, on both sides of the decode floor."""
    rng = np.random.default_rng(1)
    for _ in range(3000):
        batch = int(rng.integers(1, 256))
        ctx = int(rng.choice([rng.integers(0, 2000), rng.integers(0, 3_000_000)]))
        k_max = int(rng.integers(1, 400))
        elapsed = float(rng.uniform(0, 1.2) * costs.run_time(batch, ctx, k_max))
        boundary, end = costs.cut(elapsed, k_max, batch, ctx)
        first = next(
            (k for k in range(1, k_max + 1) if costs.run_time(batch, ctx, k) > elapsed + 1e-12),
            None,
        )
        if first is None:
            assert boundary == k_max
        else:
            assert boundary == first
            assert end == costs.run_time(batch, ctx, first)
        assert math.isfinite(end)


def test_a_profile_without_the_roles_tp_names_role_tp_and_the_tps_it_has():
    from prorsa.errors import ConfigError

    # The profile's name says TP8; role_tp (default 1) decides, and 32B has no TP1 on H100.
    with pytest.raises(ConfigError, match="comes from role_tp") as err:
        load_profiles(ClusterConfig(profile="h100-qwen2.5-32b-tp8-roofline"))
    assert "TP 2, 4, 8" in err.value.hint and "--role-tp decode=8" in err.value.hint
    tp8 = {"prefill": 8, "decode": 8, "colocated": 8}
    profiles = load_profiles(ClusterConfig(profile="h100-qwen2.5-32b-tp8-roofline", role_tp=tp8))
    assert profiles[8].name == "h100-qwen2.5-32b-tp8-roofline"
    # A name that is not a profile at all is that error, not one about role_tp.
    with pytest.raises(ConfigError, match=r"unknown cost profile 'h100-qwen2\.5-32b-tp16"):
        load_profiles(ClusterConfig(profile="h100-qwen2.5-32b-tp16-roofline"))
