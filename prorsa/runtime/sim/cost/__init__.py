"""Cost models: per-iteration time of a vLLM-style engine (model x GPU x TP degree).

``CostProfile`` holds the coefficients and evaluates prefill, decode, mixed-step and KV
transfer times; ``get_profile`` / ``list_profiles`` reach the registered profiles
(fitted to the measured H200 kernel tables, or roofline from spec sheets);
``fit_from_timings`` fits one to timings measured on a real engine. Nothing here reads
parquet at import: the kernel tables are read only when refitting.
"""

from prorsa.runtime.sim.cost.fit import LinearFit
from prorsa.runtime.sim.cost.hardware import HARDWARE, HardwareSpec, get_hardware
from prorsa.runtime.sim.cost.models import MODELS, ModelArch, get_model
from prorsa.runtime.sim.cost.profile import SOURCES, CostProfile
from prorsa.runtime.sim.cost.registry import (
    PROFILES,
    get_profile,
    list_profiles,
    register_profile,
)
from prorsa.runtime.sim.cost.roofline import roofline_profile
from prorsa.runtime.sim.cost.timings import fit_from_timings

__all__ = [
    "HARDWARE",
    "MODELS",
    "PROFILES",
    "SOURCES",
    "CostProfile",
    "HardwareSpec",
    "LinearFit",
    "ModelArch",
    "fit_from_timings",
    "get_hardware",
    "get_model",
    "get_profile",
    "list_profiles",
    "register_profile",
    "roofline_profile",
]


def __getattr__(name: str):
    # The kernel-table functions pull in pandas; load them only when asked for.
    if name in (
        "kernel_sum_prefill_s",
        "kernel_sum_decode_s",
        "fit_aiconfigurator_profiles",
        "fit_aiconfigurator_profile",
    ):
        from prorsa.runtime.sim.cost import aiconfigurator

        return getattr(aiconfigurator, name)
    raise AttributeError(name)
