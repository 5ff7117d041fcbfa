"""The layout planner (pure, on toy option tables) and the layout options it reads."""

from __future__ import annotations

import numpy as np
import pytest

from prorsa.errors import ConfigError
from prorsa.policy.layout_plan import (
    LayoutOption,
    WorkloadShape,
    mixed_gpu_s_per_token,
    plan_layouts,
)
from prorsa.workload.spec import TrajectorySpec


def option(name, gpus, prefill, decode, colocated_us, kv=1e6, dp=1):
    return LayoutOption(
        name=name,
        gpus=gpus,
        dp_ranks=dp,
        prefill_tokens_per_s_per_gpu=prefill,
        decode_tokens_per_s_per_gpu=decode,
        colocated_gpu_s_per_prefill_token=colocated_us * 1e-6,
        kv_tokens_per_gpu=kv,
    )


# prefill is best on "small", decode on "wide"; a colocated prefill token costs "wide" 10x
TOY = [
    option("small", 1, prefill=50_000, decode=2_000, colocated_us=20),
    option("mid", 4, prefill=30_000, decode=2_500, colocated_us=40),
    option("wide", 8, prefill=20_000, decode=3_000, colocated_us=200),
]


def test_planner_picks_each_roles_best_layout():
    plan = plan_layouts(TOY, prefill_share=0.5)
    assert plan.prefill == "small"  # most prefill tokens/s per GPU
    assert plan.decode == "wide"  # most decode tokens/s per GPU
    # colocated, p = 0.5: small 0.5*20 + 0.5*500 = 260 us; mid 20 + 200 = 220; wide 100 + 167
    assert plan.colocated == "mid"
    assert plan.as_layouts() == {"prefill": "small", "decode": "wide", "colocated": "mid"}
    assert plan.slot_gpus(TOY) == 8


def test_colocated_layout_follows_the_prefill_share():
    # decode-only work: the best decode layout; prefill-heavy: the cheapest prefill token
    assert plan_layouts(TOY, prefill_share=0.0).colocated == "wide"
    assert plan_layouts(TOY, prefill_share=0.95).colocated == "small"
    costs = {o.name: mixed_gpu_s_per_token(o, 0.3) for o in TOY}
    assert plan_layouts(TOY, prefill_share=0.3).colocated == min(costs, key=costs.get)


def test_ties_go_to_fewer_gpus_and_total_gpus_limits_engines():
    twins = [option("a8", 8, 10_000, 3_000, 50), option("a2", 2, 10_000, 3_000, 50)]
    plan = plan_layouts(twins, 0.5)
    assert plan.prefill == plan.decode == plan.colocated == "a2"
    # 8 GPUs in all: an 8-GPU engine leaves no room for a split
    assert plan_layouts(TOY, 0.5, total_gpus=8).decode == "mid"
    with pytest.raises(ConfigError, match="no layout fits"):
        plan_layouts(TOY, 0.5, total_gpus=1)
    with pytest.raises(ConfigError, match="prefill_share"):
        plan_layouts(TOY, 1.5)


def test_workload_shape_of_specs():
    specs = [
        TrajectorySpec("a", [100, 50], [10, 30], [2.0, 0.0]),
        TrajectorySpec("b", [300], [20], [0.0]),
    ]
    shape = WorkloadShape.of(specs)
    assert shape.prefill_tokens == pytest.approx((150 + 300) / 2)
    assert shape.decode_tokens == pytest.approx((40 + 20) / 2)
    assert shape.tool_s == pytest.approx(1.0)
    # contexts at each turn's prefill: a: 100, 160; b: 300 (output-weighted)
    assert shape.decode_context_tokens == pytest.approx((10 * 100 + 30 * 160 + 20 * 300) / 60)
    assert shape.prefill_share == pytest.approx(450 / (450 + 60))
    with pytest.raises(ConfigError):
        WorkloadShape.of([])


# ---- options from the measured layout costs ---------------------------------------------


def test_layout_options_of_a_model():
    from prorsa.runtime.cluster.layouts import layout_names, layout_options

    names = layout_names("h200-qwen3-30b-a3b")
    assert "tp1" in names and "tp1-dp8-ep8-a2a" in names
    options = {o.name: o for o in layout_options("h200-qwen3-30b-a3b", ["tp1", "tp1-dp8-ep8"])}
    assert options["tp1-dp8-ep8"].gpus == 8 and options["tp1-dp8-ep8"].dp_ranks == 8
    # one rank's prefill stalls all eight: far more GPU-time per prefill token than TP1
    dp8, tp1 = options["tp1-dp8-ep8"], options["tp1"]
    assert dp8.colocated_gpu_s_per_prefill_token > 3 * tp1.colocated_gpu_s_per_prefill_token
    assert layout_options("h200-qwen3-30b-a3b", ["tp1", "tp1-dp8-ep8"], max_gpus=4)[0].name == "tp1"
    with pytest.raises(ConfigError, match="no layout cost"):
        layout_options("h200-qwen3-30b-a3b", ["tp3"])
    with pytest.raises(ConfigError, match="no layout costs for model"):
        layout_options("h200-nonexistent")


def test_cluster_spec_quotes_the_same_numbers_as_the_options():
    from prorsa.runtime.cluster.config import ClusterConfig
    from prorsa.runtime.cluster.layouts import layout_option
    from prorsa.runtime.cluster.spec import cluster_spec, load_profiles

    config = ClusterConfig(
        profile="h200-qwen3-30b-a3b-tp1",
        num_slots=2,
        layouts={"prefill": "tp1", "decode": "tp1-dp8-ep8", "colocated": "tp1-dp8-ep8"},
    )
    spec = cluster_spec(config, load_profiles(config), min_dwell_s=10.0)
    prefill = layout_option("h200-qwen3-30b-a3b", "tp1")
    decode = layout_option("h200-qwen3-30b-a3b", "tp1-dp8-ep8")
    assert spec.decode_tokens_per_s_per_gpu == pytest.approx(decode.decode_tokens_per_s_per_gpu)
    assert spec.prefill_tokens_per_s_per_gpu == pytest.approx(prefill.prefill_tokens_per_s_per_gpu)
    assert spec.prefill_interference == pytest.approx(
        decode.colocated_gpu_s_per_prefill_token * prefill.prefill_tokens_per_s_per_gpu
    )


def test_operating_point_grows_with_load_and_respects_capacity():
    from prorsa.runtime.cluster.layouts import operating_point
    from prorsa.runtime.sim.cost.layout_registry import get_layout_cost

    cost = get_layout_cost("h200-qwen3-30b-a3b-tp1-dp8-ep8")
    shape = WorkloadShape(
        prefill_tokens=20_000,
        decode_tokens=2_000,
        tool_s=30.0,
        decode_context_tokens=8_000,
        turns=10,
    )
    points = [operating_point(cost, shape, load) for load in (2, 8, 32, 512)]
    batches = [p.batch_per_gpu for p in points]
    assert np.all(np.diff(batches) > 0)
    assert all(0 < b <= load for b, load in zip(batches, (2, 8, 32, 512), strict=True))
    cap = min(cost.max_batch, cost.kv_capacity_tokens // 8_000)
    assert batches[-1] == pytest.approx(cap / cost.tp)
    with pytest.raises(ConfigError):
        operating_point(cost, shape, 0)


# ---- the start plan --------------------------------------------------------------------


def shape(**kw):
    base = dict(
        prefill_tokens=10_000,
        decode_tokens=10_000,
        tool_s=10.0,
        decode_context_tokens=8_000,
        turns=10,
        reprefill_own_cache_tokens=12_000,
        reprefill_no_cache_tokens=100_000,
    )
    return WorkloadShape(**{**base, **kw})


def test_split_prefill_factor_follows_reuse_and_cache():
    from prorsa.policy.layout_plan import split_prefill_factor

    s = shape()
    assert split_prefill_factor(s, "kv-store", 0.0) == 1.0
    assert split_prefill_factor(s, "pull", 0.0) == 1.0
    assert split_prefill_factor(s, "reprefill", 1.0) == pytest.approx(1.2)
    assert split_prefill_factor(s, "reprefill", 0.0) == pytest.approx(10.0)
    assert split_prefill_factor(s, "reprefill", 0.5) == pytest.approx(5.6)


def test_start_plan_splits_only_where_the_split_is_faster():
    from prorsa.policy.layout_plan import plan_start

    # a colocated prefill token costs "wide" ten times a prefill GPU's: split pays with a
    # KV store; under re-prefill without room to cache, the recomputation eats the gain
    options = [
        option("small", 1, prefill=50_000, decode=2_000, colocated_us=20, kv=1e3),
        option("wide", 4, prefill=20_000, decode=4_000, colocated_us=200, kv=1e3),
    ]
    plan = plan_layouts(options, shape().prefill_share, total_gpus=16)
    assert (plan.prefill, plan.decode, plan.colocated) == ("small", "wide", "wide")
    store = plan_start(
        plan, options, shape(), total_gpus=16, load_per_gpu=16, reuse_mode="kv-store"
    )
    assert store.start == "split" and store.split_s < store.colocated_s
    assert store.split_prefill_factor == 1.0 and 0 < store.prefill_fraction < 1
    again = plan_start(plan, options, shape(), total_gpus=16, load_per_gpu=16)
    assert again.start == "colocated" and again.split_prefill_factor > 9
    # decode-only work: nothing to gain from a split
    quiet = shape(prefill_tokens=10, reprefill_own_cache_tokens=10, reprefill_no_cache_tokens=10)
    assert plan_start(plan, options, quiet, total_gpus=16, load_per_gpu=16).start == "colocated"
