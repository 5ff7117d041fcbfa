"""The learned policy's opening move: which target to start from, by predicted payoff.

A regressor trained as a contextual bandit (:mod:`prorsa.runtime.sim.rl_opening`)
predicts, from what the policy sees before any work arrives, how much faster than
colocation each target would finish if held from the start (the P25 of the log
speedup: a pessimistic estimate, since a wrong split costs far more than a right one
gains). Colocation is the yardstick (payoff 0 by definition); the opening is the split of
highest predicted payoff when that beats colocation by the margin, else colocation.
"""

from __future__ import annotations

import math

import numpy as np

from prorsa.policy.rl_actions import HOLD, TARGETS, Target
from prorsa.policy.rl_features import OBS_FEATURES

#: A split opens only when predicted more than this much faster than colocation (2%).
DEFAULT_OPENING_MARGIN = 0.02

#: The regressor's inputs: the observation, then the arm's prefill share of the slots
#: (0 colocated) and whether it is a split.
OPENING_FEATURES: tuple[str, ...] = (*OBS_FEATURES, "arm_prefill_share", "arm_is_split")


def opening_arms() -> list[tuple[int, Target]]:
    """(index into ``TARGETS``, target) of every target an opening may pick."""
    return [(i, t) for i, t in enumerate(TARGETS) if t is not HOLD]


def arm_rows(features: np.ndarray, num_slots: int) -> np.ndarray:
    """One regressor row per opening arm (in :func:`opening_arms` order)."""
    rows = []
    for _, target in opening_arms():
        if target.mode == "split":
            share, split = target.prefill_slots(num_slots) / num_slots, 1.0
        else:
            share, split = 0.0, 0.0
        rows.append([*np.asarray(features, float), share, split])
    return np.asarray(rows, float)


def choose_arm(
    booster, features: np.ndarray, num_slots: int, margin: float = DEFAULT_OPENING_MARGIN
) -> int:
    """Position in :func:`opening_arms` of the opening: the split of highest predicted
    log speedup when it exceeds ``log(1 + margin)``, else colocation."""
    from prorsa.forecast import lgbm

    arms = opening_arms()
    predicted = lgbm.predict(booster, arm_rows(features, num_slots))
    colocated = next(p for p, (_, t) in enumerate(arms) if t.mode == "colocated")
    splits = [p for p, (_, t) in enumerate(arms) if t.mode == "split"]
    best = max(splits, key=lambda p: predicted[p])
    return best if predicted[best] > math.log1p(margin) else colocated
