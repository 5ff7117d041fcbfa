"""Cost profiles of a cluster configuration and the static :class:`ClusterSpec` policies see.

Both runtimes build the policy's view of the cluster here: the simulator from the profile
it simulates, the Ray runtime from the profile that describes its engines.
"""

from __future__ import annotations

import re

from prorsa.errors import ConfigError
from prorsa.policy.base import ClusterSpec
from prorsa.runtime.cluster.config import ClusterConfig

#: Prefill chunk and context at which a profile's prefill throughput is quoted.
THROUGHPUT_CHUNK_TOKENS = 2048
THROUGHPUT_CONTEXT_TOKENS = 8192


def profile_name_for_tp(name: str, tp: int) -> str:
    """``h200-qwen2.5-7b-tp1`` -> ``h200-qwen2.5-7b-tp2`` (other suffixes kept)."""
    if not re.search(r"-tp\d+", name):
        if tp != 1:
            raise ConfigError(f"profile '{name}' has no -tpN in its name; cannot derive TP{tp}")
        return name
    return re.sub(r"-tp\d+", f"-tp{tp}", name, count=1)


def load_profiles(config: ClusterConfig) -> dict[int, object]:
    """Cost profile per tensor-parallel degree used by any role."""
    from prorsa.runtime.sim.cost import get_profile

    return {
        tp: get_profile(profile_name_for_tp(config.profile, tp))
        for tp in set(config.role_tp.values())
    }


def cluster_spec(
    config: ClusterConfig, profiles: dict[int, object], min_dwell_s: float
) -> ClusterSpec:
    """Static facts a policy may use, with throughput numbers from the cost profiles."""
    p_tp, d_tp = config.role_tp["prefill"], config.role_tp["decode"]
    prefill_profile, decode_profile = profiles[p_tp], profiles[d_tp]
    chunk = THROUGHPUT_CHUNK_TOKENS
    prefill_s = float(prefill_profile.prefill_time_s(chunk, THROUGHPUT_CONTEXT_TOKENS))
    batch = max(decode_profile.max_batch // 2, 1)
    decode_s = float(decode_profile.decode_step_time_s(batch, batch * THROUGHPUT_CONTEXT_TOKENS))
    return ClusterSpec(
        num_slots=config.num_slots,
        slot_gpus=config.slot_gpus,
        role_tp=dict(config.role_tp),
        prefill_tokens_per_s_per_gpu=chunk / prefill_s / p_tp,
        decode_tokens_per_s_per_gpu=batch / decode_s / d_tp,
        switch_latency_s=config.switch_latency_s,
        min_dwell_s=min_dwell_s,
        dp_attention_ranks=config.dp_attention_ranks,
        reshard_latency_s=config.reshard_latency_s,
    )
