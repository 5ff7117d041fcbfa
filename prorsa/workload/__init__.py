"""Workload: trajectory specs, task profiles fitted to traces, scenarios and replay."""

from prorsa.workload.profile import MixtureProfile, TaskProfile, profile_from_trace
from prorsa.workload.replay import specs_from_trace
from prorsa.workload.scenarios import SCENARIOS, get_scenario, load_profile
from prorsa.workload.spec import TrajectorySpec, spec_totals

__all__ = [
    "SCENARIOS",
    "MixtureProfile",
    "TaskProfile",
    "TrajectorySpec",
    "get_scenario",
    "load_profile",
    "profile_from_trace",
    "spec_totals",
    "specs_from_trace",
]
