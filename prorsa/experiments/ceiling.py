"""The most any allocation could gain in a regime: a lower bound on its objective.

No layout, split or policy finishes a regime faster than its trajectories allow with GPUs
as fast as the model family's fastest engine gets:

* a trajectory's **critical path** is its tool time plus its own work at the best
  single-sequence speed of any layout of the family: every appended token prefilled at the
  fastest one-rank prefill rate (``prefill_tokens_per_s_per_gpu x tp`` at its best
  chunk size, over no earlier context), every output token decoded in the fastest
  single-sequence step at the context its turn starts from (rounded down to a power of
  two: no real step is shorter). Prefix caching is assumed perfect, and
  transfers, queueing, re-prefills and scheduling are free;
* **sync** (objective: the step's makespan): at least the longest critical path of the
  step, and at least its GPU work (below) over the cluster's GPUs (summed over steps);
* **async** (objective: seconds per completed trajectory, ``end_s / completed``): the run
  lasts at least the longest critical path, at least the critical paths' sum over the
  in-flight limit (each of the ``C`` places runs its trajectories one after another), and
  at least the run's GPU work over the cluster's GPUs, each token priced at the family's
  best per-GPU rate (decode at the batch that maximises it among those the KV cache
  holds, at the turn's starting context).

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


#: Decode contexts (tokens) the floors are evaluated at; a token decoded at context ``c``
#: is priced at the largest of these <= ``c`` (decode only slows as context grows).
CONTEXTS: tuple[int, ...] = tuple(2**k for k in range(18))  # 1 .. 131,072


@dataclass(frozen=True)
class Floors:
    """The fastest rates any layout of a family reaches (bounds, not operating points).

    The decode rates are per context of :data:`CONTEXTS`.
    """

    decode_step_s: tuple[float, ...]  # one sequence: the shortest decode step
    decode_tokens_per_s_per_gpu: tuple[float, ...]  # at the batch that maximises it
    prefill_tokens_per_s: float  # one rank, its best chunk size, no earlier context
    prefill_tokens_per_s_per_gpu: float

    def as_dict(self) -> dict:
        return {**asdict(self), "contexts": list(CONTEXTS)}


def layout_floors(costs: Iterable) -> Floors:
    """:class:`Floors` over layout costs (``LayoutCost`` objects of one model)."""
    steps = np.full(len(CONTEXTS), np.inf)
    decode_gpu = np.zeros(len(CONTEXTS))
    prefill, prefill_gpu = 0.0, 0.0
    for cost in costs:
        ranks = cost.dp_ranks
        idle = [0] * (ranks - 1)
        for i, context in enumerate(CONTEXTS):
            if context > cost.kv_capacity_tokens:
                continue  # one rank cannot hold the sequence
            steps[i] = min(steps[i], cost.decode_step_s([1, *idle], [context, *idle]))
            fits = min(cost.max_batch, cost.kv_capacity_tokens // context)
            for batch in {*(2**k for k in range(fits.bit_length())), fits}:
                rate = cost.decode_tokens_per_s_per_gpu(batch, context)
                decode_gpu[i] = max(decode_gpu[i], rate)
        # Attention makes long chunks cost more per token: the best chunk size, not the largest.
        per_gpu = max(cost.prefill_tokens_per_s_per_gpu(c) for c in _chunks(cost.max_step_tokens))
        prefill_gpu = max(prefill_gpu, per_gpu)
        prefill = max(prefill, per_gpu * cost.gpus / ranks)
    # Contexts no layout holds: priced as the longest one some layout does (still a bound).
    held = np.flatnonzero(np.isfinite(steps))
    steps[held[-1] + 1 :] = steps[held[-1]]
    decode_gpu[held[-1] + 1 :] = decode_gpu[held[-1]]
    return Floors(tuple(steps.tolist()), tuple(decode_gpu.tolist()), prefill, prefill_gpu)


def _decode_contexts(spec: TrajectorySpec) -> np.ndarray:
    """Context each turn's decode starts from: everything appended and decoded before."""
    new = np.cumsum(np.asarray(spec.new_tokens, float))
    out = np.asarray(spec.output_tokens, float)
    return new + np.concatenate([[0.0], np.cumsum(out)[:-1]])


def _bucket(contexts: np.ndarray) -> np.ndarray:
    return np.clip(np.searchsorted(CONTEXTS, contexts, side="right") - 1, 0, len(CONTEXTS) - 1)


def critical_paths_s(specs: Sequence[TrajectorySpec], floors: Floors) -> np.ndarray:
    """Each trajectory's critical path (seconds), see the module doc."""
    step = np.asarray(floors.decode_step_s)
    return np.array(
        [
            float(np.sum(s.tool_latency_s))
            + _computed_tokens(s) / floors.prefill_tokens_per_s
            + float(np.asarray(s.output_tokens) @ step[_bucket(_decode_contexts(s))])
            for s in specs
        ]
    )


def _computed_tokens(spec: TrajectorySpec) -> float:
    """Tokens a trajectory must prefill at least: what its turns append, less the prompt
    prefix its GRPO group shares (another member may have cached it)."""
    return max(float(np.sum(spec.new_tokens)) - spec.shared_prompt_tokens, 0.0)


def gpu_work_s(specs: Sequence[TrajectorySpec], floors: Floors) -> float:
    """GPU-seconds the trajectories need at the family's best per-GPU rates."""
    rate = np.asarray(floors.decode_tokens_per_s_per_gpu)
    prefill = sum(_computed_tokens(s) for s in specs) / floors.prefill_tokens_per_s_per_gpu
    decode = sum(
        float(np.asarray(s.output_tokens) @ (1.0 / rate[_bucket(_decode_contexts(s))]))
        for s in specs
    )
    return prefill + decode


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
        # per step: (longest critical path, GPU work over the GPUs); a step lasts the longer
        limits = [
            (float(critical_paths_s(step, floors).max()), gpu_work_s(step, floors) / max(gpus, 1))
            for step in steps
            if len(step)
        ]
        paths = sum(path for path, _ in limits)
        work = sum(w for _, w in limits)
        bound = sum(max(path, w) for path, w in limits)
        parts = {"critical_path_s": paths, "gpu_work_s": work}
        binding = "critical_path" if paths >= work else "gpu_work"
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
