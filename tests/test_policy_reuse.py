"""Leaving colocation under re-prefill: the split also recomputes the cached contexts."""

from __future__ import annotations

import pytest

from prorsa.policy.base import ClusterSpec
from prorsa.policy.demand import choose_mode, split_recompute_slots
from prorsa.policy.types import ClusterObservation, SlotView


def spec(reuse_mode: str) -> ClusterSpec:
    return ClusterSpec(
        num_slots=4,
        slot_gpus=1,
        role_tp={"prefill": 1, "decode": 1, "colocated": 1},
        prefill_tokens_per_s_per_gpu=10_000.0,
        decode_tokens_per_s_per_gpu=2_000.0,
        switch_latency_s=0.0,
        min_dwell_s=0.0,
        colocated_prefill_factor=1.5,
        reuse_mode=reuse_mode,
    )


def colocated(idle_tokens: int) -> ClusterObservation:
    slots = tuple(
        SlotView(i, "colocated", None, 1, 1, 0, 8, 0, 1_000_000, True, 0.0) for i in range(4)
    )
    return ClusterObservation(
        time_s=10.0,
        slots=slots,
        trajectory_state={"in_tool": 100, "decoding": 32},
        trajectory_tokens={"in_tool": idle_tokens, "decoding": 100_000},
        prefill_tokens_per_s={},
        decode_tokens_per_s={},
    )


def test_recompute_counts_live_contexts_only_under_reprefill():
    obs = colocated(idle_tokens=2_900_000)  # + 100,000 decoding
    assert split_recompute_slots(obs, spec("reprefill"), 1.0, 30.0) == pytest.approx(10.0)
    assert split_recompute_slots(obs, spec("reprefill"), 1.0) == pytest.approx(30.0)  # 10 s
    # in slots run at 80%, as a policy sizes prefill
    assert split_recompute_slots(obs, spec("reprefill"), 0.8) == pytest.approx(37.5)
    assert split_recompute_slots(obs, spec("kv-store"), 1.0, 30.0) == 0.0
    assert split_recompute_slots(obs, spec("pull"), 1.0, 30.0) == 0.0


def test_recompute_adds_to_prefill_need_at_the_utilisation_it_is_sized_at():
    # Found reading the mode choice: the need was in slots at 80% and the recompute in
    # slots at 100%, so the split's prefill looked 20% lighter than it is.
    from dataclasses import replace

    obs = replace(colocated(idle_tokens=0), trajectory_tokens={"in_tool": 0, "decoding": 40_000})
    kwargs = dict(current_prefill=1, payback_s=30.0, switch_cost_weight=1.0)
    # colocated: 1.6 x 1.5 + 1.7 = 4.1 slots of demand on 4, short 0.1
    # at 100%: recompute 0.4 slots, 2.0P/1.7D on a 2/2 split, none short: split
    assert choose_mode(obs, spec("reprefill"), 1.6, 1.7, prefill_target_util=1.0, **kwargs) == 2
    # at 80%: 0.5 slots, 2.1P on 2 prefill slots, short 0.2 > 0.1: stay
    assert choose_mode(obs, spec("reprefill"), 1.6, 1.7, prefill_target_util=0.8, **kwargs) is None


def test_reprefill_keeps_colocation_where_a_kv_store_would_split():
    # prefill needs 1.6 slots, decode 1.8: colocated short 0.2 slots, a 2/2 split none
    kwargs = dict(
        current_prefill=1, payback_s=30.0, switch_cost_weight=1.0, prefill_target_util=0.8
    )
    obs = colocated(idle_tokens=100_000)  # 2.5 more prefill slots (10 s turn cycle, 80%)
    assert choose_mode(obs, spec("kv-store"), 1.6, 1.8, **kwargs) == 2
    assert choose_mode(obs, spec("reprefill"), 1.6, 1.8, **kwargs) is None


def test_leaving_colocation_counts_every_slot_that_reshards():
    from dataclasses import replace

    base = replace(spec("kv-store"), switch_latency_s=1.0, reshard_latency_s=1.0)
    same = replace(base, role_layouts={"prefill": "tp1", "decode": "dp8", "colocated": "dp8"})
    other = replace(base, role_layouts={"prefill": "tp1", "decode": "dp8", "colocated": "tp4"})
    kwargs = dict(
        current_prefill=1, payback_s=30.0, switch_cost_weight=1.0, prefill_target_util=0.8
    )
    obs = colocated(idle_tokens=0)
    # saves 0.2 slots x 30 s = 6 slot-s; two prefill slots reshard (2 x 2 s = 4): split
    assert choose_mode(obs, same, 1.6, 1.8, **kwargs) == 2
    # the two decode slots reshard as well (4 more slot-s): not worth it
    assert choose_mode(obs, other, 1.6, 1.8, **kwargs) is None


@pytest.mark.parametrize("name", ["predictive", "mpc"])
def test_policies_price_every_prefill_term_at_their_own_target_utilisation(monkeypatch, name):
    # The need, the recompute, the rebuilds, the cache overflow and the colocated
    # interference must all be in one unit: the policy's prefill_target_util.
    from dataclasses import replace

    from prorsa.policy import demand, make_policy, mpc, predictive
    from tests.policy_helpers import forecast, observation
    from tests.policy_helpers import spec as policy_spec

    seen: dict[str, list[float]] = {}

    def recording(module, fn_name: str, position: int | None) -> None:
        inner = getattr(module, fn_name)

        def wrapper(*args, **kwargs):
            util = (
                kwargs["target_util" if "target_util" in kwargs else "prefill_target_util"]
                if position is None
                else args[position]
            )
            seen.setdefault(fn_name, []).append(util)
            return inner(*args, **kwargs)

        monkeypatch.setattr(module, fn_name, wrapper)

    for module in (demand, predictive, mpc):
        for fn_name in (
            "decode_slot_rebuild_s",
            "prefill_slot_rebuild_s",
            "prefill_slot_rebuilds_s",
            "split_growth_rebuilds_s",
        ):
            if hasattr(module, fn_name):
                recording(module, fn_name, 3)
    recording(demand, "split_recompute_slots", 2)
    recording(demand, "colocated_shortage", None)
    recording(mpc, "prefill_cache_overflow_slots", None)
    policy = make_policy(name, prefill_target_util=0.5)
    # Switches slow enough that from the split no mode change pays: the split is planned.
    policy.reset(replace(policy_spec(4), switch_latency_s=1_000.0))
    roles = (["colocated"] * 4, ["prefill", "decode", "decode", "decode"])
    for t, slot_roles in zip((50.0, 100.0), roles, strict=True):
        policy.decide(observation(t, slot_roles), forecast(t, 60_000.0))
    assert {"split_recompute_slots", "colocated_shortage", "decode_slot_rebuild_s"} <= set(seen)
    if name == "mpc":
        planned = {"prefill_slot_rebuilds_s", "split_growth_rebuilds_s"}
        assert planned | {"prefill_cache_overflow_slots"} <= set(seen)
    assert all(util == 0.5 for utils in seen.values() for util in utils), seen


def split(prefill_cached: int, decode_kv: int) -> ClusterObservation:
    """One prefill slot caching ``prefill_cached`` tokens, three decode slots holding
    ``decode_kv`` tokens each."""
    slots = (SlotView(0, "prefill", None, 1, 1, 0, 0, 0, 1_000_000, True, 0.0, prefill_cached),)
    slots += tuple(
        SlotView(i, "decode", None, 1, 1, 0, 8, decode_kv, 1_000_000, True, 0.0)
        for i in range(1, 4)
    )
    return ClusterObservation(
        time_s=10.0,
        slots=slots,
        trajectory_state={"in_tool": 100, "decoding": 24},
        trajectory_tokens={"in_tool": 0, "decoding": 3 * decode_kv},
        prefill_tokens_per_s={},
        decode_tokens_per_s={},
    )


def test_leaving_a_split_prices_the_contexts_the_router_moves_not_the_prefill_caches():
    # Prefill needs 1.2 slots, decode 2.4: the 1/3 split (already the best) is short 0.8
    # slots, colocation 0.2, so colocating saves 0.6 x 30 s = 18 slot-s. Colocated, each
    # turn prefills where its context lives: the prefill slot's cache is not missed, but
    # about one decode slot's contexts are spread onto the slot that joins the decode side.
    kwargs = dict(
        current_prefill=1, payback_s=30.0, switch_cost_weight=1.0, prefill_target_util=0.8
    )
    for reuse in ("reprefill", "kv-store"):
        # 100k tokens per decode slot: 12.5 slot-s at 80%, less than the 18 saved.
        assert choose_mode(split(200_000, 100_000), spec(reuse), 1.2, 2.4, **kwargs) == (
            "colocated"
        )
        # 300k: 37.5 slot-s, more than it saves.
        assert choose_mode(split(0, 300_000), spec(reuse), 1.2, 2.4, **kwargs) is None


def test_resizing_a_split_loses_only_what_prefill_would_have_read():
    from dataclasses import replace

    from prorsa.policy.demand import prefill_slot_rebuild_s, resize_rebuild_s

    obs = split(200_000, 300_000)
    reprefill, pull, store = spec("reprefill"), spec("pull"), spec("kv-store")
    # Shrinking prefill drops the prefill slot's cache, which re-prefill must recompute;
    # a prefill engine that pulls or reads a KV store copies it instead.
    assert resize_rebuild_s(obs, reprefill, 1, 0, 0.8) == pytest.approx(200_000 / 8_000)
    assert resize_rebuild_s(obs, reprefill, 1, 0, 0.8) == prefill_slot_rebuild_s(
        obs, reprefill, 1, 0.8
    )
    assert resize_rebuild_s(obs, store, 1, 0, 0.8) == 0.0
    assert resize_rebuild_s(obs, pull, 1, 0, 0.8) == 0.0
    # Growing it takes a decode slot: only a pulling prefill engine read its 300k tokens.
    assert resize_rebuild_s(obs, pull, 1, 2, 0.8) == pytest.approx(300_000 / 8_000)
    assert resize_rebuild_s(obs, reprefill, 1, 2, 0.8) == 0.0
    assert resize_rebuild_s(obs, store, 1, 2, 0.8) == 0.0
    # A colocated slot on the decode side (a mode change under way) prefills its own
    # turns: moving it loses its contexts whatever the reuse mode.
    first = replace(obs.slots[1], role="colocated")  # the one moved first (ties: lowest id)
    mixed = replace(obs, slots=(obs.slots[0], first, *obs.slots[2:]))
    colocated_kv = 300_000 / 8_000
    assert resize_rebuild_s(mixed, reprefill, 1, 2, 0.8) == pytest.approx(colocated_kv)
    # Decode engines that prefill short turns themselves keep contexts prefill lacks.
    local = replace(obs, local_prefill_threshold=512)
    assert resize_rebuild_s(local, reprefill, 1, 2, 0.8) == pytest.approx(300_000 / 8_000)
    assert resize_rebuild_s(obs, reprefill, 1, 1, 0.8) == 0.0


def test_predictive_holds_a_split_whose_prefill_cache_would_cost_more_than_it_saves():
    from dataclasses import replace

    from prorsa.policy import make_policy
    from tests.policy_helpers import forecast, observation
    from tests.policy_helpers import spec as policy_spec

    # 4 prefill / 4 decode, demand for 2.0 prefill and 6.25 decode slots: shrinking to 2
    # prefill slots pays, unless (re-prefill) the two moved drop 1.5M cached tokens each.
    roles = ["prefill"] * 4 + ["decode"] * 4
    base = observation(30.0, roles, decoding=400, decode_kv=800_000, kv_capacity=2_000_000)
    cluster = replace(policy_spec(8), colocated_prefill_factor=3.0)
    fc = forecast(30.0, 32_000.0, decoding=400, kv=800_000)

    def decide(cached: int) -> dict[str, int]:
        slots = tuple(
            replace(s, cached_tokens=cached) if s.role == "prefill" else s for s in base.slots
        )
        policy = make_policy("predictive", start="split", quantile=None, robust=False)
        policy.reset(cluster)
        return policy.decide(replace(base, slots=slots), fc).gpus

    assert decide(0)["prefill"] == 2
    assert decide(1_500_000)["prefill"] == 4


def test_mpc_prices_each_slot_a_larger_or_later_move_takes():
    from dataclasses import replace

    from prorsa.policy import make_policy
    from tests.policy_helpers import forecast, observation
    from tests.policy_helpers import spec as policy_spec

    # 2 prefill / 6 decode slots under pull, prefill demand for about two more slots. The
    # decode slot the controller moves first (slot 2) caches nothing; every other one
    # caches ``cached`` tokens that a pulling prefill engine would read again.
    roles = ["prefill"] * 2 + ["decode"] * 6
    base = observation(30.0, roles, decoding=300, decode_kv=600_000, kv_capacity=2_000_000)
    cluster = replace(policy_spec(8), reuse_mode="pull", colocated_prefill_factor=3.0)

    def decide(cached: int) -> tuple[int, list[int]]:
        slots = tuple(
            replace(s, cached_tokens=cached) if s.role == "decode" and s.slot_id > 2 else s
            for s in base.slots
        )
        policy = make_policy("mpc", start="split", quantile=None, robust=False)
        policy.reset(cluster)
        allocation = policy.decide(replace(base, slots=slots), forecast(30.0, 60_000.0))
        return allocation.gpus["prefill"], policy.last_plan_

    # 400k tokens (25 slot-s at 80%) are worth the second slot; 3M (188 slot-s) are not,
    # now or later in the plan: priced at the first slot's rate, the second was free.
    assert decide(400_000) == (4, [4] * 5)
    assert decide(3_000_000) == (3, [3] * 5)


def test_the_slots_priced_first_are_those_the_controller_moves_first():
    # Slot 2 has just switched into decode (within the 5 s dwell): empty, so the least
    # loaded, but the controller will not move it yet. A move of one decode slot takes
    # slot 3, and its contexts and drain are what the move costs.
    from dataclasses import replace

    from prorsa.policy.demand import decode_slots_moved_first, split_growth_rebuilds_s
    from prorsa.policy.types import Allocation
    from prorsa.runtime.controller import plan_switches
    from tests.policy_helpers import observation
    from tests.policy_helpers import spec as policy_spec

    roles = ["prefill", "prefill", "decode", "decode", "decode"]
    base = observation(30.0, roles, decoding=300, decode_kv=900_000, kv_capacity=2_000_000)
    fresh = replace(base.slots[2], since_s=28.0, running_sequences=0, kv_used_tokens=0)
    obs = replace(base, slots=(*base.slots[:2], fresh, *base.slots[3:]))
    cluster = replace(policy_spec(5), reuse_mode="pull")  # prefill reads decode's contexts
    assert [s.slot_id for s in decode_slots_moved_first(obs, cluster, 3)] == [3, 4, 2]
    target = Allocation(gpus={"prefill": 3, "decode": 2}, reason="test")
    ordered = plan_switches(obs, target, min_dwell_s=cluster.min_dwell_s)
    assert ordered == [(3, "prefill")]
    # The first slot moved costs its 300k tokens; the fresh one adds nothing, last.
    per_slot = 20_000.0 * 0.8
    assert split_growth_rebuilds_s(obs, cluster, 3, 0.8) == pytest.approx(
        [0.0, 300_000 / per_slot, 600_000 / per_slot, 600_000 / per_slot]
    )
    # Once its dwell is served, the empty slot goes first.
    later = replace(obs, time_s=40.0)
    assert [s.slot_id for s in decode_slots_moved_first(later, cluster, 1)] == [2]
