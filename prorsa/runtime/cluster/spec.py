"""Cost profiles of a cluster configuration and the static :class:`ClusterSpec` policies see.

Both runtimes build the policy's view of the cluster here: the simulator from the profile
it simulates, the Ray runtime from the profile that describes its engines.
"""

from __future__ import annotations

import re

from prorsa.errors import ConfigError
from prorsa.policy.base import ClusterSpec
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.cluster.layouts import (
    THROUGHPUT_CHUNK_TOKENS,
    THROUGHPUT_CONTEXT_TOKENS,
    OperatingPoint,
    colocated_gpu_s_per_prefill_token,
    colocated_packed_prefill_tokens_per_s_per_gpu,
    decode_batch,
    decode_tokens_per_s_per_gpu,
    typical_decode,
)


def profile_name_for_tp(name: str, tp: int) -> str:
    """``h200-qwen2.5-7b-tp1`` -> ``h200-qwen2.5-7b-tp2`` (other suffixes kept)."""
    if not re.search(r"-tp\d+", name):
        if tp != 1:
            raise ConfigError(f"profile '{name}' has no -tpN in its name; cannot derive TP{tp}")
        return name
    return re.sub(r"-tp\d+", f"-tp{tp}", name, count=1)


def load_profiles(config: ClusterConfig) -> dict:
    """Cost model per engine kind: a ``CostProfile`` per tensor-parallel degree used by any
    role, or (with ``config.layouts``) a ``LayoutCost`` per role layout name."""
    from prorsa.runtime.sim.cost import get_profile

    if config.layouts:
        from prorsa.runtime.sim.cost.layout_registry import get_layout_cost

        return {
            name: get_layout_cost(
                f"{config.model_prefix}-{name}",
                semantics=config.dp_semantics,
                routing=config.moe_routing,
            )
            for name in set(config.role_layouts.values())
        }
    return {tp: get_profile(_profile_at_tp(config, tp)) for tp in set(config.role_tp.values())}


def _profile_at_tp(config: ClusterConfig, tp: int) -> str:
    """The registered profile for ``tp``, or an error that says where each role's TP comes
    from: ``--profile h100-qwen2.5-32b-tp8-roofline`` alone still asks for TP1 (the
    default ``role_tp``), which that model has no profile for."""
    from prorsa.runtime.sim.cost import list_profiles

    name = profile_name_for_tp(config.profile, tp)
    known = list_profiles()
    if config.profile not in known:
        return config.profile  # the registry's error names the profile as given
    if name in known:
        return name
    prefix, named, suffix = re.split(r"-tp(\d+)", config.profile, maxsplit=1)
    pattern = re.escape(prefix) + r"-tp(\d+)" + re.escape(suffix)
    have = sorted(int(m.group(1)) for p in known if (m := re.fullmatch(pattern, p)))
    roles = ", ".join(f"{role}={n}" for role, n in config.role_tp.items())
    raise ConfigError(
        f"no TP{tp} profile for '{config.profile}' ('{name}' is not registered); each "
        f"role's tensor-parallel degree comes from role_tp ({roles}), not from the "
        "profile's name",
        hint=(
            f"this model has TP {', '.join(map(str, have))}; e.g. "
            + " ".join(f"--role-tp {role}={named}" for role in config.role_tp)
            if have
            else "see `prorsa profile list`"
        ),
    )


def cluster_spec(config: ClusterConfig, profiles: dict, min_dwell_s: float) -> ClusterSpec:
    """Static facts a policy may use, with throughput numbers from the cost profiles."""
    if config.layouts:
        return _layout_spec(config, profiles, min_dwell_s)
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
        decode_tokens_per_s_by_load=decode_by_load(
            d_tp,
            config.max_batch or decode_profile.max_batch,
            config.kv_capacity_tokens or decode_profile.kv_capacity_tokens,
            lambda b, ctx: b / float(decode_profile.decode_step_time_s(b, b * ctx)) / d_tp,
        ),
        switch_latency_s=config.switch_latency_s,
        min_dwell_s=min_dwell_s,
        dp_attention_ranks=config.dp_attention_ranks,
        reshard_latency_s=config.reshard_latency_s,
        reuse_mode=config.reuse_mode,
        switch_mode=config.switch_mode,
        drain_timeout_s=config.drain_timeout_s,
    )


def _layout_spec(config: ClusterConfig, costs: dict, min_dwell_s: float) -> ClusterSpec:
    """The spec of a cluster of layout engines: per-role throughput from the layout costs,
    and what a colocated prefill costs the colocated layout's stalled ranks."""
    layouts = config.role_layouts
    prefill, decode, colocated = (costs[layouts[r]] for r in ("prefill", "decode", "colocated"))
    chunk = THROUGHPUT_CHUNK_TOKENS
    prefill_tps = prefill.prefill_tokens_per_s_per_gpu(min(chunk, prefill.max_step_tokens))
    point = equal_load_point(decode, colocated)
    decode_tps = decode_tokens_per_s_per_gpu(decode, point)
    colocated_tps = decode_tokens_per_s_per_gpu(colocated, point)
    return ClusterSpec(
        num_slots=config.num_slots,
        slot_gpus=config.slot_gpus,
        role_tp=dict(config.role_tp),
        prefill_tokens_per_s_per_gpu=prefill_tps,
        decode_tokens_per_s_per_gpu=decode_tps,
        switch_latency_s=config.switch_latency_s,
        min_dwell_s=min_dwell_s,
        dp_attention_ranks=colocated.dp_ranks,
        reshard_latency_s=config.reshard_latency_s,
        reuse_mode=config.reuse_mode,
        switch_mode=config.switch_mode,
        drain_timeout_s=config.drain_timeout_s,
        role_layouts=dict(layouts),
        colocated_prefill_factor=_prefill_interference(colocated, prefill_tps, point),
        colocated_packed_prefill_factor=_prefill_interference(
            colocated, prefill_tps, point, colocated.dp_ranks
        ),
        colocated_packed_prefill_ratio=(
            colocated_packed_prefill_tokens_per_s_per_gpu(colocated, point) / prefill_tps
        ),
        colocated_decode_tokens_per_s_per_gpu=colocated_tps,
        colocated_decode_ratio_by_load=_decode_ratio_by_load(decode, colocated),
        decode_tokens_per_s_by_load=decode_by_load(
            decode.tp,
            decode.max_batch,
            # per rank; the layout's step model prices no more than its own capacity
            min(config.kv_capacity_tokens or decode.kv_capacity_tokens, decode.kv_capacity_tokens),
            decode.decode_tokens_per_s_per_gpu,
        ),
        # As the simulator's engines hold it (topology: per-rank KV times the ranks).
        colocated_kv_tokens_per_engine=float(
            (config.kv_capacity_tokens or colocated.kv_capacity_tokens) * colocated.dp_ranks
        ),
        colocated_engines=config.num_slots * (config.slot_gpus // colocated.gpus),
        colocated_step_tokens_per_rank=int(colocated.max_step_tokens),
    )


#: Decode sequences per GPU and contexts at which the colocated and decode layouts are
#: compared.
RATIO_LOADS_PER_GPU = (1, 2, 4, 8, 16, 32, 64, 128)
RATIO_CONTEXT_TOKENS = (2048, 8192, 32768)


#: Decode sequences per GPU at which the decode role's throughput is quoted for policies
#: (past the engines' batch limit, so the quotes show where extra sequences only wait).
DECODE_LOADS_PER_GPU = (*RATIO_LOADS_PER_GPU, 256, 512)


def decode_by_load(
    tp: int, max_batch: int, kv_tokens: int, tokens_per_s_per_gpu
) -> tuple[tuple[float, float, float], ...]:
    """(sequences per GPU, context, decode tokens/s per GPU) over the policies' grid for an
    engine (or rank) of ``tp`` GPUs holding at most ``max_batch`` sequences and
    ``kv_tokens`` KV tokens, as the simulator's engines are limited (overrides of the
    cluster configuration included); ``tokens_per_s_per_gpu(batch, context)`` prices a
    step. Sequences past the limits wait: throughput stays at the limit's."""
    table = []
    for context in RATIO_CONTEXT_TOKENS:
        for per_gpu in DECODE_LOADS_PER_GPU:
            batch, ctx = decode_batch(tp, max_batch, kv_tokens, per_gpu, context)
            table.append((float(per_gpu), float(context), tokens_per_s_per_gpu(batch, ctx)))
    return tuple(table)


def _decode_ratio_by_load(decode, colocated) -> tuple[tuple[float, float, float], ...]:
    """(sequences per GPU, context, colocated over decode tokens/s per GPU) at equal
    loads: each layout batches what that load puts on its ranks, up to its batch and KV
    limits."""
    table = []
    for context in RATIO_CONTEXT_TOKENS:
        for per_gpu in RATIO_LOADS_PER_GPU:
            point = OperatingPoint(batch_per_gpu=per_gpu, context_tokens=context)
            ratio = decode_tokens_per_s_per_gpu(colocated, point) / decode_tokens_per_s_per_gpu(
                decode, point
            )
            table.append((float(per_gpu), float(context), ratio))
    return tuple(table)


def equal_load_point(decode, colocated) -> OperatingPoint:
    """The decode load at which the decode and colocated layouts are compared: the same
    sequences per GPU for both, the lighter of their quotes (ranks half full).

    Each layout's own quote would compare unequal loads: half a TP8 rank is 16 sequences
    per GPU, half of eight DP ranks 128, and a TP8 colocated engine would look 6.5x
    slower per GPU than a DP8 decode engine (Qwen3-235B-A22B) when it carries an eighth
    of the sequences; the policies' colocation-versus-split test then leaves colocation
    where the simulated runs show it is the faster layout.
    """
    per_gpu = min(typical_decode(cost)[0] / cost.tp for cost in (decode, colocated))
    return OperatingPoint(batch_per_gpu=per_gpu, context_tokens=THROUGHPUT_CONTEXT_TOKENS)


def _prefill_interference(
    colocated, prefill_tps_per_gpu: float, point: OperatingPoint, prefilling_ranks: int = 1
) -> float:
    """GPU-seconds of colocated capacity one prefill token costs (the step grows for
    every rank while ``prefilling_ranks`` prefill a chunk into their decoding batches),
    over what it costs a prefill engine's GPU."""
    per_token = colocated_gpu_s_per_prefill_token(colocated, point, prefilling_ranks)
    return per_token * prefill_tps_per_gpu
