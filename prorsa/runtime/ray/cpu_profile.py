"""Cost profiles fitted to this runtime's own engines, registered on import.

``benchmarks/fidelity_bench.py`` measures the CPU vLLM engines (tiny Llama, TP1), fits a
:class:`~prorsa.runtime.sim.cost.CostProfile` with ``fit_from_timings`` and saves it in
``profiles/`` next to this module; importing this module registers every profile found
there, so the simulator and the rollout's policies can use it by name.
"""

from __future__ import annotations

from pathlib import Path

#: The profile the fidelity benchmark fits and the rollout uses by default on CPU.
CPU_PROFILE = "cpu-tiny-llama-tp1"
PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


def register_runtime_profiles() -> list[str]:
    """Register the profiles shipped in :data:`PROFILE_DIR` (idempotent); their names."""
    from prorsa.runtime.sim.cost.profile import CostProfile
    from prorsa.runtime.sim.cost.registry import PROFILES, register_profile

    names = []
    for path in sorted(PROFILE_DIR.glob("*.json")):
        if path.stem not in PROFILES.names():
            register_profile(lambda p=path: CostProfile.load(p), name=path.stem)
        names.append(path.stem)
    return names


register_runtime_profiles()
