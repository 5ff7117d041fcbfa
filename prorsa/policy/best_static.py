"""The strongest fixed baseline: the static split that a search found best."""

from __future__ import annotations

from collections.abc import Callable

from prorsa.errors import ConfigError
from prorsa.policy.base import POLICIES, ClusterSpec
from prorsa.policy.baselines import StaticPolicy


@POLICIES.register("best-static")
class BestStaticPolicy(StaticPolicy):
    """A static xPyD split chosen by :func:`search_best_static` for the workload at hand.

    ``prorsa compare`` runs the search (on the same workload, on a seed of its own outside
    the scored ones) and passes the winning ``prefill_gpus``.
    """

    def __init__(self, prefill_gpus: int | None = None, prefill_fraction: float = 0.25) -> None:
        super().__init__(prefill_fraction=prefill_fraction, prefill_gpus=prefill_gpus)

    def reset(self, cluster: ClusterSpec, seed: int = 0) -> None:
        if self.prefill_gpus is None:
            raise ConfigError(
                "best-static needs prefill_gpus from a search",
                hint="use `prorsa compare` (it searches the split) or pass --param prefill_gpus=N",
            )
        super().reset(cluster, seed)


def search_best_static(
    evaluate: Callable[[int], float], num_slots: int, *, exhaustive_up_to: int = 12
) -> tuple[int, dict[int, float]]:
    """Prefill slot count in ``1..num_slots-1`` minimising ``evaluate`` (e.g. makespan).

    Exhaustive for small clusters; otherwise a coarse grid, then every count between the
    best grid point's neighbours (the makespan curve is not guaranteed unimodal, so a pure
    ternary search could stop in a local dip). Returns the best count and all evaluations.
    """
    if num_slots < 2:
        raise ConfigError("best-static needs at least two slots")
    seen: dict[int, float] = {}

    def value(x: int) -> float:
        if x not in seen:
            seen[x] = evaluate(x)
        return seen[x]

    candidates = list(range(1, num_slots))
    if len(candidates) <= exhaustive_up_to:
        for x in candidates:
            value(x)
    else:
        stride = max(len(candidates) // 8, 1)
        grid = sorted(set(candidates[::stride]) | {1, num_slots - 1})
        for x in grid:
            value(x)
        best = min(grid, key=value)
        i = grid.index(best)
        low = grid[max(i - 1, 0)]
        high = grid[min(i + 1, len(grid) - 1)]
        for x in range(low, high + 1):
            value(x)
    best = min(seen, key=lambda x: (seen[x], x))
    return best, dict(sorted(seen.items()))
