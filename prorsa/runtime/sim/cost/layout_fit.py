"""Fit ``LayoutTerms`` for one (model, layout) from the measured H200 tables.

Per DP rank (``tp`` GPUs) and summed over layers:

* non-expert GEMMs (QKV, O, router, dense MLP) from the GEMM table at ``m`` = the rank's
  tokens, with ``n``/``k`` split by ``tp`` (``ModelArch.layer_gemms``); the vocab
  projection for the sampled rows;
* two ``tp``-way all-reduces per layer (after attention, after the MLP/MoE) from the vLLM
  custom all-reduce table: graph rows in the curve, eager minus graph as the extra of
  steps that run without graphs;
* decode attention from the generation-attention table at the rank's heads, fitted per
  batch size ``B`` to ``fixed(B) + per_ctx(B) * S`` over contexts of 1k-64k tokens
  (non-negative least squares, relative residuals);
  prefill attention from the context-attention table fitted to ``per_chunk + c2 * n^2/2``
  (the tables have no prefix dimension, so ``c2`` also prices cached context);
* MoE from the fused-MoE table at the tokens one GPU's MoE sees, at the layout's
  ``(moe_tp, moe_ep)``, for every routing distribution;
* DP token exchange: NCCL all-gather + reduce-scatter of the gathered hidden states
  between the ``dp`` ranks (all-gather mode), or DeepEP low-latency (decode) / normal
  (prefill) dispatch + combine per rank (all-to-all mode);
* graph-loss and scheduling terms from ``host_costs`` (vLLM PR #25444, the all-reduce
  table).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from prorsa.errors import ConfigError
from prorsa.runtime.sim.cost import host_costs
from prorsa.runtime.sim.cost.comm_tables import CommTables, load_comm_tables
from prorsa.runtime.sim.cost.fit import DECODE_BATCH_GRID, DECODE_CONTEXT_GRID, _nnls, _stats
from prorsa.runtime.sim.cost.hardware import get_hardware
from prorsa.runtime.sim.cost.kernel_tables import KernelTables, load_kernel_tables, repo_root
from prorsa.runtime.sim.cost.layout import (
    Layout,
    candidate_layouts,
    check_layout,
    kv_capacity_tokens_per_rank,
    layout_fits,
    weight_bytes_per_gpu,
)
from prorsa.runtime.sim.cost.layout_terms import LayoutTerms
from prorsa.runtime.sim.cost.models import ModelArch, get_model
from prorsa.runtime.sim.cost.moe_tables import DISTRIBUTIONS, MoETable, load_moe_table
from prorsa.runtime.sim.cost.roofline import MIN_KV_TOKENS

log = logging.getLogger(__name__)

HARDWARE = "h200"
LAYOUT_MODELS = ("qwen2.5-7b", "qwen2.5-32b", "qwen3-30b-a3b", "qwen3-235b-a22b")
# Every token count up to 64 (small decode batches change fast), then coarser.
TOKEN_GRID = (
    tuple(range(1, 65))
    + tuple(range(72, 513, 8))
    + (576, 640, 768, 896, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096)
    + (5120, 6144, 7168, 8192)
)
# the MoE table's own token counts are on TOKEN_GRID; past 8,192, the gathered tokens of
# up to 8 ranks
MOE_GRID_EXTRA = (10240, 12288, 16384, 24576, 32768, 49152, 65536)
PREFILL_ATTN_FIT_TOKENS = tuple(range(256, 16385, 256))
# Decode attention is fitted over the contexts rollout engines hold (agentic contexts of
# thousands of tokens): the line would otherwise bend to the launch-bound short-context
# corner of the tables (~11 us a layer for one short sequence).
ATTN_FIT_MIN_CONTEXT = 1024


def layout_cost_name(model: str, layout: Layout | str, hardware: str = HARDWARE) -> str:
    """``h200-qwen3-30b-a3b-tp1-dp8-ep8``: the registry key of a fitted layout."""
    name = layout.name if isinstance(layout, Layout) else Layout.parse(layout).name
    return f"{hardware}-{model}-{name}"


def shipped_layout_dir() -> Path:
    """``datasets/profiles/layouts``: the fitted layout terms as JSON."""
    return repo_root() / "datasets" / "profiles" / "layouts"


class Tables:
    """The four H200 table sets a layout fit reads."""

    def __init__(self, data_dir: str | Path | None = None) -> None:
        key = str(data_dir) if data_dir else None
        self.kernels: KernelTables = load_kernel_tables(key)
        self.moe: MoETable = load_moe_table(key)
        self.comm: CommTables = load_comm_tables(key)

    def describe(self) -> dict:
        return {
            "kernels": self.kernels.describe(),
            "moe": self.moe.describe(),
            "comm": self.comm.describe(),
        }


# ---- pieces ---------------------------------------------------------------------------
def dense_layer_gemms_s(arch: ModelArch, tokens: float, tp: int, kernels: KernelTables) -> float:
    """One layer's non-expert GEMMs on one rank at ``m = tokens`` (seconds)."""
    return sum(
        count * kernels.gemm_s(tokens, n, k)
        for name, n, k, count in arch.layer_gemms(tp)
        if not name.startswith("expert_")
    )


def moe_layer_s(
    arch: ModelArch,
    tokens: float,
    layout: Layout,
    moe: MoETable,
    distribution: str = "balanced",
    dtype: str = "bfloat16",
) -> float:
    """One MoE layer on one GPU that sees ``tokens`` tokens, at the layout's split."""
    return moe.moe_s(
        tokens,
        hidden=arch.hidden_size,
        inter=arch.moe_intermediate_size,
        topk=arch.experts_per_token,
        experts=arch.num_experts,
        moe_tp=layout.moe_tp,
        moe_ep=layout.ep,
        distribution=distribution,
        dtype=dtype,
    )


def alltoall_moe_layer_s(
    arch: ModelArch, tokens: float, layout: Layout, moe: MoETable, distribution: str
) -> float:
    """One MoE layer on the slowest GPU when all-to-all delivers only its own tokens.

    A GPU holding ``E/ep`` experts then does ``1/ep`` of the work of one GPU holding all
    ``E`` experts at the same per-expert load (and reads ``1/ep`` of the weights): the
    ``ep = 1`` row divided by ``ep``. Routing skew multiplies it by the measured slowdown
    of the heaviest expert-parallel block (power-law over balanced rows at this ``ep``).
    Unlike all-gather mode, no GPU touches the tokens routed elsewhere.
    """
    if tokens <= 0:
        return 0.0
    single = moe_layer_s(arch, tokens, Layout(), moe) / layout.ep
    if distribution == "balanced":
        return single
    skew = moe_layer_s(arch, tokens, layout, moe, distribution) / moe_layer_s(
        arch, tokens, layout, moe, "balanced"
    )
    return single * skew


def _fit_decode_attention(arch: ModelArch, tp: int, capacity: int, max_batch: int, kernels):
    """Per batch size: ``fixed + per_ctx * S`` fitted over contexts (NNLS, relative)."""
    heads, kv = arch.heads_per_rank(tp), arch.kv_heads_per_rank(tp)
    batches, fixed, per_ctx, samples, preds = [], [], [], [], []
    for b in DECODE_BATCH_GRID:
        if b > max_batch:
            continue
        contexts = [
            c for c in DECODE_CONTEXT_GRID if c >= ATTN_FIT_MIN_CONTEXT and b * c <= capacity
        ]
        if len(contexts) < 2:
            continue
        ctx = np.asarray(contexts, dtype=float)
        y = np.asarray(
            [
                arch.num_layers * kernels.generation_attention_s(heads, kv, b, c, arch.head_dim)
                for c in contexts
            ]
        )
        design = np.column_stack([np.ones_like(ctx), b * ctx])
        coef = _nnls(design, y, relative=True)
        batches.append(b)
        fixed.append(float(coef[0]))
        per_ctx.append(float(coef[1]))
        samples.append(y)
        preds.append(design @ coef)
    y_all, p_all = np.concatenate(samples), np.concatenate(preds)
    return batches, fixed, per_ctx, _stats((0.0,), p_all, y_all)


def _fit_prefill_attention(arch: ModelArch, tp: int, kernels):
    heads, kv = arch.heads_per_rank(tp), arch.kv_heads_per_rank(tp)
    n = np.asarray(PREFILL_ATTN_FIT_TOKENS, dtype=float)
    y = np.asarray(
        [arch.num_layers * kernels.context_attention_s(heads, kv, t, arch.head_dim) for t in n]
    )
    design = np.column_stack([np.ones_like(n), n * n / 2])
    coef = _nnls(design, y, relative=True)
    return coef, _stats(coef, design @ coef, y)


def pr25444_device_estimate_s(tables: Tables) -> float:
    """Full-graph device time of the PR #25444 decode step, estimated from the H200 tables.

    Qwen3-Coder-30B-A3B-FP8 (the Qwen3-30B-A3B shape), batch 10 at its mean context:
    block-FP8 fused-MoE rows; bf16 GEMM rows halved (FP8 weights halve what a batch-10
    GEMM streams); bf16 lm_head (not quantised) and attention; times the H100/H200 HBM
    bandwidth ratio (the step streams weights).
    """
    arch = get_model("qwen3-30b-a3b")
    batch, ctx = host_costs.PR_25444_REQUESTS, host_costs.PR_25444_MEAN_CONTEXT
    k = tables.kernels
    n_lm, k_lm = arch.lm_head_gemm(1)
    gemms = 0.5 * arch.num_layers * dense_layer_gemms_s(arch, batch, 1, k)
    attention = arch.num_layers * k.generation_attention_s(
        arch.num_heads, arch.num_kv_heads, batch, ctx, arch.head_dim
    )
    moe = arch.num_layers * moe_layer_s(arch, batch, Layout(), tables.moe, dtype="fp8_block")
    h200 = gemms + attention + moe + k.gemm_s(batch, n_lm, k_lm)
    return host_costs.H100_OVER_H200_TIME * h200


def table_splits_cover(arch: ModelArch, layout: Layout, moe: MoETable) -> bool:
    """The MoE table has rows for the layout's (moe_tp, moe_ep); always true for dense."""
    if not arch.is_moe:
        return True
    splits = moe.splits(
        arch.hidden_size, arch.moe_intermediate_size, arch.experts_per_token, arch.num_experts
    )
    return (layout.moe_tp, layout.ep) in splits


# ---- one layout -----------------------------------------------------------------------
def fit_layout_terms(
    model: str,
    layout: Layout | str,
    *,
    tables: Tables | None = None,
    max_batch: int = 256,
    max_step_tokens: int = 8192,
) -> LayoutTerms:
    """Sample the tables for ``layout`` of ``model`` and return its terms."""
    arch = get_model(model)
    layout = layout if isinstance(layout, Layout) else Layout.parse(layout)
    check_layout(arch, layout)
    tables = tables or Tables()
    hw = get_hardware(HARDWARE)
    capacity = kv_capacity_tokens_per_rank(arch, layout, hw, max_step_tokens, max_batch)
    if capacity < MIN_KV_TOKENS:
        raise ConfigError(
            f"{model} at {layout.name} leaves room for {max(capacity, 0)} KV tokens per rank",
            hint=f"needs at least {MIN_KV_TOKENS}; use more GPUs or expert parallelism",
        )
    if not table_splits_cover(arch, layout, tables.moe):
        raise ConfigError(
            f"the MoE table has no rows for {model} at moe_tp={layout.moe_tp}, "
            f"moe_ep={layout.ep} (layout {layout.name})",
        )
    k, comm, L = tables.kernels, tables.comm, arch.num_layers
    tp, dp, hidden = layout.tp, layout.dp, arch.hidden_size
    grid = [t for t in TOKEN_GRID if t <= max_step_tokens]
    n_lm, k_lm = arch.lm_head_gemm(tp)

    def allreduce_s(m: float, graph: bool) -> float:
        return 2 * L * comm.allreduce_s(m * hidden, tp, graph=graph)

    dense = [L * dense_layer_gemms_s(arch, m, tp, k) + allreduce_s(m, True) for m in grid]
    ar_extra = [allreduce_s(m, False) - allreduce_s(m, True) for m in grid]
    lm_head = [k.gemm_s(m, n_lm, k_lm) for m in grid]
    d_batches, d_fixed, d_ctx, decode_fit = _fit_decode_attention(arch, tp, capacity, max_batch, k)
    (p_chunk, p_c2), prefill_fit = _fit_prefill_attention(arch, tp, k)

    moe_grid: list[int] = []
    moe_s: dict[str, list[float]] = {}
    gather: list[float] = []
    a2a_decode: list[float] = []
    a2a_prefill: list[float] = []
    if arch.is_moe:
        moe_grid = sorted({t for t in (*TOKEN_GRID, *MOE_GRID_EXTRA) if t <= dp * max_step_tokens})
        for dist in DISTRIBUTIONS:
            if layout.moe_comm == "alltoall":
                moe_s[dist] = [
                    L * alltoall_moe_layer_s(arch, t, layout, tables.moe, dist) for t in moe_grid
                ]
            else:
                moe_s[dist] = [L * moe_layer_s(arch, t, layout, tables.moe, dist) for t in moe_grid]
        if dp > 1 and layout.moe_comm == "allgather":
            gather = [
                L
                * (
                    comm.nccl_s("all_gather", t * hidden, dp)
                    + comm.nccl_s("reduce_scatter", t * hidden, dp)
                )
                for t in moe_grid
            ]
        if layout.moe_comm == "alltoall":
            shape = (hidden, arch.experts_per_token, arch.num_experts)
            a2a_decode = [L * sum(comm.deepep_low_latency_s(t, *shape)) for t in grid]
            a2a_prefill = [L * sum(comm.deepep_normal_s(t, *shape)) for t in grid]

    eager_op_s = comm.allreduce_eager_overhead_s(2)
    loss_per_layer = host_costs.graph_loss_per_moe_layer_s() if arch.is_moe else eager_op_s
    provenance = {
        "method": "H200 kernel, MoE and communication tables summed per layer at the "
        "tokens each GPU processes (see prorsa/runtime/sim/cost/layout_fit.py)",
        "tables": tables.describe(),
        "layout": {
            "tp": tp,
            "dp": dp,
            "ep": layout.ep,
            "moe_tp": layout.moe_tp,
            "moe_comm": layout.moe_comm,
            "gpus": layout.gpus,
            "weight_bytes_per_gpu": weight_bytes_per_gpu(arch, layout),
        },
        "decode_attention_fit": decode_fit.summary(),
        "prefill_attention_fit": prefill_fit.summary(),
        "allreduce": "vLLM custom all-reduce table: 2 per layer over tp GPUs; graph rows "
        "in dense_s, eager minus graph in allreduce_eager_extra_s",
        "moe": (
            "dense model"
            if not arch.is_moe
            else "all-to-all: fused-MoE ep=1 row / ep x power-law skew of the ep rows "
            "(alltoall_moe_layer_s)"
            if layout.moe_comm == "alltoall"
            else "fused-MoE table (bf16) at moe_tp/moe_ep of the layout, per distribution, "
            "at the gathered tokens"
        ),
        "dp_exchange": (
            "NCCL all_gather + reduce_scatter of tokens x hidden (half) over dp GPUs"
            if gather
            else "DeepEP low-latency (decode) / normal 24-SM (prefill) dispatch + combine"
            if a2a_decode
            else "none"
        ),
        "graph_loss": {
            **host_costs.describe(eager_op_s, pr25444_device_estimate_s(tables)),
            "per_layer_used_s": loss_per_layer,
        },
        "kv_capacity": "(141 GB * 0.9 - weights per GPU - activation reserve) / "
        "kv_bytes_per_token, per DP rank",
    }
    return LayoutTerms(
        name=layout_cost_name(model, layout),
        model=model,
        hardware=HARDWARE,
        layout=layout.name,
        num_layers=L,
        hidden_size=hidden,
        kv_bytes_per_token=arch.kv_bytes_per_token(tp),
        kv_capacity_tokens_per_rank=capacity,
        max_batch_per_rank=max_batch,
        max_step_tokens_per_rank=max_step_tokens,
        max_capture_tokens=host_costs.MAX_CAPTURE_TOKENS,
        token_grid=list(grid),
        dense_s=dense,
        allreduce_eager_extra_s=ar_extra,
        lm_head_s=lm_head,
        attn_decode_batch_grid=d_batches,
        attn_decode_fixed_s=d_fixed,
        attn_decode_per_ctx_token_s=d_ctx,
        attn_prefill_per_chunk_s=float(p_chunk),
        attn_prefill_s_per_token2=float(p_c2),
        graph_loss_s=L * loss_per_layer,
        sched_cpu_s=host_costs.sched_cpu_per_step_s(),
        moe_grid=moe_grid,
        moe_s=moe_s,
        gather_s=gather,
        a2a_decode_s=a2a_decode,
        a2a_prefill_s=a2a_prefill,
        provenance=provenance,
    )


def available_layouts(model: str, tables: Tables | None = None) -> list[Layout]:
    """Layouts of ``model`` on one H200 node that fit in memory and that the tables cover."""
    arch, hw = get_model(model), get_hardware(HARDWARE)
    tables = tables or Tables()
    return [
        lay
        for lay in candidate_layouts(arch)
        if layout_fits(arch, lay, hw) and table_splits_cover(arch, lay, tables.moe)
    ]


def fit_layout_terms_all(
    data_dir: str | Path | None = None,
    out_dir: str | Path | None = None,
    *,
    models: tuple[str, ...] = LAYOUT_MODELS,
) -> list[LayoutTerms]:
    """Fit every available layout of ``models``; write ``<name>.json`` into ``out_dir``."""
    tables = Tables(data_dir)
    out = []
    for model in models:
        for layout in available_layouts(model, tables):
            terms = fit_layout_terms(model, layout, tables=tables)
            if out_dir is not None:
                terms.save(Path(out_dir) / f"{terms.name}.json")
            log.info("fitted %s", terms.name)
            out.append(terms)
    return out
