"""KV reuse across roles is an explicit component: stock re-prefill by default, a decode->
prefill copy (pull) or a host-DRAM KV store only when configured."""

from __future__ import annotations

import pytest

from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.sim.kv_store import KvStore
from tests.sim_helpers import random_specs, run
from tests.test_sim_behaviour import _conservation

SPLIT = {"policy": "static", "policy_kw": {"prefill_gpus": 2}}


def _run(mode: str, slots: int = 4, **config):
    specs = random_specs(48, seed=21, turns=(3, 8), group=1)
    return specs, run(specs, slots=slots, reuse_mode=mode, **SPLIT, **config)


def test_default_is_stock_reprefill():
    assert ClusterConfig().reuse_mode == "reprefill"


def test_store_and_pull_save_prefill_that_reprefill_pays():
    specs, reprefill = _run("reprefill")
    _, pull = _run("pull")
    _, store = _run("kv-store", kv_store_scope="cluster")
    computed = {n: r.metrics["prefill_tokens_computed"] for n, r in
                (("reprefill", reprefill), ("pull", pull), ("store", store))}  # fmt: skip
    assert computed["store"] < computed["reprefill"]
    assert computed["pull"] < computed["reprefill"]
    assert store.metrics["kv_store_hit_rate"] > 0.9
    assert "kv_store_hit_rate" not in reprefill.metrics
    for result in (reprefill, pull, store):
        _conservation(result, specs)


def test_node_scope_store_misses_across_nodes():
    # 16 one-GPU slots are two nodes; prefill slots 0-1 read only node 0's pool, so
    # trajectories decoded on node 1 miss.
    specs = random_specs(64, seed=5, turns=(3, 6), group=1)
    node = run(specs, slots=16, reuse_mode="kv-store", kv_store_scope="node", **SPLIT)
    shared = run(specs, slots=16, reuse_mode="kv-store", kv_store_scope="cluster", **SPLIT)
    assert node.metrics["kv_store_hit_rate"] < 0.75 < shared.metrics["kv_store_hit_rate"]
    assert node.metrics["prefill_tokens_computed"] > shared.metrics["prefill_tokens_computed"]


def test_store_capacity_evicts_least_recently_used():
    store = KvStore(capacity_tokens=1000, scope="cluster")
    store.write(0, "a", 600)
    store.write(9, "b", 300)
    store.write(3, "c", 300)  # over capacity: "a" (least recent) goes
    assert store.lookup(0, "a", 600) == 0
    assert store.lookup(0, "b", 500) == 300 and store.lookup(0, "c", 100) == 100
    assert store.hit_rate == pytest.approx(400 / 1200)
    store.drop("b")
    assert store.lookup(0, "b", 10) == 0


def test_node_pools_are_separate():
    store = KvStore(capacity_tokens=10_000, scope="node")
    store.write(3, "t", 500)  # GPU 3: node 0
    assert store.lookup(7, "t", 500) == 500 and store.lookup(8, "t", 500) == 0
