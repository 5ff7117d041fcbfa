"""Which training runs share trajectories, so that no split puts one on both sides.

A held-out share that holds the same trajectories as the training share (under another
policy or cluster) measures the fit, not the forecast: calibration shifts and
out-of-fold predictions come out optimistic. Splits are therefore drawn by *source*.

Simulated runs are named by :attr:`prorsa.forecast.shipping.SimRun.run_id`,
``{workload}-{mode}-{policy}-e{slots}-l{load}-{reuse}-{profile}[-{layout}]-s{seed}``:
runs of one scenario and seed sample the same trajectories whatever their policy or
cluster (sync and async runs of a seed draw theirs differently, and share them at seed 0
only; one source holds both), and every run replaying one trace (``replay:{stem}``; seed
0 replays it, other seeds draw from it) replays the same ones. Any other run id
(imported telemetry) is a source of its own.

Replays and scenario samples are split separately (*strata*): a replayed trace holds
many runs, a scenario sample few, and a split by count alone could leave every replay
on one side.
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


def strata(sources: Iterable[str]) -> list[list[str]]:
    """Sources split into replays and the rest (each sorted; empty strata left out)."""
    ordered = sorted(sources)
    groups = [[s for s in ordered if s.startswith("replay:")]]
    groups.append([s for s in ordered if not s.startswith("replay:")])
    return [g for g in groups if g]


def held_out_sources(sources: Iterable[str], share: float, seed: int) -> list[str]:
    """A seeded ``share`` of each stratum's sources (at least one of every stratum with
    two or more, never a whole stratum) — or [] with fewer than two sources."""
    layers = strata(sources)
    if sum(len(layer) for layer in layers) < 2 or share <= 0:
        return []
    rng = np.random.default_rng(seed)
    chosen: list[str] = []
    for layer in layers:
        if len(layer) < 2:
            continue
        k = min(len(layer) - 1, max(1, round(share * len(layer))))
        chosen += [layer[i] for i in sorted(rng.choice(len(layer), k, replace=False))]
    if not chosen:  # two strata of one source each: hold out one of them
        chosen = [sorted(s for layer in layers for s in layer)[int(rng.integers(2))]]
    return chosen


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
    source in exactly one round's ``test``, every stratum dealt round the folds in turn;
    of the other sources a seeded ``stop_share`` per stratum
    (:func:`held_out_sources`) decides early stopping, so no round stops on the very runs
    it then predicts. Empty with fewer than two sources or folds: the caller can only
    predict in sample."""
    groups = runs_by_source(runs)
    if len(groups) < 2 or folds < 2:
        return []
    rng = np.random.default_rng(seed)
    fold_of: dict[str, int] = {}
    dealt = 0
    for layer in strata(groups):
        for i in rng.permutation(len(layer)):
            fold_of[layer[i]] = dealt % folds
            dealt += 1
    out = []
    for k in sorted(set(fold_of.values())):
        test = [s for s in groups if fold_of[s] == k]
        rest = [s for s in groups if fold_of[s] != k]
        stop = set(held_out_sources(rest, stop_share, seed + 1 + k)) if len(rest) > 2 else set()

        def runs_of(chosen: Iterable[str]) -> frozenset[str]:
            return frozenset(run for source in chosen for run in groups[source])

        out.append(Fold(runs_of(s for s in rest if s not in stop), runs_of(stop), runs_of(test)))
    return out
