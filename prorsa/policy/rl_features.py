"""The learned policy's view of the cluster: scale-free numbers in [0, 1].

Every feature is a fraction of GPUs, a demand divided by the cluster's own capacity, a
share of the live trajectories, or a squashed ratio, so one network serves clusters of
any size, load and cost profile. The training environment and the deployed policy both
call :func:`observation_vector`, so they see exactly the same features.
"""

from __future__ import annotations

import math

import numpy as np

from prorsa.policy.base import ClusterSpec
from prorsa.policy.rl_actions import SwitchGuard
from prorsa.policy.types import SWITCHING, ClusterObservation, WorkloadShape

OBS_FEATURES: tuple[str, ...] = (
    # The cluster (constant over a run).
    "prefill_interference",  # 1 - 1/x: x = what a colocated prefill costs over its own work
    "role_switch_latency",  # colocated -> prefill switch latency s, as s / (s + 10)
    "prefill_decode_speed",  # p / (p + d) of the per-GPU prefill and decode token rates
    "kv_per_gpu",  # KV capacity per GPU in tokens, as x / (x + 1M)
    # The current target (switching slots count toward where they are heading).
    "colocated_share",
    "prefill_share",
    "switching_share",
    # Demand, per GPU and per capacity.
    "prefill_backlog",  # queued prefill tokens / cluster prefill tokens per s, as x / (x + 2)
    "decode_batch_fill",  # decode sequences / (GPUs x 64), as x / (x + 1)
    "decode_kv_use",  # KV used / KV capacity on the decode-side slots
    "idle_context_use",  # contexts cached between turns / all KV capacity
    "context_per_trajectory",  # live context tokens per live trajectory / 32k, as x / (x + 1)
    "live_per_gpu",  # log2(1 + live trajectories per GPU) / 8
    "load_per_gpu",  # log2(1 + trajectories of the run per GPU) / 8
    "queued_share",  # of live trajectories
    "prefilling_share",
    "decoding_share",
    "in_tool_share",
    "progress",  # completed / total trajectories of the run
    # The safety rule.
    "since_change",  # seconds since the last target change / (3 x min hold), clipped
    # The run's expected shape (ClusterObservation.workload; all zero when unknown). The
    # first decision, the free initial layout, is taken before any work arrives: without
    # these a search run and a swe run look identical then.
    "workload_known",  # 1 when the run's shape is known
    "turns_per_trajectory",  # log2(1 + turns) / 7
    "new_per_output",  # a later turn's new tokens per output token, as x / (x + 1)
    "output_per_turn",  # output tokens per turn, as x / (x + 1k)
    "tool_per_call",  # tool seconds per call, as x / (x + 5)
    "prompt_share",  # first prompt / final context
    "final_context",  # final context tokens / 32k, as x / (x + 1)
)

# Decode batch size per GPU treated as "full" (the demand sizing's target batch).
_BATCH_PER_GPU = 64.0
# Context length that counts as "long" for the context feature.
_LONG_CONTEXT_TOKENS = 32_768.0


def _squash(x: float, scale: float) -> float:
    """Map ``[0, inf)`` onto ``[0, 1)``; ``scale`` maps to 0.5."""
    return x / (x + scale) if x > 0 else 0.0


def _log_per_gpu(count: float, gpus: int) -> float:
    return min(math.log2(1.0 + count / max(gpus, 1)) / 8.0, 1.0)


def observation_vector(
    obs: ClusterObservation,
    spec: ClusterSpec,
    *,
    since_change_s: float = 0.0,
    min_hold_s: float = SwitchGuard.min_hold_s,
) -> np.ndarray:
    """Encode ``obs`` as :data:`OBS_FEATURES` (float32, each in [0, 1])."""
    gpus = max(obs.total_gpus, 1)
    roles = [s.target_role if s.role == SWITCHING else s.role for s in obs.slots]
    colocated = sum(s.gpus for s, r in zip(obs.slots, roles, strict=True) if r == "colocated")
    prefill = sum(s.gpus for s, r in zip(obs.slots, roles, strict=True) if r == "prefill")
    switching = sum(s.gpus for s in obs.slots if s.role == SWITCHING)

    prefill_rate = spec.prefill_tokens_per_s_per_gpu
    decode_rate = spec.decode_tokens_per_s_per_gpu
    backlog_s = sum(s.queued_prefill_tokens for s in obs.slots) / max(prefill_rate * gpus, 1.0)
    decode_side = [s for s in obs.slots if s.role in ("decode", "colocated")]
    kv_use = sum(s.kv_used_tokens for s in decode_side) / max(
        sum(s.kv_capacity_tokens for s in decode_side), 1
    )
    kv_total = max(sum(s.kv_capacity_tokens for s in obs.slots), 1)

    states, tokens = obs.trajectory_state, obs.trajectory_tokens
    live_states = ("queued", "prefilling", "transferring", "decoding", "in_tool")
    live = sum(states.get(k, 0) for k in live_states)
    live_tokens = sum(tokens.get(k, 0) for k in live_states)
    decode_sequences = states.get("decoding", 0) + states.get("transferring", 0)
    idle_tokens = tokens.get("in_tool", 0) + tokens.get("queued", 0)
    total = obs.total_trajectories or (live + obs.completed_trajectories)

    def share(state: str) -> float:
        return states.get(state, 0) / live if live else 0.0

    switch_s = spec.switch_latency_between("colocated", "prefill")
    vec = [
        1.0 - 1.0 / max(spec.prefill_interference, 1.0),
        _squash(switch_s, 10.0),
        prefill_rate / max(prefill_rate + decode_rate, 1e-9),
        _squash(kv_total / gpus, 1e6),
        colocated / gpus,
        prefill / gpus,
        switching / gpus,
        _squash(backlog_s, 2.0),
        _squash(decode_sequences / (gpus * _BATCH_PER_GPU), 1.0),
        kv_use,
        idle_tokens / kv_total,
        _squash(live_tokens / live / _LONG_CONTEXT_TOKENS, 1.0) if live else 0.0,
        _log_per_gpu(live, gpus),
        _log_per_gpu(total, gpus),
        share("queued"),
        share("prefilling"),
        share("decoding"),
        share("in_tool"),
        obs.completed_trajectories / total if total else 0.0,
        min(since_change_s / max(3.0 * min_hold_s, 1e-9), 1.0),
        *_shape_features(obs.workload),
    ]
    return np.clip(np.asarray(vec, dtype=np.float32), 0.0, 1.0)


def _shape_features(shape: WorkloadShape | None) -> list[float]:
    if shape is None:
        return [0.0] * 7
    return [
        1.0,
        min(math.log2(1.0 + shape.turns_per_trajectory) / 7.0, 1.0),
        _squash(shape.new_tokens_per_turn / max(shape.output_tokens_per_turn, 1.0), 1.0),
        _squash(shape.output_tokens_per_turn, 1000.0),
        _squash(shape.tool_s_per_call, 5.0),
        shape.prompt_tokens / max(shape.final_context_tokens, 1.0),
        _squash(shape.final_context_tokens / _LONG_CONTEXT_TOKENS, 1.0),
    ]
