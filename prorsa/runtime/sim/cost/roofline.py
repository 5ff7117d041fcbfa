"""Roofline cost profiles from model architecture and GPU spec sheets.

Each kernel takes the longer of its compute time and its memory time, with efficiency
factors that say how close real kernels get to the datasheet:

* ``GEMM_MFU = 0.7``: large bf16 GEMMs. The measured H200 vLLM 0.19 tables reach
  0.70-0.75 of 989 TFLOP/s on 2k-8k-token projections (0.5 is the usual end-to-end MFU,
  which also counts non-GEMM time that this model books separately).
* ``ATTN_PREFILL_EFF = 0.5``: causal FlashAttention prefill (2/3 on Hopper reaches
  40-60 % of peak at head_dim 128).
* ``HBM_EFF = 0.8``: streaming weights and KV; the H200 tables' batch-1 GEMMs read
  weights at 3.5-4.0 TB/s of 4.8.
* ``NVLINK_EFF = 0.8`` of one NVLink direction for ring all-reduce, plus
  ``ALLREDUCE_LATENCY_S = 10 us`` per call; two all-reduces per layer under TP.
* ``ATTN_KERNEL_MIN_S = 10 us`` per layer: the smallest attention kernel in the tables.

The exact roofline (with its ``max`` terms and, for MoE, the number of distinct experts a
batch touches) is then sampled and fitted to the profile's linear forms like any other
reference; the fit error is in the provenance. The decode floor is the time to read the
weights a batch of one touches.
"""

from __future__ import annotations

from prorsa.errors import ConfigError
from prorsa.runtime.sim.cost.fit import (
    PREFILL_TOKENS_GRID,
    decode_grid,
    fit_decode,
    fit_prefill,
)
from prorsa.runtime.sim.cost.hardware import HardwareSpec, get_hardware
from prorsa.runtime.sim.cost.models import BYTES_BF16, ModelArch, get_model
from prorsa.runtime.sim.cost.profile import CostProfile

GEMM_MFU = 0.7
ATTN_PREFILL_EFF = 0.5
HBM_EFF = 0.8
NVLINK_EFF = 0.8
ALLREDUCE_LATENCY_S = 10e-6
ATTN_KERNEL_MIN_S = 10e-6
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of HBM it may use
RUNTIME_RESERVE_BYTES = 2**30  # CUDA graphs, NCCL buffers, allocator slack
MIN_KV_TOKENS = 32768  # an engine that cannot hold one 32k-token context does not "fit"
TP_DEGREES = (1, 2, 4, 8)

EFFICIENCY = {
    "gemm_mfu": GEMM_MFU,
    "attention_prefill_efficiency": ATTN_PREFILL_EFF,
    "hbm_efficiency": HBM_EFF,
    "nvlink_efficiency": NVLINK_EFF,
    "allreduce_latency_s": ALLREDUCE_LATENCY_S,
    "attention_kernel_min_s_per_layer": ATTN_KERNEL_MIN_S,
    "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
    "runtime_reserve_bytes": RUNTIME_RESERVE_BYTES,
}


# ---- memory -------------------------------------------------------------------------
def activation_reserve_bytes(
    model: ModelArch, tp: int, max_step_tokens: int, max_batch: int
) -> int:
    """Peak activation memory vLLM's profiling run sees, plus a fixed runtime reserve.

    Per step token: residual stream, norms and QKV (about 8 hidden-sized bf16 tensors)
    and the MLP's gate/up/act (3 intermediate-sized ones on this rank); plus fp32 logits
    for ``max_batch`` sampled sequences.
    """
    inter = (model.intermediate_size or model.moe_intermediate_size * model.experts_per_token) // tp
    per_token = BYTES_BF16 * (8 * model.hidden_size + 3 * inter)
    logits = 4 * max_batch * -(-model.vocab_size // tp)
    return RUNTIME_RESERVE_BYTES + max_step_tokens * per_token + logits


def kv_capacity_tokens(
    model: ModelArch, hw: HardwareSpec, tp: int, max_step_tokens: int = 8192, max_batch: int = 256
) -> int:
    """KV tokens one engine holds: (HBM*0.9 - weights/tp - activations) / KV bytes per token.

    Can be <= 0 when the model does not fit.
    """
    free = (
        hw.hbm_bytes * GPU_MEMORY_UTILIZATION
        - model.weight_bytes_per_gpu(tp)
        - activation_reserve_bytes(model, tp, max_step_tokens, max_batch)
    )
    return int(free // model.kv_bytes_per_token(tp))


def fits(
    model: ModelArch, hw: HardwareSpec, tp: int, max_step_tokens: int = 8192, max_batch: int = 256
) -> bool:
    """TP degree valid for the model and room left for at least ``MIN_KV_TOKENS``."""
    return model.supports_tp(tp) and (
        kv_capacity_tokens(model, hw, tp, max_step_tokens, max_batch) >= MIN_KV_TOKENS
    )


# ---- time terms ---------------------------------------------------------------------
def allreduce_time_s(payload_bytes: float, tp: int, hw: HardwareSpec) -> float:
    """One ring all-reduce of ``payload_bytes`` across ``tp`` GPUs over NVLink."""
    if tp <= 1:
        return 0.0
    wire = 2 * (tp - 1) / tp * payload_bytes
    return ALLREDUCE_LATENCY_S + wire / (NVLINK_EFF * hw.nvlink_unidirectional_bytes_per_s)


def tp_allreduce_time_s(model: ModelArch, tokens: float, tp: int, hw: HardwareSpec) -> float:
    """The two all-reduces per layer (after attention and after the MLP) under TP."""
    payload = tokens * model.hidden_size * BYTES_BF16
    return 2 * model.num_layers * allreduce_time_s(payload, tp, hw)


def expected_experts(model: ModelArch, tokens: float) -> float:
    """Distinct experts a step of ``tokens`` tokens touches per layer (uniform routing)."""
    if not model.is_moe:
        return 0.0
    miss = (1 - model.experts_per_token / model.num_experts) ** tokens
    return model.num_experts * (1 - miss)


def layer_weight_bytes_read(model: ModelArch, tp: int, tokens: float) -> float:
    """Layer weights one step reads on one rank (all layers, bf16)."""
    dense = (
        model.attention_params_per_layer(tp)
        + model.dense_mlp_params_per_layer(tp)
        + (model.num_experts * model.hidden_size if model.is_moe else 0)
    )
    experts = expected_experts(model, tokens) * model.expert_params(tp)
    return BYTES_BF16 * model.num_layers * (dense + experts)


def _gemm_time_s(model: ModelArch, hw: HardwareSpec, tp: int, tokens: float) -> float:
    flops = 2 * tokens * model.num_layers * model.active_layer_params(tp)
    compute = flops / (GEMM_MFU * hw.bf16_dense_flops)
    memory = layer_weight_bytes_read(model, tp, tokens) / (HBM_EFF * hw.hbm_bandwidth_bytes_per_s)
    return max(compute, memory)


def _lm_head_time_s(model: ModelArch, hw: HardwareSpec, tp: int, rows: float) -> float:
    n, k = model.lm_head_gemm(tp)
    compute = 2 * rows * n * k / (GEMM_MFU * hw.bf16_dense_flops)
    memory = BYTES_BF16 * n * k / (HBM_EFF * hw.hbm_bandwidth_bytes_per_s)
    return max(compute, memory)


def prefill_roofline_s(
    model: ModelArch, hw: HardwareSpec, tp: int, new_tokens: float, cached_tokens: float = 0.0
) -> float:
    """Roofline time to prefill one sequence's ``new_tokens`` over ``cached_tokens``."""
    n, c = float(new_tokens), float(cached_tokens)
    attn_flops = 4 * model.heads_per_rank(tp) * model.head_dim * n * (c + n / 2)
    attention = model.num_layers * (
        attn_flops / (ATTN_PREFILL_EFF * hw.bf16_dense_flops) + ATTN_KERNEL_MIN_S
    )
    return (
        _gemm_time_s(model, hw, tp, n)
        + attention
        + tp_allreduce_time_s(model, n, tp, hw)
        + _lm_head_time_s(model, hw, tp, 1)  # logits only for the last token
    )


def decode_roofline_s(
    model: ModelArch, hw: HardwareSpec, tp: int, batch: float, context_sum: float
) -> float:
    """Roofline time of one decode step of ``batch`` sequences holding ``context_sum`` KV."""
    kv_read = context_sum * model.kv_bytes_per_token(tp) / (HBM_EFF * hw.hbm_bandwidth_bytes_per_s)
    attention = kv_read + model.num_layers * ATTN_KERNEL_MIN_S
    return (
        _gemm_time_s(model, hw, tp, batch)
        + attention
        + tp_allreduce_time_s(model, batch, tp, hw)
        + _lm_head_time_s(model, hw, tp, batch)
    )


def decode_floor_s(model: ModelArch, hw: HardwareSpec, tp: int) -> float:
    """Weight-read time of a batch of one: no decode step can be faster."""
    n, k = model.lm_head_gemm(tp)
    read = layer_weight_bytes_read(model, tp, 1) + BYTES_BF16 * n * k
    return read / (HBM_EFF * hw.hbm_bandwidth_bytes_per_s)


# ---- profile ------------------------------------------------------------------------
def roofline_profile_name(model: str, hardware: str, tp: int) -> str:
    return f"{hardware}-{model}-tp{tp}-roofline"


def roofline_profile(
    model: str, hardware: str, tp: int, *, max_batch: int = 256, max_step_tokens: int = 8192
) -> CostProfile:
    """Build the roofline profile of ``model`` on ``tp`` GPUs of type ``hardware``."""
    arch, hw = get_model(model), get_hardware(hardware)
    arch.check_tp(tp)
    capacity = kv_capacity_tokens(arch, hw, tp, max_step_tokens, max_batch)
    if capacity < MIN_KV_TOKENS:
        raise ConfigError(
            f"{model} does not fit on {tp} x {hardware}: room for {max(capacity, 0)} KV tokens",
            hint=f"use a larger tp (needs room for at least {MIN_KV_TOKENS} tokens)",
        )
    prefill_samples = [
        (n, c, prefill_roofline_s(arch, hw, tp, n, c))
        for n in PREFILL_TOKENS_GRID
        for c in (0, 8192, 32768)
        if n + c <= capacity
    ]
    floor = decode_floor_s(arch, hw, tp)
    decode_samples = [
        (b, b * ctx, decode_roofline_s(arch, hw, tp, b, b * ctx))
        for b, ctx in decode_grid(max(max_batch, 1), capacity)
    ]
    prefill = fit_prefill(prefill_samples)
    decode = fit_decode(decode_samples, floor_s=floor)
    a, b, c2 = prefill.coefficients
    da, db, dc = decode.coefficients
    provenance = {
        "method": "roofline: max(compute, memory) per kernel with efficiency factors, "
        "sampled and fitted by non-negative least squares (relative residuals)",
        "hardware": hw.to_dict(),
        "model": arch.to_dict(),
        "efficiency": dict(EFFICIENCY),
        "prefill_fit": prefill.summary(),
        "decode_fit": decode.summary(),
        "decode_floor_s": "weight bytes a batch of one reads / (HBM_EFF * HBM bandwidth)",
        "mixed_overhead_s": "max(prefill_base_s, decode_base_s): one pass over the weights",
        "kv_capacity": {
            "formula": "(hbm_bytes * gpu_memory_utilization - weights/tp - activation "
            "reserve) / kv_bytes_per_token",
            "weight_bytes_per_gpu": arch.weight_bytes_per_gpu(tp),
            "activation_reserve_bytes": activation_reserve_bytes(
                arch, tp, max_step_tokens, max_batch
            ),
        },
    }
    if arch.is_moe:
        provenance["moe"] = (
            f"{arch.num_experts} experts, {arch.experts_per_token} active per token; GEMM "
            "FLOPs count active experts, weight reads count the distinct experts a step "
            "touches under uniform routing. Those reads saturate by ~32 sequences "
            "(concave in batch), which a line plus floor follows only roughly: see the "
            "decode_fit errors (largest at batch 4-32 and 256+)"
        )
    return CostProfile(
        name=roofline_profile_name(model, hardware, tp),
        model=model,
        hardware=hardware,
        tp=tp,
        prefill_base_s=a,
        prefill_per_token_s=b,
        prefill_attn_s_per_token2=c2,
        decode_base_s=da,
        decode_per_seq_s=db,
        decode_per_ctx_token_s=dc,
        decode_floor_s=floor,
        mixed_overhead_s=max(a, da),
        kv_bytes_per_token=arch.kv_bytes_per_token(tp),
        kv_capacity_tokens=capacity,
        max_batch=max_batch,
        max_step_tokens=max_step_tokens,
        source="roofline",
        provenance=provenance,
    )
