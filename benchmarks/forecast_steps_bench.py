"""Do the shipped forecasters forecast a sync run's later steps as well as its first?

An RL trainer runs step after step; the shipped models train on single-step runs. This
simulates runs of three sync steps (8 engines, held-out seed 123: swe at 16 and tau2 at 64
trajectories per GPU), backtests every shipped forecaster and last-value on each, and scores
WAPE at 5 s per step (a step runs from its launch to the next one's). A feature that
carries the run's history into later steps (time since the run began, a lag holding the
previous launch) shows here as step 2 and 3 scoring worse than step 1.

    .venv/bin/python benchmarks/forecast_steps_bench.py      (~5 min on one core)

Writes benchmarks/results/forecast_steps.json.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.compute as pc
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import save
from prorsa.forecast import load_forecaster, make_forecaster
from prorsa.forecast.backtest import backtest, score

REPO = Path(__file__).resolve().parents[1]
SHIPPED = ("lightgbm-trajectory", "lightgbm-aggregate", "gru")
#: (scenario, trajectories per step on 8 engines)
RUNS = (("swe", 128), ("tau2", 512))
STEPS, ENGINES, SEED, HORIZON_S = 3, 8, 123, 5.0
TARGETS = ("prefill_tokens", "decode_tokens")


def simulate(scenario: str, trajectories: int, out: Path) -> Path:
    """A three-step sync run through ``prorsa simulate``; its telemetry file."""
    subprocess.run(
        [sys.executable, "-m", "prorsa.cli.main", "simulate", "--scenario", scenario,
         "--mode", "sync", "--steps", str(STEPS), "--engines", str(ENGINES),
         "--trajectories", str(trajectories), "--seed", str(SEED), "--out", str(out)],
        check=True, stdout=subprocess.DEVNULL, cwd=REPO,
    )  # fmt: skip
    return out / "telemetry.parquet"


def launches(table) -> list[float]:
    """Each step's launch: the first trajectory start after a pause in starts."""
    starts = pc.filter(table["time"], pc.equal(pc.cast(table["kind"], "string"), "traj_start"))
    times = np.sort(starts.to_numpy())
    return [float(times[0])] + [float(b) for a, b in itertools.pairwise(times) if b - a > 5.0]


def per_step(table) -> dict[str, dict[str, float]]:
    """WAPE at 5 s per step, model and target."""
    models = {name: load_forecaster(REPO / "models" / name) for name in SHIPPED}
    models["last-value"] = make_forecaster("last-value").fit(None)
    frames = [backtest(m, table, horizons=[HORIZON_S], model=n) for n, m in models.items()]
    results = pd.concat(frames, ignore_index=True)
    edges = [*launches(table), np.inf]
    results["step"] = np.searchsorted(edges, results["cutoff"], side="right")
    out: dict[str, dict[str, float]] = {}
    for step, group in results.groupby("step"):
        scores = score(group)
        scores = scores[scores["target"].isin(TARGETS)]
        out[f"step {step}"] = {
            f"{m}/{t}": round(float(w), 4)
            for m, t, w in zip(scores["model"], scores["target"], scores["wape"], strict=True)
        }
    return out


def main() -> None:
    started = time.perf_counter()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for scenario, trajectories in RUNS:
            label = f"{scenario} {trajectories // ENGINES}/GPU"
            table = pq.read_table(simulate(scenario, trajectories, Path(tmp) / scenario))
            runs[label] = per_step(table)
            print(label)
            for step, scores in runs[label].items():
                print(" ", step, scores)
    path = save(
        "forecast_steps",
        {
            "steps": STEPS,
            "engines": ENGINES,
            "seed": SEED,
            "horizon_s": HORIZON_S,
            "wape": runs,
            "wall_s": time.perf_counter() - started,
        },
    )
    print(f"saved {path}")


if __name__ == "__main__":
    main()
