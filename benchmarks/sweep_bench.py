"""Scale-out of a compare sweep: the same 40-cell matrix on 1 and 2 local Ray workers.

Cells are small simulations (16 engines, 512 trajectories: about 1-3 s each on this
machine). Each run gets a fresh local Ray instance with ``num_cpus`` = workers; its
start-up is timed apart from the sweep, and the speedup is given both for the cells
alone and end to end (start-up included). Both runs must give identical summaries.

The machine may be shared: 1- and 2-worker runs alternate (order flipped every repeat, so
a drifting background load hits both alike), the speedup is the median of the pairs, and
each run also reports its concurrency, the cells' summed wall time over the sweep's: ~2
means two cells were in flight all the time, whatever CPU time the machine gave them.

    .venv/bin/python benchmarks/sweep_bench.py [--repeats N]

Writes benchmarks/results/sweep.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import save
from prorsa.experiments.compare import CompareConfig, run_compare
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.cluster.control import ControlConfig
from prorsa.workload.config import WorkloadConfig

WORKLOADS = [("swe", None), ("mixed", None)]
POLICIES = ["colocate", "static", "threshold", "predictive"]
SEEDS = 5  # 2 workloads x 4 policies x 5 seeds = 40 cells


def config(workers: int, policies: list[str]) -> CompareConfig:
    return CompareConfig(
        workloads=WORKLOADS,
        policies=policies,
        seeds=SEEDS,
        work=WorkloadConfig(trajectories=512, max_in_flight=256),
        cluster=ClusterConfig(num_slots=16),
        # ewma: cheap to build in every worker; the cells are what is timed
        control=ControlConfig(forecaster="ewma"),
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
        "load_average_1min": os.getloadavg()[0],
        "concurrency": sum(cell_s) / sweep_s,
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
    parser.add_argument("--repeats", type=int, default=3, help="pairs of 1- and 2-worker runs")
    parser.add_argument("--policies", default=",".join(POLICIES), help="four policies")
    args = parser.parse_args()
    policies = args.policies.split(",")
    pairs = []
    for repeat in range(args.repeats):
        pair = {}
        for workers in (1, 2) if repeat % 2 == 0 else (2, 1):
            r = pair[workers] = run(workers, policies)
            print(
                f"{workers} worker(s): {r['cells']} cells, sweep {r['sweep_s']:.1f} s "
                f"(concurrency {r['concurrency']:.2f}), Ray start {r['ray_start_s']:.1f} s, "
                f"cell {r['cell_s_mean']:.2f} s mean ({r['cell_s_min']:.2f}-"
                f"{r['cell_s_max']:.2f}), load {r['load_average_1min']:.1f}"
            )
        pair["speedup_sweep"] = pair[1]["sweep_s"] / pair[2]["sweep_s"]
        pair["speedup_end_to_end"] = pair[1]["end_to_end_s"] / pair[2]["end_to_end_s"]
        print(f"pair {repeat}: {pair['speedup_sweep']:.2f}x cells only")
        pairs.append(pair)
    summaries = [p[w].pop("summary") for p in pairs for w in (1, 2)]
    identical = all(s == summaries[0] for s in summaries)
    speedup_sweep = float(np.median([p["speedup_sweep"] for p in pairs]))
    speedup_total = float(np.median([p["speedup_end_to_end"] for p in pairs]))
    concurrency = float(np.median([p[2]["concurrency"] for p in pairs]))
    print(
        f"speedup (median of {len(pairs)} pairs), cells only: {speedup_sweep:.2f}x; "
        f"end to end: {speedup_total:.2f}x; 2-worker concurrency {concurrency:.2f}"
    )
    print(f"identical results with 1 and 2 workers: {identical}")
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
            "concurrency_2_workers": concurrency,
            "identical_results": identical,
            "pairs": [{str(k): v for k, v in p.items()} for p in pairs],
        },
    )
    print(f"saved {path}")


if __name__ == "__main__":
    main()
