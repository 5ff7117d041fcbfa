"""Does tuning pay on seeds it never saw? Tuned against default predictive on map cells.

For each chosen cell of the regime map (its predictive runs at base knobs, read from
``results/regimes/cells.jsonl``: one sync and one async cell per model family, the fastest
to simulate), ``prorsa tune predictive`` runs a study on workload seeds 1000.. (its first
trial is the defaults), then the defaults and the best trial's parameters are both
evaluated on the map's held-out seeds 9.. (neither the study's, the regime's own seed 0
nor the shipped forecasters' training seeds 0-8). ``gain`` is default objective / tuned
objective (makespan in sync, seconds per trajectory in async; each a geometric mean over
the held-out seeds, as in the map): above 1, tuning helped.
``gain_best_sampled`` does the same for the best trial other than the defaults: what a
study without its defaults trial would have handed ``prorsa compare --tuned``.

With ``--draw-start`` the study also draws the start mode and split, which the map fixes
from its exhaustive best-static search; the defaults it is judged against stay the map's
plan, so ``gain`` then says whether tuning finds that plan (or better) on its own.

    .venv/bin/python benchmarks/tune_bench.py [--trials 12] [--tune-seeds 2] [--eval-seeds 3]
    .venv/bin/python benchmarks/tune_bench.py --draw-start --trials 24
    .venv/bin/python benchmarks/tune_bench.py --losing --trials 24   # where predictive loses

Writes benchmarks/results/tune.json (tune-start.json with ``--draw-start``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import RESULTS, save
from prorsa.experiments import DEFAULT_FORECASTER
from prorsa.experiments.cells import Cell, run_cell
from prorsa.experiments.held_out import geometric_mean
from prorsa.experiments.regimes import DEFAULT_EVAL_SEEDS
from prorsa.tune import TuneConfig, tune, tuned_params

MAP_CELLS = RESULTS / "regimes" / "cells.jsonl"
#: The parameters the map fixes from its searches; ``--draw-start`` lets the study draw them.
START_PARAMS = ("start", "prefill_fraction")
FAMILIES = ("qwen2.5-7b", "qwen2.5-32b", "qwen3-30b-a3b", "qwen3-235b-a22b")
SCENARIOS = ("swe", "search", "math-tool", "mixed", "tau2")


def chosen_cells(max_wall_s: float) -> list[Cell]:
    """Per model family and mode, the map's quickest predictive cell at base knobs, the
    scenario rotating over families and modes (the quickest of any scenario if that
    one has no cell quick enough)."""
    best: dict[tuple[str, str, str], tuple[float, Cell]] = {}
    for line in MAP_CELLS.read_text().splitlines():
        result = json.loads(line)["result"]
        cell = Cell.from_dict(result["cell"])
        if cell.policy != "predictive" or cell.seed != DEFAULT_EVAL_SEEDS[0]:
            continue
        if cell.work.trace is not None:
            continue
        if (cell.knobs.tool_scale, cell.knobs.growth_scale) != (1.0, 1.0):
            continue
        family = next((f for f in FAMILIES if f in cell.cluster.profile), None)
        if family is None or result["wall_s"] > max_wall_s:
            continue
        for key in ((family, cell.mode, cell.workload), (family, cell.mode, "")):
            if key not in best or result["wall_s"] < best[key][0]:
                best[key] = (result["wall_s"], cell)
    chosen = []
    for i, family in enumerate(FAMILIES):
        for j, mode in enumerate(("sync", "async")):
            scenario = SCENARIOS[(2 * i + j) % len(SCENARIOS)]
            found = best.get((family, mode, scenario)) or best.get((family, mode, ""))
            if found is not None:
                chosen.append(found[1].changed(series=False, record=False))
    return chosen


def losing_cells() -> list[Cell]:
    """The map's predictive cells in the regimes where it misses a goal against
    colocation or best-static (``regimes.json``), as the map last ran them."""
    summary = json.loads((RESULTS / "regimes.json").read_text())
    missed = summary["goals"]["missed"]
    labels = {*missed["vs_colocate_0.98"], *missed["vs_best_static_2pct"]}
    wanted = [r for r in summary["regimes"] if r["label"] in labels]
    chosen = []
    for line in MAP_CELLS.read_text().splitlines():
        cell = Cell.from_dict(json.loads(line)["result"]["cell"])
        if cell.policy != "predictive":
            continue
        for r in wanted:
            regime, plan = r["regime"], r["run_plan"]
            if (
                # one held-out seed's cell per regime (``evaluate`` runs its own seeds)
                cell.work.seed == DEFAULT_EVAL_SEEDS[0]
                and regime["model"] in cell.cluster.profile
                and cell.workload == regime["workload"]
                and cell.mode == regime["mode"]
                and cell.work.max_in_flight == regime["load_per_gpu"] * r["gpus"]
                and (cell.knobs.tool_scale, cell.knobs.growth_scale)
                == (regime["tool_scale"], regime["growth_scale"])
                and cell.cluster.reuse_mode == regime["reuse_mode"]
                and cell.cluster.layouts == plan["layouts"]
                and cell.control.policy_params
                == {"start": plan["start"], "prefill_fraction": plan["prefill_fraction"]}
            ):
                chosen.append(cell.changed(series=False, record=False))
    return chosen


def evaluate(cell: Cell, params: dict, seeds: int) -> list[float]:
    held_out = range(DEFAULT_EVAL_SEEDS[0], DEFAULT_EVAL_SEEDS[0] + seeds)
    return [run_cell(cell.changed(seed=s, policy_params=params))["objective"] for s in held_out]


def bench_cell(cell: Cell, args: argparse.Namespace, storage: str) -> dict:
    started = time.perf_counter()
    base = cell
    if args.draw_start:  # the study draws the start mode and split too
        fixed = {k: v for k, v in cell.control.policy_params.items() if k not in START_PARAMS}
        base = cell.changed(policy_params=fixed)
    study = tune(
        TuneConfig(
            policy="predictive",
            base=base,
            trials=args.trials,
            seeds=args.tune_seeds,
            storage=storage,
            study_name=base.key(),
            workers=args.workers,
        )
    )
    best = tuned_params(storage, ["predictive"], [base.key()])["predictive"]
    defaults = dict(cell.control.policy_params)
    # Held-out objectives per trial; trial 0 is the defaults, each trial runs once.
    evals = {0: evaluate(cell, defaults, args.eval_seeds)}

    def held_out(number: int, params: dict) -> list[float]:
        if number not in evals:
            evals[number] = evaluate(cell, params, args.eval_seeds)
        return evals[number]

    default_eval = evals[0]
    tuned_eval = held_out(best["trial"], best["params"])
    # Objectives over seeds are geometric means, as in the regime map, so a gain is the
    # geometric mean of the per-seed ratios.
    gain = geometric_mean(default_eval) / geometric_mean(tuned_eval)
    # What the study would have chosen without its defaults trial.
    sampled = [t for t in study.trials[1:] if t.value is not None]
    best_sampled = min(sampled, key=lambda t: (t.value, t.number))
    sampled_eval = held_out(best_sampled.number, best_sampled.user_attrs["policy_params"])
    return {
        "cell": {
            "profile": cell.cluster.profile,
            "layouts": cell.cluster.layouts,
            "num_slots": cell.cluster.num_slots,
            "scenario": cell.workload,
            "mode": cell.mode,
            "trajectories": cell.work.trajectories,
            "fixed_params": defaults,
        },
        "tuning": {
            "default_objective": study.trials[0].value,
            "best_objective": study.best_value,
            "best_trial": best["trial"],
            "trials": len(study.trials),
            "trial_values": [t.value for t in study.trials],
            "trial_states": [t.state.name for t in study.trials],
        },
        "tuned_params": best["params"],
        "eval_default": default_eval,
        "eval_tuned": tuned_eval,
        "gain": gain,
        "best_sampled_trial": best_sampled.number,
        "eval_best_sampled": sampled_eval,
        "gain_best_sampled": geometric_mean(default_eval) / geometric_mean(sampled_eval),
        "wall_s": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--tune-seeds", type=int, default=2)
    parser.add_argument("--eval-seeds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-cell-wall-s", type=float, default=6.0)
    parser.add_argument(
        "--draw-start",
        action="store_true",
        help="tune the start mode and split with the knobs (writes tune-start.json); the "
        "default they are evaluated against stays the map's plan",
    )
    parser.add_argument(
        "--losing",
        action="store_true",
        help="tune the map's cells where predictive misses a goal instead (tune-losing.json)",
    )
    parser.add_argument(
        "--forecaster",
        default=DEFAULT_FORECASTER,
        help="predictive's forecaster in every cell (default: the policies' default; the "
        "map's cells file records the one its full run used)",
    )
    args = parser.parse_args()
    cells = losing_cells() if args.losing else chosen_cells(args.max_cell_wall_s)
    cells = [cell.changed(forecaster=args.forecaster) for cell in cells]
    first = DEFAULT_EVAL_SEEDS[0]
    if not cells:
        raise SystemExit(
            f"no predictive cell of the map on held-out seed {DEFAULT_EVAL_SEEDS[0]} in "
            f"{MAP_CELLS}: rerun the map (benchmarks/regimes_bench.py) first"
        )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        storage = f"sqlite:///{Path(tmp) / 'optuna.db'}"
        for cell in cells:
            row = bench_cell(cell, args, storage)
            rows.append(row)
            c = row["cell"]
            print(
                f"{c['profile']} {c['scenario']} {c['mode']} {c['trajectories']}: "
                f"default {geometric_mean(row['eval_default']):.4g} tuned "
                f"{geometric_mean(row['eval_tuned']):.4g} -> gain {row['gain']:.3f} "
                f"(best sampled trial {row['gain_best_sampled']:.3f}; {row['wall_s']:.0f} s)",
                flush=True,
            )
    gains = [r["gain"] for r in rows]
    summary = {
        "cells": len(rows),
        "gain_min": min(gains),
        "gain_geomean": geometric_mean(gains),
        "cells_tuned_at_least_default": sum(g >= 1.0 for g in gains),
        "goal_tuned_at_least_default_everywhere": all(g >= 1.0 for g in gains),
        "cells_best_is_defaults": sum(r["tuning"]["best_trial"] == 0 for r in rows),
        "gain_best_sampled_min": min(r["gain_best_sampled"] for r in rows),
        "cells_best_sampled_below_default": sum(r["gain_best_sampled"] < 1.0 for r in rows),
    }
    print(json.dumps(summary, indent=1))
    path = save(
        "tune-losing" if args.losing else "tune-start" if args.draw_start else "tune",
        {
            "setup": {
                "policy": "predictive",
                "forecaster": args.forecaster,
                "draws_start_and_split": args.draw_start,
                "cells": "where predictive misses a goal" if args.losing else "quickest per family",
                "trials": args.trials,
                "tune_seeds": f"1000..{1000 + args.tune_seeds - 1}",
                "eval_seeds": f"{first}..{first + args.eval_seeds - 1}",
                "workers": args.workers,
            },
            "summary": summary,
            "cells": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
