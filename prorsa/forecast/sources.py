"""Which training runs share trajectories, so that no split puts one on both sides.

A held-out share that holds the same trajectories as the training share (under another
policy, mode or cluster) measures the fit, not the forecast: calibration shifts and
out-of-fold predictions come out optimistic. Splits are therefore drawn by *source*.

Simulated runs are named by :attr:`prorsa.forecast.shipping.SimRun.run_id`,
``{workload}-{mode}-{policy}-e{slots}-l{load}-{reuse}-{profile}[-{layout}]-s{seed}``:
runs of one scenario and seed sample the same trajectories whatever their mode, policy or
cluster, and every run replaying one trace (``replay:{stem}``; seed 0 replays it, other
seeds draw from it) replays the same ones. Any other run id (imported telemetry) is a
source of its own.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

_SIM_RUN = re.compile(r"^(?P<workload>.+?)-(?:sync|async)-.+-s(?P<seed>\d+)$")


def source_of_run(run_id: str) -> str:
    """The trajectories ``run_id`` ran: ``{scenario}-s{seed}``, ``replay:{stem}``, or the
    run id itself when it is not a simulated run's."""
    match = _SIM_RUN.match(run_id)
    if match is None:
        return run_id
    workload = match["workload"]
    return workload if workload.startswith("replay:") else f"{workload}-s{match['seed']}"


def runs_by_source(runs: Iterable[str]) -> dict[str, list[str]]:
    """Runs grouped by :func:`source_of_run` (sources and runs sorted)."""
    groups: dict[str, list[str]] = {}
    for run in sorted(set(runs)):
        groups.setdefault(source_of_run(run), []).append(run)
    return dict(sorted(groups.items()))


@dataclass(frozen=True)
class Fold:
    """One out-of-fold round: fit on ``fit``, stop adding trees where the loss on
    ``stop`` stops improving, predict ``test`` (three disjoint sets of runs, no source
    in two of them)."""

    fit: frozenset[str]
    stop: frozenset[str]
    test: frozenset[str]


def source_folds(runs: Iterable[str], folds: int, seed: int, stop_share: float = 0.2) -> list[Fold]:
    """``folds`` rounds over the runs' sources (fewer when there are fewer sources), each
    source in exactly one round's ``test``; of the other sources a seeded ``stop_share``
    (at least one, when two or more are left) decides early stopping, so no round stops
    on the very runs it then predicts. Empty with fewer than two sources or folds: the
    caller can only predict in sample."""
    groups = runs_by_source(runs)
    sources = list(groups)
    if len(sources) < 2 or folds < 2:
        return []
    order = np.random.default_rng(seed).permutation(len(sources))
    fold_of = {sources[i]: k % folds for k, i in enumerate(order)}
    out = []
    for k in range(min(folds, len(sources))):
        test = [s for s in sources if fold_of[s] == k]
        rest = [s for s in sources if fold_of[s] != k]
        stop: list[str] = []
        if len(rest) >= 2:
            n = min(len(rest) - 1, max(1, round(stop_share * len(rest))))
            picked = np.random.default_rng([seed, k]).choice(len(rest), n, replace=False)
            stop = [rest[i] for i in sorted(picked)]

        def runs_of(chosen: list[str]) -> frozenset[str]:
            return frozenset(run for source in chosen for run in groups[source])

        fit = [s for s in rest if s not in stop]
        out.append(Fold(runs_of(fit), runs_of(stop), runs_of(test)))
    return out
