"""Allocation policies: how many GPUs serve prefill, decode, or both, tick by tick."""

from prorsa.policy import baselines, best_static, mpc, predictive, rl, threshold  # noqa: F401
from prorsa.policy.base import POLICIES, ClusterSpec, Policy, make_policy
from prorsa.policy.types import ROLES, Allocation, ClusterObservation, Forecast, SlotView

__all__ = [
    "POLICIES",
    "ROLES",
    "Allocation",
    "ClusterObservation",
    "ClusterSpec",
    "Forecast",
    "Policy",
    "SlotView",
    "make_policy",
]
