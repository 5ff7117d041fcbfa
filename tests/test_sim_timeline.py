"""Hand-computed timelines and the closed-form vs per-step equivalence."""

from __future__ import annotations

import numpy as np
import pytest

from prorsa.telemetry.views import turn_table
from prorsa.workload.spec import TrajectorySpec
from tests.sim_helpers import arrivals, profile, reference_colocated, run


def _times(result, traj="a", turn=0):
    t = turn_table(result.telemetry)
    return t[(t.trajectory_id == traj) & (t.turn == turn)].iloc[0]


def test_one_colocated_engine_one_turn_by_hand():
    p = profile(max_step_tokens=4096)
    spec = TrajectorySpec("a", [1000], [10], [0.0])
    res = run([spec], slots=1, prof=p)
    row = _times(res)
    prefill = 0.01 + 1e-4 * 1000 + 1e-8 * 1000 * 500
    assert row.prefill_start == 0 and row.prefill_end == pytest.approx(prefill)
    assert row.decode_start == pytest.approx(prefill)
    decode = sum(0.005 + 1e-4 + 1e-7 * (1000 + j) for j in range(10))
    assert row.decode_end == pytest.approx(prefill + decode)
    assert res.metrics["makespan_s"] == pytest.approx(prefill + decode)


def test_chunked_prefill_splits_by_token_budget():
    p = profile(max_step_tokens=400)
    res = run([TrajectorySpec("a", [1000], [1], [0.0])], slots=1, prof=p)
    # three chunks: 400 (prior 0), 400 (prior 400), 200 (prior 800)
    chunks = [(400, 0), (400, 400), (200, 800)]
    expect = sum(0.01 + 1e-4 * n + 1e-8 * n * (c + n / 2) for n, c in chunks)
    assert _times(res).prefill_end == pytest.approx(expect)


def test_disaggregated_turn_by_hand():
    p = profile(max_step_tokens=4096)
    spec = TrajectorySpec("a", [1000], [10], [0.0])
    res = run(
        [spec],
        "static",
        slots=2,
        prof=p,
        policy_kw={"prefill_fraction": 0.5},
        transfer_base_s=0.002,
        transfer_bandwidth_gbytes_per_s=1.0,
    )
    row = _times(res)
    prefill = 0.01 + 1e-4 * 1000 + 1e-8 * 1000 * 500
    transfer = 0.002 + 1000 * 1000 / 1e9
    assert row.prefill_engine == 0 and row.decode_engine == 1
    assert row.prefill_end == pytest.approx(prefill)
    assert row.kv_transfer_start == pytest.approx(prefill)
    assert row.kv_transfer_end == pytest.approx(prefill + transfer)
    assert row.decode_start == pytest.approx(prefill + transfer)
    decode = sum(0.005 + 1e-4 + 1e-7 * (1000 + j) for j in range(10))
    assert row.decode_end == pytest.approx(prefill + transfer + decode)


def test_second_turn_hits_prefix_cache_and_waits_for_tool():
    p = profile(max_step_tokens=4096)
    spec = TrajectorySpec("a", [1000, 200], [10, 5], [1.5, 0.0])
    res = run([spec], slots=1, prof=p)
    t0, t1 = _times(res, turn=0), _times(res, turn=1)
    assert t0.tool_start == t0.decode_end and t0.tool_end == pytest.approx(t0.decode_end + 1.5)
    assert t1.prefill_start == pytest.approx(t0.tool_end)
    assert (t1.context_tokens, t1.cached_tokens, t1.new_tokens) == (1210, 1010, 200)
    prefill = 0.01 + 1e-4 * 200 + 1e-8 * 200 * (1010 + 100)
    assert t1.prefill_end == pytest.approx(t1.prefill_start + prefill)


def test_new_prefill_stalls_running_decode_on_a_colocated_engine():
    p = profile(max_step_tokens=4096)
    a = TrajectorySpec("a", [100], [200], [0.0])
    b = TrajectorySpec("b", [3000], [1], [0.0])
    alone = run([a], slots=1, prof=p)
    both = arrivals([a, b], [0.0, 0.3], slots=1, prof=p)
    assert _times(both, "a").decode_end > _times(alone, "a").decode_end + 0.02
    # b's prefill ran as a mixed step: a's decode kept going, one token in that step.
    assert _times(both, "b").prefill_start == pytest.approx(
        _times(both, "a").decode_start + _steps_before(0.3, p, 100), abs=1e-9
    )


def _steps_before(t_arrival, p, prompt):
    prefill = p.prefill_time_s(prompt, 0)
    t, ctx, k = prefill, prompt, 0
    while t <= t_arrival:
        t += p.decode_step_time_s(1, ctx + k)
        k += 1
    return t - prefill


@pytest.mark.parametrize("seed", range(8))
def test_closed_form_equals_per_step_reference(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 12))
    p = profile(
        max_step_tokens=int(rng.choice([256, 512, 2048])),
        decode_floor_s=float(rng.choice([0.0, 0.006])),
    )
    reqs = [
        (float(rng.uniform(0, 2)), int(rng.integers(1, 1500)), int(rng.integers(1, 80)))
        for _ in range(n)
    ]
    specs = [TrajectorySpec(f"r{i}", [pr], [o], [0.0]) for i, (_, pr, o) in enumerate(reqs)]
    res = arrivals(specs, [r[0] for r in reqs], slots=1, prof=p)
    t = turn_table(res.telemetry).set_index("trajectory_id")
    expect = reference_colocated(p, reqs)
    got = [t.loc[f"r{i}", "decode_end"] for i in range(n)]
    assert got == pytest.approx(expect, rel=1e-9, abs=1e-9)


def test_request_overhead_delays_each_leg():
    p = profile(max_step_tokens=4096)
    spec = TrajectorySpec("a", [1000], [10], [0.0])
    colocated = _times(run([spec], slots=1, prof=p))
    delayed = _times(run([spec], slots=1, prof=p, request_overhead_s=0.05))
    assert delayed.prefill_start == pytest.approx(0.05)
    assert delayed.decode_end == pytest.approx(colocated.decode_end + 0.05)
    pd = dict(policy="static", slots=2, prof=p, policy_kw={"prefill_fraction": 0.5})
    base = _times(run([spec], **pd))
    slow = _times(run([spec], request_overhead_s=0.05, **pd))
    assert slow.decode_end == pytest.approx(base.decode_end + 0.10)  # prefill leg + decode leg
