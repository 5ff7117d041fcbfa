"""Domain randomisation for training the learned allocation policy.

Each training episode is one simulated rollout drawn from a :class:`DomainConfig`: a
cluster family (model, cost profile, parallel layout), a slot count, a load in
trajectories per GPU, a scenario and a sync/async mode. ``max_slots`` is the curriculum's
knob (small clusters first); ``max_trajectories`` caps an episode's size so training on
two cores stays affordable (bigger cells are left to the held-out evaluation).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from prorsa.errors import ConfigError

if TYPE_CHECKING:  # the simulator is imported when an episode is built (keeps the CLI light)
    from prorsa.runtime.cluster.config import ClusterConfig
    from prorsa.runtime.sim.scenario import WorkloadConfig


@dataclass(frozen=True)
class ClusterFamily:
    """A model on one kind of slot, and the slot counts an episode may use."""

    profile: str
    role_tp: tuple[tuple[str, int], ...] = (("prefill", 1), ("decode", 1), ("colocated", 1))
    dp_attention_ranks: int = 1
    slots: tuple[int, ...] = (4, 6, 8, 12, 16, 24, 32)

    def cluster(self, num_slots: int) -> ClusterConfig:
        from prorsa.runtime.cluster.config import ClusterConfig

        return ClusterConfig(
            profile=self.profile,
            num_slots=num_slots,
            role_tp=dict(self.role_tp),
            dp_attention_ranks=self.dp_attention_ranks,
        )

    @property
    def slot_gpus(self) -> int:
        return max(tp for _, tp in self.role_tp)


def _tp(tp: int) -> tuple[tuple[str, int], ...]:
    return (("prefill", tp), ("decode", tp), ("colocated", tp))


# MoE with data-parallel attention: prefill at TP8 (or TP4) per slot; decode and colocated
# as TP1 engines, the colocated ones in lock-step DP groups (the policy benchmark's layout).
_MOE_DP8 = (("prefill", 8), ("decode", 1), ("colocated", 1))
_MOE_DP4 = (("prefill", 4), ("decode", 1), ("colocated", 1))

FAMILIES: dict[str, ClusterFamily] = {
    "qwen2.5-7b-h200": ClusterFamily("h200-qwen2.5-7b-tp1"),
    "llama-3-8b-h200": ClusterFamily("h200-llama-3-8b-tp1"),
    "qwen2.5-32b-h200-tp2": ClusterFamily("h200-qwen2.5-32b-tp2", _tp(2), slots=(4, 6, 8, 12, 16)),
    "qwen2.5-7b-a100": ClusterFamily("a100-qwen2.5-7b-tp1-roofline"),
    "qwen3-30b-a3b-h200-dp8": ClusterFamily(
        "h200-qwen3-30b-a3b-tp1-roofline", _MOE_DP8, dp_attention_ranks=8, slots=(2, 4, 5, 8)
    ),
    "qwen3-30b-a3b-h200-dp4": ClusterFamily(
        "h200-qwen3-30b-a3b-tp1-roofline", _MOE_DP4, dp_attention_ranks=4, slots=(2, 4, 8, 12)
    ),
}


@dataclass(frozen=True)
class EpisodeConfig:
    """One training (or evaluation) rollout."""

    family: str
    num_slots: int
    scenario: str
    mode: str
    trajectories_per_gpu: int
    seed: int
    # Whether the policy is told the workload's shape (``ClusterObservation.workload``);
    # training hides it in some episodes so the agent also acts sensibly without it.
    workload_known: bool = True

    @property
    def gpus(self) -> int:
        return self.num_slots * FAMILIES[self.family].slot_gpus

    def cluster(self) -> ClusterConfig:
        return FAMILIES[self.family].cluster(self.num_slots)

    def workload(self) -> WorkloadConfig:
        """Sync: one step of ``load x GPUs`` trajectories; async: that many in flight and
        twice as many in total (long enough to reach a steady state)."""
        from prorsa.runtime.sim.scenario import WorkloadConfig

        in_flight = self.trajectories_per_gpu * self.gpus
        if self.mode == "sync":
            return WorkloadConfig(
                scenario=self.scenario, mode="sync", trajectories=in_flight, seed=self.seed
            )
        return WorkloadConfig(
            scenario=self.scenario,
            mode="async",
            trajectories=2 * in_flight,
            max_in_flight=in_flight,
            seed=self.seed,
        )

    @property
    def trajectories(self) -> int:
        in_flight = self.trajectories_per_gpu * self.gpus
        return in_flight if self.mode == "sync" else 2 * in_flight

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class DomainConfig:
    """What training episodes are drawn from (uniformly per field, families optionally
    weighted)."""

    families: tuple[str, ...] = field(
        default=tuple(FAMILIES), metadata={"help": "cluster families (model, profile, layout)"}
    )
    family_weights: tuple[float, ...] = field(
        default=(),
        metadata={"help": "relative draw weight per family (empty: uniform)"},
    )
    scenarios: tuple[str, ...] = field(
        default=("swe", "search", "math-tool", "mixed"), metadata={"help": "workload scenarios"}
    )
    modes: tuple[str, ...] = field(default=("sync", "async"), metadata={"help": "RL modes"})
    loads_per_gpu: tuple[int, ...] = field(
        default=(4, 8, 16, 32, 64), metadata={"help": "trajectories per GPU (sync: per step)"}
    )
    max_slots: int = field(default=32, metadata={"help": "largest slot count (curriculum)"})
    max_trajectories: int = field(
        default=1024, metadata={"help": "largest episode, in trajectories (cost cap)"}
    )
    hide_workload: float = field(
        default=0.2, metadata={"help": "share of episodes that hide the workload's shape"}
    )

    def validate(self) -> None:
        unknown = set(self.families) - set(FAMILIES)
        if unknown:
            raise ConfigError(
                f"unknown cluster families {sorted(unknown)}", hint=f"choose from {list(FAMILIES)}"
            )
        if not (self.families and self.scenarios and self.modes and self.loads_per_gpu):
            raise ConfigError("the training domain needs a family, scenario, mode and load")
        if self.max_slots < 2 or self.max_trajectories < 1:
            raise ConfigError("max_slots must be >= 2 and max_trajectories >= 1")
        if not 0.0 <= self.hide_workload <= 1.0:
            raise ConfigError("hide_workload must be a share in [0, 1]")
        if self.family_weights:
            weights = np.asarray(self.family_weights, dtype=float)
            if len(weights) != len(self.families):
                raise ConfigError(
                    f"{len(weights)} family weights for {len(self.families)} families",
                    hint="give one weight per family, in the same order",
                )
            if not (np.all(np.isfinite(weights)) and np.all(weights >= 0) and weights.sum() > 0):
                raise ConfigError("family weights must be finite, >= 0 and not all zero")

    def sample(self, rng: np.random.Generator) -> EpisodeConfig:
        """Draw one episode (a load too heavy for the cap falls back to a lighter one)."""
        if self.family_weights:
            weights = np.asarray(self.family_weights, dtype=float)
            family_name = self.families[rng.choice(len(self.families), p=weights / weights.sum())]
        else:
            family_name = self.families[rng.integers(len(self.families))]
        family = FAMILIES[family_name]
        sizes = [n for n in family.slots if n <= self.max_slots] or [min(family.slots)]
        num_slots = int(sizes[rng.integers(len(sizes))])
        mode = self.modes[rng.integers(len(self.modes))]
        gpus = num_slots * family.slot_gpus
        per_gpu_cap = self.max_trajectories / (gpus * (2 if mode == "async" else 1))
        loads = [x for x in self.loads_per_gpu if x <= per_gpu_cap] or [min(self.loads_per_gpu)]
        return EpisodeConfig(
            family=family_name,
            num_slots=num_slots,
            scenario=self.scenarios[rng.integers(len(self.scenarios))],
            mode=mode,
            trajectories_per_gpu=int(loads[rng.integers(len(loads))]),
            seed=int(rng.integers(2**31)),
            workload_known=bool(rng.random() >= self.hide_workload),
        )
