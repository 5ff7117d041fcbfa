"""The cost-profile registry: names to lazily built, cached ``CostProfile`` objects.

Two kinds of names are registered when this module is imported, without building anything:

* ``<hardware>-<model>-tp<N>``: fitted to the measured H200 kernel tables, loaded from
  ``datasets/profiles/<name>.json`` (refit with ``prorsa profile fit-aiconfigurator``);
* ``<hardware>-<model>-tp<N>-roofline``: computed from spec sheets on first use, for
  every model, GPU and TP degree that fits.

Plugins add their own with ``register_profile``; a duplicate name is an error.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

from prorsa.errors import ConfigError
from prorsa.registry import Registry
from prorsa.runtime.sim.cost.hardware import HARDWARE
from prorsa.runtime.sim.cost.kernel_tables import repo_root
from prorsa.runtime.sim.cost.models import MODELS
from prorsa.runtime.sim.cost.profile import CostProfile
from prorsa.runtime.sim.cost.roofline import (
    TP_DEGREES,
    fits,
    roofline_profile,
    roofline_profile_name,
)

PROFILES: Registry[Callable[[], CostProfile]] = Registry("cost profile")
_cache: dict[str, CostProfile] = {}


def shipped_profile_dir() -> Path:
    """``datasets/profiles`` of this checkout: the fitted profiles as JSON."""
    return repo_root() / "datasets" / "profiles"


def get_profile(name: str) -> CostProfile:
    """Build (first call) or return (later calls) the profile registered as ``name``."""
    if name not in _cache:
        profile = PROFILES.get(name)()
        _cache[name] = profile
    return _cache[name]


def list_profiles() -> list[str]:
    """All registered profile names, sorted."""
    return PROFILES.names()


def register_profile(
    profile: CostProfile | Callable[[], CostProfile], name: str | None = None
) -> str:
    """Register a profile object (under its own name) or a factory (under ``name``)."""
    if isinstance(profile, CostProfile):
        key = name or profile.name
        PROFILES.register(key, lambda: profile)
    else:
        if not name:
            raise ConfigError("register_profile: a factory needs a name")
        key = name
        PROFILES.register(key, profile)
    return key


def _register_builtins() -> None:
    for path in sorted(shipped_profile_dir().glob("*.json")):
        PROFILES.register(path.stem, partial(CostProfile.load, path))
    for model, arch in MODELS.items():
        for hardware, hw in HARDWARE.items():
            for tp in TP_DEGREES:
                if fits(arch, hw, tp):
                    PROFILES.register(
                        roofline_profile_name(model, hardware, tp),
                        partial(roofline_profile, model, hardware, tp),
                    )


_register_builtins()
