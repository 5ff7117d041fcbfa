"""Findings of a review of the policies: each test fails on the code before its fix."""

from __future__ import annotations

from dataclasses import replace

import pytest

from prorsa.policy import make_policy
from prorsa.policy.demand import choose_mode
from prorsa.policy.rl import ExternalPolicy
from prorsa.policy.rl_actions import COLOCATED, TARGETS
from prorsa.policy.types import WorkloadShape
from tests.policy_helpers import forecast, observation, spec


def _lose_a_slot(policy, cluster):
    """What the controller does when an engine dies: the same spec, one slot fewer."""
    policy.resize(replace(cluster, num_slots=cluster.num_slots - 1))


# Finding 1: a lost engine re-sized the policy with a full reset.


def test_threshold_keeps_its_split_and_cooldown_when_the_cluster_loses_a_slot():
    # The reset snapped the split back to prefill_fraction (2 of 7) and forgot the
    # cooldown of the move just ordered.
    cluster = spec(8)
    policy = make_policy("threshold")
    policy.reset(cluster, seed=0)
    policy.decide(observation(0.0, ["colocated"] * 8), None)  # the initial split
    roles = ["prefill"] * 3 + ["decode"] * 5
    ordered = policy.decide(observation(10.0, roles, prefill_queue=400_000), None)
    assert ordered.gpus["prefill"] == 4
    _lose_a_slot(policy, cluster)
    after = observation(12.0, ["prefill"] * 4 + ["decode"] * 3, prefill_queue=400_000)
    assert policy.decide(after, None).gpus == {"prefill": 4, "decode": 3}


def test_a_fresh_run_still_forgets_the_last_one():
    cluster = spec(8)
    policy = make_policy("threshold")
    policy.reset(cluster, seed=0)
    policy.decide(observation(0.0, ["colocated"] * 8), None)
    policy.reset(replace(cluster, num_slots=7), seed=0)  # reset: a new run
    roles = ["prefill"] * 4 + ["decode"] * 3
    assert policy.decide(observation(0.0, roles), None).gpus["prefill"] == 2


@pytest.mark.parametrize("name", ["predictive", "mpc"])
def test_a_mode_change_under_way_is_finished_on_the_slots_left(name):
    # The reset dropped the change, so the straggler was left to the split's tuning.
    cluster = spec(4)
    policy = make_policy(name)
    policy.reset(cluster)
    assert policy.apply_mode(observation(50.0, ["colocated"] * 4), 3, name).gpus == {
        "prefill": 3,
        "decode": 1,
    }
    _lose_a_slot(policy, cluster)
    straggler = observation(52.0, ["prefill", "colocated", "decode"])
    finishing = policy.apply_mode(straggler, None, name)
    assert finishing is not None and finishing.gpus == {"prefill": 2, "decode": 1}
    policy.apply_mode(straggler, "colocated", name)
    _lose_a_slot(policy, replace(cluster, num_slots=3))
    leftover = observation(60.0, ["colocated", "prefill"])
    assert policy.apply_mode(leftover, None, name).gpus == {"colocated": 2}


@pytest.mark.parametrize("name", ["predictive", "mpc"])
def test_the_measured_prefill_work_ratio_survives_a_lost_slot(name):
    cluster = spec(8)
    policy = make_policy(name)
    policy.reset(cluster)
    roles = ["prefill"] * 2 + ["decode"] * 6
    for t, appended in ((0.0, 0), (10.0, 100_000)):  # engines computed 3x what was appended
        obs = replace(
            observation(t, roles),
            prefill_tokens_appended_total=appended,
            prefill_tokens_computed_total=3 * appended,
        )
        policy.decide(obs, forecast(t, 10_000.0))
    fc = forecast(10.0, 10_000.0)
    needs = policy.needs if name == "predictive" else policy.requirements
    before = needs(obs, fc)[1 if name == "mpc" else 0]
    _lose_a_slot(policy, cluster)
    assert needs(obs, fc)[1 if name == "mpc" else 0] == pytest.approx(before)


def test_the_rl_guard_still_holds_after_a_lost_slot():
    # The reset made the next decision a free "initial layout", past the safety rule.
    cluster = spec(8)
    policy = ExternalPolicy(decision_interval_s=1.0, min_hold_s=30.0)
    policy.reset(cluster)
    roles = ["prefill"] * 2 + ["decode"] * 6
    policy.action = TARGETS.index(COLOCATED)
    policy.decide(observation(0.0, ["colocated"] * 8), None)
    policy.action = 3  # a split
    assert "prefill" in policy.decide(observation(40.0, ["colocated"] * 8), None).gpus
    _lose_a_slot(policy, cluster)
    policy.action = TARGETS.index(COLOCATED)
    held = policy.decide(observation(45.0, roles[:7]), None)
    assert held.gpus.get("colocated", 0) == 0  # within min_hold_s of the last change


# Finding 2: MPC's cost-to-go counted the backlog a second time.


def test_mpc_tail_does_not_count_the_backlog_the_horizon_drains():
    # One prefill slot, 1.125 slots of prefill need over the 30 s horizon (0.5 arriving,
    # 0.625 the backlog): 15 slot-seconds short. A move costing 20 does not pay; the tail
    # priced the backlog's drain for 30 s more and made it look like 30.
    roles = ["prefill", "decode", "decode", "decode"]
    obs = observation(30.0, roles, decoding=100, prefill_queue=300_000)
    chosen = {}
    for cost, tail_s in ((20.0, 0.0), (20.0, 30.0), (10.0, 30.0)):
        policy = make_policy(
            "mpc", start="split", quantile=None, robust=False, switch_cost_s=cost, tail_s=tail_s
        )
        policy.reset(spec(4))
        chosen[cost, tail_s] = policy.decide(obs, forecast(30.0, 8_000.0)).gpus["prefill"]
    assert chosen[20.0, 0.0] == chosen[20.0, 30.0] == 1
    assert chosen[10.0, 30.0] == 2  # the backlog still wins a slot where it pays


# Finding 4: leaving a split for colocation, resharded decode slots drain first.


def test_colocating_a_split_waits_for_the_decode_slots_that_reshard_to_drain():
    layouts = {"prefill": "tp1", "decode": "tp2", "colocated": "tp4"}
    cluster = replace(spec(4), role_layouts=layouts, reshard_latency_s=5.0)
    roles = ["prefill", "decode", "decode", "decode"]
    kwargs = dict(current_prefill=1, payback_s=60.0, switch_cost_weight=1.0)
    chosen = {}
    for output_tokens in (40.0, 4_000.0):  # 50 sequences a slot: ~2 s or the 60 s timeout
        shape = WorkloadShape(10, 1000, 300, output_tokens, 2.0, 9000)
        obs = replace(observation(30.0, roles, decoding=150, decode_kv=16_000), workload=shape)
        chosen[output_tokens] = choose_mode(
            obs, cluster, 1.5, 2.5, prefill_target_util=0.8, **kwargs
        )
    assert chosen == {40.0: "colocated", 4_000.0: None}


# Finding 5: predictive switched on a tie of zero saved and zero lost.


def test_predictive_needs_a_strict_saving_to_switch():
    # Free switches (no latency, no contexts to rebuild) and a split that is not short:
    # rebalancing saves nothing, so it holds; once prefill is short it moves.
    cluster = replace(spec(8), switch_latency_s=0.0)
    roles = ["prefill"] * 2 + ["decode"] * 6
    obs = observation(30.0, roles)
    chosen = {}
    for need_p in (1.9, 2.4):  # prefill slots at the sizing target
        policy = make_policy("predictive", quantile=None)
        policy.reset(cluster)
        chosen[need_p] = policy.decide(obs, forecast(30.0, need_p * 16_000.0)).gpus["prefill"]
    assert chosen[1.9] == 2
    assert chosen[2.4] > 2


def test_resizing_a_split_waits_for_the_decode_slots_it_takes_to_drain():
    # The alternative colocation is weighed against, growing the split's prefill, takes
    # decode slots that drain first: with long outputs it pays back too late and
    # colocation (one layout, a relabel) wins; with one-token outputs the resize does.
    roles = ["prefill", "decode", "decode", "decode"]
    chosen = {}
    for output_tokens in (1.0, 4_000.0):
        shape = WorkloadShape(10, 1000, 300, output_tokens, 2.0, 9000)
        obs = replace(observation(30.0, roles, decoding=150, decode_kv=16_000), workload=shape)
        chosen[output_tokens] = choose_mode(
            obs, spec(4), 2.0, 1.5, current_prefill=1, payback_s=60.0,
            switch_cost_weight=1.0, prefill_target_util=0.8,
        )  # fmt: skip
    assert chosen == {1.0: None, 4_000.0: "colocated"}


def test_threshold_gives_decode_a_slot_back_when_its_engine_is_lost():
    # Found by review of the resize: 2 prefill + 1 decode, the decode engine dies; the
    # kept split read both survivors as prefill and no branch could leave it.
    cluster = spec(3)
    policy = make_policy("threshold")
    policy.reset(cluster, seed=0)
    policy.decide(observation(0.0, ["colocated"] * 3), None)
    policy.decide(observation(10.0, ["prefill", "prefill", "decode"]), None)
    _lose_a_slot(policy, cluster)
    for t in (40.0, 50.0):  # a prefill queue would have grown prefill further
        after = policy.decide(observation(t, ["prefill", "prefill"], prefill_queue=400_000), None)
        assert after.gpus == {"prefill": 1, "decode": 1}
