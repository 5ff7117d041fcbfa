"""Scoring on held-out seeds: a run's metrics over seeds, and paired speedups with a
95% interval.

The regime map chooses every plan (colocation's layout, best-static's pair and split,
the dynamic policies' start) on one seed and scores it on others. Each held-out seed is
one draw of the workload; a policy and its baseline run the same draw, so a speedup is
a *paired* ratio per seed, summarised by its geometric mean and a Student-t interval on
the log ratios (with three seeds the interval is wide; that is what three seeds know).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
from scipy import stats


def mean_run(metrics_by_seed: Mapping[int, dict]) -> dict:
    """One run's metrics (:func:`~prorsa.experiments.regimes.run_metrics`) over seeds:
    the objective's geometric mean (so that one objective over another is their paired
    speedup, :func:`paired_speedup`), other numbers and per-role dicts averaged, each
    seed's objective kept in ``objective_by_seed``. A seed whose run failed makes the
    objective infinite and names itself in ``error``."""
    seeds = sorted(metrics_by_seed)
    runs = [metrics_by_seed[s] for s in seeds]
    by_seed = {s: metrics_by_seed[s]["objective"] for s in seeds}
    failed = [(s, r["error"]) for s, r in zip(seeds, runs, strict=True) if "error" in r]
    if failed:
        seed, error = failed[0]
        return {
            "objective": math.inf,
            "error": f"seed {seed}: {error}",
            "objective_by_seed": by_seed,
        }
    out: dict = {}
    for key in runs[0]:
        values = [r.get(key) for r in runs]
        out[key] = _mean(values)
    out["objective"] = geometric_mean(list(by_seed.values()))
    out["objective_by_seed"] = by_seed
    return out


def _mean(values: list):
    if any(v is None for v in values):
        return None
    if all(isinstance(v, dict) for v in values):
        return {k: _mean([v.get(k) for v in values]) for k in values[0]}
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return float(np.mean(values))
    return values[0]


def paired_speedup(
    baseline_by_seed: Mapping[int, float], policy_by_seed: Mapping[int, float]
) -> dict:
    """Speedup of a policy over its baseline on the seeds both ran: ``speedup`` (the
    geometric mean of the per-seed ratios baseline / policy), ``ci95`` (a Student-t 95%
    interval on the mean log ratio; None with one seed or a failed run) and ``by_seed``.
    A failed policy run (infinite objective) gives speedup 0."""
    seeds = sorted(set(baseline_by_seed) & set(policy_by_seed))
    if not seeds:
        raise ValueError("no seed ran both the policy and its baseline")
    ratios = {s: _ratio(baseline_by_seed[s], policy_by_seed[s]) for s in seeds}
    values = np.array(list(ratios.values()))
    if not np.all(np.isfinite(values) & (values > 0)):
        worst = 0.0 if np.any(values == 0) else math.inf
        return {"speedup": worst, "ci95": None, "by_seed": ratios}
    logs = np.log(values)
    centre = float(np.exp(logs.mean()))
    ci = None
    if len(logs) > 1:
        half = float(stats.t.ppf(0.975, len(logs) - 1) * logs.std(ddof=1) / math.sqrt(len(logs)))
        ci = [float(np.exp(logs.mean() - half)), float(np.exp(logs.mean() + half))]
    return {"speedup": centre, "ci95": ci, "by_seed": ratios}


def _ratio(baseline: float, policy: float) -> float:
    if policy == math.inf:
        return 0.0
    return baseline / policy if policy > 0 else math.inf


def geometric_mean(values: list[float]) -> float:
    """The geometric mean of positive finite values (inf if any is inf)."""
    array = np.asarray(values, dtype=float)
    if np.any(~np.isfinite(array)):
        return math.inf
    return float(np.exp(np.log(array).mean()))
