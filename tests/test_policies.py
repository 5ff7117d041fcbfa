"""One conformance test for every registered policy, plus hand-made situations."""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace

import numpy as np
import pytest

from prorsa.errors import ConfigError
from prorsa.policy import POLICIES, Allocation, Forecast, make_policy
from prorsa.policy.best_static import search_best_static
from prorsa.policy.demand import DecodePace
from prorsa.runtime.controller import plan_switches, roles_for_allocation
from tests.policy_helpers import HORIZONS, forecast, observation, spec

PARAMS = {"best-static": {"prefill_gpus": 2}}
ROLES8 = ["prefill"] * 2 + ["decode"] * 6


@pytest.mark.parametrize("name", POLICIES.names())
def test_policy_conformance(name):
    policy = make_policy(name, **PARAMS.get(name, {}))
    cluster = spec(8)
    policy.reset(cluster, seed=0)
    cases = [
        (observation(0.0, ["colocated"] * 8), None),
        (observation(5.0, ROLES8, prefill_queue=400_000), forecast(5.0, 150_000.0)),
        (
            observation(6.0, ROLES8, decoding=900, decode_kv=5_500_000),
            forecast(6.0, 1_000.0, decoding=900, kv=5_500_000),
        ),
        (observation(7.0, ROLES8), forecast(7.0, 20_000.0)),
    ]
    decisions = []
    for obs, fc in cases:
        frozen = copy.deepcopy((obs, fc))
        alloc = policy.decide(obs, fc if policy.needs_forecast else None)
        assert isinstance(alloc, Allocation)
        assert repr((obs, fc)) == repr(frozen), "decide must not mutate its inputs"
        roles = roles_for_allocation(alloc, 8, 1) if alloc.gpus else None
        if alloc.gpus is not None:
            assert sum(alloc.gpus.values()) == cluster.total_gpus
            assert alloc.gpus.get("decode", 0) + alloc.gpus.get("colocated", 0) >= 1
            assert len(roles) == 8
        decisions.append(alloc)
    # Pure and deterministic: a fresh policy on the same inputs decides the same.
    again = make_policy(name, **PARAMS.get(name, {}))
    again.reset(cluster, seed=0)
    replay = [again.decide(o, f if again.needs_forecast else None) for o, f in cases]
    assert [d.gpus for d in replay] == [d.gpus for d in decisions]


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("static", {"prefill_fraction": 1.5}),
        ("static", {"prefill_gpus": 3, "prefill_fraction": 0.5}),  # 3 of 8 fine; 9 is not
        ("threshold", {"prefill_wait_low_s": 2.0, "prefill_wait_high_s": 1.0}),
        ("predictive", {"horizon_s": 0}),
        ("mpc", {"drain_s": -1}),
        ("best-static", {}),
    ],
)
def test_bad_parameters_are_rejected(name, params):
    policy = make_policy(name, **params)
    if params == {"prefill_gpus": 3, "prefill_fraction": 0.5}:
        policy = make_policy(name, prefill_gpus=9)
    with pytest.raises(ConfigError):
        policy.reset(spec(8))


def test_unknown_policy_lists_choices():
    with pytest.raises(ConfigError) as info:
        make_policy("clairvoyant")
    assert "predictive" in info.value.hint


def _first_switch_to_prefill(policy, timeline):
    policy.reset(spec(8), seed=0)
    roles = list(ROLES8)
    for t, queue, rate in timeline:
        alloc = policy.decide(
            observation(t, roles, prefill_queue=queue),
            forecast(t, rate) if policy.needs_forecast else None,
        )
        # Colocated slots prefill too: either way more GPUs now serve prefill.
        if alloc.gpus.get("prefill", 0) + alloc.gpus.get("colocated", 0) > 2:
            return t
    return None


def test_prefill_burst_moves_predictive_before_threshold():
    # A burst of prefill arrives at t=20; the forecast sees it coming from t=15 (5 s
    # ahead); the queue only builds once it has arrived.
    timeline = []
    for t in range(1, 40):
        queue = 600_000 if t >= 20 else 0
        rate = 150_000.0 if t >= 15 else 10_000.0
        timeline.append((float(t), queue, rate))
    predictive = _first_switch_to_prefill(make_policy("predictive"), timeline)
    threshold = _first_switch_to_prefill(make_policy("threshold"), timeline)
    mpc = _first_switch_to_prefill(make_policy("mpc"), timeline)
    assert predictive is not None and threshold is not None and mpc is not None
    assert predictive < 20 <= threshold
    assert mpc < 20


@pytest.mark.parametrize("name", ["predictive", "mpc", "threshold", "oracle"])
def test_no_prefill_slot_outside_colocation_is_decided(name):
    # Between modes a cluster can hold decode and colocated slots and no prefill slot
    # (found in the regime map: predictive divided by zero prefill slots).
    for roles in (["decode", "colocated", "colocated", "colocated"], ["decode"] * 4):
        policy = make_policy(name)
        policy.reset(spec(4))
        obs = observation(30.0, roles, prefill_queue=200_000, decoding=1000)
        fc = None if name == "oracle" else forecast(30.0, 40_000.0, decoding=1000)
        alloc = policy.decide(obs, fc)
        assert sum(alloc.gpus.values()) == 4


def test_predictive_weighs_switch_cost_and_lost_cache():
    # 2.8 prefill slots needed on 2: worth a switch when switching is cheap...
    cheap = make_policy("predictive", switch_cost_weight=0.1)
    cheap.reset(spec(8))
    gpus = cheap.decide(observation(1.0, ROLES8), forecast(1.0, 40_000.0)).gpus
    assert gpus.get("prefill", 0) + gpus.get("colocated", 0) > 2
    # ...but not when prefill reads the contexts the decode slots to move cache (pull:
    # rebuilt next turn), and colocation (which would serve it all) runs another layout:
    # reaching it would reshard every slot and lose every cached context.
    layouts = {"prefill": "tp1", "decode": "tp1", "colocated": "tp2"}
    cluster = replace(spec(8), role_layouts=layouts, reshard_latency_s=20.0)
    obs = observation(1.0, ROLES8, decode_kv=5_000_000, kv_capacity=10_000_000)
    moved = {}
    for reuse in ("pull", "reprefill"):
        costly = make_policy("predictive")
        costly.reset(replace(cluster, reuse_mode=reuse))
        moved[reuse] = costly.decide(obs, forecast(1.0, 40_000.0, kv=5_000_000))
    assert moved["pull"].gpus["prefill"] == 2 and "hold" in moved["pull"].reason
    # Under re-prefill a split's prefill engines never read the decode slots' caches.
    assert moved["reprefill"].gpus["prefill"] > 2


@pytest.mark.parametrize("name", ["predictive", "mpc"])
def test_backlog_wins_slots_when_both_sides_are_short(name):
    # A 10M-token prefill backlog on 1 of 4 slots while decode also wants more than its 3
    # (found in the regime map: 235B swe sync, where best-static runs 3P/1D). Summing each
    # side's shortfall made every split look alike, and the policies held one prefill slot
    # for the whole run (0.44x colocation); the cluster moves at its busier side's pace.
    # Colocation is no way out here: prefill costs three times its work there.
    policy = make_policy(name)
    policy.reset(replace(spec(4), colocated_prefill_factor=3.0))
    roles = ["prefill", "decode", "decode", "decode"]
    obs = observation(30.0, roles, prefill_queue=10_000_000, decoding=400)
    alloc = policy.decide(obs, forecast(30.0, 20_000.0, decoding=400))
    assert alloc.gpus.get("prefill", 0) >= 2, alloc.reason


def _with_queued_contexts(obs, trajectories: int, tokens: int):
    """``obs`` with ``trajectories`` waiting for their next prefill, holding ``tokens``."""
    state, held = dict(obs.trajectory_state), dict(obs.trajectory_tokens)
    state["queued"], held["queued"] = trajectories, tokens
    return replace(obs, trajectory_state=state, trajectory_tokens=held)


@pytest.mark.parametrize("name", ["predictive", "mpc"])
def test_queued_contexts_do_not_size_decode_while_prefill_is_bound(name):
    # Found in the regime map: 235B swe sync 64/GPU, best-static's 3P/1D split under a
    # backlog of hours. The 2,048 contexts waiting in the prefill queue counted as decode
    # KV (13 decode slots of 4), and predictive and the oracle gave decode a second slot
    # for 9,400 s (0.78-0.81x against best-static's 1.14x).
    roles = ["prefill", "prefill", "prefill", "decode"]
    cluster = replace(spec(4), colocated_prefill_factor=3.0)
    bound = _with_queued_contexts(
        observation(30.0, roles, prefill_queue=10_000_000, decoding=400), 2_000, 100_000_000
    )
    policy = make_policy(name)
    policy.reset(cluster)
    alloc = policy.decide(bound, forecast(30.0, 20_000.0, decoding=400))
    assert alloc.gpus.get("prefill", 0) == 3, alloc.reason
    # The same contexts with prefill keeping up: decode caches them between turns, so
    # they do size decode and it takes slots from prefill (40 decoding sequences alone
    # fit one decode slot's batch).
    free = _with_queued_contexts(observation(30.0, roles, decoding=40), 2_000, 100_000_000)
    policy = make_policy(name)
    policy.reset(cluster)
    alloc = policy.decide(free, forecast(30.0, 20_000.0, decoding=40, kv=50_000))
    assert alloc.gpus.get("prefill", 0) < 3, alloc.reason


def test_prefill_bound_needs_a_backlog_no_split_could_clear():
    from prorsa.policy.demand import Sizing, current_load

    sizing, cluster = Sizing(), spec(4)
    roles = ["prefill", "prefill", "decode", "decode"]
    # A slot clears 16k tokens/s at the 0.8 target; the largest split has 3 prefill
    # slots: 240k tokens in 5 s.
    small = current_load(observation(1.0, roles, prefill_queue=100_000))
    beyond_two = current_load(observation(1.0, roles, prefill_queue=200_000))
    large = current_load(observation(1.0, roles, prefill_queue=400_000))
    assert not sizing.prefill_bound(cluster, small, 5.0)
    # More than today's two prefill slots clear, but a 3/1 split would: not bound, so the
    # answer does not change with the split a policy weighs.
    assert not sizing.prefill_bound(cluster, beyond_two, 5.0)
    assert sizing.prefill_bound(cluster, large, 5.0)
    assert not sizing.prefill_bound(cluster, large, 30.0)
    # Colocated engines (no prefill slots) prefill locally: never prefill-bound here.
    colocated = replace(large, prefill_slots=0, decode_slots=4)
    assert not sizing.prefill_bound(cluster, colocated, 5.0)


def _mpc_path_cost(
    path,
    lengths,
    need_p,
    need_d,
    *,
    n,
    start,
    blocked,
    switch_cost_s,
    switching=None,
    pace=None,
    cache=None,
    prefill_rebuild=0.0,
    hold_last=False,
    growth_rebuilds=None,
    shrink_rebuilds=None,
):
    """MPC's model, written out interval by interval: a move blocks its slots for
    ``blocked(prev, x)`` seconds from its interval's start, into later intervals too,
    and no other move may start before they are through (``inf``: such a path); a
    switch under way (``(to prefill, to decode, seconds left)``) blocks from the start.
    ``pace``: decode's load on its slots (else ``need_d`` over them); ``cache[k][x-1]``:
    prefill slots added at split ``x`` (while a move is under way, at the side of it
    with fewer prefill slots); ``prefill_rebuild``: per prefill slot of ``start`` moved
    to decode; ``growth_rebuilds[m]`` / ``shrink_rebuilds[m]``: the first ``m`` decode /
    prefill slots of ``start`` moved to the other side; ``hold_last``: no move in the
    last interval."""
    starts = np.concatenate([[0.0], np.cumsum(lengths)[:-1]])
    total, prev, until, gained, origin = 0.0, start, 0.0, (0, 0), start
    if switching is not None:
        until, gained = switching[2], switching[:2]
    for k, x in enumerate(path):
        if x != prev:
            if starts[k] < until or (hold_last and k == len(path) - 1):
                return np.inf
            origin = prev
            until = starts[k] + blocked(prev, x)
            gained = (max(x - prev, 0), max(prev - x, 0))
            total += switch_cost_s * abs(x - prev)
            # Slots leave each side in one order from the start: a returning one is free.
            if shrink_rebuilds is None:
                total += prefill_rebuild * max(min(prev, start) - min(x, start), 0)
            elif x < prev:
                total += shrink_rebuilds[max(start - x, 0)] - shrink_rebuilds[max(start - prev, 0)]
            if growth_rebuilds is not None and x > prev:
                taken = max(x - start, 0), max(prev - start, 0)
                total += growth_rebuilds[taken[0]] - growth_rebuilds[taken[1]]
        lost = min(max(until - starts[k], 0.0), lengths[k]) / lengths[k]
        eff_p = x - lost * gained[0]
        eff_d = (n - x) - lost * gained[1]
        load_d = need_d[k] / eff_d if pace is None else pace.utilisation(k, [eff_d])[0]
        if cache is None:
            need = need_p[k]
        elif lost > 0:
            need = need_p[k] + max(cache[k][origin - 1], cache[k][x - 1])
        else:
            need = need_p[k] + cache[k][x - 1]
        total += n * max(max(need / eff_p, load_d) - 1, 0) * lengths[k]
        prev = x
    return total


@pytest.mark.parametrize(
    "drains, switching",
    [
        (None, None),
        ([0.5, 9.0, 0.0, 30.0], None),  # the third slot the controller moves is idle
        (None, (1, 0, 2.5)),  # a slot still on its way to prefill for 2.5 s
        ([0.5, 9.0, 0.0, 30.0], (0, 2, 7.0)),
        (None, (1, 0, 60.0)),  # past the horizon: nothing else may move
    ],
)
@pytest.mark.parametrize("priced", [False, "per slot", "by count"])
def test_mpc_dp_matches_brute_force(drains, switching, priced):
    # Switch latency 2 s; moves to decode drain for drain_s (1 s), moves to prefill for
    # the longest drains[i] of the decode slots they take when given (slot i the i-th
    # moved, counted from the start; a slot coming back is priced as the first).
    # ``priced``: decode paced by its step, prefill's cache overflow per split, its caches
    # rebuilt when slots leave it, and the decode contexts lost by a move to prefill,
    # dearer per slot the more it takes.
    policy = make_policy("mpc", drain_s=1.0, switch_cost_s=0.5)
    policy.reset(spec(6))

    def blocked(prev, x):
        if drains is None or x <= prev:
            return 2.0 + 1.0
        taken = range(max(prev - 2, 0), max(x - 2, 0))
        returning = range(max(min(2, x) - prev, 0))
        return 2.0 + max((drains[i] for i in (*taken, *returning)), default=0.0)

    rng = np.random.default_rng(0)
    lengths = np.array([1.0, 1.0, 3.0, 5.0, 20.0])
    for _ in range(8):
        need_p = rng.uniform(0, 5, 5)
        need_d = rng.uniform(0, 5, 5)
        drain_arg = None if drains is None else np.asarray(drains)
        pace = cache = grow = shrink = None
        rebuild = 0.0
        if priced:
            pace = DecodePace(
                _paced_spec(6), rng.uniform(0, 400, 5), np.full(5, 4096.0),
                rng.uniform(0, 3, 5), 64.0,
            )  # fmt: skip
            cache, rebuild = rng.uniform(-1, 2, (5, 5)), 0.7
        if priced == "by count":
            # Each slot's own price, in the order the controller moves them (not sorted).
            grow = np.concatenate([[0.0], np.cumsum(rng.uniform(0, 3, 4))])
            shrink = np.concatenate([[0.0], np.cumsum(rng.uniform(0, 3, 4))])
        # Every slot alike: the first m prefill slots cost m times one (the brute force
        # below prices them per slot).
        planned_shrink = rebuild * np.arange(5) if shrink is None else shrink
        plan = policy.plan(
            2, lengths, need_p, need_d, decode_slot_drains=drain_arg, switching=switching,
            pace=pace, cache_need_p=cache, hold_last=bool(priced), growth_rebuilds=grow,
            shrink_rebuilds=planned_shrink,
        )  # fmt: skip

        def cost(
            path, need_p=need_p, need_d=need_d, pace=pace, cache=cache, rebuild=rebuild,
            grow=grow, shrink=shrink,
        ):  # fmt: skip
            return _mpc_path_cost(
                path, lengths, need_p, need_d, n=6, start=2, blocked=blocked,
                switch_cost_s=0.5, switching=switching, pace=pace, cache=cache,
                prefill_rebuild=rebuild, hold_last=bool(priced), growth_rebuilds=grow,
                shrink_rebuilds=shrink,
            )  # fmt: skip

        best = min(itertools.product(range(1, 6), repeat=5), key=cost)
        assert cost(plan) == pytest.approx(cost(best))
        if switching is not None and switching[2] > lengths.sum():
            assert plan == [2] * 5


def _paced_spec(num_slots: int):
    """``spec(num_slots)`` quoting decode throughput by load: a 10 ms step plus 0.01 ms
    per sequence up to a batch of 512 (later sequences wait), at one context."""
    loads = (1, 4, 16, 64, 256, 512, 1024, 4096)
    table = tuple((float(b), 4096.0, min(b, 512) / (0.010 + 0.00001 * min(b, 512))) for b in loads)
    return replace(spec(num_slots), decode_tokens_per_s_by_load=table)


def test_decode_step_ratio_is_sublinear_until_the_batch_limit():
    paced = _paced_spec(4)
    ratio = paced.decode_step_ratio(np.array([64.0, 256.0, 512.0, 1024.0]), 4096.0, 64.0)
    step = {b: 0.010 + 0.00001 * b for b in (64, 256)}
    assert ratio[0] == pytest.approx(1.0)
    assert ratio[1] == pytest.approx(step[256] / step[64], rel=1e-6)  # 1.14x, not 4x
    # Past the batch limit the extra sequences wait: the time per token doubles with them.
    assert ratio[3] == pytest.approx(2 * ratio[2], rel=1e-6)


@pytest.mark.parametrize(
    "layouts",
    [None, {"prefill": "tp1", "decode": "tp1-dp8-ep8-a2a", "colocated": "tp4"}],
)
def test_cluster_specs_quote_decode_by_load(layouts):
    from prorsa.runtime.cluster.config import ClusterConfig
    from prorsa.runtime.cluster.spec import cluster_spec, load_profiles

    if layouts is None:
        config = ClusterConfig(profile="h200-qwen2.5-7b-tp1", num_slots=4)
    else:
        config = ClusterConfig(profile="h200-qwen3-30b-a3b-tp1", num_slots=4, layouts=layouts)
    quoted = cluster_spec(config, load_profiles(config), 10.0)
    assert quoted.decode_tokens_per_s_by_load
    loads = np.array([16.0, 64.0, 128.0, 256.0])
    ratio = quoted.decode_step_ratio(loads, 8192.0, 64.0)
    assert ratio[1] == pytest.approx(1.0)
    assert np.all(np.diff(ratio) > 0)
    # Memory-bound decode: twice the batch costs less than twice the step.
    assert ratio[2] < 2.0
    # The configuration's KV limit holds too (and a TP engine's batch limit; layout
    # engines batch by their own, as the simulator's do): past it the extra sequences
    # wait, so the time per token doubles with the load.
    overrides = [{"kv_capacity_tokens": 64 * 8192}]
    if layouts is None:
        overrides.append({"max_batch": 64})
    for override in overrides:
        capped = cluster_spec(replace(config, **override), load_profiles(config), 10.0)
        over = capped.decode_step_ratio(np.array([64.0, 128.0]), 8192.0, 16.0)
        assert over[1] == pytest.approx(2 * over[0], rel=1e-9), override


def test_mpc_paces_decode_at_the_context_of_what_decodes():
    # 100 sequences of 2k context decode; 10M tokens of context wait in tools. The KV
    # decode must hold counts them; the step's cost does not.
    two_contexts = tuple(
        (float(b), float(ctx), b / (0.010 + 0.00001 * b * ctx / 2048))
        for ctx in (2048, 32768)
        for b in (1, 16, 64, 256)
    )
    cluster = replace(spec(4), decode_tokens_per_s_by_load=two_contexts)
    obs = observation(30.0, ["prefill", "decode", "decode", "decode"], decoding=100)
    obs = replace(obs, trajectory_tokens={**obs.trajectory_tokens, "decoding": 204_800})
    tokens = {**obs.trajectory_tokens, "in_tool": 10_000_000}
    obs = replace(obs, trajectory_tokens=tokens)
    policy = make_policy("mpc", quantile=None)
    policy.reset(cluster)
    pace = policy.requirements(obs, forecast(30.0, 1_000.0, decoding=100, kv=204_800))[3]
    assert pace.context_tokens == pytest.approx(np.full(len(HORIZONS), 2048.0))
    assert pace.kv_slots[0] > 10_000_000 / 1_000_000  # the idle contexts in the KV


def test_mpc_paces_decode_by_its_step_not_a_target_batch():
    # 600 sequences on 2 of 4 slots: 300 per GPU, 4.7x a 64-sequence target batch, but
    # their step is only 1.22x the target's. Prefill needs ~1.6 slots. Sized by batch,
    # decode looks the busier side and takes a prefill slot; paced by its step, prefill
    # would be the busier side after that move, and the split holds. (Found in the
    # regime map: Qwen3-30B-A3B search sync 128/GPU, 0.90x of holding the split.)
    roles = ["prefill", "prefill", "decode", "decode"]
    # Caches large enough for every context: no prefill cache overflow either way.
    obs = observation(30.0, roles, decoding=600, decode_kv=600 * 4096, kv_capacity=10**8)
    fc = forecast(30.0, 25_600.0, decoding=600, kv=600 * 4096)
    moved = {}
    for paced in (False, True):
        policy = make_policy("mpc", start="split", quantile=None)
        policy.reset(_paced_spec(4) if paced else spec(4))
        moved[paced] = policy.decide(obs, fc).gpus["prefill"]
    assert moved == {False: 1, True: 2}


def test_prefill_cache_overflow_counts_what_a_smaller_pool_cannot_hold():
    from prorsa.policy.demand import prefill_cache_overflow_slots, prefill_slot_rebuild_s

    roles = ["prefill", "prefill", "decode", "decode"]
    obs = observation(30.0, roles, decoding=100, decode_kv=3_000_000)
    cached = tuple(
        replace(s, cached_tokens=900_000) if s.role == "prefill" else s for s in obs.slots
    )
    obs = replace(obs, slots=cached)
    cluster = spec(4)  # 1M-token caches; re-prefill; 20k prefill tokens/s per slot
    at = np.array([0.5, 20.0])
    extra = prefill_cache_overflow_slots(obs, cluster, np.array([1, 2, 3]), at, target_util=1.0)
    # 3M live context tokens: 1M over two caches, 2M over one, none over three; what
    # overflows comes back once per 10 s turn cycle, relative to today's two slots.
    per_slot_s = 10.0 * 20_000.0
    assert extra[0] == pytest.approx([1e6 / per_slot_s, 0.0, -1e6 / per_slot_s])
    # Without the workload's shape the contexts are not grown ahead.
    assert np.allclose(extra[1], extra[0])
    # In slots run at a target utilisation, as policies size prefill.
    at_target = prefill_cache_overflow_slots(obs, cluster, np.array([1, 2, 3]), at, target_util=0.8)
    assert at_target == pytest.approx(extra / 0.8)
    assert not prefill_cache_overflow_slots(
        obs, replace(cluster, reuse_mode="kv-store"), np.array([1, 2, 3]), at, target_util=1.0
    ).any()
    # Moving one prefill slot to decode drops the 900k tokens it caches.
    assert prefill_slot_rebuild_s(obs, cluster, 1, 1.0) == pytest.approx(900_000 / 20_000.0)
    # in slots run at 80%, the unit of the prefill need it is weighed against
    assert prefill_slot_rebuild_s(obs, cluster, 1, 0.8) == pytest.approx(900_000 / 16_000.0)
    assert prefill_slot_rebuild_s(obs, cluster, 0, 1.0) == 0.0
    # A prefill engine that reads a KV store copies the contexts instead.
    assert prefill_slot_rebuild_s(obs, replace(cluster, reuse_mode="kv-store"), 1, 1.0) == 0.0


def test_decode_pace_is_exact_at_whole_slots_and_close_between():
    rng = np.random.default_rng(1)
    pace = DecodePace(
        _paced_spec(6), rng.uniform(50, 900, 3), np.full(3, 4096.0), rng.uniform(0, 2, 3), 64.0
    )
    whole = np.arange(1.0, 7.0)
    between = np.array([0.3, 1.37, 2.5, 4.81])
    for k in range(3):
        assert pace.utilisation(k, whole) == pytest.approx(pace.exact(k, whole), rel=1e-12)
        assert pace.utilisation(k, between) == pytest.approx(pace.exact(k, between), rel=0.05)
    longer = pace.held_for_one_more()
    assert longer.utilisation(3, whole) == pytest.approx(pace.exact(2, whole))


def test_mpc_tail_sees_contexts_outgrow_a_smaller_prefill_pool():
    # Decode is a little short on two of four slots and prefill would fit on one, so
    # within the 30 s horizon a prefill slot is worth more to decode. But 150 live
    # trajectories of 0.8M context tokens grow 10k tokens a second (667 tokens per 10 s
    # turn): within 30 s they still fit one prefill slot's 1M-token cache, 15 s later
    # they overflow it by 0.25M, re-prefilled each turn. Only the cost-to-go sees that.
    # (Found in the regime map: Qwen3-30B-A3B mixed sync 64/GPU, 0.92x of holding.)
    from prorsa.policy.types import WorkloadShape

    roles = ["prefill", "prefill", "decode", "decode"]
    shape = WorkloadShape(
        turns_per_trajectory=16,
        prompt_tokens=1000,
        new_tokens_per_turn=333,
        output_tokens_per_turn=334,
        tool_s_per_call=2.5,
        final_context_tokens=12_000,
    )
    obs = replace(observation(30.0, roles, decoding=150, decode_kv=800_000), workload=shape)
    fc = forecast(30.0, 16_000.0, decoding=150, kv=800_000)
    kept = {}
    for tail_s in (0.0, 30.0):
        policy = make_policy("mpc", start="split", quantile=None, tail_s=tail_s)
        policy.reset(spec(4))
        kept[tail_s] = policy.decide(obs, fc).gpus["prefill"]
        assert len(policy.last_plan_) == len(HORIZONS)
    assert kept == {0.0: 1, 30.0: 2}


@pytest.mark.parametrize("name", ["predictive", "mpc"])
def test_resizing_a_split_prices_the_reshard(name):
    # Prefill and decode of different layouts: a slot moving between them reshards (20 s
    # here), not the 2 s relabel (found in the regime map: 235B search sync 16/GPU, where
    # the oracle moved a TP8 decode slot to a DP8 prefill engine, priced as a relabel).
    # Prefill about a quarter over its one slot: a second slot saves more over the payback
    # window than a relabel costs (2 s a slot), less than a reshard (20 s).
    roles = ["prefill", "decode", "decode", "decode"]
    obs = observation(30.0, roles, decoding=100)
    fc = forecast(30.0, 18_000.0, decoding=100)
    moved = {}
    for layouts in ({"prefill": "tp1", "decode": "tp1"}, {"prefill": "tp1", "decode": "tp8"}):
        policy = make_policy(name)
        policy.reset(
            replace(
                spec(4),
                role_layouts={**layouts, "colocated": "tp4"},
                reshard_latency_s=20.0,
                colocated_prefill_factor=3.0,
            )
        )
        moved[layouts["decode"]] = policy.decide(obs, fc).gpus.get("prefill", 0)
    assert moved["tp1"] > 1  # the relabel pays for the burst
    assert moved["tp8"] == 1  # the reshard does not


def _burst_forecast(t: float, prefill_by_horizon, sequences: float) -> Forecast:
    """Cumulative prefill tokens per horizon (a burst stops growing), steady decode."""
    h = np.asarray(HORIZONS)
    point = {
        "prefill_tokens": np.asarray(prefill_by_horizon, float),
        "decode_tokens": 50.0 * sequences * h,
        "decode_sequences": np.full(len(h), sequences),
        "decode_kv_tokens": np.full(len(h), 500_000.0),
    }
    return Forecast(t, HORIZONS, point, quantiles={0.5: point, 0.9: point})


def test_predictive_judges_a_switch_over_its_payback_window():
    # 1 prefill + 3 decode slots; colocation pools them, so with prefill 1.5 slots and
    # decode 3 it serves what no split does, but reaching it reshards the prefill slot
    # (20 s). Demand that lasts pays for that; a burst that is over within 5 s does not
    # (found in the regime map: 235B search sync 16/GPU, where predictive resharded for a
    # sync step's opening burst and lost 8%).
    layouts = {"prefill": "tp1", "decode": "tp4", "colocated": "tp4"}
    cluster = replace(spec(4), role_layouts=layouts, reshard_latency_s=20.0)
    roles = ["prefill", "decode", "decode", "decode"]
    obs = observation(30.0, roles, decoding=192)
    per_s = 1.5 * 20_000 * 0.8  # 1.5 prefill slots at the sizing target
    lasting = [per_s * h for h in HORIZONS]
    burst = [per_s * min(h, 5.0) for h in HORIZONS]
    chosen = {}
    for name, tokens in (("lasting", lasting), ("burst", burst)):
        policy = make_policy("predictive", payback_s=60.0)
        policy.reset(cluster)
        chosen[name] = policy.decide(obs, _burst_forecast(30.0, tokens, 192.0)).gpus
    assert chosen["lasting"] == {"colocated": 4}
    # nor a reshard of decode slots into prefill for it
    assert chosen["burst"] == {"prefill": 1, "decode": 3}


def test_predictive_counts_savings_only_once_a_switch_completes():
    # The lasting demand above colocates when the 20 s reshard leaves 40 s of a 60 s
    # payback window; a reshard as long as the window saves nothing (found in the regime
    # map: 235B search async 16/GPU, where predictive resharded 16 of 32 GPUs for the
    # opening burst, waited 37 s for them and ended at 0.77x of colocation).
    per_s = 1.5 * 20_000 * 0.8
    roles = ["prefill", "decode", "decode", "decode"]
    obs = observation(30.0, roles, decoding=192)
    chosen = {}
    for reshard_s in (20.0, 60.0):
        cluster = replace(
            spec(4),
            role_layouts={"prefill": "tp1", "decode": "tp4", "colocated": "tp4"},
            reshard_latency_s=reshard_s,
        )
        policy = make_policy("predictive", payback_s=60.0)
        policy.reset(cluster)
        fc = _burst_forecast(30.0, [per_s * h for h in HORIZONS], 192.0)
        chosen[reshard_s] = policy.decide(obs, fc).gpus
    assert chosen[20.0] == {"colocated": 4}
    assert chosen[60.0] == {"prefill": 1, "decode": 3}


def test_decode_drain_follows_the_longest_running_sequence():
    from prorsa.policy.demand import decode_drain_s
    from prorsa.policy.types import WorkloadShape

    shape = WorkloadShape(10, 1000, 300, 400, 2.0, 9000)
    roles = ["prefill", "decode", "decode", "decode"]
    cluster = spec(4)  # a decode slot decodes 5,000 tokens/s

    def drain(decoding, *, workload=shape, slots=1, **changes):
        obs = replace(observation(10.0, roles, decoding=decoding), workload=workload)
        return decode_drain_s(obs, replace(cluster, **changes), slots)

    # 30 sequences a slot: the longest has 400 * H(30) = 1,598 tokens to go, one a
    # 6 ms step (30 sequences at 5,000 tokens/s).
    assert drain(90) == pytest.approx(400 * sum(1 / k for k in range(1, 31)) * 30 / 5_000)
    assert drain(0) == 0.0
    assert drain(900) == 60.0  # capped at the drain timeout
    assert drain(900, drain_timeout_s=20.0) == 20.0
    assert drain(90, switch_mode="migrate") == 0.0
    assert drain(90, workload=None) == 0.0
    assert drain(90, slots=0) == 0.0


def test_predictive_does_not_move_decode_slots_whose_drain_outlasts_the_payback():
    # Found in the regime map (235B mixed sync 16/GPU, half context growth): predictive
    # moved two decode slots to prefill for a burst; they drained for the 60 s timeout
    # and the run ended at 0.93x colocation.
    from prorsa.policy.types import WorkloadShape

    roles = ["prefill", "decode", "decode", "decode"]
    per_s = 2.0 * 20_000 * 0.8  # two prefill slots' worth, lasting
    chosen = {}
    for output_tokens in (40.0, 4_000.0):
        shape = WorkloadShape(10, 1000, 300, output_tokens, 2.0, 9000)
        obs = replace(observation(30.0, roles, decoding=150), workload=shape)
        policy = make_policy("predictive", payback_s=30.0)
        # DP8 attention: a colocated prefill stalls eight ranks, so only splits compete.
        policy.reset(replace(spec(4), dp_attention_ranks=8))
        fc = _burst_forecast(30.0, [per_s * h for h in HORIZONS], 150.0)
        chosen[output_tokens] = policy.decide(obs, fc).gpus
    assert chosen[40.0] == {"prefill": 2, "decode": 2}
    assert chosen[4_000.0] == {"prefill": 1, "decode": 3}


def test_predictive_moves_draining_slots_to_prefill_under_a_backlog_no_split_clears():
    # The drain above delays a move; under a backlog of hours the prefill it adds is
    # short for the whole window after it completes, so the move still pays (235B swe
    # sync 64/GPU: priced with the drain eating the window, predictive moved back to
    # prefill at 1,777 s instead of 331 s and fell from 1.15x to 1.09x).
    from prorsa.policy.types import WorkloadShape

    roles = ["prefill", "decode", "decode", "decode"]
    shape = WorkloadShape(10, 1000, 300, 4_000.0, 2.0, 9000)
    cluster = replace(spec(4), dp_attention_ranks=8)
    chosen = {}
    for backlog in (0, 10_000_000):
        obs = replace(observation(30.0, roles, decoding=150, prefill_queue=backlog), workload=shape)
        policy = make_policy("predictive", payback_s=30.0)
        policy.reset(cluster)
        per_s = 2.0 * 20_000 * 0.8
        fc = _burst_forecast(30.0, [per_s * h for h in HORIZONS], 150.0)
        chosen[backlog] = policy.decide(obs, fc).gpus
    assert chosen[0] == {"prefill": 1, "decode": 3}
    assert chosen[10_000_000]["prefill"] > 1


def _running(obs, sequences, output_tokens):
    """``obs`` with these running sequences per slot and this mean output per turn."""
    from prorsa.policy.types import WorkloadShape

    return replace(
        obs,
        slots=[
            replace(slot, running_sequences=n) for slot, n in zip(obs.slots, sequences, strict=True)
        ],
        workload=WorkloadShape(10, 1000, 300, output_tokens, 2.0, 9000),
    )


def test_decode_slot_drains_follow_the_controllers_order_and_bound_decode_drain_s():
    from prorsa.policy.demand import decode_drain_s, decode_slot_drains_s

    roles = ["prefill", "decode", "decode", "decode"]
    obs = _running(observation(10.0, roles, decoding=140), [0, 40, 10, 90], 400)
    drains = decode_slot_drains_s(obs, spec(4), 5)
    assert 0 < drains[0] < drains[1] < drains[2] and not drains[3:].any()  # three slots
    assert [decode_drain_s(obs, spec(4), m) for m in range(4)] == [0.0, *drains[:3]]
    assert not decode_slot_drains_s(obs, replace(spec(4), switch_mode="migrate"), 3).any()


def test_mpc_prices_a_move_by_the_drains_of_the_decode_slots_it_takes():
    from prorsa.policy.mpc import _longest_drain_taken

    # Six slots, two in prefill now; the controller would move decode slots whose
    # drains are, in its order, 0.5, 9, 0 and 30 s. Entry [prev - 1, next - 1].
    drains = _longest_drain_taken(np.array([0.5, 9.0, 0.0, 30.0]), np.arange(1, 6), 2)
    assert drains[1, 2] == 0.5 and drains[2, 3] == 9.0  # a second move takes the second
    assert drains[3, 4] == 0.0 and drains[1, 4] == 9.0
    # A slot that left prefill earlier in the plan and returns is priced as the first.
    assert drains[0, 1] == 0.5 and drains[0, 3] == 9.0
    assert not drains[np.tril_indices(5)].any()  # moves to decode: not decode drains


def test_mpc_caps_decode_drains_at_drain_s_under_a_backlog_no_split_clears():
    roles = ["prefill", "decode", "decode", "decode"]
    drains = {}
    for backlog in (0, 10_000_000):
        obs = observation(10.0, roles, decoding=140, prefill_queue=backlog)
        obs = _running(obs, [0, 0, 40, 90], 4_000)
        policy = make_policy("mpc", drain_s=2.0)
        policy.reset(spec(4))
        drains[backlog] = list(policy.decode_slot_drains(obs, 30.0))
    assert drains[0][0] == 0.0 and drains[0][1] > 2.0  # the first two moved (of 4 slots)
    # The idle slot still drains at once; the busy one at most drain_s.
    assert drains[10_000_000] == [0.0, 2.0]


@pytest.mark.parametrize("backlog", [0, 10_000_000])
def test_mpc_prices_the_drain_of_the_decode_slots_it_moves(backlog):
    # Prefill wants a second slot for 10 s. Decode slots that drain within a few seconds
    # are worth moving; ones whose sequences run for the 60 s drain timeout would reach
    # prefill after the burst (235B mixed sync 16/GPU, half context growth: MPC and the
    # oracle, priced at a 2 s drain, ran at 0.90x colocation there) - unless a backlog no
    # split clears keeps prefill short long after the drain.
    from prorsa.policy.types import WorkloadShape

    roles = ["prefill", "decode", "decode", "decode"]
    per_s = 2.0 * 20_000 * 0.8
    chosen = {}
    for output_tokens in (40.0, 4_000.0):
        shape = WorkloadShape(10, 1000, 300, output_tokens, 2.0, 9000)
        obs = replace(observation(30.0, roles, decoding=150, prefill_queue=backlog), workload=shape)
        policy = make_policy("mpc", start="split")
        policy.reset(replace(spec(4), dp_attention_ranks=8))
        fc = _burst_forecast(30.0, [per_s * min(h, 10.0) for h in HORIZONS], 150.0)
        chosen[output_tokens] = policy.decide(obs, fc).gpus["prefill"]
    if backlog:
        assert chosen[40.0] > 1 and chosen[4_000.0] > 1
    else:
        assert chosen == {40.0: 2, 4_000.0: 1}


def test_best_static_search_finds_the_minimum():
    curve = {x: (x - 5) ** 2 + 3 for x in range(1, 32)}
    best, seen = search_best_static(curve.__getitem__, 32)
    assert best == 5 and len(seen) < 31
    best, seen = search_best_static(curve.__getitem__, 8)
    assert best == 5 and len(seen) == 7


def test_controller_plan_never_touches_switching_or_dwelling_slots():
    obs = observation(
        10.0, ["prefill", "decode", "decode", "decode"], since=8.0, switching={1: "prefill"}
    )
    alloc = Allocation(gpus={"prefill": 3, "decode": 1})
    # slot 1 already heading to prefill counts toward the target; the others dwell.
    assert plan_switches(obs, alloc, min_dwell_s=5.0) == []
    orders = plan_switches(obs, alloc, min_dwell_s=1.0)
    assert orders and all(sid != 1 for sid, _ in orders)
    assert len(orders) == 1  # 1 + 1 switching already = 2; one more reaches 3


@pytest.mark.parametrize("name", ["predictive", "mpc"])
def test_a_mode_change_held_back_by_dwell_is_finished_not_retuned(name):
    # Found in the regime map (235B tau2 sync 128/GPU): predictive disaggregated from
    # colocation, dwell held one colocated slot back, and the next tick tuned the split
    # on the slots already moved, sending the straggler to decode (a 20 s reshard);
    # 18 switches where 4 do.
    policy = make_policy(name)
    policy.reset(spec(4))
    colocated = observation(50.0, ["colocated"] * 4)
    assert policy.apply_mode(colocated, 3, name).gpus == {"prefill": 3, "decode": 1}
    straggler = observation(52.0, ["prefill", "prefill", "colocated", "decode"])
    finishing = policy.apply_mode(straggler, None, name)
    assert finishing is not None and finishing.gpus == {"prefill": 3, "decode": 1}
    # and back: a colocation under way is finished too
    assert policy.apply_mode(straggler, "colocated", name).gpus == {"colocated": 4}
    leftover = observation(60.0, ["colocated", "colocated", "prefill", "decode"])
    assert policy.apply_mode(leftover, None, name).gpus == {"colocated": 4}
    # once every slot is in one mode, the split is the policy's to tune again
    assert (
        policy.apply_mode(observation(70.0, ["prefill", "decode", "decode", "decode"]), None, name)
        is None
    )


def test_mode_choice_colocates_dense_models_and_splits_under_dp_attention():
    from dataclasses import replace

    from prorsa.policy.demand import choose_mode

    colocated = observation(5.0, ["colocated"] * 8, decode_kv=0)
    dense = spec(8)
    # Pooled capacity always serves at least as much as a split: stay colocated.
    assert (
        choose_mode(
            colocated,
            dense,
            3.0,
            4.0,
            current_prefill=1,
            payback_s=30,
            switch_cost_weight=1.0,
            prefill_target_util=0.8,
        )
        is None
    )
    # With DP8 attention each prefill slot-second stalls 8 ranks: a split pays.
    moe = replace(dense, dp_attention_ranks=8)
    x = choose_mode(
        colocated,
        moe,
        1.5,
        4.0,
        current_prefill=1,
        payback_s=30,
        switch_cost_weight=1.0,
        prefill_target_util=0.8,
    )
    assert isinstance(x, int) and 1 <= x <= 7
    # A split short of prefill on a dense model colocates when the saving pays the switch.
    split = observation(5.0, ROLES8, decode_kv=10_000)
    assert (
        choose_mode(
            split,
            dense,
            5.0,
            2.0,
            current_prefill=2,
            payback_s=30,
            switch_cost_weight=1.0,
            prefill_target_util=0.8,
        )
        == "colocated"
    )


def test_colocated_prefill_costs_less_per_token_when_every_rank_prefills():
    from dataclasses import replace

    from prorsa.policy.demand import choose_mode

    moe = replace(
        spec(8),
        dp_attention_ranks=8,
        colocated_prefill_factor=3.5,  # one rank prefills, seven wait for it
        colocated_packed_prefill_factor=0.9,  # all eight share the stall
        colocated_packed_prefill_ratio=0.9,
    )
    costs = [moe.prefill_interference_at(n) for n in (0.0, 0.1, 1.0, 3.0, 7.2, 50.0)]
    assert costs[0] == pytest.approx(3.5)
    assert costs[-1] == pytest.approx(0.9) and costs[-2] == pytest.approx(0.9)
    assert all(a > b for a, b in itertools.pairwise(costs[:-1]))
    # Without the packed figures (or one rank) the one-rank factor holds at any demand.
    assert replace(moe, colocated_packed_prefill_factor=None).prefill_interference_at(50) == 3.5
    # A start-up burst (every rank prefilling) no longer reads as a reason to split...
    colocated = observation(5.0, ["colocated"] * 8, decode_kv=0)
    burst = dict(current_prefill=1, payback_s=30, switch_cost_weight=1.0, prefill_target_util=0.8)
    assert choose_mode(colocated, moe, 7.0, 1.0, **burst) is None
    one_rank = replace(moe, colocated_packed_prefill_factor=None)
    assert isinstance(choose_mode(colocated, one_rank, 7.0, 1.0, **burst), int)
    # ...while light prefill, which stalls seven ranks for one, still does.
    assert isinstance(choose_mode(colocated, moe, 1.5, 6.5, **burst), int)


def test_colocated_interference_follows_the_work_whatever_utilisation_it_is_sized_at():
    # How often a rank prefills is the prefill work over the packed capacity: a need of
    # 4.0 slots sized at 80% is 3.2 slots of work, and interferes as 3.2 slots at 100%.
    from prorsa.policy.demand import colocated_shortage

    moe = replace(
        spec(8),
        dp_attention_ranks=8,
        colocated_prefill_factor=3.5,
        colocated_packed_prefill_factor=0.9,
        colocated_packed_prefill_ratio=0.9,
    )

    def per_slot_of_need(need_p: float, util: float) -> float:
        short = colocated_shortage(moe, need_p, 10.0, prefill_target_util=util)
        return (short - 10.0 + 8) / need_p  # need_d 10 on 8 slots keeps it short

    assert per_slot_of_need(4.0, 0.8) == pytest.approx(moe.prefill_interference_at(3.2))
    assert per_slot_of_need(3.2, 1.0) == pytest.approx(moe.prefill_interference_at(3.2))
    assert moe.prefill_interference_at(3.2) != pytest.approx(moe.prefill_interference_at(4.0))


def test_decode_slot_rebuild_is_priced_in_slots_at_the_target_utilisation():
    from prorsa.policy.demand import decode_slot_rebuild_s

    obs = observation(5.0, ["prefill", "decode", "decode", "decode"], decode_kv=600_000)
    # the least-loaded decode slot holds 200,000 tokens; 20,000 prefill tokens/s a slot
    assert decode_slot_rebuild_s(obs, spec(4), 1, 1.0) == pytest.approx(10.0)
    assert decode_slot_rebuild_s(obs, spec(4), 1, 0.8) == pytest.approx(12.5)
    assert decode_slot_rebuild_s(obs, spec(4), 0, 0.8) == 0.0


def _kv_bound_moe():
    return replace(
        spec(8),
        dp_attention_ranks=8,
        colocated_prefill_factor=3.5,
        colocated_packed_prefill_factor=0.9,
        colocated_packed_prefill_ratio=0.9,
        colocated_kv_tokens_per_engine=2_000_000.0,
        colocated_engines=8,
        colocated_step_tokens_per_rank=8192,
    )


def test_colocated_prefill_costs_more_when_kv_admits_prefills_on_few_ranks():
    moe = _kv_bound_moe()
    free = moe.prefill_interference_at(50.0)
    assert moe.prefill_interference_at(50.0, 8.0) == free == pytest.approx(0.9)
    # Saturated, k ranks share the stall: m + F / k (m = 0.5286, F = 2.9714 here).
    stall = (3.5 - 0.9) * 8 / 7
    for cap in (1.0, 2.0, 3.5, 6.0):
        assert moe.prefill_interference_at(50.0, cap) == pytest.approx(3.5 - stall + stall / cap)
    # Under light demand few ranks prefill anyway: the cap matters less.
    light = moe.prefill_interference_at(0.5)
    assert light == pytest.approx(moe.prefill_interference_at(0.5, 4.0), rel=0.02)


def test_prefills_a_colocated_engine_admits_follow_kv_and_the_turn_shape():

    from prorsa.policy.demand import colocated_prefill_ranks
    from prorsa.policy.types import WorkloadShape

    moe = _kv_bound_moe()
    shape = WorkloadShape(
        turns_per_trajectory=10,
        prompt_tokens=2000,
        new_tokens_per_turn=500,
        output_tokens_per_turn=70,
        tool_s_per_call=1.0,
        final_context_tokens=8000,
    )

    def with_live(trajectories: int, context: int, workload=shape):
        obs = observation(1.0, ["prefill"] * 6 + ["decode"] * 2, decoding=0, decode_kv=0)
        state, tokens = dict(obs.trajectory_state), dict(obs.trajectory_tokens)
        state["queued"], tokens["queued"] = trajectories, trajectories * context
        return replace(obs, trajectory_state=state, trajectory_tokens=tokens, workload=workload)

    # Live contexts within the colocated KV (8 engines x 2M): no bound.
    assert colocated_prefill_ranks(with_live(2000, 6000), moe) is None
    # Beyond it: C / c * p / (p + o) with p = c / budget steps, o = 70.
    admitted = colocated_prefill_ranks(with_live(4000, 6000), moe)
    p = 6000 / 8192
    assert admitted == pytest.approx(2_000_000 / 6000 * p / (p + 70))
    # Longer outputs hold KV longer: fewer prefills fit.
    longer = replace(shape, output_tokens_per_turn=700)
    assert colocated_prefill_ranks(with_live(4000, 6000, longer), moe) < admitted
    # Unknown shape, or one rank: nothing to bound.
    assert colocated_prefill_ranks(with_live(4000, 6000, None), moe) is None
    assert (
        colocated_prefill_ranks(with_live(4000, 6000), replace(moe, dp_attention_ranks=1)) is None
    )


def test_a_prefill_bound_split_holds_when_colocated_kv_would_starve_prefill():
    """The Qwen3-235B-A22B tau2 sync cells: every trajectory queued for its first
    prefill, live contexts 3x the colocated KV. Priced as if all eight ranks prefilled,
    colocation looks cheaper; with the KV bound (~3 ranks) the split holds."""
    from prorsa.policy.demand import choose_mode
    from prorsa.policy.types import WorkloadShape

    moe = replace(_kv_bound_moe(), num_slots=4, colocated_engines=4)
    shape = WorkloadShape(10, 2000, 500, 70, 1.0, 8000)
    obs = observation(1.0, ["prefill"] * 3 + ["decode"], decoding=0, decode_kv=0)
    state, tokens = dict(obs.trajectory_state), dict(obs.trajectory_tokens)
    state["queued"], tokens["queued"] = 4096, 4096 * 6000
    split = replace(obs, trajectory_state=state, trajectory_tokens=tokens)
    kwargs = dict(current_prefill=3, payback_s=30, switch_cost_weight=1.0, prefill_target_util=0.8)
    assert choose_mode(split, moe, 17.0, 1.7, **kwargs) == "colocated"
    assert choose_mode(replace(split, workload=shape), moe, 17.0, 1.7, **kwargs) is None


def test_layout_spec_quotes_packed_prefill_from_the_cost_model():
    from prorsa.runtime.cluster.config import ClusterConfig
    from prorsa.runtime.cluster.spec import cluster_spec, load_profiles

    dp8 = "tp1-dp8-ep8-a2a"
    config = ClusterConfig(
        profile="h200-qwen3-30b-a3b-tp1",
        num_slots=4,
        layouts={"prefill": "tp1", "decode": dp8, "colocated": dp8},
    )
    moe = cluster_spec(config, load_profiles(config), 10.0)
    assert moe.colocated_packed_prefill_factor < 1.5 < moe.prefill_interference
    assert 0.1 < moe.colocated_packed_prefill_ratio < 10


def _meter_at(meter, base, t: float, appended: int, computed: int) -> float:
    """``meter``'s ratio after an observation like ``base`` at ``t`` with these totals."""
    obs = replace(
        base,
        time_s=t,
        prefill_tokens_appended_total=appended,
        prefill_tokens_computed_total=computed,
    )
    return meter.update(obs)


def test_prefill_work_meter_scales_appended_tokens_by_what_engines_computed():
    from prorsa.policy.demand import PrefillWorkMeter

    meter = PrefillWorkMeter(window_s=30.0, min_appended_tokens=1_000)
    base = observation(0.0, ["colocated"] * 2)

    def at(t, appended, computed):
        return _meter_at(meter, base, t, appended, computed)

    assert at(0.0, 0, 0) == 1.0
    assert at(10.0, 500, 5_000) == 1.0  # too few appended tokens to judge: hold
    assert at(20.0, 2_000, 40_000) == pytest.approx(20.0)
    # The baseline is the newest sample at or before the window's start (t=20 here).
    assert at(50.0, 4_000, 52_000) == pytest.approx((52_000 - 40_000) / (4_000 - 2_000))
    assert at(90.0, 10_000, 58_000) == pytest.approx(1.0)  # caches hit again
    with pytest.raises(ConfigError):
        PrefillWorkMeter(window_s=0)


def test_prefill_work_meter_keeps_a_ratio_per_mode():
    # Found in the regime map (235B tau2 async 16/GPU): a split's prefill engines
    # recompute what colocated engines cache (15-60x what turns append, ~1x colocated);
    # priced at the split's ratio colocation looked as short and was never chosen again.
    from prorsa.policy.demand import PrefillWorkMeter

    meter = PrefillWorkMeter(window_s=30.0, min_appended_tokens=1_000)
    colocated = observation(0.0, ["colocated"] * 2)
    split = observation(0.0, ["prefill", "decode"])

    def at(base, t, appended, computed):
        return _meter_at(meter, base, t, appended, computed)

    at(colocated, 0.0, 0, 0)
    assert at(colocated, 20.0, 10_000, 11_000) == pytest.approx(1.1)
    # The split's window starts at the switch: no colocated tokens in its ratio.
    assert at(split, 30.0, 12_000, 13_000) == pytest.approx(1.1)  # nothing measured yet
    assert at(split, 60.0, 22_000, 313_000) == pytest.approx(30.0)
    assert meter.ratio_for(colocated=True) == pytest.approx(1.1)
    assert meter.ratio_for(colocated=False) == pytest.approx(30.0)


@pytest.mark.parametrize(
    ("name", "kwargs", "robust_by_default"),
    [("predictive", {}, True), ("mpc", {"start": "split"}, True)],
)
def test_a_robust_policy_moves_only_where_both_ends_of_the_forecast_band_pay(
    name, kwargs, robust_by_default
):
    # A split resize that pays at the forecast's P90 but not at its P10 is held (found in
    # the regime map: 235B search sync 64/GPU, where sizing at the P90 of a sync step's
    # prefill waves resized a 4-slot split back and forth, 0.98x against 1.19x held).
    roles = ["prefill", "decode", "decode", "decode"]
    obs = observation(30.0, roles, decoding=100)
    cluster = replace(spec(4), role_layouts={"prefill": "tp1", "decode": "tp1", "colocated": "tp4"})
    high, low = forecast(30.0, 18_000.0), forecast(30.0, 4_000.0)

    def banded(p10: Forecast, p90: Forecast) -> Forecast:
        return replace(p90, quantiles={0.1: p10.point, 0.5: p90.point, 0.9: p90.point})

    moved = {}
    for case, fc, robust in (
        ("wide band", banded(low, high), True),
        ("wide band, P90 only", banded(low, high), False),
        ("narrow band", banded(high, high), True),
    ):
        policy = make_policy(name, robust=robust, **kwargs)
        policy.reset(cluster)
        moved[case] = policy.decide(obs, fc).gpus.get("prefill", 0)
    assert moved["wide band"] == 1
    assert moved["wide band, P90 only"] > 1
    assert moved["narrow band"] > 1
    if name == "mpc":
        assert moved["narrow band"] == moved["wide band, P90 only"]
    # Both judge a move at both ends of the band unless told not to (docs/decisions.md).
    assert make_policy(name).robust is robust_by_default


def test_the_band_agrees_on_a_move_only_in_one_direction_and_by_the_smaller_step():
    from prorsa.policy.demand import agreed_mode, agreed_move

    assert agreed_move(2, [3, 5]) == 3
    assert agreed_move(3, [1, 2]) == 2
    assert agreed_move(2, [1, 3]) == 2  # opposite directions: hold
    assert agreed_move(2, [2, 4]) == 2  # one end holds
    assert agreed_move(2, [4]) == 4  # one end only: its own move
    assert agreed_mode(["colocated", "colocated"]) == "colocated"
    assert agreed_mode([2, 3]) == 3  # both disaggregate: the last end's split
    assert agreed_mode([None, 3]) is None
    assert agreed_mode(["colocated", 3]) is None


def test_the_band_is_both_ends_or_the_policys_own_quantile():
    from prorsa.policy.demand import band_levels

    both = forecast(30.0, 1_000.0)
    both = replace(both, quantiles={**both.quantiles, 0.1: both.point})
    assert band_levels(both, 0.5, robust=True) == [0.1, 0.9]
    assert band_levels(both, 0.5, robust=False) == [0.5]
    # One end only (this helper's forecast has P50 and P90): not a band.
    assert band_levels(forecast(30.0, 1_000.0), 0.5, robust=True) == [0.5]
    assert band_levels(both, None, robust=True) == [None]  # point forecasts stay point


def test_best_split_is_the_least_short_then_most_balanced_then_smallest_split():
    from prorsa.policy.demand import best_split, busier_utilisation, split_shortage

    def by_definition(slots: int, need_p: float, need_d: float) -> int:
        return min(
            range(1, slots),
            key=lambda x: (
                split_shortage(x, slots, need_p, need_d),
                busier_utilisation(x, slots, need_p, need_d),
                x,
            ),
        )

    rng = np.random.default_rng(0)
    nan, inf = float("nan"), float("inf")
    cases = [(2, 0.0, 0.0), (8, 0.0, 3.0), (8, 3.0, 0.0), (512, 40.0, 400.0), (512, 1e4, 1.0)]
    cases += [(8, 12.0, nan), (8, nan, 12.0), (8, inf, 3.0), (8, 3.0, inf), (8, inf, inf)]
    for _ in range(3000):
        slots = int(rng.choice([2, 3, 5, 8, 16, 20, 64, 512]))
        need = rng.uniform(0, 2 * slots, size=2) * 10.0 ** rng.uniform(-3, 1, size=2)
        cases.append((slots, float(need[0]), float(need[1])))
    for slots, need_p, need_d in cases:
        assert best_split(slots, need_p, need_d) == by_definition(slots, need_p, need_d)
    with pytest.raises(ValueError):
        best_split(1, 1.0, 1.0)


def test_mpc_sees_a_switch_under_way_and_waits_for_it():
    policy = make_policy("mpc")
    policy.reset(replace(spec(8), colocated_prefill_factor=3.0))  # a split pays here
    idle = observation(10.0, ROLES8)
    assert policy.switching_now(idle) is None
    # Slot 2 left decode for prefill at t=9 and still drains its sequences: it serves
    # after drain_s (2 s, the workload's shape unknown) plus the 2 s latency.
    draining = observation(10.0, ROLES8, since=9.0, switching={2: "prefill"})
    assert policy.switching_now(draining) == (1, 0, 4.0)
    # Drained at t=9.5: what is left of the latency from then.
    slots = list(draining.slots)
    slots[2] = replace(slots[2], source_role="decode", drained_s=9.5)
    assert policy.switching_now(replace(draining, slots=tuple(slots))) == (1, 0, 1.5)
    # 59 s into a 60 s drain timeout: at most 1 s of drain is left.
    late = observation(68.0, ROLES8, since=9.0, switching={2: "prefill"})
    assert policy.switching_now(late) == (1, 0, 3.0)
    # A prefill burst that wants more prefill slots: while the switch is under way (the
    # first 3 intervals, 4 s) the plan holds the split, and only then moves.
    burst = forecast(10.0, 150_000.0)
    policy.decide(draining, burst)
    plan = policy.last_plan_
    assert plan[:3] == [3, 3, 3] and max(plan) > 3
    policy.decide(observation(10.0, ["prefill"] * 3 + ["decode"] * 5), burst)
    assert policy.last_plan_[0] > 3  # the same cluster with no switch under way moves now


def test_predictive_resizes_to_the_split_whose_busier_side_is_least_loaded():
    # Needs of 2.36 prefill and 10.59 decode slots overload any split of 8. A proportional
    # share rounds to 1 prefill slot (prefill at 2.36x); 2 prefill slots put the busier
    # side at 1.76x (decode): the split the policy's own gain and shortage measure favour.
    from tests.policy_helpers import forecast, observation

    obs = observation(30.0, ["prefill"] + ["decode"] * 7, decoding=300, decode_kv=600_000)
    policy = make_policy("predictive", start="split", quantile=None, robust=False)
    policy.reset(replace(spec(8), colocated_prefill_factor=3.0))
    policy.needs = lambda *args, **kwargs: (2.36, 10.59)  # the demand, given
    assert policy.decide(obs, forecast(30.0, 40_000.0)).gpus == {"prefill": 2, "decode": 6}


@pytest.mark.parametrize(
    ("policy", "params", "message"),
    [
        ("predictive", {"prefill_target_util": 0.0}, "prefill_target_util"),
        ("predictive", {"target_batch_per_gpu": 0.0}, "target_batch_per_gpu"),
        ("mpc", {"kv_target_fraction": 1.5}, "kv_target_fraction"),
        ("mpc", {"quantile": 0.0}, "quantile"),
        ("predictive", {"quantile": 1.0}, "quantile"),
    ],
)
def test_sizing_knobs_out_of_range_are_refused_at_reset(policy, params, message):
    # Found by review: a zero utilisation divided by zero at the first forecast, a zero
    # batch held for ever, and a quantile outside (0, 1) quietly read the point.
    with pytest.raises(ConfigError, match=message):
        make_policy(policy, **params).reset(spec(4))


def test_an_allocation_of_nan_gpus_is_refused():
    with pytest.raises(ConfigError, match="finite"):
        Allocation(gpus={"prefill": float("nan"), "decode": 4})
    with pytest.raises(ConfigError, match="finite"):
        Allocation(gpus={"colocated": 8}, local_prefill_threshold=float("nan"))
