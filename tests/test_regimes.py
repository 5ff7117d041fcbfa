"""The regime map: workload knobs, speedups against colocation at its best layout, resuming,
Ray, goals and grids (on a small dense family so every test runs in seconds)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from prorsa.errors import ConfigError
from prorsa.experiments.cells import Cell, run_cell
from prorsa.experiments.families import ModelFamily
from prorsa.experiments.grids import LOADS, WORKLOADS, full_grid, get_grid, select
from prorsa.experiments.knobs import WorkloadKnobs
from prorsa.experiments.regime_report import goals_markdown, headline, headline_markdown
from prorsa.experiments.regimes import (
    MapConfig,
    Regime,
    goals,
    plan_regime,
    run_map,
    simulated_run_plan,
)
from prorsa.workload.spec import TrajectorySpec

TOY = ModelFamily("toy-7b", "h200-qwen2.5-7b", ("tp1", "tp2"), 4, "tp1", moe=False)


def toy_config(tmp_path=None, **kw) -> MapConfig:
    regimes = kw.pop("regimes", [Regime("toy-7b", "search", "sync", 4)])
    return MapConfig(
        regimes=regimes,
        families={"toy-7b": TOY},
        forecaster="ewma",  # data-free: no shipped model needed
        workers=1,
        cells_path=tmp_path / "cells.jsonl" if tmp_path else None,
        **kw,
    )


def test_knobs_scale_tool_latency_and_growth_but_keep_the_prompt():
    spec = TrajectorySpec("t", [1000, 200, 300], [50, 60, 70], [2.0, 4.0, 0.0])
    scaled = WorkloadKnobs(tool_scale=0.5, growth_scale=2.0).apply(spec)
    assert scaled.new_tokens.tolist() == [1000, 400, 600]
    assert scaled.tool_latency_s.tolist() == [1.0, 2.0, 0.0]
    assert scaled.output_tokens.tolist() == [50, 60, 70]
    assert WorkloadKnobs().apply(spec) is spec
    with pytest.raises(ConfigError, match="tool_scale"):
        WorkloadKnobs(tool_scale=-1.0)


def test_knobs_change_the_simulated_workload():
    base = Cell.of(
        scenario="search",
        mode="sync",
        policy="colocate",
        seed=0,
        num_slots=4,
        profile="h200-qwen2.5-7b-tp1",
        trajectories=32,
        series=False,
        record=False,
    )
    plain = run_cell(base)["metrics"]
    slow_tools = run_cell(base.changed(tool_scale=4.0))["metrics"]
    growth = run_cell(base.changed(growth_scale=2.0))["metrics"]
    assert slow_tools["makespan_s"] > plain["makespan_s"]
    assert slow_tools["prefill_tokens_computed"] == plain["prefill_tokens_computed"]
    assert growth["prefill_tokens_computed"] > plain["prefill_tokens_computed"]


def test_map_speedups_are_against_the_best_colocated_layout(tmp_path):
    result = run_map(toy_config(tmp_path))
    (summary,) = result["regimes"]
    assert summary["eval_seeds"] == [9, 10, 11]
    colocate = {k: v["objective"] for k, v in summary["colocate"].items()}
    assert set(colocate) == {"tp1", "tp2"}
    best_layout = min(colocate, key=colocate.get)
    best = summary["colocate_best"]
    assert best["layout"] == best_layout and best["objective"] == colocate[best_layout]
    by_seed = best["objective_by_seed"]
    held_out = (9, 10, 11)
    # over the seeds, the geometric mean: one objective over another is their speedup
    assert set(by_seed) == set(held_out)
    assert best["objective"] == pytest.approx(np.exp(np.mean(np.log([*by_seed.values()]))))
    for policy in ("best-static", "predictive", "mpc", "oracle"):
        ran = summary["policies"][policy]["objective_by_seed"]
        ratios = [by_seed[s] / ran[s] for s in held_out]
        # a paired ratio per held-out seed, their geometric mean, its t-interval around it
        assert summary["speedup_by_seed"][policy] == pytest.approx(
            dict(zip(held_out, ratios, strict=True))
        )
        assert summary["speedup"][policy] == pytest.approx(np.exp(np.mean(np.log(ratios))))
        low, high = summary["speedup_ci95"][policy]
        assert low <= summary["speedup"][policy] <= high
        tp1 = summary["colocate"]["tp1"]["objective_by_seed"]
        assert summary["speedup_vs_baseline"][policy] == pytest.approx(
            np.exp(np.mean(np.log([tp1[s] / ran[s] for s in held_out])))
        )
    # best-static is the best split any searched (prefill, decode) pair found on the
    # selection seed, and is scored at that very split on the held-out seeds
    searched = [s["objective"] for s in summary["static_searches"]]
    assert summary["best_static"]["objective"] == min(searched)
    assert (
        summary["policies"]["best-static"]["prefill_gpus"] == summary["best_static"]["prefill_gpus"]
    )
    pairs = {(s["prefill_layout"], s["decode_layout"]) for s in summary["static_searches"]}
    assert ("tp1", "tp1") in pairs
    # the dynamic policies ran with the layouts and start the selection seed's searches chose
    selection = summary["selection"]
    assert selection["seed"] == 0
    chosen = selection["colocate_best_layout"]
    chosen_from = _chosen_from(summary)
    assert chosen == _first(chosen_from, summary, ("tp1", "tp2"))
    run_plan = summary["run_plan"]
    chosen_split = summary["best_static"]
    assert run_plan["by"] == "simulation"
    assert run_plan["layouts"] == {
        "prefill": chosen_split["prefill_layout"],
        "decode": chosen_split["decode_layout"],
        "colocated": chosen,
    }
    split_won = _first(chosen_from, summary, (chosen, "best-static")) == "best-static"
    assert run_plan["start"] == ("split" if split_won else "colocated")
    assert set(summary["planned_layouts"].values()) <= {"tp1", "tp2"}
    lines = (tmp_path / "cells.jsonl").read_text().splitlines()
    cells = [Cell.from_dict(json.loads(line)["result"]["cell"]) for line in lines]
    # the searches ran on seed 0 only; every held-out seed ran each plan once
    assert {c.work.seed for c in cells if c.policy == "static"} >= {0, *held_out}
    searched_cells = [c for c in cells if c.policy == "static" and c.work.seed == 0]
    assert len(searched_cells) == sum(
        len(s["objective_by_prefill_slots"]) for s in summary["static_searches"]
    )
    for seed in held_out:
        assert sum(c.policy == "static" and c.work.seed == seed for c in cells) == 1
    dynamic = [c for c in cells if c.policy in ("predictive", "mpc", "oracle")]
    assert sorted(c.work.seed for c in dynamic) == sorted(3 * held_out)
    assert all(c.cluster.layouts == run_plan["layouts"] for c in dynamic)
    assert all(c.control.policy_params["start"] == run_plan["start"] for c in dynamic)
    assert all(c.control.forecaster == "ewma" for c in dynamic if c.policy != "oracle")
    # No simulated allocation beats its seed's bound: every speedup is within the ceiling.
    ceiling = summary["ceiling"]
    assert ceiling["binding"] == "critical_path"
    assert 1.0 < ceiling["ceiling"] < 50.0
    assert all(sp <= ceiling["ceiling"] for sp in summary["speedup"].values())
    for seed, bound in ceiling["by_seed"].items():
        ran = [p["objective_by_seed"][seed] for p in summary["colocate"].values()]
        ran += [p["objective_by_seed"][seed] for p in summary["policies"].values()]
        assert min(ran) >= bound["bound"]
        assert all(r[seed] <= bound["ceiling"] for r in summary["speedup_by_seed"].values())


def _chosen_from(summary: dict) -> dict[str, float]:
    """Each option's objective the plan was chosen by: the selection seed's, or its
    geometric mean with the confirmation seeds' where it was confirmed."""
    selection = summary["selection"]
    own = {**selection["colocate"], "best-static": summary["best_static"]["objective"]}
    out = {}
    for option, value in own.items():
        extra = list(selection["confirmed"].get(option, {}).values())
        out[option] = float(np.exp(np.mean(np.log([value, *extra])))) if extra else value
    return out


def _first(chosen_from: dict[str, float], summary: dict, options) -> str:
    """The option a plan takes among ``options``: confirmed ones (where any were) before
    the others, then the least objective."""
    confirmed = summary["selection"]["confirmed"]
    return min(options, key=lambda n: (bool(confirmed) and n not in confirmed, chosen_from[n], n))


def test_a_close_choice_of_plan_is_confirmed_on_more_seeds(tmp_path):
    # Everything counts as close: every layout and the best split also run on seeds 1, 2
    # and the plan follows the geometric mean over seeds 0-2.
    (summary,) = run_map(toy_config(tmp_path, confirm_within=1.0))["regimes"]
    confirmed = summary["selection"]["confirmed"]
    assert set(confirmed) == {"tp1", "tp2", "best-static"}
    assert all(set(by_seed) == {"1", "2"} for by_seed in confirmed.values())
    chosen_from = _chosen_from(summary)  # all confirmed: the least mean over seeds 0-2
    chosen = min(("tp1", "tp2"), key=chosen_from.get)
    assert summary["selection"]["colocate_best_layout"] == chosen
    split_won = chosen_from["best-static"] < chosen_from[chosen]
    assert summary["run_plan"]["start"] == ("split" if split_won else "colocated")
    cells = [
        Cell.from_dict(json.loads(line)["result"]["cell"])
        for line in (tmp_path / "cells.jsonl").read_text().splitlines()
    ]
    for seed in (1, 2):  # each option once per confirmation seed, nothing else
        on_seed = [c for c in cells if c.work.seed == seed]
        assert sorted(c.policy for c in on_seed) == ["colocate", "colocate", "static"]
    # The confirmation seeds' draws differ from the selection seed's.
    assert confirmed["tp1"]["1"] != summary["selection"]["colocate"]["tp1"]
    # Nothing is close when no margin is allowed and no seed confirms without seeds.
    for kw in ({"confirm_within": 0.0}, {"confirm_seeds": ()}):
        (plain,) = run_map(toy_config(tmp_path / str(kw), **kw))["regimes"]
        assert plain["selection"]["confirmed"] == {}
        own = plain["selection"]["colocate"]
        assert plain["selection"]["colocate_best_layout"] == min(own, key=own.get)


def test_confirmation_seeds_can_overturn_the_selection_seeds_choice():
    from prorsa.experiments.regimes import _run_plan

    cfg = toy_config()
    plan = plan_regime(Regime("toy-7b", "swe", "async", 8), cfg)

    def run(objective):
        return {"objective": objective, "metrics": {}}

    static = {"prefill_layout": "tp1", "decode_layout": "tp2", "prefill_slots": 1,
              "prefill_gpus": 2, "objective": 99.0}  # fmt: skip
    runs = {"colocate": {"tp1": run(100.0), "tp2": run(101.0)}, "static": [static]}
    alone = _run_plan(cfg, plan, runs)
    assert alone.start == "split" and alone.layouts["colocated"] == "tp1"
    # seeds 1 and 2 find the split and TP1 slower: the plan stays colocated at TP2
    runs["confirmed"] = {"tp1": {1: 120.0, 2: 120.0}, "tp2": {1: 100.0, 2: 100.0},
                         "best-static": {1: 130.0, 2: 130.0}}  # fmt: skip
    confirmed = _run_plan(cfg, plan, runs)
    assert confirmed.start == "colocated" and confirmed.layouts["colocated"] == "tp2"
    runs["confirmed"]["tp2"] = {1: 200.0, 2: 200.0}
    assert _run_plan(cfg, plan, runs).layouts["colocated"] == "tp1"
    # a confirmed option that failed on a confirmation seed is not chosen
    runs["confirmed"]["tp1"] = {1: float("inf"), 2: 90.0}
    assert _run_plan(cfg, plan, runs).layouts["colocated"] == "tp2"
    # nor before an unconfirmed one that ran, when every confirmed layout failed
    runs["confirmed"] = {"tp1": {1: float("inf")}, "best-static": {1: 90.0, 2: 90.0}}
    assert _run_plan(cfg, plan, runs).layouts["colocated"] == "tp2"
    # A split that failed on a confirmation seed keeps its searched layouts (the planner's
    # would take over only when no split finished on seed 0) and starts colocated.
    runs["confirmed"] = {"tp1": {1: 100.0, 2: 100.0}, "best-static": {1: float("inf")}}
    failed = _run_plan(cfg, plan, runs)
    assert failed.start == "colocated"
    assert (failed.layouts["prefill"], failed.layouts["decode"]) == ("tp1", "tp2")


def test_options_left_unconfirmed_rank_after_the_confirmed_ones():
    # Found by review: seeds 1-2 may be harder draws as a whole, so a mean over them is not
    # comparable with an option's seed-0 objective alone; TP2 (6% behind on seed 0, not
    # confirmed) must not win because the confirmed options met harder draws.
    from prorsa.experiments.regimes import _run_plan, summarise_regime

    cfg = toy_config()
    plan = plan_regime(Regime("toy-7b", "swe", "async", 8), cfg)
    static = {
        "prefill_layout": "tp1",
        "decode_layout": "tp2",
        "prefill_slots": 1,
        "prefill_gpus": 2,
        "objective": 104.0,
        "objective_by_prefill_slots": {1: 104.0},
    }
    runs = {
        "colocate": {
            name: {"objective": v, "metrics": {}} for name, v in (("tp1", 100.0), ("tp2", 106.0))
        },
        "static": [static],
        "confirmed": {"tp1": {1: 115.0, 2: 115.0}, "best-static": {1: 113.0, 2: 113.0}},
    }
    run = _run_plan(cfg, plan, runs)
    assert run.layouts["colocated"] == "tp1" and run.start == "colocated"  # 109.8 < 109.9
    runs["confirmed"]["best-static"] = {1: 110.0, 2: 110.0}
    run = _run_plan(cfg, plan, runs)
    assert run.start == "split" and run.layouts["colocated"] == "tp1"
    # the summary names the layout the plan chose, not seed 0's or the unconfirmed one
    runs["confirmed"]["tp1"] = {1: 130.0, 2: 130.0}
    runs["confirmed"]["tp2"] = {1: 112.0, 2: 112.0}
    seeds = {9: {}, 10: {}}
    for seed in seeds:
        for name in ("tp1", "tp2"):
            seeds[seed][("colocate", name)] = {"objective": 100.0 + seed, "metrics": {}}
    runs["held_out"] = seeds
    chosen = _run_plan(cfg, plan, runs)
    summary = summarise_regime(plan, runs, chosen)
    assert summary["selection"]["colocate_best_layout"] == chosen.layouts["colocated"] == "tp2"
    assert summary["selection"]["confirmed"]["tp2"] == {"1": 112.0, "2": 112.0}


def test_confirm_seeds_neither_score_nor_choose_already():
    with pytest.raises(ConfigError, match="both choose the plans and score"):
        toy_config(confirm_seeds=(1, 9)).validate()
    with pytest.raises(ConfigError, match="regimes' own seeds"):
        toy_config(confirm_seeds=(0, 1)).validate()
    with pytest.raises(ConfigError, match="distinct"):
        toy_config(confirm_seeds=(1, 1)).validate()
    with pytest.raises(ConfigError, match="confirm_within"):
        toy_config(confirm_within=-0.1).validate()


def test_eval_seeds_never_include_the_seed_that_chose_the_plans_or_trained_the_models():
    toy_config(eval_seeds=(9, 12)).validate()
    with pytest.raises(ConfigError, match="cannot also score"):
        toy_config(
            eval_seeds=(9, 12), regimes=[Regime("toy-7b", "search", "sync", 4, seed=12)]
        ).validate()
    # the shipped forecasters trained on seeds 0-8: scoring predictive there is in sample
    with pytest.raises(ConfigError, match="training seeds"):
        toy_config(eval_seeds=(3, 9)).validate()
    for seeds in ((9, 9), (9,), ()):  # an interval needs two distinct seeds
        with pytest.raises(ConfigError, match="at least two distinct"):
            toy_config(eval_seeds=seeds).validate()


def test_simulated_plan_starts_split_only_where_the_split_won():
    plan = plan_regime(Regime("toy-7b", "swe", "async", 8), toy_config())
    colocate = {"tp1": 100.0, "tp2": 90.0}
    static = {"prefill_layout": "tp1", "decode_layout": "tp2", "prefill_gpus": 2}
    lost = simulated_run_plan(plan, colocate, {**static, "objective": 95.0})
    assert lost.start == "colocated" and lost.layouts["colocated"] == "tp2"
    won = simulated_run_plan(plan, colocate, {**static, "objective": 80.0})
    assert won.start == "split"
    assert won.prefill_fraction == pytest.approx(2 / plan.family.gpus)
    assert won.layouts == {"prefill": "tp1", "decode": "tp2", "colocated": "tp2"}


def test_a_split_start_keeps_slots_fine_enough_for_its_split():
    """A TP2 colocated layout would make 2-GPU slots: a 1-GPU TP1 prefill pool cannot be
    formed from them, so the colocated role takes the fastest layout that can."""
    plan = plan_regime(Regime("toy-7b", "swe", "async", 8), toy_config())
    colocate = {"tp1": 100.0, "tp2": 90.0}
    odd = {"prefill_layout": "tp1", "decode_layout": "tp1", "prefill_gpus": 1, "objective": 80.0}
    run = simulated_run_plan(plan, colocate, odd)
    assert run.start == "split" and run.layouts["colocated"] == "tp1"
    assert plan.slots(run.layouts) == plan.family.gpus  # 1-GPU slots: the split is exact
    even = simulated_run_plan(plan, colocate, {**odd, "prefill_gpus": 2})
    assert even.layouts["colocated"] == "tp2"  # 2-GPU slots form a 2-GPU pool
    lost = simulated_run_plan(plan, colocate, {**odd, "objective": 95.0})
    assert lost.start == "colocated" and lost.layouts["colocated"] == "tp2"


def test_analytic_plan_runs_the_cost_model_planners_layouts(tmp_path):
    result = run_map(toy_config(tmp_path, plan_by="analytic"))
    (summary,) = result["regimes"]
    assert summary["run_plan"]["layouts"] == summary["planned_layouts"]
    assert summary["run_plan"]["start"] == summary["planned_start"]["start"]


def test_map_resumes_from_its_cells_file(tmp_path):
    first = run_map(toy_config(tmp_path))
    assert first["cells"]["run"] > 0 and first["cells"]["reused"] == 0
    again = run_map(toy_config(tmp_path))
    assert again["cells"]["run"] == 0
    assert again["cells"]["reused"] == first["cells"]["run"]
    assert again["regimes"][0]["speedup"] == first["regimes"][0]["speedup"]


@pytest.mark.ray
def test_map_runs_cells_as_ray_tasks(tmp_path):
    pytest.importorskip("ray")
    cfg = toy_config(tmp_path, backend="ray")
    result = run_map(cfg)
    assert result["cells"]["run"] > 0
    assert result["regimes"][0]["speedup"]["oracle"] > 0


def test_plan_offers_static_pairs_and_colocated_layouts():
    cfg = toy_config()
    plan = plan_regime(Regime("toy-7b", "swe", "async", 8), cfg)
    assert plan.colocated == ("tp1", "tp2")
    assert plan.static_pairs and all(p == "tp1" for p, _ in plan.static_pairs)  # TP1 prefills best
    assert plan.slots({"prefill": "tp1", "decode": "tp2", "colocated": "tp2"}) == 2
    assert 0 < plan.shape.prefill_share < 1


def test_goals_cell_by_cell():
    def summary(label, pred, oracle, static, model="qwen3-30b-a3b", workload="swe", load=16):
        return {
            "label": label,
            "variant": "",
            "regime": {"model": model, "workload": workload, "load_per_gpu": load},
            "gpus": 8,
            "speedup": {"predictive": pred, "oracle": oracle, "best-static": static},
        }

    rows = [
        summary("seed-ok", 1.35, 1.36, 1.30),
        summary("seed-short", 1.10, 1.12, 1.10),
        summary("below-colocation", 0.95, 0.96, 0.9, model="qwen2.5-7b"),
        summary("far-from-oracle", 1.0, 1.2, 1.0, model="qwen2.5-7b"),
        summary("below-static", 1.0, 1.0, 1.05, model="qwen2.5-7b"),
        # every colocation layout failed: an infinite "speedup", no baseline (found by review)
        {**summary("no-baseline", float("inf"), float("inf"), float("inf")), "valid": False},
    ]
    rows[1]["ceiling"] = {"ceiling": 1.2}  # no allocation could reach 1.3x there
    rows[0]["ceiling"] = {"ceiling": 1.6}
    met = goals(rows)
    assert met["missed"]["seed_1.3x"] == ["seed-short"]
    assert met["seed_1.3x_beyond_ceiling"] == ["seed-short"]
    assert met["missed"]["vs_colocate_0.98"] == ["below-colocation"]
    assert met["missed"]["vs_oracle_5pct"] == ["far-from-oracle"]
    assert met["missed"]["vs_best_static_2pct"] == ["below-static"]
    assert met["seed_setting_cells"] == 2
    assert met["seed_setting_predictive_min"] == pytest.approx(1.10)
    assert met["missed"]["valid_baseline"] == ["no-baseline"] and met["cells"] == 5
    assert not any(met["met"].values())
    # seed-ok and seed-short pay; the regime without a baseline is not counted
    assert [h["split_pays_cells"] for h in headline(rows) if h["model"] == "qwen3-30b-a3b"] == [2]
    # a speedup whose interval over the held-out seeds reaches 1x does not pay
    rows[1]["speedup_ci95"] = {"predictive": [0.99, 1.22]}
    assert [h["split_pays_cells"] for h in headline(rows) if h["model"] == "qwen3-30b-a3b"] == [1]
    assert [h["invalid"] for h in headline(rows) if h["model"] == "qwen3-30b-a3b"] == [
        ["no-baseline"]
    ]
    assert "Left out (no colocation layout finished): no-baseline." in headline_markdown(rows)
    assert "no-baseline" in goals_markdown(met)


def test_grids_and_filters():
    regimes = full_grid()
    models = {r.model for r in regimes}
    assert models == {"qwen2.5-7b", "qwen2.5-32b", "qwen3-30b-a3b", "qwen3-235b-a22b"}
    sync = [
        r
        for r in regimes
        if not r.variant
        and r.mode == "sync"
        and r.load_per_gpu in LOADS
        and r.workload in WORKLOADS
    ]
    assert len(sync) == 4 * len(WORKLOADS) * len(LOADS)
    assert {r.workload for r in regimes} == {*WORKLOADS, "replay:tau2-telecom"}
    seed_async = {
        (r.workload, r.load_per_gpu)
        for r in regimes
        if r.mode == "async" and r.model == "qwen3-30b-a3b"
    }
    assert {("swe", 16), ("swe", 64), ("mixed", 64), ("search", 64)} <= seed_async
    assert {r.load_per_gpu for r in regimes} == {*LOADS, 128}
    assert {r.variant for r in regimes} >= {"tool x4", "growth x0.5", "kv-store"}
    assert len(set(regimes)) == len(regimes)
    picked = select(get_grid("quick"), models=["qwen2.5-7b"], workloads=["search"])
    assert [r.label for r in picked] == ["qwen2.5-7b search sync 4/GPU"]
    with pytest.raises(ConfigError, match="no regime left"):
        select(regimes, models=["nope"])
    with pytest.raises(ConfigError, match="unknown grid"):
        get_grid("huge")
    with pytest.raises(ConfigError, match="unknown model"):
        Regime("gpt-9", "swe", "sync", 4).validate()


def test_replays_use_the_shipped_traces():
    regime = Regime("qwen2.5-7b", "replay:mini-swe-agent", "sync", 4)
    scenario, trace = regime.workload_source()
    assert scenario is None and trace.endswith("mini-swe-agent-swebench.parquet")
    plan = plan_regime(regime, MapConfig(regimes=[regime]))
    assert np.isfinite(plan.shape.decode_context_tokens)


def test_an_infeasible_cell_is_recorded_and_any_other_error_stops_the_map(tmp_path, monkeypatch):
    import prorsa.experiments.cells as cells
    from prorsa.errors import CapacityError

    real = cells.run_cell

    def too_long(cell):
        if cell.policy == "mpc":
            raise CapacityError("trajectory t reaches 9 tokens")
        return real(cell)

    monkeypatch.setattr(cells, "run_cell", too_long)
    (summary,) = run_map(toy_config(tmp_path))["regimes"]
    assert summary["failed_cells"] == ["mpc"]
    error = summary["policies"]["mpc"]["error"]
    assert error == "seed 9: CapacityError: trajectory t reaches 9 tokens"
    assert summary["speedup"]["mpc"] == 0.0 and summary["speedup_ci95"]["mpc"] is None
    assert summary["speedup"]["oracle"] > 0
    saved = [json.loads(line)["result"] for line in (tmp_path / "cells.jsonl").open()]
    assert sum("error" in r for r in saved) == 3  # one per held-out seed

    # A simulator fault is not a loss to score: it stops the map (found by review).
    for error in (ValueError("rank over max_batch"), ConfigError("bad cell")):

        def broken(cell, error=error):
            raise error

        monkeypatch.setattr(cells, "run_cell", broken)
        with pytest.raises(type(error), match=str(error)):
            run_map(toy_config(tmp_path / type(error).__name__))


def test_plots_draw_the_intervals_and_survive_a_failed_run(tmp_path):
    from prorsa.experiments.regime_report import heatmap, pays, speedup_bars

    def summary(load, pred, ci):
        return {
            "label": f"toy search sync {load}/GPU",
            "variant": "",
            "gpus": 4,
            "regime": {
                "model": "toy-7b",
                "workload": "search",
                "mode": "sync",
                "load_per_gpu": load,
            },
            "speedup": {"predictive": pred, "best-static": 1.0},
            "speedup_ci95": {"predictive": ci, "best-static": [0.95, 1.05]},
        }

    rows = [summary(4, 1.10, [1.04, 1.16]), summary(16, 1.10, [0.9, 1.3]), summary(64, 0.0, None)]
    # no colocation layout finished: an infinite "speedup" that is neither paid nor drawn
    rows.append({**summary(128, float("inf"), None), "valid": False})
    assert [pays(r) for r in rows] == [True, False, False, False]
    assert speedup_bars(rows, tmp_path / "bars.png").stat().st_size > 0
    assert heatmap(rows, "toy-7b", tmp_path / "map.png").stat().st_size > 0


def test_paying_regimes_over_a_whole_map_are_read_at_a_false_discovery_rate():
    from prorsa.experiments.regime_report import (
        chance_pays,
        many_tests_markdown,
        p_value,
        pays_at_fdr,
    )

    def summary(label, by_seed, valid=True):
        ratios = list(by_seed)
        centre = float(np.exp(np.mean(np.log(ratios))))
        return {
            "label": label, "variant": "", "valid": valid, "gpus": 8,
            "regime": {"model": "qwen3-30b-a3b", "workload": "swe", "load_per_gpu": 16},
            "speedup": {"predictive": centre},
            "speedup_ci95": {"predictive": [centre * 0.99, centre * 1.01]},  # "pays"
            "speedup_by_seed": {"predictive": dict(zip((9, 10, 11), ratios, strict=True))},
        }  # fmt: skip

    strong = summary("strong", [1.20, 1.21, 1.19])
    # pays on its own interval, but among many regimes a p of ~0.02 is what chance gives
    marginal = summary("marginal", [1.05, 1.10, 1.07])
    noise = [summary(f"flat-{i}", [1.0 + d, 1.0 - d, 1.0 + d / 2]) for i, d in
             enumerate(np.linspace(0.01, 0.05, 30))]  # fmt: skip
    rows = [strong, marginal, *noise, summary("gone", [1.3, 1.3, 1.3], valid=False)]
    assert p_value(strong) < 1e-3 < p_value(marginal) < 0.05
    failed = {**strong, "speedup_by_seed": {"predictive": {9: 1.2, 10: 0.0, 11: 1.2}}}
    assert p_value(failed) == 1.0  # tested, no evidence: it counts in the family
    assert p_value({**strong, "speedup_by_seed": {"predictive": {9: 1.2}}}) is None
    assert p_value(summary("same", [1.1, 1.1, 1.1])) == 0.0
    assert p_value(summary("unchanged", [1.0, 1.0, 1.0])) == 1.0
    assert pays_at_fdr(rows) == ["strong"]
    assert pays_at_fdr([strong, marginal]) == ["strong", "marginal"]  # two tests only
    # regimes where the plan failed on a seed are tests too: they tighten the threshold
    assert pays_at_fdr([strong, marginal, *[failed] * 30]) == ["strong"]
    assert chance_pays(rows) == pytest.approx(0.025 * 32)  # the invalid one is not tested
    text = many_tests_markdown(rows)
    assert "pays in 2 of 32" in text and "1 remains: strong." in text
    assert "2 remain: strong, marginal." in many_tests_markdown([strong, marginal])
    assert [h["split_pays_fdr_cells"] for h in headline(rows)] == [1]


def test_misses_against_colocation_split_into_its_layout_choice_and_the_policy():
    from prorsa.experiments.regime_report import (
        colocate_misses_by_cause,
        colocate_misses_markdown,
        layout_choice,
    )

    def summary(label, chosen, best, tp4, tp8, predictive, selection=None):
        seeds = (9, 10, 11)
        colocate = {
            "tp4": {"objective_by_seed": dict(zip(seeds, tp4, strict=True))},
            "tp8": {"objective_by_seed": dict(zip(seeds, tp8, strict=True))},
        }
        run = dict(zip(seeds, predictive, strict=True))
        at_best = np.array(tp4 if best == "tp4" else tp8, float)
        speedup = float(np.exp(np.mean(np.log(at_best / np.array(predictive)))))
        return {
            "label": label, "valid": True,
            "selection": {"colocate_best_layout": chosen, **(selection or {})},
            "colocate": colocate,
            "colocate_best": {"layout": best, **colocate[best]},
            "policies": {"predictive": {"objective_by_seed": run}},
            "speedup": {"predictive": speedup},
        }  # fmt: skip

    # seed 0 chose tp4 (3% faster there; confirmed on seeds 1 and 2, faster on one), tp8
    # is 4% faster on the held-out seeds; predictive = colocated tp4
    chose = {
        "seed": 0,
        "colocate": {"tp4": 100.0, "tp8": 103.0, "tp2": 120.0},
        "confirmed": {"tp4": {"1": 100.0, "2": 100.0}, "tp8": {"1": 102.0, "2": 99.0}},
    }
    layout = summary(
        "layout", "tp4", "tp8", [104, 104, 104], [100, 100, 100], [104, 104, 104], chose
    )
    # the same layout both ways, the policy itself 5% slower
    policy = summary("policy", "tp8", "tp8", [110, 110, 110], [100, 100, 100], [105, 105, 105])
    fine = summary("fine", "tp8", "tp8", [110, 110, 110], [100, 100, 100], [99, 99, 99])
    # the chosen layout 3% off the best, and the policy 3% off colocation at that layout
    both = summary("both", "tp4", "tp8", [103, 103, 103], [100, 100, 100], [106, 106, 106])
    # colocation at the chosen layout failed on a seed: the factors say nothing
    failed = summary("failed", "tp4", "tp8", [104, np.inf, 104], [100, 100, 100], [104] * 3)
    split = layout_choice(layout)
    assert split["chosen_layout"] == "tp4" and split["best_layout"] == "tp8"
    assert split["colocate_chosen_vs_best"] == pytest.approx(100 / 104)
    assert split["vs_colocate_chosen"] == pytest.approx(1.0)
    # the two factors multiply to the speedup over colocation@best, seed by seed
    assert split["colocate_chosen_vs_best"] * split["vs_colocate_chosen"] == pytest.approx(
        layout["speedup"]["predictive"]
    )
    # every seed both layouts ran, selection and confirmation ones included
    assert split["best_over_chosen_time_by_seed"] == pytest.approx(
        {"0": 1.03, "1": 1.02, "2": 0.99, "9": 100 / 104, "10": 100 / 104, "11": 100 / 104}
    )
    assert split["seeds_chosen_not_slower"] == 2
    assert layout_choice(policy)["best_over_chosen_time_by_seed"] == {"9": 1, "10": 1, "11": 1}
    assert layout_choice(failed) is None
    causes = colocate_misses_by_cause([layout, policy, fine, both, failed])
    assert {cause: [r["label"] for r in rows] for cause, rows in causes.items()} == {
        "layout": ["layout"], "policy": ["policy"], "both": ["both"], "unknown": ["failed"]
    }  # fmt: skip
    text = colocate_misses_markdown([layout, policy, fine])
    assert "| layout | layout | 0.962x | 0.962x (tp4 / tp8) | on 2 of 6 seeds | 1.000x |" in text
    same = "| policy | policy | 0.952x | 1.000x (tp8 / tp8) | - (the same layout) | 0.952x |"
    assert same in text
    assert colocate_misses_markdown([fine]).endswith("in every regime.")


def test_a_policy_rerun_on_the_saved_plans_reproduces_the_map_and_records_new_params(tmp_path):
    from prorsa.experiments.policy_rerun import rerun_policies

    (summary,) = run_map(toy_config(tmp_path / "map"))["regimes"]
    saved = json.loads(json.dumps(summary, default=float))  # as regimes.json holds it
    kw = dict(forecaster="ewma", families={"toy-7b": TOY}, workers=1)
    (same,) = rerun_policies([saved], ["predictive"], cells_path=tmp_path / "a.jsonl", **kw)
    # the same cells on the recorded plan and seeds: the map's own result
    assert same["speedup"]["predictive"] == pytest.approx(summary["speedup"]["predictive"])
    assert same["speedup"]["mpc"] == saved["speedup"]["mpc"]  # not rerun: kept
    assert same["rerun_from"]["predictive"]["speedup"] == saved["speedup"]["predictive"]
    # every number the map kept of the run (a saved compact map keeps fewer)
    assert same["policies"]["predictive"].keys() == summary["policies"]["predictive"].keys()
    # other parameters: recorded, run (the toy plan starts colocated; this one does not),
    # and scored against the saved baselines
    params = {"predictive": {"start": "split", "prefill_fraction": 0.5}}
    (split,) = rerun_policies(
        [saved], ["predictive"], params=params, cells_path=tmp_path / "b.jsonl", **kw
    )
    assert split["rerun_params"] == params
    ran = split["policies"]["predictive"]["objective_by_seed"]
    assert ran != saved["policies"]["predictive"]["objective_by_seed"]
    assert set(ran) == set(saved["colocate_best"]["objective_by_seed"])  # keyed as saved
    from prorsa.experiments.regime_report import colocate_misses_by_cause, layout_choice

    assert layout_choice(split, "predictive") is not None  # pairs new runs with saved ones
    colocate_misses_by_cause([split])
    for baseline, speedup in (
        (saved["colocate_best"]["objective_by_seed"], split["speedup"]["predictive"]),
        (saved["colocate"]["tp1"]["objective_by_seed"], split["speedup_vs_baseline"]["predictive"]),
    ):
        ratios = [baseline[s] / ran[s] for s in ("9", "10", "11")]
        assert speedup == pytest.approx(np.exp(np.mean(np.log(ratios))))
    assert goals([split])["cells"] == 1 and "predictive" not in split["failed_cells"]
    with pytest.raises(ConfigError, match="among"):
        rerun_policies([saved], ["colocate"], **kw)
    with pytest.raises(ConfigError, match="distinct"):
        rerun_policies([saved], ["predictive", "predictive"], **kw)
    with pytest.raises(ConfigError, match="min_gian"):  # before any cell runs
        rerun_policies([saved], ["predictive"], params={"predictive": {"min_gian": 0.2}}, **kw)
    with pytest.raises(ConfigError, match="not rerun"):
        rerun_policies([saved], ["predictive"], params={"mpc": {}}, **kw)
