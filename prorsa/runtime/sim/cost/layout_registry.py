"""The layout-cost registry: ``<hardware>-<model>-<layout>`` to ``LayoutTerms`` factories.

Every ``datasets/profiles/layouts/*.json`` is registered when this module is imported
(nothing is read until asked for); refit them with ``prorsa profile fit-layouts``.
``get_layout_cost`` builds the evaluator with the run's options (DP semantics, routing
distribution, asynchronous scheduling); ``layouts_for`` lists what a model can use, so a
policy or a best-static search can choose among layouts.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from prorsa.errors import ConfigError
from prorsa.registry import Registry
from prorsa.runtime.sim.cost.layout import Layout
from prorsa.runtime.sim.cost.layout_cost import (
    DEFAULT_ROUTING,
    DEFAULT_SEMANTICS,
    LayoutCost,
)
from prorsa.runtime.sim.cost.layout_fit import HARDWARE, layout_cost_name, shipped_layout_dir
from prorsa.runtime.sim.cost.layout_terms import LayoutTerms

LAYOUT_COSTS: Registry[Callable[[], LayoutTerms]] = Registry("layout cost")
_terms: dict[str, LayoutTerms] = {}
_costs: dict[tuple, LayoutCost] = {}


def get_layout_terms(name: str) -> LayoutTerms:
    """The fitted terms registered as ``name`` (loaded once)."""
    if name not in _terms:
        _terms[name] = LAYOUT_COSTS.get(name)()
    return _terms[name]


def get_layout_cost(
    name: str,
    *,
    semantics: str = DEFAULT_SEMANTICS,
    routing: str = DEFAULT_ROUTING,
    async_scheduling: bool = False,
) -> LayoutCost:
    """The evaluator of layout ``name`` with these options (built once per option set)."""
    key = (name, semantics, routing, bool(async_scheduling))
    if key not in _costs:
        _costs[key] = LayoutCost(
            get_layout_terms(name),
            semantics=semantics,
            routing=routing,
            async_scheduling=async_scheduling,
        )
    return _costs[key]


def list_layout_costs() -> list[str]:
    """All registered layout-cost names, sorted."""
    return LAYOUT_COSTS.names()


def layouts_for(model: str, hardware: str = HARDWARE) -> list[Layout]:
    """The layouts of ``model`` with fitted costs, fewest GPUs first."""
    prefix = f"{hardware}-{model}-"
    found = []
    for name in LAYOUT_COSTS.names():
        rest = name[len(prefix) :] if name.startswith(prefix) else None
        if rest and rest.startswith("tp"):
            try:
                found.append(Layout.parse(rest))
            except ConfigError:
                continue
    return sorted(found, key=lambda lay: (lay.gpus, lay.tp, lay.dp, lay.ep, lay.moe_comm))


def layout_cost_for(model: str, layout: Layout | str, hardware: str = HARDWARE, **options):
    """``get_layout_cost`` by model and layout instead of by name."""
    return get_layout_cost(layout_cost_name(model, layout, hardware), **options)


def register_layout_terms(terms: LayoutTerms | Callable[[], LayoutTerms], name: str | None = None):
    """Register terms (under their own name) or a factory (under ``name``)."""
    if isinstance(terms, LayoutTerms):
        key = name or terms.name
        LAYOUT_COSTS.register(key, lambda: terms)
    else:
        if not name:
            raise ConfigError("register_layout_terms: a factory needs a name")
        key = name
        LAYOUT_COSTS.register(key, terms)
    return key


def _register_builtins() -> None:
    for path in sorted(shipped_layout_dir().glob("*.json")):
        LAYOUT_COSTS.register(path.stem, partial(LayoutTerms.load, path))


_register_builtins()
