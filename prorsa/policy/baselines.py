"""Fixed allocations: everything colocated, or a fixed xPyD split."""

from __future__ import annotations

from prorsa.errors import ConfigError
from prorsa.policy.base import POLICIES, ClusterSpec, Policy, SplitPolicy
from prorsa.policy.types import Allocation, ClusterObservation, Forecast


@POLICIES.register("colocate")
class ColocatePolicy(Policy):
    """All GPUs serve prefill and decode together (the baseline every speedup is against)."""

    dynamic = False

    def decide(self, obs: ClusterObservation, forecast: Forecast | None) -> Allocation:
        return Allocation(gpus={"colocated": obs.total_gpus}, reason="colocate")


@POLICIES.register("static")
class StaticPolicy(SplitPolicy):
    """A fixed disaggregated split: ``prefill_fraction`` of the GPUs prefill, the rest decode.

    Args:
        prefill_fraction: share of GPUs serving prefill, rounded to whole slots, keeping at
            least one slot on each side.
        prefill_gpus: exact prefill GPU count instead of a fraction.
    """

    dynamic = False

    @classmethod
    def search_space(cls, trial) -> dict:
        return {"prefill_fraction": trial.suggest_float("prefill_fraction", 0.05, 0.75)}

    def __init__(self, prefill_fraction: float = 0.25, prefill_gpus: int | None = None) -> None:
        self.prefill_fraction = prefill_fraction
        self.prefill_gpus = prefill_gpus

    def reset(self, cluster: ClusterSpec, seed: int = 0) -> None:
        super().reset(cluster, seed)
        size, total = cluster.slot_gpus, cluster.total_gpus
        if self.prefill_gpus is None:
            self.prefill_slots_ = self.initial_prefill_slots()
        elif self.prefill_gpus % size or not 0 < self.prefill_gpus < total:
            raise ConfigError(f"static: prefill_gpus must be a multiple of {size} in (0, {total})")
        else:
            self.prefill_slots_ = self.prefill_gpus // size

    def decide(self, obs: ClusterObservation, forecast: Forecast | None) -> Allocation:
        alloc = self.split(self.prefill_slots_, "")
        return Allocation(
            gpus=alloc.gpus, reason=f"static {alloc.gpus['prefill']}P{alloc.gpus['decode']}D"
        )
