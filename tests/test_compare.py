"""`prorsa compare` end to end on a small matrix (real worker processes)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from prorsa.cli.main import app
from prorsa.errors import ConfigError
from prorsa.experiments.cells import cell_of
from prorsa.experiments.compare import CompareConfig, run_compare, summarise
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.cluster.control import ControlConfig
from prorsa.workload.config import WorkloadConfig


def test_compare_cli_writes_report_and_sane_summary(tmp_path):
    out = tmp_path / "cmp"
    result = CliRunner().invoke(
        app,
        [
            "compare",
            "--scenario",
            "search",
            "--policies",
            "colocate,best-static,threshold,predictive",
            "--engines",
            "4",
            "--seeds",
            "2",
            "--trajectories",
            "32",
            "--forecaster",
            "ewma",
            "--workers",
            "2",
            "--out",
            str(out),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output[result.output.index("{") :])["summary"]
    rows = {r["policy"]: r for r in summary}
    assert set(rows) == {"colocate", "best-static", "threshold", "predictive"}
    assert rows["colocate"]["speedup"] == pytest.approx(1.0)
    assert all(r["seeds"] == 2 and r["speedup_ci95"] is not None for r in summary)
    saved = json.loads((out / "results.json").read_text())
    searched = saved["best_static"]["search/sync"]
    objective = searched["objective_by_prefill_slots"]
    best = min(objective.items(), key=lambda kv: (kv[1], int(kv[0])))
    assert int(best[0]) == searched["prefill_slots"] == searched["prefill_gpus"]  # 1-GPU slots
    for name in (
        "report.md",
        "speedup.png",
        "allocation-search-sync.png",
        "completion-search-sync.png",
    ):
        assert (out / name).stat().st_size > 0, name
    assert "| predictive |" in (out / "report.md").read_text()


def test_speedups_are_paired_by_seed():
    def run(policy, seed, objective):
        return {
            "cell": {
                "scenario": "x",
                "trace": None,
                "mode": "sync",
                "policy": policy,
                "seed": seed,
            },
            "objective": objective,
            "wall_s": 1.0,
            "metrics": {
                "switches_completed": 0,
                "busy_fraction": dict.fromkeys(("prefill", "decode", "colocated")),
                "makespan_s": objective,
            },
        }

    rows = summarise(
        [
            run("colocate", 0, 100.0),
            run("colocate", 1, 200.0),
            run("p", 0, 50.0),
            run("p", 1, 200.0),
        ]
    )
    p = next(r for r in rows if r["policy"] == "p")
    assert p["speedup"] == pytest.approx((2.0 + 1.0) / 2)  # not 300/250


def test_best_static_counts_gpus_when_slots_hold_several():
    cfg = CompareConfig(
        workloads=[("search", None)],
        policies=["colocate", "best-static"],
        seeds=1,
        work=WorkloadConfig(trajectories=24),
        cluster=ClusterConfig(num_slots=3, role_tp={"prefill": 2, "decode": 1, "colocated": 1}),
        workers=1,
    )
    result = run_compare(cfg)
    found = result["best_static"]["search/sync"]
    assert found["prefill_gpus"] == 2 * found["prefill_slots"]
    best = next(r for r in result["runs"] if cell_of(r).policy == "best-static")
    assert cell_of(best).control.policy_params["prefill_gpus"] == found["prefill_gpus"]


def test_best_static_is_searched_on_a_seed_it_is_not_scored_on(tmp_path):
    # Found by review: the split was chosen on seed 0 and then averaged over seeds that
    # include seed 0, flattering best-static and narrowing its interval.
    cfg = CompareConfig(
        workloads=[("search", None)],
        policies=["colocate", "best-static"],
        seeds=2,
        work=WorkloadConfig(trajectories=16),
        cluster=ClusterConfig(num_slots=3),
        workers=1,
        cells_path=tmp_path / "cells.jsonl",
    )
    result = run_compare(cfg)
    lines = [json.loads(line) for line in (tmp_path / "cells.jsonl").read_text().splitlines()]
    searched = {cell_of(r["result"]).seed for r in lines if cell_of(r["result"]).policy == "static"}
    scored = {cell_of(r).seed for r in result["runs"]}
    assert searched == {2} and scored == {0, 1}


def test_compare_rejects_bad_matrices():
    with pytest.raises(ConfigError, match="colocate"):
        run_compare(CompareConfig(workloads=[("swe", None)], policies=["static"]))
    with pytest.raises(ConfigError, match="unknown policy"):
        run_compare(CompareConfig(workloads=[("swe", None)], policies=["colocate", "magic"]))


def test_mlflow_logging_only_when_asked(tmp_path):
    import mlflow

    from prorsa.tracking import log_compare

    result = {
        "summary": [
            {
                "workload": "x",
                "mode": "sync",
                "policy": "colocate",
                "objective": 10.0,
                "speedup": 1.0,
                "completion_s_p99": 9.0,
                "switches": 0.0,
                "wall_s": 0.1,
            }
        ]
    }
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "report.md").write_text("# r\n")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = log_compare(result, {"engines": 4}, tmp_path / "report", uri)
    client = mlflow.tracking.MlflowClient(uri)
    parent = client.get_run(run_id)
    assert parent.data.params["engines"] == "4"
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'"
    )
    assert len(children) == 1 and children[0].data.metrics["speedup"] == 1.0


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"policy_params": {"statc": {"prefill_gpus": 2}}}, "policy 'statc'"),
        ({"policy_params": {"static": {"prefill_gpu": 2}}}, "no parameter 'prefill_gpu'"),
        ({"workers": -1}, "workers must be at least 0"),
        ({"control": ControlConfig(interval_s=float("nan"))}, "interval_s must be finite"),
        ({"control": ControlConfig(interval_s=1e-9)}, "interval_s must be at least"),
        ({"cluster": ClusterConfig(num_slots=4, reuse_mode="magic")}, "reuse_mode"),
        ({"work": WorkloadConfig(trajectories=0)}, "trajectories"),
        ({"workloads": [(None, "missing.parquet")]}, "trace not found"),
        ({"tuned_storage": "redis://host/0"}, "not a database"),
        ({"control": ControlConfig(policy_params={"prefill_gpus": 2})}, "per policy"),
        # found by review: accepted, then replaced by the searched split
        (
            {
                "policies": ["colocate", "best-static"],
                "policy_params": {"best-static": {"prefill_gpus": 2}},
            },
            "searched per workload",
        ),
    ],
)
def test_bad_inputs_fail_before_any_cell_runs(monkeypatch, changes, message):
    from dataclasses import replace

    from prorsa.experiments import compare

    def no_sweep(*_a, **_k):
        raise AssertionError("cells started for a comparison that cannot work")

    monkeypatch.setattr(compare, "Sweep", no_sweep)
    cfg = CompareConfig(workloads=[("search", None)], policies=["colocate", "static"], workers=1)
    with pytest.raises(ConfigError, match=message):
        run_compare(replace(cfg, **changes))
