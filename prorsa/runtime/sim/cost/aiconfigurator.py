"""Kernel-table sums and the H200 profiles fitted to them.

A prefill of ``n`` tokens costs, per layer, the QKV, O, gate/up and down GEMMs at
``m = n`` plus one context-attention kernel; the lm_head runs once, for the last token.
A decode step of ``B`` sequences costs the same GEMMs at ``m = B``, a generation-
attention kernel per layer, and the lm_head for all ``B`` rows. Under TP the GEMMs'
``n`` (column-parallel) or ``k`` (row-parallel) and the heads are split by ``tp``, and two
all-reduces per layer come from the measured vLLM custom all-reduce table: the CUDA-graph
rows for decode steps (replayed from full graphs), the eager rows for prefill (chunks past
the captured sizes run without graphs). MoE models (one engine, experts tensor parallel
over its ``tp`` GPUs) take their expert layers from the fused-MoE table at ``moe_tp = tp``
instead of the per-expert GEMMs. The sums are GPU-kernel time only: no norms,
activations, sampling or CPU scheduling, which is also what the published reference
points in shared/data/README.md count. Engines with data-parallel attention or expert
parallelism are priced by ``layout_fit`` / ``LayoutCost``.
"""

from __future__ import annotations

from pathlib import Path

from prorsa.errors import ConfigError
from prorsa.runtime.sim.cost.fit import decode_grid, fit_decode, fit_prefill
from prorsa.runtime.sim.cost.hardware import get_hardware
from prorsa.runtime.sim.cost.kernel_tables import KernelTables, load_kernel_tables
from prorsa.runtime.sim.cost.models import ModelArch, get_model
from prorsa.runtime.sim.cost.profile import CostProfile
from prorsa.runtime.sim.cost.roofline import (
    EFFICIENCY,
    TP_DEGREES,
    activation_reserve_bytes,
    fits,
    kv_capacity_tokens,
)

HARDWARE = "h200"
# Dense prefill grid: the tables' GEMM latencies jump between neighbouring m (e.g. a slow
# m=4096 or m=8192 measurement), so many points average the bumps out of the fit.
PREFILL_FIT_TOKENS = tuple(range(256, 16385, 256))
MOE_FLOOR_BATCH = 32
KERNEL_MODELS = ("llama-3-8b", "qwen2.5-7b", "qwen2.5-32b", "qwen3-30b-a3b", "qwen3-235b-a22b")

# shared/data/README.md: TP1, bf16, GPU kernels only; milliseconds.
PUBLISHED_MS = {
    "llama-3-8b": {"prefill": {2048: 38.0, 8192: 184.0}, "decode_2k": {1: 4.4, 64: 8.8, 128: 13.1}},
    "qwen2.5-7b": {"prefill": {2048: 36.0, 8192: 149.0}, "decode_2k": {1: 4.3, 64: 6.0, 128: 8.1}},
    "qwen2.5-32b": {
        "prefill": {2048: 168.0, 8192: 821.0},
        "decode_2k": {1: 17.1, 64: 26.7, 128: 34.4},
    },
}


def _arch(model: str | ModelArch) -> ModelArch:
    return model if isinstance(model, ModelArch) else get_model(model)


def _tables(tables: KernelTables | None) -> KernelTables:
    return tables if tables is not None else load_kernel_tables()


def _side_tables(tables: KernelTables):
    """The MoE and communication tables from the kernel tables' folder."""
    from prorsa.runtime.sim.cost.comm_tables import load_comm_tables
    from prorsa.runtime.sim.cost.moe_tables import load_moe_table

    return load_moe_table(str(tables.data_dir)), load_comm_tables(str(tables.data_dir))


def _layer_gemms_s(arch: ModelArch, m: float, tp: int, tables: KernelTables) -> float:
    # MoE expert GEMMs come from the fused-MoE table, not from per-expert GEMM rows
    return sum(
        count * tables.gemm_s(m, n, k)
        for name, n, k, count in arch.layer_gemms(tp)
        if not name.startswith("expert_")
    )


def _moe_s(arch: ModelArch, tokens: float, tp: int, tables: KernelTables) -> float:
    if not arch.is_moe or tokens <= 0:
        return 0.0
    moe, _ = _side_tables(tables)
    return arch.num_layers * moe.moe_s(
        tokens,
        hidden=arch.hidden_size,
        inter=arch.moe_intermediate_size,
        topk=arch.experts_per_token,
        experts=arch.num_experts,
        moe_tp=tp,
    )


def _moe_covered(arch: ModelArch, tp: int, tables: KernelTables) -> bool:
    """The fused-MoE table has rows for ``moe_tp = tp`` (always true for dense models)."""
    if not arch.is_moe:
        return True
    moe, _ = _side_tables(tables)
    splits = moe.splits(
        arch.hidden_size, arch.moe_intermediate_size, arch.experts_per_token, arch.num_experts
    )
    return (tp, 1) in splits


def _allreduce_s(arch: ModelArch, tokens: float, tp: int, tables: KernelTables, graph: bool):
    """Two custom all-reduces per layer of ``tokens x hidden`` bf16 values over ``tp``."""
    if tp <= 1 or tokens <= 0:
        return 0.0
    _, comm = _side_tables(tables)
    return 2 * arch.num_layers * comm.allreduce_s(tokens * arch.hidden_size, tp, graph=graph)


def kernel_breakdown_prefill(
    model: str | ModelArch, tokens: float, *, tp: int = 1, tables: KernelTables | None = None
) -> dict[str, float]:
    """Seconds per part (gemm, attention, lm_head, allreduce) of prefilling ``tokens``."""
    arch, t = _arch(model), _tables(tables)
    arch.check_tp(tp)
    n_lm, k_lm = arch.lm_head_gemm(tp)
    heads, kv = arch.heads_per_rank(tp), arch.kv_heads_per_rank(tp)
    return {
        "gemm": arch.num_layers * _layer_gemms_s(arch, tokens, tp, t),
        "attention": arch.num_layers * t.context_attention_s(heads, kv, tokens, arch.head_dim),
        "lm_head": t.gemm_s(1, n_lm, k_lm) if tokens > 0 else 0.0,
        "moe": _moe_s(arch, tokens, tp, t),
        "allreduce": _allreduce_s(arch, tokens, tp, t, graph=False),
    }


def kernel_sum_prefill_s(
    model: str | ModelArch, tokens: float, *, tp: int = 1, tables: KernelTables | None = None
) -> float:
    """Summed kernel time (seconds) to prefill one ``tokens``-long sequence on H200."""
    return sum(kernel_breakdown_prefill(model, tokens, tp=tp, tables=tables).values())


def kernel_breakdown_decode(
    model: str | ModelArch,
    batch: float,
    ctx: float,
    *,
    tp: int = 1,
    tables: KernelTables | None = None,
) -> dict[str, float]:
    """Seconds per part of one decode step of ``batch`` sequences of ``ctx`` tokens each."""
    arch, t = _arch(model), _tables(tables)
    arch.check_tp(tp)
    n_lm, k_lm = arch.lm_head_gemm(tp)
    heads, kv = arch.heads_per_rank(tp), arch.kv_heads_per_rank(tp)
    return {
        "gemm": arch.num_layers * _layer_gemms_s(arch, batch, tp, t),
        "attention": arch.num_layers
        * t.generation_attention_s(heads, kv, batch, ctx, arch.head_dim),
        "lm_head": t.gemm_s(batch, n_lm, k_lm),
        "moe": _moe_s(arch, batch, tp, t),
        "allreduce": _allreduce_s(arch, batch, tp, t, graph=True),
    }


def kernel_sum_decode_s(
    model: str | ModelArch,
    batch: float,
    ctx: float,
    *,
    tp: int = 1,
    tables: KernelTables | None = None,
) -> float:
    """Summed kernel time (seconds) of one decode step on H200 (contexts all ``ctx``)."""
    return sum(kernel_breakdown_decode(model, batch, ctx, tp=tp, tables=tables).values())


def weight_read_floor_s(
    model: str | ModelArch, *, tp: int = 1, tables: KernelTables | None = None
) -> float:
    """Measured GEMM + MoE + lm_head time at batch 1: the weight-streaming floor of a step."""
    parts = kernel_breakdown_decode(model, 1, 1, tp=tp, tables=tables)
    return parts["gemm"] + parts["moe"] + parts["lm_head"]


def profile_name(model: str, tp: int) -> str:
    return f"{HARDWARE}-{model}-tp{tp}"


def attention_floor_extra_s(model: str | ModelArch, tokens: float, tables: KernelTables) -> float:
    """Seconds the prefill attention floor adds over the context-attention table (TP1)."""
    arch = get_model(model) if isinstance(model, str) else model
    args = (arch.num_heads, arch.num_kv_heads, tokens, arch.head_dim)
    floored = tables.context_attention_s(*args)
    return arch.num_layers * (floored - tables.context_attention_table_s(*args))


def calibration_rows(
    model: str, tables: KernelTables | None = None, profile: CostProfile | None = None
) -> list[dict]:
    """Published vs kernel-table sum (vs fitted profile, if given), in milliseconds."""
    rows = []
    ref = PUBLISHED_MS[model]
    for tokens, published in ref["prefill"].items():
        row = {"point": f"prefill {tokens}", "published_ms": published}
        if tables is not None:
            row["kernel_sum_ms"] = round(
                1e3 * kernel_sum_prefill_s(model, tokens, tables=tables), 3
            )
            # what the FA3-rate attention floor adds over the table (the published sums
            # use the table's attention rows as they are)
            row["attention_floor_ms"] = round(
                1e3 * attention_floor_extra_s(model, tokens, tables), 3
            )
        if profile is not None:
            row["fitted_ms"] = round(1e3 * profile.prefill_time_s(tokens), 3)
        rows.append(row)
    for batch, published in ref["decode_2k"].items():
        row = {"point": f"decode batch {batch} at 2048", "published_ms": published}
        if tables is not None:
            row["kernel_sum_ms"] = round(
                1e3 * kernel_sum_decode_s(model, batch, 2048, tables=tables), 3
            )
        if profile is not None:
            row["fitted_ms"] = round(1e3 * profile.decode_step_time_s(batch, batch * 2048), 3)
        rows.append(row)
    return rows


def fit_aiconfigurator_profile(
    model: str,
    tp: int = 1,
    *,
    tables: KernelTables | None = None,
    max_batch: int = 256,
    max_step_tokens: int = 8192,
) -> CostProfile:
    """Sample the kernel sums over prefill lengths and decode (batch, context) points and
    fit the profile's coefficients by non-negative least squares (relative residuals)."""
    arch, t = _arch(model), _tables(tables)
    arch.check_tp(tp)
    hw = get_hardware(HARDWARE)
    capacity = kv_capacity_tokens(arch, hw, tp, max_step_tokens, max_batch)
    if not fits(arch, hw, tp, max_step_tokens, max_batch):
        raise ConfigError(f"{model} does not fit on {tp} x {HARDWARE}")
    prefill_samples = [
        (n, 0, kernel_sum_prefill_s(arch, n, tp=tp, tables=t)) for n in PREFILL_FIT_TOKENS
    ]
    decode_samples = [
        (b, b * ctx, kernel_sum_decode_s(arch, b, ctx, tp=tp, tables=t))
        for b, ctx in decode_grid(max_batch, capacity)
    ]
    floor = weight_read_floor_s(arch, tp=tp, tables=t)
    min_batch = 1
    if arch.is_moe:
        # A step of MOE_FLOOR_BATCH sequences already reads ~all experts (87 % under
        # uniform top-8 of 128): the plateau a line plus floor can follow. Smaller
        # batches read fewer experts and are overestimated (see decode_fit).
        floor = sum(kernel_breakdown_decode(arch, MOE_FLOOR_BATCH, 1, tp=tp, tables=t).values())
        min_batch = MOE_FLOOR_BATCH
    prefill = fit_prefill(prefill_samples)
    decode = fit_decode(decode_samples, floor_s=floor, min_batch=min_batch)
    a, b, c2 = prefill.coefficients
    da, db, dc = decode.coefficients
    provenance = {
        "method": "sum of measured H200 kernel latencies (GEMMs + attention per layer, "
        "lm_head once), sampled at prefill lengths and decode (batch, context) points, "
        "fitted by non-negative least squares with relative residuals",
        "kernel_tables": t.describe(),
        "lookup_rules": "see prorsa/runtime/sim/cost/kernel_tables.py: m linear; off-grid "
        "n/k scaled by n*k from the nearest measured shape below; attention rows "
        "window 0, bf16 KV, 0.19.0/0.19.1 averaged, floored at their roofline (the GQA "
        "context rows undercut the compute bound)",
        "prefill_samples": "one sequence, no cached prefix: the tables carry no prefix "
        "dimension, so the attention term c2 fitted at c=0 also prices cached context",
        "prefill_fit": prefill.summary(),
        "decode_fit": decode.summary(),
        "decode_floor_s": "measured GEMM + lm_head time at batch 1 (weight streaming)"
        if not arch.is_moe
        else f"measured decode step at batch {MOE_FLOOR_BATCH}, context 1 (all experts read); "
        f"the line is fitted on batches >= {MOE_FLOOR_BATCH}",
        "mixed_overhead_s": "max(prefill_base_s, decode_base_s): one pass over the weights",
        "kv_capacity": {
            "formula": "(hbm_bytes * gpu_memory_utilization - weights/tp - activation "
            "reserve) / kv_bytes_per_token (roofline memory model, H200 141 GB)",
            "weight_bytes_per_gpu": arch.weight_bytes_per_gpu(tp),
            "activation_reserve_bytes": activation_reserve_bytes(
                arch, tp, max_step_tokens, max_batch
            ),
            "gpu_memory_utilization": EFFICIENCY["gpu_memory_utilization"],
        },
    }
    if tp > 1:
        _, comm = _side_tables(t)
        provenance["tensor_parallel"] = (
            f"GEMM n (QKV, gate/up, lm_head) or k (O, down) and attention heads divided by "
            f"tp={tp} before the table lookup; two vLLM custom all-reduces per layer from "
            "the measured all-reduce table (graph rows for decode, eager rows for prefill)"
        )
        provenance["allreduce_table"] = comm.describe()
    if arch.is_moe:
        moe, _ = _side_tables(t)
        provenance["moe"] = (
            f"{arch.num_experts} experts, top-{arch.experts_per_token}, tensor parallel over "
            f"tp={tp}: fused-MoE table (bf16, balanced routing) at the step's tokens. The "
            "MoE time is concave in tokens (distinct experts read); the line-plus-floor fit "
            "follows it only roughly (see decode_fit) - LayoutCost keeps the measured curve"
        )
        provenance["moe_table"] = moe.describe()
    profile = CostProfile(
        name=profile_name(arch.name, tp),
        model=arch.name,
        hardware=HARDWARE,
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
        source="aiconfigurator",
        provenance=provenance,
    )
    if tp == 1 and arch.name in PUBLISHED_MS:
        profile.provenance["calibration_ms"] = calibration_rows(arch.name, t, profile)
    return profile


def fit_aiconfigurator_profiles(
    data_dir: str | Path | None = None,
    out_dir: str | Path | None = None,
    *,
    models: tuple[str, ...] = KERNEL_MODELS,
    tps: tuple[int, ...] = TP_DEGREES,
) -> list[CostProfile]:
    """Fit every (model, tp) that fits on H200; write ``<name>.json`` into ``out_dir``."""
    tables = load_kernel_tables(str(data_dir) if data_dir else None)
    hw = get_hardware(HARDWARE)
    profiles = []
    for model in models:
        arch = _arch(model)
        for tp in tps:
            if not fits(arch, hw, tp) or not _moe_covered(arch, tp, tables):
                continue
            profile = fit_aiconfigurator_profile(model, tp, tables=tables)
            if out_dir is not None:
                profile.save(Path(out_dir) / f"{profile.name}.json")
            profiles.append(profile)
    return profiles
