"""Scale-out of a compare sweep: the same 40-cell matrix on 1 and 2 local Ray workers.

Cells are small simulations (16 engines, 512 trajectories: about 1-3 s each on this
machine). Each run gets a fresh local Ray instance with ``num_cpus`` = workers; its
start-up is timed apart from the sweep, and the speedup is given both for the cells
alone and end to end (start-up included). Both runs must give identical summaries.

    .venv/bin/python benchmarks/sweep_bench.py [--repeats N]

Writes benchmarks/results/sweep.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import save
from prorsa.experiments.compare import CompareConfig, run_compare

WORKLOADS = [("swe", None), ("mixed", None)]
POLICIES = ["colocate", "static", "threshold", "predictive"]
SEEDS = 5  # 2 workloads x 4 policies x 5 seeds = 40 cells


def config(workers: int, policies: list[str]) -> CompareConfig:
    return CompareConfig(
        workloads=WORKLOADS,
        policies=policies,
        seeds=SEEDS,
        engines=16,
        trajectories=512,
        max_in_flight=256,
        forecaster="ewma",  # cheap to build in every worker; the cells are what is timed
        workers=workers,
        backend="ray",
    )


def run(workers: int, policies: list[str]) -> dict:
    """One timed sweep on a fresh local Ray instance of ``workers`` CPUs."""
    import ray

    started = time.perf_counter()
    ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
    ray_start_s = time.perf_counter() - started
    try:
        t0 = time.perf_counter()
        result = run_compare(config(workers, policies))
        sweep_s = time.perf_counter() - t0
    finally:
        ray.shutdown()
    cell_s = [r["wall_s"] for r in result["runs"]]
    return {
        "workers": workers,
        "cells": len(result["runs"]),
        "ray_start_s": ray_start_s,
        "sweep_s": sweep_s,
        "end_to_end_s": ray_start_s + sweep_s,
        "cell_s_mean": sum(cell_s) / len(cell_s),
        "cell_s_min": min(cell_s),
        "cell_s_max": max(cell_s),
        "summary": [
            (r["workload"], r["policy"], r["objective"], r["speedup"]) for r in result["summary"]
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=1, help="alternating 1/2-worker runs")
    parser.add_argument("--policies", default=",".join(POLICIES), help="four policies")
    args = parser.parse_args()
    policies = args.policies.split(",")
    runs: dict[int, list[dict]] = {1: [], 2: []}
    load_before = os.getloadavg()
    for _ in range(args.repeats):
        for workers in (1, 2):
            r = run(workers, policies)
            runs[workers].append(r)
            print(
                f"{workers} worker(s): {r['cells']} cells, sweep {r['sweep_s']:.1f} s, "
                f"Ray start {r['ray_start_s']:.1f} s, cell {r['cell_s_mean']:.2f} s mean "
                f"({r['cell_s_min']:.2f}-{r['cell_s_max']:.2f})"
            )
    one, two = (min(runs[w], key=lambda r: r["sweep_s"]) for w in (1, 2))
    identical = all(r["summary"] == one["summary"] for w in (1, 2) for r in runs[w])
    speedup_sweep = one["sweep_s"] / two["sweep_s"]
    speedup_total = one["end_to_end_s"] / two["end_to_end_s"]
    print(f"speedup, cells only: {speedup_sweep:.2f}x; end to end: {speedup_total:.2f}x")
    print(f"identical results with 1 and 2 workers: {identical}")
    for r in (*runs[1], *runs[2]):
        r.pop("summary")
    path = save(
        "sweep",
        {
            "matrix": {
                "workloads": [w for w, _ in WORKLOADS],
                "policies": policies,
                "seeds": SEEDS,
                "engines": 16,
                "trajectories": 512,
            },
            "goal": "2 workers >= 1.7x faster than 1 (issue 13)",
            "speedup_sweep": speedup_sweep,
            "speedup_end_to_end": speedup_total,
            "identical_results": identical,
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "runs": runs,
        },
    )
    print(f"saved {path}")


if __name__ == "__main__":
    main()
