"""Rolling-origin backtests: replay held-out runs tick by tick, forecast at every cutoff.

Each tick of each run is a forecast origin (``cutoff``). The forecaster is not refitted; it
is fed the run's events up to the cutoff through ``update`` exactly as the online provider
feeds it, and its forecast is compared with the targets computed from the telemetry. The
result is one tidy frame (statsforecast style): ``model, run_id, cutoff, target,
horizon_s, actual, forecast, q0.1, q0.5, q0.9, fallback``; :func:`score` reduces it to WAPE, MAE and
pinball losses per target and horizon.
"""

from __future__ import annotations

import time as _time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from prorsa.errors import ConfigError
from prorsa.forecast.base import Forecaster
from prorsa.forecast.events import as_batch, slice_batch
from prorsa.forecast.targets import event_frame, run_targets, tick_times, trajectory_events
from prorsa.forecast.tracker import rows_of
from prorsa.forecast.types import QUANTILES, TARGETS, check_horizons, target_column


def backtest(
    forecaster: Forecaster,
    telemetry: pa.Table | pd.DataFrame,
    *,
    horizons: Sequence[float] | None = None,
    tick_s: float | None = None,
    model: str | None = None,
    every: int = 1,
    candidates: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> pd.DataFrame:
    """Forecast at every tick of every run in ``telemetry``; a tidy frame of the results.

    ``every``: forecast (and score) only every n-th tick; the forecaster is still fed
    every tick, exactly as online. ``candidates``: add a ``forecast:CHOICE`` column for
    each point the forecaster could have handed out
    (:meth:`~prorsa.forecast.base.Forecaster.point_candidates`; NaN where it offered
    none), a ``raw:q{level}`` column per quantile the model made
    (:meth:`~prorsa.forecast.base.Forecaster.raw_quantiles`) and a ``live_scale`` column
    (:meth:`~prorsa.forecast.base.Forecaster.live_scale` at the tick: the unit quantile
    shifts are measured in). The frame's
    ``attrs["predict_s"]`` holds every predict call's duration (seconds).
    """
    if every < 1:
        raise ConfigError(f"every must be >= 1, got {every}")
    forecaster._check_fitted()
    hs = forecaster.horizons_ if horizons is None else check_horizons(horizons)
    tick = tick_s or forecaster.tick_s_
    if tick <= 0:
        raise ConfigError(f"tick_s must be > 0, got {tick}")
    events = event_frame(telemetry, keep_allocations=True)
    if forecaster.needs_future:
        forecaster.attach(telemetry)  # type: ignore[attr-defined]
    frames, latencies = [], []
    runs = list(events.groupby("run_id", sort=True))
    for done, (run_id, run) in enumerate(runs, 1):
        ticks = tick_times(run, tick)
        if not len(ticks):
            continue
        scored = np.arange(len(ticks)) % every == 0
        actual = run_targets(trajectory_events(run), ticks[scored], hs)
        forecaster.reset()
        # The oracle reads row tuples (its run id); everyone else one batch per run.
        rows = list(rows_of(run)) if forecaster.needs_future else None
        batch = as_batch(run)
        ends = np.searchsorted(batch.time, ticks, side="right")
        shape = (int(scored.sum()), len(TARGETS), len(hs))
        point = np.empty(shape)
        bands = {q: np.full(shape, np.nan) for q in QUANTILES}
        fallback = np.zeros(shape[0], bool)
        offered: dict[str, np.ndarray] = {}  # each candidate point, as ``point``
        raw_bands = {q: np.full(shape, np.nan) for q in QUANTILES}
        live_scale = np.full(shape[0], np.nan)
        start, i = 0, -1
        for t, end, score_it in zip(ticks, ends, scored, strict=True):
            events = rows[start:end] if rows is not None else slice_batch(batch, start, end)
            forecaster.update(events, float(t))
            start = end
            if not score_it:
                continue
            i += 1
            began = _time.perf_counter()
            fc = forecaster.predict(hs)
            latencies.append(_time.perf_counter() - began)
            fallback[i] = bool(fc.fallback)
            for k, target in enumerate(TARGETS):
                point[i, k] = fc.point[target]
                for q, table in fc.quantiles.items():
                    if q in bands:
                        bands[q][i, k] = table[target]
            if candidates:
                live_scale[i] = forecaster.live_scale()
                for q, table in forecaster.raw_quantiles().items():
                    if q in raw_bands:
                        for k, target in enumerate(TARGETS):
                            raw_bands[q][i, k] = table[target]
                for k, target in enumerate(TARGETS):
                    for choice, values in forecaster.point_candidates().get(target, {}).items():
                        offered.setdefault(choice, np.full(shape, np.nan))[i, k] = values
        truth = np.stack(
            [np.column_stack([actual[target_column(t, h)] for h in hs]) for t in TARGETS], axis=1
        )
        frame = _tidy(str(run_id), ticks[scored], hs, truth, point, bands, fallback)
        for choice, values in offered.items():
            frame[f"forecast:{choice}"] = values.reshape(-1)
        if candidates:
            for q, values in raw_bands.items():
                frame[f"raw:q{q:g}"] = values.reshape(-1)
            frame["live_scale"] = np.repeat(live_scale, len(TARGETS) * len(hs))
        frames.append(frame)
        if progress is not None:
            progress(done, len(runs))
    out = (
        pd.concat(frames, ignore_index=True) if frames else _tidy("", [], hs, None, None, {}, None)
    )
    out.insert(0, "model", model or forecaster.name)
    out.attrs["predict_s"] = latencies
    return out


def _tidy(run_id, ticks, hs, truth, point, bands, fallback) -> pd.DataFrame:
    n = len(ticks)
    quantile_cols = [f"q{q:g}" for q in QUANTILES]
    if n == 0:
        cols = ["run_id", "cutoff", "target", "horizon_s", "actual", "forecast", *quantile_cols]
        return pd.DataFrame({c: [] for c in [*cols, "fallback"]})
    nt, nh = len(TARGETS), len(hs)
    frame = {
        "run_id": run_id,
        "cutoff": np.repeat(np.asarray(ticks, float), nt * nh),
        "target": np.tile(np.repeat(np.array(TARGETS), nh), n),
        "horizon_s": np.tile(np.asarray(hs, float), n * nt),
        "actual": truth.reshape(-1),
        "forecast": point.reshape(-1),
    }
    for q, col in zip(QUANTILES, quantile_cols, strict=True):
        frame[col] = bands[q].reshape(-1)
    frame["fallback"] = np.repeat(fallback, nt * nh)
    return pd.DataFrame(frame)


def pinball(y: np.ndarray, q: np.ndarray, level: float) -> float:
    """Mean pinball (quantile) loss of predictions ``q`` at ``level``."""
    diff = y - q
    return float(np.mean(np.maximum(level * diff, (level - 1) * diff)))


def score(results: pd.DataFrame) -> pd.DataFrame:
    """WAPE, MAE, pinball losses and coverage per (model, target, horizon_s).

    WAPE = sum |actual - forecast| / sum |actual|. Pinball loss and coverage (share of
    outcomes at or below) of each quantile level are over the ticks that have that
    quantile (NaN for forecasters without quantiles); the p50 pinball falls back on the
    point forecast. ``fallback_share``: ticks forecast by the drift fallback.
    """
    rows = []
    for (model, target, h), g in results.groupby(["model", "target", "horizon_s"], sort=False):
        y = g["actual"].to_numpy(float)
        f = g["forecast"].to_numpy(float)
        total = float(np.abs(y).sum())
        row = {
            "model": model,
            "target": target,
            "horizon_s": h,
            "wape": float(np.abs(y - f).sum() / total) if total > 0 else np.nan,
            "mae": float(np.mean(np.abs(y - f))) if len(y) else np.nan,
        }
        for level in QUANTILES:
            col = f"q{level:g}"
            q = g[col].to_numpy(float) if col in g.columns else np.full(len(y), np.nan)
            ok = np.isfinite(q)
            if level == 0.5 and not ok.any():
                q, ok = f, np.ones(len(y), bool)
            row[f"pinball_{level:g}"] = pinball(y[ok], q[ok], level) if ok.any() else np.nan
            row[f"coverage_{level:g}"] = (
                float(np.mean(y[ok] <= q[ok])) if ok.any() and col in g.columns else np.nan
            )
        if "fallback" in g.columns:
            row["fallback_share"] = float(np.mean(g["fallback"].to_numpy(bool)))
        row["n"] = len(g)
        rows.append(row)
    return pd.DataFrame(rows)


def plot_backtest(
    results: pd.DataFrame,
    out_dir: str | Path,
    *,
    horizon_s: float = 5.0,
    max_runs: int = 4,
) -> list[Path]:
    """One PNG per (model, run): forecast vs actual over time for every target at one
    horizon, with the p10-p90 band where given. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = results[np.isclose(results["horizon_s"], horizon_s)]
    if data.empty:
        raise ConfigError(f"no results at horizon {horizon_s:g} s to plot")
    files = []
    for model, by_model in data.groupby("model", sort=False):
        for run_id in sorted(by_model["run_id"].unique())[:max_runs]:
            run = by_model[by_model["run_id"] == run_id]
            fig, axes = plt.subplots(len(TARGETS), 1, figsize=(10, 9), sharex=True)
            for ax, target in zip(axes, TARGETS, strict=True):
                g = run[run["target"] == target]
                ax.plot(g["cutoff"], g["actual"], color="black", lw=1.0, label="actual")
                ax.plot(g["cutoff"], g["forecast"], color="tab:blue", lw=1.0, label="forecast")
                if np.isfinite(g["q0.9"]).any():
                    ax.fill_between(
                        g["cutoff"],
                        g["q0.1"],
                        g["q0.9"],
                        color="tab:blue",
                        alpha=0.2,
                        label="p10-p90",
                    )
                ax.set_ylabel(target.replace("_", " "), fontsize=8)
            axes[0].legend(loc="upper right", fontsize=8)
            axes[0].set_title(f"{model} on {run_id}: next {horizon_s:g} s at each tick")
            axes[-1].set_xlabel("cutoff (s)")
            fig.tight_layout()
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{model}-{run_id}")
            path = out_dir / f"backtest-{safe}-h{horizon_s:g}.png"
            fig.savefig(path, dpi=90)
            plt.close(fig)
            files.append(path)
    return files
