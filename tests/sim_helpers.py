"""Small profiles, specs and a per-step reference engine for simulator tests."""

from __future__ import annotations

import numpy as np

from prorsa.policy import make_policy
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.sim.cost.profile import CostProfile
from prorsa.runtime.sim.drivers import ArrivalDriver, SyncDriver
from prorsa.runtime.sim.simulation import Simulation
from prorsa.workload.spec import TrajectorySpec


def profile(tp: int = 1, **overrides) -> CostProfile:
    """A hand-set profile with round coefficients (easy to compute timelines by hand)."""
    values = dict(
        name=f"test-tp{tp}",
        model="test",
        hardware="test",
        tp=tp,
        prefill_base_s=0.01,
        prefill_per_token_s=1e-4,
        prefill_attn_s_per_token2=1e-8,
        decode_base_s=0.005,
        decode_per_seq_s=1e-4,
        decode_per_ctx_token_s=1e-7,
        decode_floor_s=0.0,
        mixed_overhead_s=0.008,
        kv_bytes_per_token=1000,
        kv_capacity_tokens=1_000_000,
        max_batch=64,
        max_step_tokens=512,
        source="timings",
        provenance={"test": True},
    )
    values.update(overrides)
    return CostProfile(**values)


def random_specs(n: int, seed: int, *, turns=(1, 6), group: int = 4) -> list[TrajectorySpec]:
    rng = np.random.default_rng(seed)
    specs = []
    for i in range(n):
        t = int(rng.integers(*turns))
        specs.append(
            TrajectorySpec(
                f"t{i:03d}",
                rng.integers(20, 600, t),
                rng.integers(1, 60, t),
                rng.uniform(0.0, 2.0, t),
                group_id=f"g{i // group}",
                task="test",
            )
        )
    return specs


def run(
    specs,
    policy="colocate",
    *,
    slots=2,
    prof=None,
    driver=None,
    seed=0,
    policy_kw=None,
    interval_s=1.0,
    min_dwell_s=0.0,
    **config,
):
    cfg = ClusterConfig(profile="test-tp1", num_slots=slots, **config)
    profiles = {tp: prof or profile(tp) for tp in set(cfg.role_tp.values())}
    if isinstance(policy, str):
        policy = make_policy(policy, **(policy_kw or {}))
    sim = Simulation(
        cfg,
        policy,
        driver or SyncDriver([specs]),
        profiles=profiles,
        seed=seed,
        interval_s=interval_s,
        min_dwell_s=min_dwell_s,
    )
    return sim.run()


def arrivals(specs, times, **kw):
    return run(specs, driver=ArrivalDriver(specs, times), **kw)


def reference_colocated(prof: CostProfile, requests: list[tuple[float, int, int]]) -> list[float]:
    """Per-step reference of one colocated engine (no KV pressure, no prefix cache).

    ``requests`` are (arrival_s, prompt_tokens, output_tokens); returns each decode_end.
    Independent of the simulator's closed form: it ticks every single step.
    """
    budget = prof.max_step_tokens
    order = sorted(range(len(requests)), key=lambda i: requests[i][0])
    pending = list(order)
    queue: list[list] = []  # [idx, left, done]
    waiting: list[int] = []
    running: dict[int, list] = {}  # idx -> [remaining, context]
    end = [0.0] * len(requests)
    t = 0.0
    while pending or queue or waiting or running:
        while pending and requests[pending[0]][0] < t + 1e-12:
            i = pending.pop(0)
            queue.append([i, requests[i][1], 0])
        if not (queue or waiting or running):
            t = requests[pending[0]][0]
            continue
        for i in waiting:
            running[i] = [requests[i][2], requests[i][1]]
        waiting = []
        batch = len(running)
        ctx = sum(v[1] for v in running.values())
        left = max(budget - batch, 1)
        chunks = []
        prefill_s = 0.0
        for item in queue:
            if left <= 0:
                break
            n = min(item[1], left)
            prefill_s += prof.prefill_per_token_s * n + prof.prefill_attn_s_per_token2 * n * (
                item[2] + n / 2
            )
            chunks.append((item, n))
            left -= n
        if chunks and batch:
            dt = max(
                prof.mixed_overhead_s
                + prefill_s
                + prof.decode_per_seq_s * batch
                + prof.decode_per_ctx_token_s * ctx,
                prof.decode_floor_s,
            )
        elif chunks:
            dt = prof.prefill_base_s + prefill_s
        else:
            dt = prof.decode_step_time_s(batch, ctx)
        t += dt
        for i in list(running):
            running[i][0] -= 1
            running[i][1] += 1
            if running[i][0] == 0:
                end[i] = t
                del running[i]
        for item, n in chunks:
            item[1] -= n
            item[2] += n
            if item[1] == 0:
                queue.remove(item)
                waiting.append(item[0])
    return end
