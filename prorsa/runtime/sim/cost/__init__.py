"""Cost models: per-iteration time of a vLLM-style engine (model x GPU x TP degree).

``CostProfile`` holds the coefficients and evaluates prefill, decode, mixed-step and KV
transfer times; ``get_profile`` / ``list_profiles`` reach the registered profiles
(fitted to the measured H200 kernel tables, or roofline from spec sheets);
``fit_from_timings`` fits one to timings measured on a real engine.

``LayoutCost`` prices an engine of any parallel layout (``Layout``: tensor parallel x
data-parallel attention x expert parallel): lock-stepped ranks, MoE at the tokens each GPU
sees, DP token exchange, CUDA-graph loss and CPU scheduling (docs/cost_model.md);
``get_layout_cost`` / ``layouts_for`` / ``list_layout_costs`` reach the fitted layouts.
Nothing here reads parquet at import: the tables are read only when refitting.
"""

from prorsa.runtime.sim.cost.fit import LinearFit
from prorsa.runtime.sim.cost.hardware import HARDWARE, HardwareSpec, get_hardware
from prorsa.runtime.sim.cost.layout import Layout
from prorsa.runtime.sim.cost.layout_cost import SEMANTICS, LayoutCost
from prorsa.runtime.sim.cost.layout_registry import (
    LAYOUT_COSTS,
    get_layout_cost,
    get_layout_terms,
    layout_cost_for,
    layouts_for,
    list_layout_costs,
    register_layout_terms,
)
from prorsa.runtime.sim.cost.layout_terms import LayoutTerms
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
    "LAYOUT_COSTS",
    "MODELS",
    "PROFILES",
    "SEMANTICS",
    "SOURCES",
    "CostProfile",
    "HardwareSpec",
    "Layout",
    "LayoutCost",
    "LayoutTerms",
    "LinearFit",
    "ModelArch",
    "fit_from_timings",
    "get_hardware",
    "get_layout_cost",
    "get_layout_terms",
    "get_model",
    "get_profile",
    "layout_cost_for",
    "layouts_for",
    "list_layout_costs",
    "list_profiles",
    "register_layout_terms",
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
