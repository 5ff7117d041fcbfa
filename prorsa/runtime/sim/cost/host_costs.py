"""Host-side step costs: losing full CUDA graphs, and per-step CPU scheduling.

Both come from one published measurement, vLLM PR #25444 ("Change default CUDAGraphMode
from PIECEWISE to FULL_AND_PIECEWISE"): Qwen/Qwen3-Coder-30B-A3B-Instruct-FP8 on one H100,
``vllm bench serve --num-prompts 10`` (10 requests of 1,024 input and 128 output tokens,
all sent at once), request throughput by CUDA-graph mode and scheduling:

====================================  ========  ==================
cudagraph mode                        sync      async scheduling
====================================  ========  ==================
PIECEWISE (old default)               4.07      4.29
FULL                                  5.83      6.03
FULL_AND_PIECEWISE (new default)      5.98      6.20
====================================  ========  ==================

Prefill steps run piecewise in both PIECEWISE and FULL_AND_PIECEWISE, so the gap between
them is the 127 pure-decode steps (the first output token comes with the prefill):
``(10/4.07 - 10/5.98) / 127 = 6.18 ms`` per decode step at batch 10. Asynchronous
scheduling overlaps the scheduler with the GPU, so its gap is the scheduler's time per
step: ``(10/5.98 - 10/6.20) / 128 = 0.46 ms``.

The graph-loss model: a step run without full graphs (piecewise, or eager past the
captured sizes) costs its device time plus a per-layer host overhead that the GPU waits
for: the attention launched outside the graph pieces, and for MoE layers the work around
the fused-MoE custom op.

* MoE layers: the PR's gap per layer, ``6.18 ms / 48 = 129 us``. A small-batch MoE decode
  therefore loses up to ~1.5x (the published 5.98/4.07 = 1.47).
* Dense layers: one op dispatched from Python instead of replayed, priced from the vLLM
  custom all-reduce table: eager minus graph time of the smallest all-reduce, ~17 us
  (``vllm_eager`` ~21 us against ``vllm_graph`` ~4.5 us, 2-8 GPUs). Cross-check: vLLM
  PR #20059 measured Qwen2.5-1.5B (28 layers) at 5.42 ms median TPOT piecewise and
  5.02 ms with full graphs at 1 QPS: 14 us per layer.

The overhead is taken as additive: the published gaps were measured where the host is
the bottleneck (small batches), so at large batches, where the GPU could hide some host
work, it is an upper bound. Cross-check of the MoE side: the H200 tables predict the PR's
full-graph decode step (``layout_fit.pr25444_device_estimate_s``) and with it the
FULL_AND_PIECEWISE run time (see docs/cost_model.md). Steps with no graph at all also pay
their tensor-parallel all-reduces at the table's eager rows.
"""

from __future__ import annotations

PR_25444_URL = "https://github.com/vllm-project/vllm/pull/25444"
PR_25444_REQUESTS = 10
PR_25444_INPUT_TOKENS = 1024
PR_25444_OUTPUT_TOKENS = 128
PR_25444_NUM_LAYERS = 48  # Qwen3-Coder-30B-A3B: the Qwen3-30B-A3B architecture
PR_25444_REQ_PER_S = {
    "piecewise": 4.07,
    "piecewise_async": 4.29,
    "full": 5.83,
    "full_async": 6.03,
    "full_and_piecewise": 5.98,
    "full_and_piecewise_async": 6.20,
}
# The decode context midway through the PR's 128 output tokens.
PR_25444_MEAN_CONTEXT = PR_25444_INPUT_TOKENS + PR_25444_OUTPUT_TOKENS // 2
# H100 SXM HBM3 3.35 TB/s vs H200 4.8 TB/s (datasheets, hardware.py): a batch-10 decode
# streams weights, so its device time scales with the bandwidth.
H100_OVER_H200_TIME = 4.8 / 3.35

# vLLM's default largest captured CUDA graph: min(2 * max_num_seqs, 512) tokens
# (vllm/config/compilation.py, max_cudagraph_capture_size); steps over it run without
# graphs.
MAX_CAPTURE_TOKENS = 512


def pr25444_run_s(config: str) -> float:
    """Wall time of the PR's 10-request run in one configuration."""
    return PR_25444_REQUESTS / PR_25444_REQ_PER_S[config]


def graph_loss_per_decode_step_s() -> float:
    """6.18 ms: piecewise minus full graphs, per decode step at batch 10 (PR #25444)."""
    decode_steps = PR_25444_OUTPUT_TOKENS - 1
    return (pr25444_run_s("piecewise") - pr25444_run_s("full_and_piecewise")) / decode_steps


def sched_cpu_per_step_s() -> float:
    """0.46 ms: the scheduler time asynchronous scheduling hides, per step (PR #25444)."""
    steps = PR_25444_OUTPUT_TOKENS
    return (pr25444_run_s("full_and_piecewise") - pr25444_run_s("full_and_piecewise_async")) / steps


def graph_loss_per_moe_layer_s() -> float:
    """129 us: the PR #25444 gap per decode step spread over its 48 MoE layers."""
    return graph_loss_per_decode_step_s() / PR_25444_NUM_LAYERS


# vLLM PR #20059, Qwen2.5-1.5B-Instruct (28 layers), median TPOT at 1 QPS (ms)
PR_20059_URL = "https://github.com/vllm-project/vllm/pull/20059"
PR_20059_TPOT_MS = {"piecewise": 5.42, "full": 5.02}
PR_20059_NUM_LAYERS = 28


def pr20059_loss_per_dense_layer_s() -> float:
    """14 us: the cross-check of the dense per-layer loss (PR #20059)."""
    gap_ms = PR_20059_TPOT_MS["piecewise"] - PR_20059_TPOT_MS["full"]
    return gap_ms * 1e-3 / PR_20059_NUM_LAYERS


def describe(eager_op_overhead_s: float, pr_device_step_s: float | None = None) -> dict:
    """The derivation, with every number, for a profile's provenance."""
    out = {
        "source": PR_25444_URL,
        "measurement": "Qwen3-Coder-30B-A3B-Instruct-FP8, 1x H100, 10 requests x 1024 in / "
        "128 out; req/s by cudagraph mode: "
        + ", ".join(f"{k} {v}" for k, v in PR_25444_REQ_PER_S.items()),
        "graph_loss_per_decode_step_s": graph_loss_per_decode_step_s(),
        "graph_loss_per_moe_layer_s": graph_loss_per_moe_layer_s(),
        "graph_loss_per_dense_layer_s": eager_op_overhead_s,
        "dense_layer_source": "vLLM custom all-reduce table: eager minus graph latency of the "
        "smallest message (one op dispatched from Python instead of a graph)",
        "dense_layer_cross_check_s": pr20059_loss_per_dense_layer_s(),
        "dense_layer_cross_check_source": PR_20059_URL,
        "sched_cpu_per_step_s": sched_cpu_per_step_s(),
        "rule": "a step without full CUDA graphs costs device time + num_layers x per-layer "
        "loss (additive; an upper bound where the GPU could hide host work)",
        "max_capture_tokens": MAX_CAPTURE_TOKENS,
    }
    if pr_device_step_s is not None:
        out["pr_full_graph_device_step_estimate_s"] = pr_device_step_s
    return out
