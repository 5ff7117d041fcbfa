"""How many data-parallel ranks prefill together, colocated against disaggregated.

A colocated data-parallel engine pays the lockstep stall of a prefill chunk once per step,
shared by every rank that prefills in that step; the policies price colocated prefill as
if all ranks did (``ClusterSpec.colocated_packed_prefill_factor``) once prefill demand
fills them. This logs every step of two regime-map cells of Qwen3-235B-A22B tau2 sync on
four 8-GPU tp1-dp8-ep8-a2a engines (64 and 128 trajectories per GPU), run colocated and
as best-static's 3/1 split, and reports per engine role:

* ranks prefilling per step (mean and median), prefill tokens per step;
* the engine's KV in use and the turns waiting for and admitted to prefill, per step;
* GPU-seconds per prefilled token (step time x GPUs / tokens, steps with prefill only).

The cells are read from the committed map (``results/regimes/cells.jsonl``) so they are
exactly the map's. Writes ``results/prefill_concurrency.json``; ~10 s.

    .venv/bin/python benchmarks/prefill_concurrency_bench.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import RESULTS, save

LAYOUT = "tp1-dp8-ep8-a2a"
PREFILL_GPUS_OF_SPLIT = 24  # best-static's split in both cells: 3 prefill, 1 decode engine


def _cells() -> dict[tuple[int, str], dict]:
    """(trajectories, policy) -> the map's cell, for the two tau2 regimes."""
    found = {}
    for line in (RESULTS / "regimes" / "cells.jsonl").read_text().splitlines():
        cell = json.loads(line)["result"]["cell"]
        work, cluster, control = cell["work"], cell["cluster"], cell["control"]
        if (work["scenario"], work["mode"]) != ("tau2", "sync"):
            continue
        if "235b" not in cluster["profile"] or set(cluster["layouts"].values()) != {LAYOUT}:
            continue
        policy = control["policy"]
        if policy == "static":
            if control["policy_params"].get("prefill_gpus") != PREFILL_GPUS_OF_SPLIT:
                continue
        elif policy != "colocate":
            continue
        if work["trajectories"] in (2048, 4096):
            found[(work["trajectories"], policy)] = cell
    return found


def measure(cell_dict: dict) -> dict:
    """Run one cell with every data-parallel engine step logged; see the module doc."""
    from prorsa.experiments.cells import Cell, run_cell
    from prorsa.runtime.sim import dp_engine

    steps: dict[str, list[tuple]] = {}
    priced = dp_engine.DpSimEngine._step_s

    def logged(self, chunks):
        seconds = priced(self, chunks)
        tokens = sum(n for _, n in chunks)
        ranks = len({req.rank for req, _ in chunks})
        steps.setdefault(self.role, []).append(
            (
                seconds,
                tokens,
                ranks,
                self.kv_used / self.kv_capacity,
                len(self.prefill_active),
                len(self.prefill_queue),
                sum(self.rank_batch),
                self.costs.cost.gpus,
            )
        )
        return seconds

    dp_engine.DpSimEngine._step_s = logged
    try:
        result = run_cell(Cell.from_dict(cell_dict))
    finally:
        dp_engine.DpSimEngine._step_s = priced
    out = {"makespan_s": result["metrics"]["end_s"], "roles": {}}
    for role, rows in steps.items():
        a = np.asarray(rows, float)
        prefilling = a[a[:, 1] > 0]
        if not len(prefilling):
            continue
        secs, tokens, ranks, kv, active, queue, batch, gpus = prefilling.T
        out["roles"][role] = {
            "steps_with_prefill": len(prefilling),
            "ranks_prefilling_mean": round(float(ranks.mean()), 2),
            "ranks_prefilling_median": float(np.median(ranks)),
            "prefill_tokens_per_step_mean": round(float(tokens.mean())),
            "kv_used_fraction_median": round(float(np.median(kv)), 3),
            "prefill_admitted_median": float(np.median(active)),
            "prefill_waiting_median": float(np.median(queue)),
            "decode_sequences_median": float(np.median(batch)),
            "gpu_us_per_prefill_token": round(float((secs * gpus).sum() / tokens.sum() * 1e6), 1),
        }
    return out


def main() -> None:
    cells = _cells()
    results = {}
    for (trajectories, policy), cell in sorted(cells.items()):
        name = f"tau2-sync-{trajectories // 32}-per-gpu-{policy}"
        results[name] = measure(cell)
        for role, r in results[name]["roles"].items():
            print(
                f"{name:32s} {role:10s} ranks {r['ranks_prefilling_mean']:4.2f} "
                f"kv {r['kv_used_fraction_median']:.2f} "
                f"admitted {r['prefill_admitted_median']:4.0f} "
                f"waiting {r['prefill_waiting_median']:5.0f} "
                f"{r['gpu_us_per_prefill_token']:6.1f} us/token"
            )
    path = save(
        "prefill_concurrency",
        {
            "cells": results,
            "layout": LAYOUT,
            "note": "colocated steps include the decode batch's share of each step; the "
            "split's decode engine is left out (it prefills only recomputations)",
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
