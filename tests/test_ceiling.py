"""The regime bound: critical paths and GPU work at the family's best rates, and a bound
no simulated allocation beats."""

from __future__ import annotations

import pytest

from prorsa.experiments.ceiling import (
    CONTEXTS,
    Floors,
    critical_paths_s,
    gpu_work_s,
    layout_floors,
    regime_ceiling,
)
from prorsa.experiments.regimes import MapConfig, Regime, plan_regime, regime_ceiling_of
from prorsa.runtime.sim.cost.layout_registry import get_layout_cost
from prorsa.workload.spec import TrajectorySpec
from tests.test_regimes import TOY

FLOORS = Floors(  # the same rates at every context
    decode_step_s=(0.01,) * len(CONTEXTS),
    decode_tokens_per_s_per_gpu=(100.0,) * len(CONTEXTS),
    prefill_tokens_per_s=1000.0,
    prefill_tokens_per_s_per_gpu=500.0,
)


def _spec(name: str, new, out, tool) -> TrajectorySpec:
    return TrajectorySpec(name, new_tokens=new, output_tokens=out, tool_latency_s=tool)


SHORT = _spec("short", [1000, 100], [10, 10], [1.0, 0.0])  # 1 + 1.1 + 0.2 = 2.3 s
LONG = _spec("long", [2000, 1000], [100, 50], [5.0, 0.0])  # 5 + 3 + 1.5 = 9.5 s


def test_critical_path_is_tools_plus_own_work_at_the_best_rates():
    assert critical_paths_s([SHORT, LONG], FLOORS) == pytest.approx([2.3, 9.5])
    # 4,100 prefill tokens at 500/s per GPU, 170 decode tokens at 100/s per GPU
    assert gpu_work_s([SHORT, LONG], FLOORS) == pytest.approx(4100 / 500 + 170 / 100)


def test_sync_bound_is_the_longest_path_of_each_step():
    c = regime_ceiling(
        "sync", [[SHORT, LONG], [SHORT]], FLOORS, in_flight=2, gpus=8, colocate_objective=23.6
    )
    assert c["bound"] == pytest.approx(9.5 + 2.3)
    assert c["ceiling"] == pytest.approx(2.0)
    assert c["binding"] == "critical_path"
    # on one GPU the step's work (14.2 GPU-s of prefill, 3.2 of decode) outlasts its paths
    c = regime_ceiling(
        "sync", [[SHORT, LONG, LONG]], FLOORS, in_flight=3, gpus=1, colocate_objective=1.0
    )
    work = (1100 + 3000 * 2) / 500 + (20 + 150 * 2) / 100
    assert c["binding"] == "gpu_work"
    assert c["bound"] == pytest.approx(work)


def test_async_bound_takes_the_binding_limit_per_trajectory():
    specs = [SHORT, LONG, SHORT, LONG]
    # one place in flight: the paths run one after another (23.6 s) > the longest (9.5 s)
    c = regime_ceiling("async", [specs], FLOORS, in_flight=1, gpus=8, colocate_objective=11.8)
    assert c["binding"] == "in_flight"
    assert c["bound"] == pytest.approx(23.6 / 4)
    assert c["ceiling"] == pytest.approx(2.0)
    # one GPU: the work (2 x 9.9 GPU-s) binds
    c = regime_ceiling("async", [specs], FLOORS, in_flight=4, gpus=1, colocate_objective=10.0)
    assert c["binding"] == "gpu_work"
    assert c["bound"] == pytest.approx(2 * (4100 / 500 + 170 / 100) / 4)


def test_floors_are_the_fastest_layout_of_each_kind():
    costs = [get_layout_cost(f"h200-qwen2.5-7b-{name}") for name in ("tp1", "tp2")]
    floors = layout_floors(costs)
    at_4k = CONTEXTS.index(4096)
    for cost in costs:
        assert floors.decode_step_s[at_4k] <= cost.decode_step_s([1], [4096])
        assert floors.decode_step_s[at_4k] <= cost.decode_step_s([1], [6000])  # rounded down
        rate = floors.decode_tokens_per_s_per_gpu[at_4k]
        assert rate >= cost.decode_tokens_per_s_per_gpu(16, 4096)
        assert floors.prefill_tokens_per_s_per_gpu >= cost.prefill_tokens_per_s_per_gpu(2048)
    # decode slows as context grows: the floors are monotone
    assert list(floors.decode_step_s) == sorted(floors.decode_step_s)
    assert list(floors.decode_tokens_per_s_per_gpu) == sorted(
        floors.decode_tokens_per_s_per_gpu, reverse=True
    )


def test_decode_is_priced_at_each_turns_starting_context():
    step = [0.001 * (1 + k) for k in range(len(CONTEXTS))]  # 1 ms at 1 token, +1 ms per doubling
    floors = Floors(tuple(step), (1e9,) * len(CONTEXTS), 1e12, 1e12)
    spec = _spec("t", [1000, 1000], [10, 10], [0.0, 0.0])
    # turn 0 decodes from 1,000 tokens (bucket 512: 10 ms), turn 1 from 2,010 (bucket 1,024)
    assert critical_paths_s([spec], floors)[0] == pytest.approx(10 * 0.010 + 10 * 0.011)


def test_async_regime_bound_reads_the_runs_trajectories():
    regime = Regime("toy-7b", "search", "async", 4)
    cfg = MapConfig(regimes=[regime], families={"toy-7b": TOY}, forecaster="ewma", workers=1)
    c = regime_ceiling_of(cfg, plan_regime(regime, cfg), "tp1", 1.0)
    assert set(c["parts"]) == {"critical_path_s", "in_flight_s", "gpu_work_s"}
    assert c["bound"] > 0 and c["ceiling"] == pytest.approx(1.0 / c["bound"])
