"""Fixed allocations: everything colocated, or a fixed xPyD split."""

from __future__ import annotations

from prorsa.errors import ConfigError
from prorsa.policy.base import POLICIES, ClusterSpec, Policy
from prorsa.policy.types import Allocation, ClusterObservation, Forecast


@POLICIES.register("colocate")
class ColocatePolicy(Policy):
    """All GPUs serve prefill and decode together (the baseline every speedup is against)."""

    dynamic = False

    def decide(self, obs: ClusterObservation, forecast: Forecast | None) -> Allocation:
        return Allocation(gpus={"colocated": obs.total_gpus}, reason="colocate")


@POLICIES.register("static")
class StaticPolicy(Policy):
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
        if not 0 < self.prefill_fraction < 1:
            raise ConfigError("static: prefill_fraction must be in (0, 1)")
        slots, size = cluster.num_slots, cluster.slot_gpus
        if slots < 2:
            raise ConfigError("static: a disaggregated split needs at least two slots")
        if self.prefill_gpus is not None:
            if self.prefill_gpus % size or not 0 < self.prefill_gpus < cluster.total_gpus:
                total = cluster.total_gpus
                raise ConfigError(
                    f"static: prefill_gpus must be a multiple of {size} in (0, {total})"
                )
            prefill_slots = self.prefill_gpus // size
        else:
            prefill_slots = min(max(round(self.prefill_fraction * slots), 1), slots - 1)
        self.split_ = {"prefill": prefill_slots * size, "decode": (slots - prefill_slots) * size}

    def decide(self, obs: ClusterObservation, forecast: Forecast | None) -> Allocation:
        split = self.split_
        return Allocation(gpus=dict(split), reason=f"static {split['prefill']}P{split['decode']}D")
