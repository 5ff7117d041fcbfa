"""Layouts (TP x DP-attention x EP) and the LayoutCost step model."""

from __future__ import annotations

import math

import pytest

from prorsa.errors import ConfigError
from prorsa.runtime.sim.cost import (
    Layout,
    LayoutCost,
    LayoutTerms,
    get_layout_cost,
    get_layout_terms,
    get_model,
    layout_cost_for,
    layouts_for,
    list_layout_costs,
)
from prorsa.runtime.sim.cost.hardware import get_hardware
from prorsa.runtime.sim.cost.host_costs import (
    graph_loss_per_decode_step_s,
    graph_loss_per_moe_layer_s,
    sched_cpu_per_step_s,
)
from prorsa.runtime.sim.cost.layout import (
    candidate_layouts,
    check_layout,
    kv_capacity_tokens_per_rank,
    weight_bytes_per_gpu,
)

DP8 = "h200-qwen3-30b-a3b-tp1-dp8-ep8"


# ---- layouts --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name", ["tp1", "tp4", "tp2-ep2", "tp1-dp8-ep8", "tp1-dp8-ep8-a2a", "tp2-dp4", "tp4-dp2-ep8"]
)
def test_layout_names_round_trip(name):
    layout = Layout.parse(name)
    assert layout.name == name == str(layout)
    assert layout.gpus == layout.tp * layout.dp
    assert layout.moe_tp == (1 if layout.ep > 1 else layout.gpus)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tp": 0}, "tp"),
        ({"tp": 2, "dp": 2, "ep": 2}, "ep must be 1"),
        ({"moe_comm": "ring"}, "moe_comm"),
        ({"tp": 2, "moe_comm": "alltoall"}, "needs dp > 1"),
    ],
)
def test_bad_layouts_say_why(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Layout(**kwargs)


def test_bad_layout_name():
    with pytest.raises(ConfigError, match="not a layout name"):
        Layout.parse("dp8")


def test_layout_checks_against_the_model():
    dense, moe = get_model("qwen2.5-7b"), get_model("qwen3-30b-a3b")
    with pytest.raises(ConfigError, match="dense"):
        check_layout(dense, Layout(dp=2))
    with pytest.raises(ConfigError, match="tp=8"):
        check_layout(dense, Layout(tp=8))  # 28 heads
    with pytest.raises(ConfigError, match="spans 16 GPUs") as info:
        check_layout(moe, Layout(tp=2, dp=8, ep=16))
    assert "one 8-GPU node" in info.value.hint
    check_layout(moe, Layout(dp=8, ep=8, moe_comm="alltoall"))


def test_weights_and_kv_per_gpu_follow_the_split():
    arch, hw = get_model("qwen3-30b-a3b"), get_hardware("h200")
    one = weight_bytes_per_gpu(arch, Layout())
    ep8 = weight_bytes_per_gpu(arch, Layout(dp=8, ep=8))
    tp8 = weight_bytes_per_gpu(arch, Layout(tp=8, ep=8))
    assert one == pytest.approx(arch.weight_bytes_per_gpu(1), rel=1e-9)
    # EP8 keeps full attention and embeddings on every rank, 1/8 of the experts
    experts = arch.num_layers * arch.num_experts * arch.expert_params(1) * 2
    assert one - ep8 == pytest.approx(experts * 7 / 8, rel=1e-9)
    assert tp8 < ep8
    assert kv_capacity_tokens_per_rank(arch, Layout(dp=8, ep=8), hw) > kv_capacity_tokens_per_rank(
        arch, Layout(), hw
    )


def test_available_layouts_per_model():
    dense = [lay.name for lay in layouts_for("qwen2.5-7b")]
    assert dense == ["tp1", "tp2", "tp4"]  # 28 heads do not split 8 ways
    moe = {lay.name for lay in layouts_for("qwen3-30b-a3b")}
    assert {"tp1", "tp1-dp8-ep8", "tp1-dp8-ep8-a2a", "tp2", "tp4", "tp8-ep8"} <= moe
    assert "tp8" not in moe  # the MoE table has no moe_tp=8 rows for this shape
    big = {lay.name for lay in layouts_for("qwen3-235b-a22b")}
    assert {"tp4", "tp8", "tp1-dp8-ep8"} <= big
    assert not any(Layout.parse(n).gpus < 4 for n in big)  # 470 GB of weights
    for model in ("qwen3-30b-a3b", "qwen3-235b-a22b"):
        cands = {lay.name for lay in candidate_layouts(get_model(model))}
        assert {lay.name for lay in layouts_for(model)} <= cands
    assert layouts_for("llama-3-8b") == []  # no layout terms fitted for it


# ---- the step model -----------------------------------------------------------------
def test_registry_caches_and_names():
    names = list_layout_costs()
    assert DP8 in names and "h200-qwen2.5-7b-tp1" in names
    cost = get_layout_cost(DP8)
    assert get_layout_cost(DP8) is cost
    assert layout_cost_for("qwen3-30b-a3b", "tp1-dp8-ep8") is cost
    assert get_layout_cost(DP8, semantics="sglang") is not cost
    with pytest.raises(ConfigError, match="unknown layout cost"):
        get_layout_cost("h200-qwen3-30b-a3b-tp3")
    with pytest.raises(ConfigError, match="semantics"):
        get_layout_cost(DP8, semantics="trtllm")
    with pytest.raises(ConfigError, match="routing"):
        get_layout_cost(DP8, routing="zipf")


def test_decode_is_linear_in_the_slowest_rank_context():
    cost = get_layout_cost(DP8)
    base, per_ctx = cost.decode_epoch_terms(64)
    assert per_ctx > 0
    for s in (64 * 1024, 64 * 8192, 64 * 32768):
        assert cost.decode_step_s([64] * 8, [s] * 8) == pytest.approx(base + per_ctx * s, rel=1e-12)
    # the step lasts as long as the slowest rank: more context on one rank only
    uneven = [64 * 2048] * 7 + [64 * 16384]
    assert cost.decode_step_s([64] * 8, uneven) == pytest.approx(
        cost.decode_step_s([64] * 8, [64 * 16384] * 8), rel=1e-12
    )
    # ranks are padded to the fullest one: a rank with fewer (equally long) sequences
    # costs no more than the fullest rank
    assert cost.decode_step_s([64] + [8] * 7, [64 * 2048] + [8 * 2048] * 7) == pytest.approx(
        cost.decode_step_s([64] * 8, [64 * 2048] * 8), rel=1e-12
    )
    assert cost.decode_step_s([0] * 8, [0] * 8) == 0.0


def test_decode_run_is_the_sum_of_its_steps():
    cost = get_layout_cost(DP8)
    b, s, k = 48, 48 * 3000, 200
    total = sum(cost.decode_step_s([b] * 8, [s + j * b] * 8) for j in range(k))
    assert cost.decode_run_s(b, s, k) == pytest.approx(total, rel=1e-9)
    assert cost.decode_run_s(b, s, 0) == 0.0


def test_a_prefill_on_one_rank_stalls_every_rank_and_drops_graphs():
    cost = get_layout_cost(DP8)
    batch, ctx = [64] * 8, [64 * 8192] * 8
    decode = cost.decode_step_s(batch, ctx)
    for chunk, mode in ((256, "piecewise"), (2048, "eager")):
        pre = [chunk] + [0] * 7
        prior = [8192] + [0] * 7
        parts = cost.step_breakdown(batch, ctx, pre, prior)
        assert parts["mode"] == mode
        assert parts["graph_loss_s"] == pytest.approx(48 * graph_loss_per_moe_layer_s())
        assert parts["step_s"] > decode + parts["graph_loss_s"]
        assert parts["step_s"] == pytest.approx(cost.step_s(batch, ctx, pre, prior), rel=1e-12)
    # piecewise steps pad every rank to the largest (64 + 256 tokens) for the MoE exchange
    parts = cost.step_breakdown(batch, ctx, [256] + [0] * 7, [8192] + [0] * 7)
    assert parts["padded"] and parts["moe_tokens"] == 8 * (64 + 256)
    # eager steps are not padded
    parts = cost.step_breakdown(batch, ctx, [2048] + [0] * 7, [8192] + [0] * 7)
    assert not parts["padded"] and parts["moe_tokens"] == 64 * 8 + 2048


def test_prefill_chunk_cost_grows_with_prior_context():
    cost = get_layout_cost(DP8)
    short, long = cost.prefill_chunk_s(2048, 0), cost.prefill_chunk_s(2048, 32768)
    terms = get_layout_terms(DP8)
    assert long - short == pytest.approx(terms.attn_prefill_s_per_token2 * 2048 * 32768, rel=1e-9)
    with pytest.raises(ValueError, match="max_step_tokens"):
        cost.prefill_chunk_s(9000)


def test_sglang_semantics_keep_prefill_and_decode_apart():
    vllm, sglang = get_layout_cost(DP8), get_layout_cost(DP8, semantics="sglang")
    assert vllm.mixes_prefill_with_decode and not sglang.mixes_prefill_with_decode
    batch, ctx = [64] * 8, [64 * 8192] * 8
    pre, prior = [256] + [0] * 7, [8192] + [0] * 7
    parts = sglang.step_breakdown(batch, ctx, pre, prior)
    assert parts["mode"] == "eager" and not parts["padded"]
    # the prefilling rank's own decodes wait: its tokens are the chunk alone
    assert parts["moe_tokens"] == 256 + 7 * 64
    assert sglang.decode_step_s(batch, ctx) == pytest.approx(vllm.decode_step_s(batch, ctx))


def test_async_scheduling_removes_the_scheduler_time():
    sync, overlapped = get_layout_cost(DP8), get_layout_cost(DP8, async_scheduling=True)
    batch, ctx = [32] * 8, [32 * 4096] * 8
    gap = sync.decode_step_s(batch, ctx) - overlapped.decode_step_s(batch, ctx)
    assert gap == pytest.approx(sched_cpu_per_step_s(), rel=1e-5)


def test_power_law_routing_is_slower_than_balanced_at_large_batches():
    bal = get_layout_cost(DP8)
    skew = get_layout_cost(DP8, routing="power_law_1.2")
    pre = [4096] * 8
    assert skew.step_s([0] * 8, [0] * 8, pre, [0] * 8) > bal.step_s([0] * 8, [0] * 8, pre, [0] * 8)


def test_alltoall_moves_only_routed_tokens():
    gather = get_layout_cost(DP8)
    a2a = get_layout_cost(DP8 + "-a2a")
    # a GPU no longer runs every rank's tokens through its experts
    assert a2a.prefill_tokens_per_s_per_gpu() > gather.prefill_tokens_per_s_per_gpu()
    assert a2a.decode_step_s([64] * 8, [64 * 2048] * 8) < gather.decode_step_s(
        [64] * 8, [64 * 2048] * 8
    )


def test_dense_layout_matches_the_kernel_sums():
    """A single-rank dense layout is the TP profile's kernel sum plus host terms."""
    pytest.importorskip("pandas")
    from prorsa.runtime.sim.cost.aiconfigurator import kernel_breakdown_decode

    cost = get_layout_cost("h200-qwen2.5-32b-tp4")
    for b, ctx in ((16, 4096), (64, 2048), (128, 8192)):
        parts = kernel_breakdown_decode("qwen2.5-32b", b, ctx, tp=4)
        expected = sum(parts.values()) + cost.sched_cpu_s
        # the attention term is a fit (its error is in the provenance); the rest is exact
        assert cost.decode_step_s(b, b * ctx) == pytest.approx(expected, rel=0.06), (b, ctx)


def test_throughput_helpers_are_consistent_with_steps():
    cost = get_layout_cost(DP8)
    step = cost.decode_step_s([32] * 8, [32 * 4096] * 8)
    assert cost.decode_tokens_per_s_per_gpu(32, 4096) == pytest.approx(8 * 32 / step / 8)
    pre_step = cost.step_s([0] * 8, [0] * 8, [4096] * 8, [0] * 8)
    assert cost.prefill_tokens_per_s_per_gpu(4096) == pytest.approx(8 * 4096 / pre_step / 8)


def test_per_rank_arguments_are_checked():
    cost = get_layout_cost(DP8)
    with pytest.raises(ValueError, match="8 values"):
        cost.decode_step_s([1, 2], [10, 20])
    with pytest.raises(ValueError, match="one value per rank"):
        cost.decode_step_s(4, 400)
    with pytest.raises(ValueError, match=">= 0"):
        cost.decode_step_s([-1] + [0] * 7, [0] * 8)
    with pytest.raises(ValueError, match="max_batch"):
        cost.decode_step_s([300] * 8, [0] * 8)
    single = get_layout_cost("h200-qwen2.5-7b-tp1")
    assert single.decode_step_s(8, 8 * 1000) == single.decode_step_s([8], [8000])


def test_graph_loss_numbers_come_from_the_published_figures():
    assert graph_loss_per_decode_step_s() == pytest.approx((10 / 4.07 - 10 / 5.98) / 127, rel=1e-12)
    assert 6.0e-3 < graph_loss_per_decode_step_s() < 6.4e-3
    assert 0.4e-3 < sched_cpu_per_step_s() < 0.5e-3
    dense = get_layout_terms("h200-qwen2.5-7b-tp1")
    per_layer = dense.graph_loss_s / dense.num_layers
    assert 10e-6 < per_layer < 25e-6  # one eager op (all-reduce table), ~PR #20059's 14 us


# ---- terms ----------------------------------------------------------------------------
def test_terms_round_trip_and_validation(tmp_path):
    terms = get_layout_terms(DP8)
    path = terms.save(tmp_path / "t.json")
    again = LayoutTerms.load(path)
    assert again.layout == terms.layout and again.token_grid == terms.token_grid
    for a, b in zip(again.moe_s["balanced"], terms.moe_s["balanced"], strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    d = terms.to_dict()
    with pytest.raises(ConfigError, match="unknown field 'bogus'"):
        LayoutTerms.from_dict({**d, "bogus": 1})
    with pytest.raises(ConfigError, match="missing field 'dense_s'"):
        LayoutTerms.from_dict({k: v for k, v in d.items() if k != "dense_s"})
    with pytest.raises(ConfigError, match="'dense_s' must be a list"):
        LayoutTerms.from_dict({**d, "dense_s": d["dense_s"][:-1]})
    with pytest.raises(ConfigError, match="gather_s"):
        LayoutTerms.from_dict({**d, "gather_s": []})
    bad = list(d["lm_head_s"])
    bad[3] = math.nan
    with pytest.raises(ConfigError, match="'lm_head_s' entry 3"):
        LayoutTerms.from_dict({**d, "lm_head_s": bad})
    assert isinstance(LayoutCost(again), LayoutCost)


TABLES = (
    __import__("pathlib").Path(__file__).resolve().parents[2]
    / "shared"
    / "data"
    / "profiles"
    / "aiconfigurator-h200-vllm-0.19"
)


@pytest.mark.skipif(not TABLES.is_dir(), reason="no kernel tables beside the checkout")
@pytest.mark.parametrize(
    "name",
    ["h200-qwen2.5-7b-tp2", "h200-qwen3-30b-a3b-tp1-dp8-ep8-a2a", "h200-qwen3-235b-a22b-tp8"],
)
def test_shipped_terms_are_the_fit_of_the_tables(name):
    from prorsa.runtime.sim.cost.layout_fit import Tables, fit_layout_terms

    shipped = get_layout_terms(name)
    fresh = fit_layout_terms(shipped.model, shipped.layout, tables=Tables(TABLES))
    for curve in ("dense_s", "lm_head_s", "attn_decode_per_ctx_token_s", "a2a_decode_s"):
        for a, b in zip(getattr(fresh, curve), getattr(shipped, curve), strict=True):
            assert a == pytest.approx(b, rel=1e-5, abs=1e-12), curve
    for dist, curve in fresh.moe_s.items():
        assert curve == pytest.approx(shipped.moe_s[dist], rel=1e-5)
    assert fresh.kv_capacity_tokens_per_rank == shipped.kv_capacity_tokens_per_rank
    assert fresh.graph_loss_s == pytest.approx(shipped.graph_loss_s, rel=1e-5)


@pytest.mark.skipif(not TABLES.is_dir(), reason="no kernel tables beside the checkout")
def test_dp8_decode_step_rebuilt_from_raw_table_rows():
    """DP8/EP8 decode at 64 sequences per rank, rebuilt from the parquet rows by hand."""
    import pandas as pd

    cost = get_layout_cost(DP8)
    terms = get_layout_terms(DP8)
    moe = pd.read_parquet(TABLES / "moe_vllm_0.19.0_moe_perf.parquet")
    moe = moe[
        (moe.hidden_size == 2048)
        & (moe.inter_size == 768)
        & (moe.moe_tp_size == 1)
        & (moe.moe_ep_size == 8)
        & (moe.moe_dtype == "bfloat16")
        & (moe.distribution == "balanced")
        & (moe.num_tokens == 512)  # 8 ranks x 64 tokens, gathered
    ]
    nccl = pd.read_parquet(TABLES / "nccl_2.29.2_perf.parquet")
    nccl = nccl[
        (nccl.nccl_dtype == "half") & (nccl.num_gpus == 8) & (nccl.message_size == 512 * 2048)
    ]
    gather_ms = sum(
        nccl[nccl.op_name == op].latency.mean() for op in ("all_gather", "reduce_scatter")
    )
    layers = 48
    expected_moe_and_comm = layers * (moe.latency.mean() + gather_ms) * 1e-3
    parts = cost.step_breakdown([64] * 8, [64 * 4096] * 8)
    rebuilt = (
        cost._dense(64)
        + cost._lm_head(64)
        + cost._attn_fixed(64)
        + cost._attn_per_ctx[64] * 64 * 4096
        + expected_moe_and_comm
        + terms.sched_cpu_s
    )
    assert parts["step_s"] == pytest.approx(rebuilt, rel=1e-4)
    # the MoE and its exchange are the larger part of this step
    assert expected_moe_and_comm > 0.3 * parts["step_s"]
