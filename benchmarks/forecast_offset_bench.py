"""What lightgbm-trajectory's calibration corrects for decode: bottom-up sum, recent demand, blend.

The variants are trained on the shipping recipe's training runs, simulated by the current
simulator (``prorsa.forecast.shipping``: 162 runs over the regime map), with the recipe's
parameters; only ``decode_offset`` differs (prefill keeps the bottom-up offset in all).
They are backtested, with the three baselines at their default smoothing, on every
``--runs-every``-th run of the recipe's held-out cells (scenarios and the held-out halves
of the shipped traces), a forecast scored every ``--score-every``-th tick at 5 s. WAPE per
target, over all scored runs, over simulations and trace replays apart, and per held-out
cell, with each variant's ratio to the best baseline (issue 14's decode goal: <= 0.7x).

    .venv/bin/python benchmarks/forecast_offset_bench.py --work out/offset   (~25 min on
    2 cores; a re-run with the same --work reuses the data and the trained variants)

Writes benchmarks/results/forecast_offset.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import save
from benchmarks.forecast_bench import cell_of
from prorsa.experiments.held_out import geometric_mean
from prorsa.forecast import load_forecaster, make_forecaster
from prorsa.forecast.backtest import backtest, score
from prorsa.forecast.shipping import SHIP_TRACES, ship, train_model
from prorsa.forecast.types import TARGETS

MODEL = "lightgbm-trajectory"
VARIANTS = ("bottom-up", "recent", "blend")
BASELINES = ("last-value", "ewma", "kalman")
HORIZON_S = 5.0


def trained_variants(work: Path) -> dict[str, Path]:
    """Each variant's model folder under ``work`` (simulated and trained when missing)."""
    folders = {v: work / v / MODEL for v in VARIANTS}
    first = folders[VARIANTS[0]]
    if not (first / "manifest.json").exists():  # simulates the recipe into work/data
        ship(first.parent, keep_data=work / "data", models=[MODEL], validate_every=0)
    for variant, folder in folders.items():
        if not (folder / "manifest.json").exists():
            train_model(MODEL, work / "data" / "train.parquet", folder,
                        params={"decode_offset": variant})  # fmt: skip
    return folders


def heldout(work: Path, runs_every: int) -> pa.Table:
    table = pq.read_table(work / "data" / "heldout-telemetry.parquet")
    runs = sorted(set(table.column("run_id").to_pylist()))[::runs_every]
    return table.filter(pc.is_in(table.column("run_id"), value_set=pa.array(runs)))


def wape_by_span(results: pd.DataFrame) -> dict[str, dict[str, dict[str, float]]]:
    replay = results["run_id"].str.contains("|".join(SHIP_TRACES), regex=True)
    spans = {"all": results, "sim": results[~replay], "replay": results[replay]}
    for cell in sorted(results["run_id"].map(cell_of).unique()):
        spans[f"cell {cell}"] = results[results["run_id"].map(cell_of) == cell]
    out: dict = {}
    for label, frame in spans.items():
        if frame.empty:
            continue
        table: dict = {}
        for r in score(frame).itertuples(index=False):
            table.setdefault(r.model, {})[r.target] = round(float(r.wape), 4)
        for variant in VARIANTS:
            table[f"{variant} / best baseline"] = {
                t: round(table[variant][t] / min(table[b][t] for b in BASELINES), 3)
                for t in TARGETS
            }
        out[label] = table
    return out


def decode_geomean(span: dict, variant: str) -> float:
    """Geometric mean over the three decode targets of the variant's ratio to the best
    baseline."""
    ratios = [span[f"{variant} / best baseline"][t] for t in TARGETS[1:]]
    return round(geometric_mean(ratios), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="keep data and models here (re-runs reuse)")
    parser.add_argument("--runs-every", type=int, default=3, help="every n-th held-out run")
    parser.add_argument("--score-every", type=int, default=3, help="score every n-th tick")
    args = parser.parse_args()
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        folders = trained_variants(work)
        table = heldout(work, args.runs_every)
        models = {v: load_forecaster(folder) for v, folder in folders.items()}
        models.update({b: make_forecaster(b).fit(None) for b in BASELINES})
        frames = []
        for name, model in models.items():
            started = time.perf_counter()
            frames.append(
                backtest(model, table, model=name, every=args.score_every, horizons=[HORIZON_S])
            )
            print(f"backtest {name}: {time.perf_counter() - started:.0f} s", flush=True)
        wape = wape_by_span(pd.concat(frames, ignore_index=True))
        runs = len(set(table.column("run_id").to_pylist()))
    for label, span in wape.items():
        print(label)
        for target in TARGETS:
            best = min(span[b][target] for b in BASELINES)
            scores = "  ".join(
                f"{v} {span[v][target]:.3f} ({span[f'{v} / best baseline'][target]:.2f}x)"
                for v in VARIANTS
            )
            print(f"  {target:17s} {scores}  best baseline {best:.3f}")
    path = save(
        "forecast_offset",
        {
            "setup": {
                "model": MODEL,
                "variants": list(VARIANTS),
                "baselines": list(BASELINES),
                "baseline_smoothing": "defaults (not tuned)",
                "horizon_s": HORIZON_S,
                "heldout_runs": runs,
                "runs_every": args.runs_every,
                "score_every": args.score_every,
            },
            "wape_h5": wape,
            "geomean_ratio_decode": {v: decode_geomean(wape["all"], v) for v in VARIANTS},
            "bench_wall_s": round(time.perf_counter() - began),
        },
    )
    print(f"saved {path}")


if __name__ == "__main__":
    main()
