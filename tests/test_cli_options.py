"""CLI options come from the config dataclasses: names, defaults, help, dict and bool fields."""

from __future__ import annotations

import dataclasses
import json

import pytest
import typer
from typer.testing import CliRunner

from prorsa.cli.main import app
from prorsa.cli.options import config_command, option_name, parse_params
from prorsa.errors import ConfigError
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.cluster.control import ControlConfig
from prorsa.workload.config import WorkloadConfig

runner = CliRunner()


def test_every_config_field_is_a_simulate_option_with_its_help():
    result = runner.invoke(app, ["simulate", "--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0
    text = " ".join(result.output.replace("│", " ").split())
    for cls in (WorkloadConfig, ClusterConfig, ControlConfig):
        for f in dataclasses.fields(cls):
            assert f"--{option_name(f)}" in text, f.name
            first_words = " ".join(f.metadata["help"].split()[:3])
            assert first_words in text, f.name


def test_options_build_the_configs_with_their_defaults():
    seen = {}

    @config_command(work=WorkloadConfig, cluster=ClusterConfig, control=ControlConfig)
    def cmd(work, cluster, control, extra: int = typer.Option(3)) -> None:
        seen.update(work=work, cluster=cluster, control=control, extra=extra)

    command = typer.Typer()
    command.command()(cmd)
    args = ["--engines", "6", "--role-tp", "decode=2", "--param", "prefill_gpus=2"]
    args += ["--no-link-contention", "--interval-s", "0.5", "--extra", "4"]
    result = runner.invoke(command, args)
    assert result.exit_code == 0, result.output
    cluster, control, work = seen["cluster"], seen["control"], seen["work"]
    assert cluster.num_slots == 6 and cluster.link_contention is False
    # A dict option lays its items over the field's default.
    assert cluster.role_tp == {"prefill": 1, "decode": 2, "colocated": 1}
    assert control.policy_params == {"prefill_gpus": 2} and control.interval_s == 0.5
    assert work == WorkloadConfig() and seen["extra"] == 4
    assert dataclasses.replace(cluster, num_slots=8, role_tp=ClusterConfig().role_tp,
                               link_contention=True) == ClusterConfig()  # fmt: skip


def test_simulate_writes_the_configs_it_ran(tmp_path):
    out = tmp_path / "sim"
    args = ["simulate", "--scenario", "math-tool", "--engines", "3", "--trajectories", "8"]
    args += ["--policy", "static", "--param", "prefill_gpus=1", "--out", str(out), "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["request"]["cluster"]["num_slots"] == 3
    assert metrics["request"]["control"]["policy_params"] == {"prefill_gpus": 1}
    assert metrics["trajectories_completed"] == 8


@pytest.mark.parametrize("value", ["nan", "1e-9", "-1"])
def test_bad_interval_is_refused_before_running(value, tmp_path):
    args = ["simulate", "--interval-s", value, "--policy", "threshold", "--out", str(tmp_path)]
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    assert "interval_s" in result.output


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_bad_train_step_is_refused_before_running(value, tmp_path):
    args = ["simulate", "--mode", "async", "--train-step-s", value, "--out", str(tmp_path)]
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    assert "train_step_s" in result.output


def test_parse_params_rejects_items_without_a_key():
    assert parse_params(["a=1", "b=x", "c=[1, 2]"]) == {"a": 1, "b": "x", "c": [1, 2]}
    for bad in (["novalue"], ["=3"]):
        with pytest.raises(ConfigError):
            parse_params(bad)


@pytest.mark.parametrize(
    ("command", "left_out"),
    [
        (["compare"], {"scenario", "trace", "mode", "seed", "policy", "policy_params"}),
        (["tune"], {"seed", "policy"}),
    ],
)
def test_compare_and_tune_options_come_from_the_configs(command, left_out):
    """Every config field the command does not set itself is an option with the field's
    help and default (the matrix axes and the tuned policy are the commands' own)."""
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0
    text = " ".join(result.output.replace("│", " ").split())
    for cls in (WorkloadConfig, ClusterConfig, ControlConfig):
        for f in dataclasses.fields(cls):
            if f.name in left_out:
                continue
            assert f"--{option_name(f)}" in text, f.name
            assert " ".join(f.metadata["help"].split()[:3]) in text, f.name
    # Option names users already had.
    for name in ("--engines", "--profile", "--trajectories", "--forecaster", "--param"):
        assert name in text
    assert "[default: 8]" in text  # engines: ClusterConfig's default, not a second one


def test_compare_builds_its_cells_from_the_config_options(tmp_path, monkeypatch):
    from prorsa.experiments import compare

    seen = {}

    def fake_run(cfg, progress=None):
        cfg.validate()
        seen["cells"] = [
            compare._cell(cfg, w, m, p, 0) for w in cfg.workloads for m in cfg.modes
            for p in cfg.policies
        ]  # fmt: skip
        raise SystemExit(0)

    monkeypatch.setattr(compare, "run_compare", fake_run)
    args = ["compare", "--scenario", "search,swe", "--policies", "colocate,predictive"]
    args += ["--engines", "6", "--in-flight", "32", "--role-tp", "decode=2"]
    args += ["--interval-s", "0.5", "--param", "predictive.horizon_s=10", "--out", str(tmp_path)]
    runner.invoke(app, args)
    cells = {(c.workload, c.policy): c for c in seen["cells"]}
    assert set(cells) == {(w, p) for w in ("search", "swe") for p in ("colocate", "predictive")}
    predictive = cells["swe", "predictive"]
    assert predictive.cluster.num_slots == 6 and predictive.cluster.slot_gpus == 2
    assert predictive.work.max_in_flight == 32 and predictive.work.trajectories == 256
    assert predictive.control.interval_s == 0.5
    assert predictive.control.policy_params == {"horizon_s": 10}
    assert predictive.control.forecaster == "per-target"  # the sweeps' default
    assert cells["search", "colocate"].control.forecaster is None
    assert cells["search", "colocate"].control.policy_params == {}
