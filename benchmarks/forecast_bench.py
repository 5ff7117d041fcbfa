"""Forecast quality and latency: every forecaster on held-out runs, and predict at 10k live.

Quality: rolling-origin backtests (every 1 s tick a forecast origin) on held-out simulated
runs (all five scenarios, sync and async, seeds 100-101, policy static, 8 engines,
profile h200-qwen2.5-7b-tp1) and on held-out real-trace replays (the odd-numbered
trajectories of each shipped trace, which the shipped models never saw). WAPE per
target x horizon x forecaster, over all ticks and over ticks >= 30 s ("steady": after a
sync step's start-up burst, which reactive baselines cannot handle). The learned
forecasters are the shipped ones in models/ (regenerate: `prorsa forecast ship`); EWMA
and Kalman pick their smoothing on a small separate training set (seed 50).
``lightgbm-trajectory (raw)`` is the shipped model with its calibration stage switched
off: the pure bottom-up expectation.

Latency: a 512-engine simulation with 10,000 trajectories in flight (swe, async), replayed
tick by tick; ``update`` (ingest the tick's events) and ``predict`` timed separately at
ticks with >= 9,500 live trajectories.

Goal (reported whether met or not): lightgbm-trajectory at h = 5 s has at most half the
WAPE of the best baseline on prefill tokens, and predict p99 < 20 ms.

    .venv/bin/python benchmarks/forecast_bench.py      (a few minutes; writes
    benchmarks/results/forecast.json and benchmarks/results/forecast-*.png)
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import RESULTS, save
from prorsa.cli.forecast import SHIP_SCENARIOS, SHIP_TRACES, SimPlan, simulate_runs, split_trace
from prorsa.forecast import build_dataset, load_forecaster, make_forecaster
from prorsa.forecast.backtest import backtest, plot_backtest, score
from prorsa.forecast.tracker import rows_of
from prorsa.forecast.types import TARGETS
from prorsa.runtime.forecast_provider import models_dir
from prorsa.workload.scenarios import datasets_dir

BASELINES = ("last-value", "ewma", "kalman")
LEARNED = ("lightgbm-trajectory", "lightgbm-aggregate", "gru")
HELDOUT_SEEDS = (100, 101)
STEADY_S = 30.0


def concat(tables):
    import pyarrow as pa

    meta = tables[0].schema.metadata
    return pa.concat_tables(
        [t.replace_schema_metadata(None) for t in tables]
    ).replace_schema_metadata(meta)


def heldout_sets(work: Path) -> dict[str, object]:
    halves = [split_trace(datasets_dir() / "traces" / f"{t}.parquet", work) for t in SHIP_TRACES]
    modes = ["sync", "async"]
    sims = SimPlan(SHIP_SCENARIOS, [], modes, HELDOUT_SEEDS, 8, "static")
    replays = SimPlan([], [str(h) for _, h in halves], modes, HELDOUT_SEEDS[:1], 8, "static")
    tune = SimPlan(SHIP_SCENARIOS, [str(t) for t, _ in halves], modes, (50,), 8, "static")
    return {
        "sim": concat(simulate_runs(sims)),
        "replay": concat(simulate_runs(replays)),
        "tune": simulate_runs(tune),
    }


def forecasters(tune_tables) -> dict[str, object]:
    data = build_dataset(tune_tables)
    out = {name: make_forecaster(name).fit(data) for name in BASELINES}
    for name in LEARNED:
        out[name] = load_forecaster(models_dir() / name)
    raw = load_forecaster(models_dir() / "lightgbm-trajectory")
    raw.calibrate = False  # the pure bottom-up sum of the same per-trajectory models
    out["lightgbm-trajectory (raw)"] = raw
    out["oracle"] = make_forecaster("oracle").fit(None)
    return out


def wape_tables(results: pd.DataFrame) -> dict:
    out = {}
    for label, frame in (("all", results), ("steady", results[results["cutoff"] >= STEADY_S])):
        s = score(frame)
        table: dict = {}
        for r in s.itertuples(index=False):
            table.setdefault(r.model, {}).setdefault(r.target, {})[f"{r.horizon_s:g}"] = round(
                float(r.wape), 4
            )
        out[label] = table
    return out


def by_group(results: pd.DataFrame) -> dict:
    """WAPE at 5 s of prefill and decode tokens per scenario / replayed trace and mode."""
    x = results[np.isclose(results["horizon_s"], 5.0)]
    x = x[x["target"].isin(["prefill_tokens", "decode_tokens"])]
    group = x["run_id"].str.replace(r"-(static|colocate)-e\d+-s\d+$", "", regex=True)
    out: dict = {}
    for (g, model, target), part in x.groupby([group, "model", "target"]):
        total = part["actual"].abs().sum()
        wape = float((part["actual"] - part["forecast"]).abs().sum() / total) if total else None
        out.setdefault(g, {}).setdefault(model, {})[target] = (
            None if wape is None else round(wape, 3)
        )
    return out


def timing_floor(table, horizon_s: float = 5.0) -> dict:
    """WAPE of a "timing oracle" for prefill tokens: it knows exactly when every prefill
    arrives but only the shipped model's expected size of each (the next-size model at the
    previous turn's arrival; a new trajectory's prompt is given exactly). No forecaster that
    cannot see the sizes can do much better: this is the floor the goal is judged against.
    """
    from prorsa.forecast import lgbm
    from prorsa.forecast.tracker import EVENT_FEATURES

    model = load_forecaster(models_dir() / "lightgbm-trajectory")
    data = build_dataset(table, tasks=model.tasks_, horizons=[horizon_s])
    turns = data.turns
    mu = lgbm.predict(model.boosters_["next"], turns[list(EVENT_FEATURES)].to_numpy(float))
    spread = np.asarray(model.spread_["next"])
    task = np.nan_to_num(turns["task"].to_numpy(float), nan=len(spread) - 1).astype(int)
    sd = spread[np.minimum(task, len(spread) - 1)]
    expected = turns[["run_id", "trajectory_id", "turn"]].assign(
        expected=np.exp(mu + sd**2 / 2) - 1.0, turn=turns["turn"] + 1
    )
    arrivals = turns.merge(expected, on=["run_id", "trajectory_id", "turn"], how="left")
    arrivals["expected"] = np.where(
        arrivals["turn"] == 0, arrivals["turn_new_tokens"], arrivals["expected"]
    )
    out = {}
    for label, cut in (("all", 0.0), ("steady", STEADY_S)):
        err = tot = 0.0
        for run_id, ticks in data.ticks.groupby("run_id"):
            ticks = ticks[ticks["time"] >= cut]
            a = arrivals[arrivals["run_id"] == run_id].sort_values("time")
            cum = np.concatenate([[0.0], np.cumsum(np.nan_to_num(a["expected"].to_numpy()))])
            at, tt = a["time"].to_numpy(), ticks["time"].to_numpy()
            forecast = (
                cum[np.searchsorted(at, tt + horizon_s, "right")]
                - cum[np.searchsorted(at, tt, "right")]
            )
            y = ticks[f"y_prefill_tokens_h{horizon_s:g}"].to_numpy()
            err += float(np.abs(y - forecast).sum())
            tot += float(y.sum())
        out[label] = round(err / tot, 4)
    return out


def goal(tables: dict, key: str) -> dict:
    prefill = {m: v["prefill_tokens"]["5"] for m, v in tables[key].items()}
    best = min(BASELINES, key=lambda m: prefill[m])
    ratio = prefill["lightgbm-trajectory"] / prefill[best]
    return {
        "lightgbm_trajectory_wape": prefill["lightgbm-trajectory"],
        "best_baseline": best,
        "best_baseline_wape": prefill[best],
        "ratio": round(ratio, 3),
        "met (ratio <= 0.5)": bool(ratio <= 0.5),
    }


def latency() -> dict:
    from prorsa.policy import make_policy
    from prorsa.runtime.sim.config import ClusterConfig
    from prorsa.runtime.sim.scenario import WorkloadConfig, build_driver
    from prorsa.runtime.sim.simulation import Simulation

    work = WorkloadConfig(
        scenario="swe", mode="async", trajectories=20_000, max_in_flight=10_000, seed=0
    )
    sim = Simulation(
        ClusterConfig(num_slots=512), make_policy("static"), build_driver(work), run_id="big"
    )
    began = time.perf_counter()
    table = sim.run(max_time_s=40.0).telemetry
    sim_s = time.perf_counter() - began
    rows = list(rows_of(table))
    times = np.asarray(table.column("time"))
    out = {"simulated_s": 40, "events": len(rows), "engines": 512, "simulate_wall_s": sim_s}
    for name in ("lightgbm-trajectory", "lightgbm-aggregate", "gru", "ewma"):
        f = (
            load_forecaster(models_dir() / name)
            if name in LEARNED
            else make_forecaster(name).fit(None)
        )
        f.reset()
        update, predict, live, events = [], [], [], []
        start = 0
        for t in np.arange(1.0, 41.0):
            end = int(np.searchsorted(times, t, side="right"))
            a = time.perf_counter()
            f.update(rows[start:end], float(t))
            b = time.perf_counter()
            f.predict()
            c = time.perf_counter()
            n = f.tracker_.live_count()
            if n >= 9_500:
                update.append(b - a)
                predict.append(c - b)
                live.append(n)
                events.append(end - start)
            start = end
        out[name] = {
            "ticks_measured": len(predict),
            "live_mean": float(np.mean(live)),
            "events_per_tick_mean": float(np.mean(events)),
            "predict_ms_p50": 1e3 * float(np.percentile(predict, 50)),
            "predict_ms_p99": 1e3 * float(np.percentile(predict, 99)),
            "update_ms_p50": 1e3 * float(np.percentile(update, 50)),
            "update_ms_p99": 1e3 * float(np.percentile(update, 99)),
        }
        print(name, {k: round(v, 2) for k, v in out[name].items()})
    return out


def main() -> None:
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        sets = heldout_sets(Path(tmp))
    models = forecasters(sets["tune"])
    results: dict[str, pd.DataFrame] = {}
    latencies: dict[str, dict] = {}
    for key in ("sim", "replay"):
        frames = []
        for name, f in models.items():
            frame = backtest(f, sets[key], model=name)
            lat = 1e3 * np.asarray(frame.attrs["predict_s"])
            latencies.setdefault(name, {})[key] = {
                "predict_ms_p50": float(np.percentile(lat, 50)),
                "predict_ms_p99": float(np.percentile(lat, 99)),
            }
            frames.append(frame)
            print(f"{key}: {name} backtested")
        results[key] = pd.concat(frames, ignore_index=True)
    quality = {key: wape_tables(frame) for key, frame in results.items()}
    floors = {key: timing_floor(sets[key]) for key in ("sim", "replay")}
    print("prefill timing floor (h=5):", floors)
    goals = {
        f"{key}/{span}": goal(quality[key], span) for key in quality for span in ("all", "steady")
    }
    for name, g in goals.items():
        key, span = name.split("/")
        # The goal asks for half the best baseline; below the timing floor nobody gets.
        g["prefill_timing_floor"] = floors[key][span]
        g["half_best_baseline"] = round(g["best_baseline_wape"] / 2, 4)
        g["goal_below_floor"] = bool(g["half_best_baseline"] < floors[key][span])
    lat = latency()
    p99 = lat["lightgbm-trajectory"]["predict_ms_p99"]
    # Plots: forecast vs actual at 5 s for the headline and the best baseline.
    sim = results["sim"]
    best = goals["sim/steady"]["best_baseline"]
    keep = sim[
        sim["model"].isin(["lightgbm-trajectory", best]) & sim["run_id"].str.startswith("swe-")
    ]
    files = plot_backtest(keep, RESULTS, horizon_s=5.0, max_runs=2)
    for f in files:
        f.rename(f.with_name("forecast-" + f.name))
    payload = {
        "setup": {
            "heldout_sim_runs": int(sim["run_id"].nunique()),
            "heldout_replay_runs": int(results["replay"]["run_id"].nunique()),
            "scenarios": SHIP_SCENARIOS,
            "traces": SHIP_TRACES,
            "seeds": list(HELDOUT_SEEDS),
            "engines": 8,
            "policy": "static",
            "profile": "h200-qwen2.5-7b-tp1",
            "steady_from_s": STEADY_S,
            "models": {n: str(models_dir() / n) for n in LEARNED},
        },
        "wape": quality,
        "wape_h5": {
            key: {
                span: {m: {t: v[t]["5"] for t in TARGETS} for m, v in quality[key][span].items()}
                for span in ("all", "steady")
            }
            for key in quality
        },
        "wape_h5_by_workload": {key: by_group(frame) for key, frame in results.items()},
        "prefill_h5_timing_oracle_floor": floors,
        "predict_latency_backtest": latencies,
        "latency_10k_live": lat,
        "goals": {
            **goals,
            "predict_p99_ms_at_10k": p99,
            "predict p99 < 20 ms": bool(p99 < 20.0),
        },
        "plots": [f"benchmarks/results/forecast-{f.name}" for f in files],
        "bench_wall_s": time.perf_counter() - began,
    }
    path = save("forecast", payload)
    print(f"wrote {path}")
    for key, value in payload["goals"].items():
        print(key, value)


if __name__ == "__main__":
    main()
