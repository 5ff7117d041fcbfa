"""Router overhead per request vs a direct engine-actor call, plus KV handoff latency.

Starts three tiny-model engines (prefill, decode, colocated) in Ray, then:

* overhead: the same short colocated request alternately as a direct
  ``actor.generate.remote`` call and through ``PDRouter.generate`` (streaming leg, lease
  bookkeeping, telemetry to a recorder); the difference per pair is the router's cost;
* handoff: disaggregated turns (prefill leg -> NIXL pull -> decode leg) vs colocated turns
  for growing prompts; the decode engine's time to first token is the KV pull plus one step.

Writes benchmarks/results/router_overhead.json. Needs the [ray,vllm] extras; about 2 min
on 2 cores.

    .venv/bin/python benchmarks/router_overhead.py [--pairs 200]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from benchmarks._common import save

PROMPT_LENGTHS = (128, 512, 900)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) * 1000.0


def summary_ms(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": pct(values, 50),
        "p99_ms": pct(values, 99),
        "mean_ms": 1000 * statistics.fmean(values),
    }


async def overhead(fleet, router, pairs: int, max_tokens: int) -> dict:
    from prorsa.runtime.ray.router import TurnRequest

    actor = fleet.actors[2]
    prompt = [(7 * i) % 500 + 3 for i in range(32)]
    direct, routed = [], []
    for i in range(pairs + 10):
        started = time.perf_counter()
        await actor.generate.remote(f"direct{i}", prompt, max_tokens, 0.0)
        t_direct = time.perf_counter() - started
        started = time.perf_counter()
        await router.generate(TurnRequest(f"routed{i}", prompt, max_tokens, mode="colocated"))
        t_routed = time.perf_counter() - started
        if i >= 10:  # warm-up pairs dropped
            direct.append(t_direct)
            routed.append(t_routed)
    diffs = [r - d for r, d in zip(routed, direct, strict=True)]
    return {
        "pairs": pairs,
        "prompt_tokens": len(prompt),
        "max_tokens": max_tokens,
        "direct": summary_ms(direct),
        "router": summary_ms(routed),
        "overhead": summary_ms(diffs),
    }


async def handoff(router, repeats: int, max_tokens: int) -> dict:
    from prorsa.runtime.ray.router import TurnRequest

    out = {}
    for n in PROMPT_LENGTHS:
        rows = {"colocated_s": [], "disaggregated_s": [], "prefill_leg_s": [], "kv_pull_s": []}
        for r in range(repeats):
            prompt = [(11 * i + 97 * r + n) % 500 + 3 for i in range(n)]  # fresh: no cache hits
            col = await router.generate(
                TurnRequest(f"c{n}-{r}", prompt, max_tokens, mode="colocated")
            )
            pd = await router.generate(
                TurnRequest(f"d{n}-{r}", prompt, max_tokens, mode="disaggregated")
            )
            assert pd.output_token_ids == col.output_token_ids, "handoff changed the tokens"
            rows["colocated_s"].append(col.latency_s)
            rows["disaggregated_s"].append(pd.latency_s)
            rows["prefill_leg_s"].append(pd.legs["prefill"]["timings"]["total_s"])
            rows["kv_pull_s"].append(pd.legs["decode"]["timings"]["first_token_s"])
        out[str(n)] = {k: summary_ms(v) for k, v in rows.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    import ray

    from prorsa.runtime.ray.cluster import EngineFleet, FleetSpec
    from prorsa.runtime.ray.config import EngineConfig
    from prorsa.runtime.ray.router import PDRouter, RouterConfig
    from prorsa.runtime.ray.tiny_model import make_tiny_model
    from prorsa.telemetry import Recorder

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model", seed=0)
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
        config = EngineConfig(
            model=str(model),
            dtype="float32",
            max_model_len=1024,
            kv_cache_gib=0.125,
            kv_storage_dir=str(Path(tmp) / "kv"),
        )
        fleet = EngineFleet.start(FleetSpec(config, roles=["prefill", "decode", "colocated"]))
        try:
            recorder = Recorder(Path(tmp) / "telemetry", run_id="bench")
            router = PDRouter(fleet.pools(), RouterConfig(), recorder=recorder)

            async def run() -> tuple[dict, dict]:
                return (
                    await overhead(fleet, router, args.pairs, max_tokens=8),
                    await handoff(router, args.repeats, max_tokens=16),
                )

            over, hand = asyncio.run(run())
            recorder.close()
        finally:
            fleet.shutdown()
            ray.shutdown()
    result = {
        "connector": fleet.health[0]["connector"],
        "engine_start": {
            "fleet_of_3_s": fleet.start_s,
            "asyncllm_build_s": {str(k): h["start_s"] for k, h in fleet.health.items()},
        },
        "router_overhead": over,
        "handoff": hand,
    }
    path = save("router_overhead", result)
    o, d, r = over["overhead"], over["direct"], over["router"]
    print(f"engines ({result['connector']}): 3 started in {fleet.start_s:.1f} s")
    print(
        f"router overhead per request: p50 {o['p50_ms']:.2f} ms, p99 {o['p99_ms']:.2f} ms "
        f"(direct p50 {d['p50_ms']:.2f} ms, routed p50 {r['p50_ms']:.2f} ms)"
    )
    for n, row in hand.items():
        p50 = {k: v["p50_ms"] for k, v in row.items()}
        print(
            f"prompt {n:>4}: colocated p50 {p50['colocated_s']:.1f} ms, disaggregated p50 "
            f"{p50['disaggregated_s']:.1f} ms (prefill leg {p50['prefill_leg_s']:.1f}, "
            f"KV pull + 1st token {p50['kv_pull_s']:.1f})"
        )
    print(f"saved {path}")


if __name__ == "__main__":
    main()
