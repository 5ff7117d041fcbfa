"""The three mechanism experiments produce their numbers and plots."""

from __future__ import annotations

import json

import numpy as np
import pytest

from prorsa.experiments import mechanisms
from prorsa.experiments.families import ModelFamily
from prorsa.experiments.regimes import MapConfig, Regime, run_map

TOY = ModelFamily("toy-7b", "h200-qwen2.5-7b", ("tp1", "tp2"), 4, "tp1", moe=False)


def test_interference_colocated_decode_slows_as_prefill_arrives(tmp_path):
    setup = mechanisms.InterferenceSetup(layouts=("tp1-dp8-ep8",), points=6)
    result = mechanisms.interference(tmp_path, setup)
    (sweep,) = result["layouts"]
    coloc_step = np.asarray(sweep["colocated_step_s"])
    coloc_tps = np.asarray(sweep["colocated_decode_tokens_per_s_per_gpu"])
    split_tps = np.asarray(sweep["disaggregated_decode_tokens_per_s_per_gpu"])
    # no prefill: the same engine, the same decode; then colocated steps stretch
    assert coloc_step[0] == pytest.approx(sweep["decode_step_s"])
    assert coloc_tps[0] == pytest.approx(split_tps[0])
    assert np.all(np.diff(coloc_step) > 0) and np.all(np.diff(coloc_tps) < 0)
    # the split pays its prefill in extra GPUs, less than colocation pays in stalls
    assert np.all(split_tps[1:] > coloc_tps[1:])
    assert sweep["disaggregated_step_s"] == [sweep["decode_step_s"]] * 6
    # a step with a 2,048-token chunk runs past the captured graph sizes (eager)
    assert sweep["mixed_step_mode"] == "eager"
    assert sweep["mixed_step_s"] > sweep["decode_step_s"]
    assert (tmp_path / "mechanism-a.png").stat().st_size > 0
    saved = json.loads((tmp_path / "mechanism-a.json").read_text())
    assert saved["layouts"][0]["saturation_prefill_tokens_per_s"] == pytest.approx(
        sweep["saturation_prefill_tokens_per_s"]
    )


def test_stage_layouts_through_a_sync_step(tmp_path):
    regime = Regime("qwen2.5-7b", "search", "sync", 2)
    result = mechanisms.stage_layouts(tmp_path, regime, windows=6)
    family = regime.family
    rows = result["windows"]
    assert rows and len(rows) <= 6
    for row in rows:
        for key in ("best_prefill", "best_decode", "best_single"):
            assert row[key] in family.layouts
        assert row["gpus_per_role_best"] > 0
        assert row["gpus_single_best"] == pytest.approx(min(row["gpus_colocated"].values()))
    fixed = result["gpu_time_fixed_single_layout"]
    assert fixed["layout"] in family.layouts
    assert result["gpu_time_best_single_per_window"] <= fixed["gpu_s"] + 1e-9
    assert (tmp_path / "mechanism-b.png").stat().st_size > 0


def test_completion_tail_of_colocation_and_the_split(tmp_path):
    cfg = MapConfig(
        regimes=[Regime("toy-7b", "search", "sync", 4)],
        families={"toy-7b": TOY},
        forecaster="ewma",
        workers=1,
    )
    (summary,) = run_map(cfg)["regimes"]
    result = mechanisms.completion_tail(tmp_path, summary, cfg)
    runs = result["runs"]
    assert set(runs) == {"colocation@best", "best-static", "predictive"}
    for name, stats in runs.items():
        c = np.asarray(stats["completion_s"])
        assert len(c) == 16 and np.all(np.diff(c) >= 0)
        # the sync step ends with its slowest trajectory
        assert stats["makespan_s"] >= c[-1] - 1e-6
        assert stats["completion_s_p50"] <= stats["completion_s_p90"] <= stats["makespan_s"]
        assert stats["tail_after_p90_s"] == pytest.approx(
            stats["makespan_s"] - stats["completion_s_p90"]
        )
        if name == "colocation@best":
            assert stats["speedup_at_makespan"] == pytest.approx(1.0)
    # the same makespans the map measured for these allocations on its first held-out seed
    assert result["seed"] == 9
    assert runs["colocation@best"]["makespan_s"] == pytest.approx(
        summary["colocate_best"]["objective_by_seed"][9]
    )
    for name in ("best-static", "predictive"):
        measured = summary["policies"][name]["objective_by_seed"][9]
        assert runs[name]["makespan_s"] == pytest.approx(measured)
    assert (tmp_path / "mechanism-c.png").stat().st_size > 0
    assert "[16 values]" in json.dumps(mechanisms.brief(result))
    # a plan that failed on that seed (a draw too long for its layout) is left out
    by_seed = {**summary["policies"]["predictive"]["objective_by_seed"], 9: float("inf")}
    failed = {**summary["policies"]["predictive"], "objective_by_seed": by_seed}
    summary = {**summary, "policies": {**summary["policies"], "predictive": failed}}
    again = mechanisms.completion_tail(tmp_path, summary, cfg)
    assert set(again["runs"]) == {"colocation@best", "best-static"}
