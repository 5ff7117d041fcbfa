"""Named workload scenarios: the shipped task profiles in ``datasets/workloads``."""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

from prorsa.errors import ConfigError
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
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read profile {path}: {exc}") from None
    if data.get("kind") == "mixture":
        components = [(get_scenario(c["profile"]), float(c["weight"])) for c in data["components"]]
        for profile, _ in components:
            if isinstance(profile, MixtureProfile):
                raise ConfigError(f"{path}: a mixture cannot contain another mixture")
        return MixtureProfile(data["name"], components, sources=data.get("sources", {}))  # type: ignore[arg-type]
    return TaskProfile.from_dict(data)


@cache
def get_scenario(name: str) -> TaskProfile | MixtureProfile:
    """The shipped profile called ``name`` (one of :data:`SCENARIOS`)."""
    path = datasets_dir() / "workloads" / f"{name}.json"
    if not path.exists():
        raise ConfigError(
            f"unknown scenario '{name}'", hint=f"choose one of: {', '.join(SCENARIOS)}"
        )
    return load_profile(path)
