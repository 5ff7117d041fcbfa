"""The learned policy (`rl`, shipped `models/rl-ppo`) against best-static and colocation on
cluster sizes and loads it was not trained on.

Training drew 4, 6, 8, 12, 16, 24 or 32 slots (dense) and 2, 4, 5, 8 or 12 slots (MoE), at
4, 8, 16, 32 or 64 trajectories per GPU (see the model's manifest). Every block here
uses a slot count and a load outside those sets, and one block a cost profile (H100
roofline) the policy never saw; the mini-swe-agent replay is a workload it never saw.
Goals: rl >= 0.98x best-static's objective in every cell, <= 1 switch per minute on
average. Each block is run again with rl not reading the workload's expected shape
(``read_workload=False``), to show what the shape buys. Writes benchmarks/results/rl.json.

    .venv/bin/python benchmarks/rl_bench.py            # full (tens of minutes)
    .venv/bin/python benchmarks/rl_bench.py --quick    # 1 seed, two small blocks
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import save
from prorsa.experiments.cells import cell_of
from prorsa.experiments.compare import CompareConfig, run_compare
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.workload.config import WorkloadConfig

REPO = Path(__file__).resolve().parents[1]
POLICIES = ["colocate", "best-static", "rl"]
SCENARIOS = [("swe", None), ("search", None), ("math-tool", None), ("mixed", None)]
TRACE = (None, str(REPO / "datasets" / "traces" / "mini-swe-agent-swebench.parquet"))
MOE_DP8 = {"role_tp": {"prefill": 8, "decode": 1, "colocated": 1}, "dp_attention_ranks": 8}
GOAL_VS_BEST_STATIC = 0.98
GOAL_SWITCHES_PER_MIN = 1.0


def blocks(quick: bool) -> list[dict]:
    """(name, description, compare settings) of each held-out block."""
    dense = {"profile": "h200-qwen2.5-7b-tp1"}
    out = [
        {
            "name": "dense-20x24",
            "about": "Qwen2.5-7B H200, 20 slots, 24 trajectories/GPU",
            "engines": 20,
            "load": 24,
            "workloads": [*SCENARIOS, TRACE],
            "modes": ["sync", "async"],
            **dense,
        },
        {
            "name": "moe-dp8-3x48",
            "about": "Qwen3-30B-A3B DP8, 3 slots x 8 H200, 48 trajectories/GPU",
            "engines": 3,
            "load": 48,
            "workloads": SCENARIOS,
            "modes": ["sync"],
            "profile": "h200-qwen3-30b-a3b-tp1-roofline",
            "cluster_overrides": MOE_DP8,
        },
    ]
    if quick:
        for block in out:
            block["workloads"] = block["workloads"][:2]
            block["modes"] = ["sync"]
        return out
    return [
        *out,
        {
            "name": "dense-48x12",
            "about": "Qwen2.5-7B H200, 48 slots, 12 trajectories/GPU",
            "engines": 48,
            "load": 12,
            "workloads": SCENARIOS,
            "modes": ["sync"],
            **dense,
        },
        {
            "name": "dense-10x128",
            "about": "Qwen2.5-7B H200, 10 slots, 128 trajectories/GPU (heavier than trained)",
            "engines": 10,
            "load": 128,
            "workloads": [("swe", None), ("search", None), ("mixed", None)],
            "modes": ["sync"],
            **dense,
        },
        {
            "name": "moe-dp8-6x24",
            "about": "Qwen3-30B-A3B DP8, 6 slots x 8 H200, 24 trajectories/GPU",
            "engines": 6,
            "load": 24,
            "workloads": SCENARIOS,
            "modes": ["sync", "async"],
            "profile": "h200-qwen3-30b-a3b-tp1-roofline",
            "cluster_overrides": MOE_DP8,
        },
        {
            "name": "h100-roofline-14x24",
            "about": "Qwen2.5-7B H100 roofline (profile not trained on), 14 slots, 24/GPU",
            "engines": 14,
            "load": 24,
            "workloads": SCENARIOS,
            "modes": ["sync"],
            "profile": "h100-qwen2.5-7b-tp1-roofline",
        },
    ]


def run_block(block: dict, seeds: int, backend: str, policies=POLICIES, policy_params=None) -> dict:
    cluster = ClusterConfig(
        profile=block["profile"],
        num_slots=block["engines"],
        **block.get("cluster_overrides", {}),
    )
    in_flight = block["load"] * cluster.total_gpus
    cfg = CompareConfig(
        workloads=block["workloads"],
        policies=list(policies),
        policy_params=policy_params or {},
        modes=block["modes"],
        seeds=seeds,
        # Sync: one step of load x GPUs; async: that many in flight, twice as many in all.
        work=WorkloadConfig(trajectories=in_flight, max_in_flight=in_flight),
        cluster=cluster,
        backend=backend,
    )
    if "async" in block["modes"]:
        # One config per mode: async runs twice the trajectories of a sync step.
        sync = run_compare(_with(cfg, modes=[m for m in cfg.modes if m == "sync"]))
        twice = replace(cfg.work, trajectories=2 * in_flight)
        asyn = run_compare(_with(cfg, modes=["async"], work=twice))
        return {
            k: sync[k] + asyn[k] if k != "best_static" else {**sync[k], **asyn[k]}
            for k in ("runs", "summary", "best_static")
        }
    return run_compare(cfg)


def _with(cfg: CompareConfig, **changes) -> CompareConfig:
    return replace(cfg, **changes)


def _by_cell(result: dict) -> dict:
    by = {}
    for run in result["runs"]:
        cell = cell_of(run)
        work = cell.work
        key = (work.scenario or Path(work.trace).stem, cell.mode)
        by.setdefault(key, {}).setdefault(cell.policy, []).append(run)
    return by


def cell_rows(block: dict, result: dict, hidden: dict | None = None) -> list[dict]:
    """One row per (workload, mode): rl against best-static and colocation, and rl's
    switching rate (slot switches per minute of rollout, mean over seeds). ``hidden``:
    the same cells run with rl not reading the workload's shape (the ablation)."""
    by = _by_cell(result)
    hidden_by = _by_cell(hidden) if hidden else {}
    rows = []
    for (workload, mode), runs in sorted(by.items()):
        objective = {p: float(np.mean([r["objective"] for r in rs])) for p, rs in runs.items()}
        rl_runs = runs["rl"]
        per_min = [
            r["metrics"]["switches_completed"] / max(float(r["metrics"]["end_s"]) / 60.0, 1e-9)
            for r in rl_runs
        ]
        changes = [
            sum(1 for d in r.get("series", {}).get("decisions", []) if "change to" in d["reason"])
            for r in rl_runs
        ]
        prefill_share = [_prefill_gpu_share(r) for r in rl_runs]
        vs_best = objective["best-static"] / objective["rl"]
        rows.append(
            {
                "block": block["name"],
                "workload": workload,
                "mode": mode,
                "rl_vs_best_static": vs_best,
                "rl_vs_colocate": objective["colocate"] / objective["rl"],
                "best_static_vs_colocate": objective["colocate"] / objective["best-static"],
                "rl_switches_per_min": float(np.mean(per_min)),
                "rl_target_changes": float(np.mean(changes)),
                "rl_prefill_gpu_share": float(np.mean(prefill_share)),
                "objective": objective,
                "goal_vs_best_static_met": vs_best >= GOAL_VS_BEST_STATIC,
                "goal_switches_met": float(np.mean(per_min)) <= GOAL_SWITCHES_PER_MIN,
            }
        )
        if (workload, mode) in hidden_by:
            blind = float(np.mean([r["objective"] for r in hidden_by[workload, mode]["rl"]]))
            rows[-1]["rl_shape_hidden_vs_best_static"] = objective["best-static"] / blind
    return rows


def _prefill_gpu_share(run: dict) -> float:
    """Share of the run's GPU-seconds that served prefill alone (0: stayed colocated)."""
    held = run["metrics"]["gpu_seconds_by_role"]
    return float(held.get("prefill", 0.0)) / max(sum(held.values()), 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--backend", default="process", help="compare backend")
    parser.add_argument(
        "--no-ablation",
        action="store_true",
        help="skip the rerun of rl with the workload's shape hidden",
    )
    args = parser.parse_args()
    seeds = args.seeds or (1 if args.quick else 2)
    manifest = json.loads((REPO / "models" / "rl-ppo" / "manifest.json").read_text())
    started = time.perf_counter()
    rows, best_static = [], {}
    for block in blocks(args.quick):
        result = run_block(block, seeds, args.backend)
        hidden = None
        if not args.no_ablation:
            hidden = run_block(
                block, seeds, args.backend, ["colocate", "rl"], {"rl": {"read_workload": False}}
            )
        rows.extend(cell_rows(block, result, hidden))
        best_static[block["name"]] = result["best_static"]
        print(f"block {block['name']} done after {time.perf_counter() - started:,.0f} s")
    ratios = [r["rl_vs_best_static"] for r in rows]
    per_min = [r["rl_switches_per_min"] for r in rows]
    summary = {
        "cells": len(rows),
        "rl_vs_best_static_min": min(ratios),
        "rl_vs_best_static_mean": float(np.mean(ratios)),
        "cells_meeting_0.98x_best_static": sum(r["goal_vs_best_static_met"] for r in rows),
        "rl_switches_per_min_mean": float(np.mean(per_min)),
        "rl_switches_per_min_max": max(per_min),
        "goal_0.98x_best_static_every_cell": all(r["goal_vs_best_static_met"] for r in rows),
        "goal_at_most_1_switch_per_min_on_average": float(np.mean(per_min))
        <= GOAL_SWITCHES_PER_MIN,
    }
    blind = [
        r["rl_shape_hidden_vs_best_static"] for r in rows if "rl_shape_hidden_vs_best_static" in r
    ]
    if blind:
        summary["shape_hidden_cells_meeting_0.98x_best_static"] = sum(
            x >= GOAL_VS_BEST_STATIC for x in blind
        )
        summary["shape_hidden_vs_best_static_min"] = min(blind)
    path = save(
        "rl",
        {
            "summary": summary,
            "cells": rows,
            "blocks": blocks(args.quick),
            "best_static": best_static,
            "model": {k: manifest.get(k) for k in ("training", "validation", "simulator")},
            "seeds": seeds,
            "quick": args.quick,
            "wall_s": time.perf_counter() - started,
        },
    )
    for r in rows:
        print(
            f"{r['block']:>20} {r['workload']:>24} {r['mode']:>5}: rl/best-static "
            f"{r['rl_vs_best_static']:.3f}x, rl/colocate {r['rl_vs_colocate']:.3f}x, "
            f"{r['rl_switches_per_min']:.2f} switches/min, "
            f"prefill GPU share {r['rl_prefill_gpu_share']:.2f}"
            + (
                f", shape hidden {r['rl_shape_hidden_vs_best_static']:.3f}x"
                if "rl_shape_hidden_vs_best_static" in r
                else ""
            )
        )
    print(json.dumps(summary, indent=2))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
