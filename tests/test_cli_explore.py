"""``prorsa explore`` end to end on the quick grid, resuming, and a mechanism."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from prorsa.cli.demo import verdict
from prorsa.cli.main import app

runner = CliRunner()
QUICK = [
    "explore",
    "--quick",
    "--models",
    "qwen2.5-7b",
    "--workloads",
    "search",
    "--forecaster",
    "ewma",
    "--workers",
    "1",
]


def test_explore_quick_writes_the_map_and_resumes(tmp_path):
    out = tmp_path / "map"
    result = runner.invoke(app, [*QUICK, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "report:" in result.output
    assert (out / "heatmap-qwen2.5-7b.png").stat().st_size > 0
    report = (out / "report.md").read_text()
    assert "## Goals" in report and "colocation@best" in report
    saved = json.loads((out / "results.json").read_text())
    (summary,) = saved["regimes"]
    assert summary["label"] == "qwen2.5-7b search sync 4/GPU"
    assert summary["colocate_best"]["layout"] in ("tp1", "tp2", "tp4")
    assert saved["headline"][0]["model"] == "qwen2.5-7b"
    again = runner.invoke(app, [*QUICK, "--out", str(out), "--json"])
    assert again.exit_code == 0, again.output
    assert "reused" not in again.output  # JSON only
    assert json.loads(again.output)["headline"][0]["cells"] == 1
    lines = (out / "cells.jsonl").read_text().splitlines()
    assert len(lines) == len({json.loads(line)["key"] for line in lines})  # nothing ran twice


def test_explore_plan_by_is_checked_and_recorded(tmp_path):
    bad = runner.invoke(app, [*QUICK, "--plan-by", "guess", "--out", str(tmp_path / "x")])
    assert bad.exit_code == 1 and "unknown plan_by 'guess'" in bad.output
    scored = runner.invoke(app, [*QUICK, "--confirm-seeds", "1,9", "--out", str(tmp_path / "y")])
    assert scored.exit_code == 1 and "both choose the plans and score them" in scored.output
    out = tmp_path / "analytic"
    result = runner.invoke(
        app, [*QUICK, "--plan-by", "analytic", "--confirm-seeds", "none", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "results.json").read_text())
    assert saved["config"]["confirm_seeds"] == []
    (summary,) = saved["regimes"]
    assert summary["run_plan"]["by"] == "analytic"
    assert summary["run_plan"]["layouts"] == summary["planned_layouts"]


def test_explore_mechanism_a(tmp_path):
    result = runner.invoke(app, ["explore", "--mechanism", "a", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "mechanism-a.png").exists()
    bad = runner.invoke(app, ["explore", "--mechanism", "z", "--out", str(tmp_path)])
    assert bad.exit_code == 1 and "unknown mechanism" in bad.output


def test_explore_refuses_an_empty_selection(tmp_path):
    result = runner.invoke(app, ["explore", "--quick", "--models", "gpt-9", "--out", str(tmp_path)])
    assert result.exit_code == 1
    assert "no regime left" in result.output


def test_demo_verdict_says_where_the_split_pays():
    base = {
        "colocate_best": {"layout": "tp4"},
        "best_static": {"prefill_layout": "tp1", "prefill_gpus": 8, "decode_layout": "dp8"},
    }
    speedup = {"predictive": 1.12, "best-static": 1.10}
    sure = {**base, "eval_seeds": [9, 10, 11], "speedup": speedup}
    pays = verdict({**sure, "speedup_ci95": {"predictive": [1.05, 1.2]}})
    assert pays.startswith("the split pays: predictive 1.120x (1.05-1.20)") and "tp4" in pays
    assert "3 held-out seeds" in pays
    # as fast on average, but the interval over the held-out seeds reaches 1x: not shown
    unsure = verdict(
        {**sure, "speedup_ci95": {"predictive": [0.97, 1.29], "best-static": [0.9, 1.3]}}
    )
    assert unsure.startswith("the split is not shown to pay: predictive 1.120x (0.97-1.29)")
    # best-static's interval lies above 1 where predictive's does not: the split pays
    either = {"predictive": [0.97, 1.29], "best-static": [1.01, 1.2]}
    assert verdict({**sure, "speedup_ci95": either}).startswith("the split pays: best-static")
    flat = verdict({**base, "speedup": {"predictive": 1.0, "best-static": 0.97}})
    assert flat.startswith("colocation at tp4 is as good as any split")


def test_map_options_given_with_a_mechanism_are_refused_by_name(tmp_path):
    # Found by review: --mechanism c dropped --fresh, --address, --workers and the rest
    # without a word (it reused cells.jsonl and ran in process).
    result = runner.invoke(
        app,
        ["explore", "--mechanism", "c", "--fresh", "--workers", "2", "--out", str(tmp_path)],
    )
    assert result.exit_code != 0
    text = " ".join(result.output.split())
    assert "--workers, --fresh apply to the map" in text
    assert not (tmp_path / "cells.jsonl").exists()
