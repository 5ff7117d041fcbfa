"""Named workload scenarios: the shipped task profiles in ``datasets/workloads``."""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

from prorsa.errors import ConfigError, InputError
from prorsa.workload.profile import MixtureProfile, TaskProfile

SCENARIOS = ("swe", "tau2", "search", "math-tool", "mixed")


def datasets_dir() -> Path:
    """The repository's ``datasets/`` folder (override with ``PRORSA_DATASETS``)."""
    env = os.environ.get("PRORSA_DATASETS")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "datasets"
    if not path.is_dir():
        raise ConfigError(
            f"datasets folder not found at {path}",
            hint="run from a source checkout or set PRORSA_DATASETS",
        )
    return path


def load_profile(path: str | os.PathLike[str]) -> TaskProfile | MixtureProfile:
    """Load a task profile or a mixture (whose components are looked up by name)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read the profile: {exc}", source=str(path)) from None
    if isinstance(data, dict) and data.get("kind") == "mixture":
        return _mixture(data, str(path))
    return TaskProfile.from_dict(data, source=str(path))


def _mixture(data: dict, source: str) -> MixtureProfile:
    """A mixture file: shipped components by name, each with a positive weight."""
    raw = data.get("components")
    if not isinstance(raw, list) or not raw:
        raise InputError("a mixture needs a non-empty list", source=source, field="components")
    if not isinstance(data.get("name"), str):
        raise InputError("missing or not a string", source=source, field="name")
    components = []
    for i, c in enumerate(raw):
        record = f"components[{i}]"
        if not isinstance(c, dict) or not isinstance(c.get("profile"), str):
            raise InputError("needs a scenario name", source=source, record=record, field="profile")
        weight = c.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
            raise InputError(
                f"must be a positive number, got {weight!r}",
                source=source,
                record=record,
                field="weight",
            )
        profile = get_scenario(c["profile"])
        if isinstance(profile, MixtureProfile):
            raise InputError(
                "a mixture cannot contain another mixture",
                source=source,
                record=record,
                field="profile",
            )
        components.append((profile, float(weight)))
    return MixtureProfile(data["name"], components, sources=data.get("sources", {}))


@cache
def get_scenario(name: str) -> TaskProfile | MixtureProfile:
    """The shipped profile called ``name`` (one of :data:`SCENARIOS`)."""
    path = datasets_dir() / "workloads" / f"{name}.json"
    if not path.exists():
        raise ConfigError(
            f"unknown scenario '{name}'", hint=f"choose one of: {', '.join(SCENARIOS)}"
        )
    return load_profile(path)
