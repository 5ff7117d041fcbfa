"""Choosing each role's parallel layout before a run: pure arithmetic over layout options.

The planner reads a table of :class:`LayoutOption` (what each layout of the model offers
each role, per GPU; built by :mod:`prorsa.runtime.cluster.layouts` from the measured
layout costs) and the workload's expected prefill share, and picks:

* **prefill**: the layout with the most prefill tokens/s per GPU;
* **decode**: the layout with the most decode tokens/s per GPU;
* **colocated**: the layout with the least GPU-time per unit of mixed work,
  ``p * colocated_gpu_s_per_prefill_token + (1 - p) / decode_tokens_per_s_per_gpu``
  with ``p`` the prefill share of the tokens computed.

Ties go to the layout of fewer GPUs (finer switching granularity), then to the name.
Layouts are fixed for a run: the policies then move slots between roles, each role
keeping the layout chosen here (mid-run re-layout of a role is not modelled).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from prorsa.errors import ConfigError

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class LayoutOption:
    """One layout of a model and what it offers each role (per GPU, at an operating point)."""

    name: str  # layout name, e.g. "tp1-dp8-ep8"
    gpus: int  # GPUs one engine occupies
    dp_ranks: int  # lock-stepped attention ranks
    prefill_tokens_per_s_per_gpu: float
    decode_tokens_per_s_per_gpu: float
    # GPU-seconds one prefill token costs a colocated engine of this layout (the step
    # grows for every rank while one rank prefills a chunk into its decoding batch).
    colocated_gpu_s_per_prefill_token: float
    kv_tokens_per_gpu: float  # KV capacity of one engine over its GPUs

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class WorkloadShape:
    """Per-trajectory means of a workload (what the planner and operating points need)."""

    prefill_tokens: float  # tokens prefilled when earlier context is cached
    decode_tokens: float
    tool_s: float
    decode_context_tokens: float  # context a decoded token attends to (output-weighted)
    turns: float
    # Split under re-prefill (stock vLLM + NIXL): a prefill engine that still caches the
    # trajectory's earlier prefills computes the previous turn's output (decoded
    # elsewhere) and the new tokens; one that caches nothing computes the whole context.
    reprefill_own_cache_tokens: float = 0.0
    reprefill_no_cache_tokens: float = 0.0

    @property
    def prefill_share(self) -> float:
        """Share of the computed tokens that are prefill."""
        total = self.prefill_tokens + self.decode_tokens
        return self.prefill_tokens / total if total > 0 else 0.0

    @classmethod
    def of(cls, specs: Iterable) -> WorkloadShape:
        """The shape of trajectory specs (``TrajectorySpec``-like objects)."""
        specs = list(specs)
        if not specs:
            raise ConfigError("a workload shape needs at least one trajectory")
        output = np.array([s.total_output_tokens for s in specs], dtype=float)
        weighted = sum(float(np.dot(s.context_by_turn, s.output_tokens)) for s in specs)
        own = [s.total_new_tokens + float(np.sum(s.output_tokens[:-1])) for s in specs]
        return cls(
            prefill_tokens=float(np.mean([s.total_new_tokens for s in specs])),
            decode_tokens=float(output.mean()),
            tool_s=float(np.mean([s.total_tool_s for s in specs])),
            decode_context_tokens=weighted / max(float(output.sum()), 1.0),
            turns=float(np.mean([s.num_turns for s in specs])),
            reprefill_own_cache_tokens=float(np.mean(own)),
            reprefill_no_cache_tokens=float(np.mean([s.context_by_turn.sum() for s in specs])),
        )


@dataclass(frozen=True)
class LayoutPlan:
    """The layout of each role for one run."""

    prefill: str
    decode: str
    colocated: str

    def as_layouts(self) -> dict[str, str]:
        """``ClusterConfig.layouts``."""
        return {"prefill": self.prefill, "decode": self.decode, "colocated": self.colocated}

    def slot_gpus(self, options: Sequence[LayoutOption]) -> int:
        """GPUs of one slot: the largest engine of any role."""
        gpus = {o.name: o.gpus for o in options}
        return max(gpus[name] for name in self.as_layouts().values())


def mixed_gpu_s_per_token(option: LayoutOption, prefill_share: float) -> float:
    """GPU-seconds per token of mixed work on a colocated engine of ``option``."""
    decode_s = 1.0 / max(option.decode_tokens_per_s_per_gpu, 1e-12)
    return prefill_share * option.colocated_gpu_s_per_prefill_token + (1 - prefill_share) * decode_s


def role_score(option: LayoutOption, role: str, prefill_share: float) -> float:
    """Lower is better: the quantity the planner minimises for ``role``."""
    if role == "prefill":
        return -option.prefill_tokens_per_s_per_gpu
    if role == "decode":
        return -option.decode_tokens_per_s_per_gpu
    if role == "colocated":
        return mixed_gpu_s_per_token(option, prefill_share)
    raise ConfigError(f"unknown role '{role}'", hint=f"one of {ROLES}")


def best_for_role(options: Sequence[LayoutOption], role: str, prefill_share: float) -> LayoutOption:
    """The option the planner picks for ``role``."""
    if not options:
        raise ConfigError("the layout planner needs at least one layout option")
    return min(options, key=lambda o: (role_score(o, role, prefill_share), o.gpus, o.name))


def plan_layouts(
    options: Sequence[LayoutOption], prefill_share: float, *, total_gpus: int | None = None
) -> LayoutPlan:
    """Each role's layout from ``options`` for a workload whose computed tokens are
    ``prefill_share`` prefill.

    With ``total_gpus``, only layouts whose engines divide the GPUs and fit at least
    twice are considered, so any plan leaves room for a prefill/decode split.
    """
    if not 0.0 <= prefill_share <= 1.0:
        raise ConfigError(f"prefill_share must be in [0, 1], got {prefill_share}")
    usable = list(options)
    if total_gpus is not None:
        usable = [o for o in usable if total_gpus % o.gpus == 0 and 2 * o.gpus <= total_gpus]
        if not usable:
            raise ConfigError(
                f"no layout fits a split of {total_gpus} GPUs",
                hint="give more GPUs or layouts of fewer GPUs",
            )
    prefill = best_for_role(usable, "prefill", prefill_share)
    decode = best_for_role(usable, "decode", prefill_share)
    colocated = best_for_role(usable, "colocated", prefill_share)
    return LayoutPlan(prefill.name, decode.name, colocated.name)


@dataclass(frozen=True)
class StartPlan:
    """The mode a dynamic policy starts in, before its first forecast."""

    start: str  # "colocated" or "split"
    prefill_fraction: float  # of the GPUs, when split
    colocated_s: float  # relative time of the work, colocated
    split_s: float  # relative time of the work at the best split
    split_prefill_factor: float  # prefill tokens a split computes per colocated one


def split_prefill_factor(shape: WorkloadShape, reuse_mode: str, cache_share: float) -> float:
    """Prefill tokens a split computes for each one colocated engines compute.

    Colocated engines keep a trajectory's context in their prefix cache between turns;
    so do the decode engines of a split, but under ``reprefill`` (stock vLLM + NIXL: KV
    moves prefill -> decode only) a prefill engine reuses only its own prefix cache. A
    ``cache_share`` of the live contexts fits there; the rest is recomputed whole.
    ``pull`` and ``kv-store`` give the prefill engine the earlier context (factor 1).
    """
    if reuse_mode != "reprefill" or shape.prefill_tokens <= 0:
        return 1.0
    share = min(max(cache_share, 0.0), 1.0)
    own = max(shape.reprefill_own_cache_tokens, shape.prefill_tokens)
    none = max(shape.reprefill_no_cache_tokens, own)
    return (share * own + (1 - share) * none) / shape.prefill_tokens


def plan_start(
    plan: LayoutPlan,
    options: Sequence[LayoutOption],
    shape: WorkloadShape,
    *,
    total_gpus: int,
    load_per_gpu: float,
    reuse_mode: str = "reprefill",
) -> StartPlan:
    """Colocated or split from the start, from the same per-GPU numbers as the plan.

    Work per token of the workload, in GPU-seconds: colocated, ``p * c + (1 - p) / d``
    pooled over every GPU; split, prefill ``p * f / prefill_tps`` on a share ``s`` of the
    GPUs and decode ``(1 - p) / decode_tps`` on the rest, which finishes when the busier
    side does: ``max(prefill / s, decode / (1 - s))`` over the shares whole slots allow
    (``f``: :func:`split_prefill_factor`, with the prefill engines' KV as the share of
    live contexts they can cache). The split starts only where it is faster.
    """
    by_name = {o.name: o for o in options}
    p = shape.prefill_share
    colocated = by_name[plan.colocated]
    colocated_s = mixed_gpu_s_per_token(colocated, p)
    prefill, decode = by_name[plan.prefill], by_name[plan.decode]
    slot = max(prefill.gpus, decode.gpus, colocated.gpus)
    slots = total_gpus // slot
    live_tokens = load_per_gpu * total_gpus * max(shape.decode_context_tokens, 1.0)
    best = (float("inf"), 0.5, 1.0)
    for k in range(1, slots):
        share = k / slots
        cache = share * total_gpus * prefill.kv_tokens_per_gpu / live_tokens
        factor = split_prefill_factor(shape, reuse_mode, cache)
        prefill_s = p * factor / max(prefill.prefill_tokens_per_s_per_gpu, 1e-12)
        decode_s = (1 - p) / max(decode.decode_tokens_per_s_per_gpu, 1e-12)
        best = min(best, (max(prefill_s / share, decode_s / (1 - share)), share, factor))
    split_s, share, factor = best
    return StartPlan(
        start="split" if split_s < colocated_s else "colocated",
        prefill_fraction=share,
        colocated_s=colocated_s,
        split_s=split_s,
        split_prefill_factor=factor,
    )
