"""The most any allocation could gain in a regime: a lower bound on its objective.

No layout, split or policy finishes a regime faster than its trajectories allow with GPUs
as fast as the model family's fastest engine gets:

* a trajectory's **critical path** is its tool time plus its own work at the best
  single-sequence speed of any layout of the family: every appended token prefilled at the
  fastest one-rank prefill rate (``prefill_tokens_per_s_per_gpu x tp`` at its best
  chunk size, over no earlier context), every output token decoded in the fastest single-sequence step (one sequence of
  one token of context: no real step is shorter). Prefix caching is assumed perfect, and
  transfers, queueing, re-prefills and scheduling are free;
* **sync** (objective: the step's makespan): at least the longest critical path of the
  step (summed over steps);
* **async** (objective: seconds per completed trajectory, ``end_s / completed``): the run
  lasts at least the longest critical path, at least the critical paths' sum over the
  in-flight limit (each of the ``C`` places runs its trajectories one after another), and
  at least the run's GPU work over the cluster's GPUs, each token priced at the family's
  best per-GPU rate (decode at any batch with one token of context).

``ceiling = colocation@best objective / bound`` is then the largest speedup over
colocation that any allocation could reach. Where it is below a goal, the goal is out of
reach for the physics simulated, whatever the policy; the report says which bound binds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from prorsa.workload.spec import TrajectorySpec


def _chunks(max_tokens: int) -> list[int]:
    """Prefill chunk sizes to try: powers of two up to the step budget, and the budget."""
    sizes, size = [], 64
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return [*sizes, max_tokens]


@dataclass(frozen=True)
class Floors:
    """The fastest rates any layout of a family reaches (bounds, not operating points)."""

    decode_step_s: float  # one sequence, one token of context: the shortest decode step
    prefill_tokens_per_s: float  # one rank prefilling its largest chunk
    prefill_tokens_per_s_per_gpu: float
    decode_tokens_per_s_per_gpu: float  # at the batch that maximises it, context 1

    def as_dict(self) -> dict:
        return asdict(self)


def layout_floors(costs: Iterable) -> Floors:
    """:class:`Floors` over layout costs (``LayoutCost`` objects of one model)."""
    step, prefill, prefill_gpu, decode_gpu = np.inf, 0.0, 0.0, 0.0
    for cost in costs:
        ranks = cost.dp_ranks
        one = [1] + [0] * (ranks - 1)
        step = min(step, cost.decode_step_s(one, one))
        # Attention makes long chunks cost more per token: the best chunk size, not the largest.
        per_gpu = max(cost.prefill_tokens_per_s_per_gpu(c) for c in _chunks(cost.max_step_tokens))
        prefill_gpu = max(prefill_gpu, per_gpu)
        prefill = max(prefill, per_gpu * cost.gpus / ranks)
        batch = 1
        while batch <= cost.max_batch:
            decode_gpu = max(decode_gpu, cost.decode_tokens_per_s_per_gpu(batch, 1))
            batch *= 2
    return Floors(step, prefill, prefill_gpu, decode_gpu)


def critical_paths_s(specs: Sequence[TrajectorySpec], floors: Floors) -> np.ndarray:
    """Each trajectory's critical path (seconds), see the module doc."""
    return np.array(
        [
            float(np.sum(s.tool_latency_s))
            + _computed_tokens(s) / floors.prefill_tokens_per_s
            + float(np.sum(s.output_tokens)) * floors.decode_step_s
            for s in specs
        ]
    )


def _computed_tokens(spec: TrajectorySpec) -> float:
    """Tokens a trajectory must prefill at least: what its turns append, less the prompt
    prefix its GRPO group shares (another member may have cached it)."""
    return max(float(np.sum(spec.new_tokens)) - spec.shared_prompt_tokens, 0.0)


def gpu_work_s(specs: Sequence[TrajectorySpec], floors: Floors) -> float:
    """GPU-seconds the trajectories need at the family's best per-GPU rates."""
    new = sum(_computed_tokens(s) for s in specs)
    out = sum(int(np.sum(s.output_tokens)) for s in specs)
    return new / floors.prefill_tokens_per_s_per_gpu + out / floors.decode_tokens_per_s_per_gpu


def regime_ceiling(
    mode: str,
    steps: Sequence[Sequence[TrajectorySpec]],
    floors: Floors,
    *,
    in_flight: int,
    gpus: int,
    colocate_objective: float,
) -> dict:
    """The bound on a regime's objective and the ceiling on any speedup over colocation.

    ``steps``: the sync steps' trajectories (async: one sequence, every trajectory).
    """
    if mode == "sync":
        bound = sum(float(critical_paths_s(step, floors).max()) for step in steps if len(step))
        parts = {"critical_path_s": bound}
        binding = "critical_path"
    else:
        specs = [s for step in steps for s in step]
        paths = critical_paths_s(specs, floors)
        run_s = {
            "critical_path": float(paths.max()),
            "in_flight": float(paths.sum()) / max(in_flight, 1),
            "gpu_work": gpu_work_s(specs, floors) / max(gpus, 1),
        }
        binding = max(run_s, key=run_s.get)
        bound = run_s[binding] / max(len(specs), 1)
        parts = {f"{k}_s": v for k, v in run_s.items()}
    return {
        "bound": bound,
        "binding": binding,
        "parts": parts,
        "ceiling": colocate_objective / bound if bound > 0 else float("inf"),
        "floors": floors.as_dict(),
    }
