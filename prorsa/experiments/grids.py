"""Named grids of the regime map: ``quick`` (tests, a first look), ``demo`` and ``full``.

The full grid is sized for about half an hour on two idle CPU cores (~3,400 CPU-seconds:
a regime costs ~1.6-2.7 ms of CPU per simulated turn over all its runs, measured; a
simulated turn costs ~50-80 µs colocated and ~280 µs with the oracle forecaster):

* every model x every workload (the five scenarios and a replay of the mini-swe-agent
  trace) x sync x 4, 16 and 64 trajectories per GPU;
* async at 16 per GPU for every model and scenario, and at 64 per GPU for the seed's
  setting (Qwen3-30B-A3B on swe, mixed and search);
* 128 per GPU (sync) for the workloads with few turns (search, math-tool, tau2);
* one knob at a time at mixed, sync, 16 per GPU: tool latency x0.25 and x4, context
  growth x0.5 and x2, and the host-DRAM KV store instead of re-prefill; the KV store on
  swe too; and a replay of the tau2-telecom trace (sync, 16 per GPU).

Async runs twice as many trajectories as they keep in flight; swe-like workloads have
~35 turns per trajectory, which is why they are not run async at every load.
"""

from __future__ import annotations

from collections.abc import Sequence

from prorsa.errors import ConfigError
from prorsa.experiments.families import FAMILIES
from prorsa.experiments.regimes import Regime, product_regimes, variants

MODELS = tuple(FAMILIES)
SCENARIOS = ("swe", "search", "math-tool", "mixed", "tau2")
WORKLOADS = (*SCENARIOS, "replay:mini-swe-agent")
LOADS = (4, 16, 64)
FEW_TURNS = ("search", "math-tool", "tau2")  # cheap enough for 128 per GPU
KNOB_AXES = {
    "tool_scale": (0.25, 4.0),
    "growth_scale": (0.5, 2.0),
    "reuse_mode": ("kv-store",),
}
GRIDS = ("quick", "demo", "full")


SEED_MODEL, SEED_WORKLOADS = "qwen3-30b-a3b", ("swe", "mixed", "search")


def full_grid(models: Sequence[str] = MODELS) -> list[Regime]:
    regimes = product_regimes(models, WORKLOADS, ("sync",), LOADS)
    regimes += product_regimes(models, SCENARIOS, ("async",), (16,))
    if SEED_MODEL in models:
        regimes += product_regimes([SEED_MODEL], SEED_WORKLOADS, ("async",), (64,))
    regimes += product_regimes(models, FEW_TURNS, ("sync",), (128,))
    for model in models:
        regimes += variants(Regime(model, "mixed", "sync", 16), **KNOB_AXES)
        # swe keeps ~97% of each turn's context cached: where KV reuse decides the most
        regimes += variants(Regime(model, "swe", "sync", 16), reuse_mode=("kv-store",))
        regimes.append(Regime(model, "replay:tau2-telecom", "sync", 16))
    return regimes


def quick_grid(models: Sequence[str] = ("qwen2.5-7b", "qwen3-30b-a3b")) -> list[Regime]:
    """Two models, two workloads, sync, 4 per GPU: a minute on two cores."""
    return product_regimes(models, ("search", "swe"), ("sync",), (4,))


def demo_grid() -> list[Regime]:
    """Where the split pays next to where it does not, sync and async, 16 per GPU:
    Qwen3-30B-A3B (DP-attention MoE) on search, Qwen2.5-7B (dense) on swe."""
    return [
        Regime(model, workload, mode, 16)
        for model, workload in (("qwen3-30b-a3b", "search"), ("qwen2.5-7b", "swe"))
        for mode in ("sync", "async")
    ]


def get_grid(name: str) -> list[Regime]:
    """The grid called ``name`` (one of :data:`GRIDS`)."""
    makers = {"quick": quick_grid, "demo": demo_grid, "full": full_grid}
    if name not in makers:
        raise ConfigError(f"unknown grid '{name}'", hint=f"one of {', '.join(GRIDS)}")
    return makers[name]()


def select(
    regimes: Sequence[Regime],
    *,
    models: Sequence[str] = (),
    workloads: Sequence[str] = (),
    modes: Sequence[str] = (),
    loads: Sequence[int] = (),
) -> list[Regime]:
    """The regimes matching every non-empty filter."""
    out = [
        r
        for r in regimes
        if (not models or r.model in models)
        and (not workloads or r.workload in workloads)
        and (not modes or r.mode in modes)
        and (not loads or r.load_per_gpu in loads)
    ]
    if not out:
        raise ConfigError(
            "no regime left after the filters",
            hint="check --models, --workloads, --modes and --loads against the grid",
        )
    return out
