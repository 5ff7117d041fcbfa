"""``prorsa forecast`` end to end on a small simulation, and MLflow logging only when asked."""

from __future__ import annotations

import json
import sys
import types
from typing import ClassVar

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from prorsa.cli.main import app
from prorsa.telemetry.reader import write_parquet
from tests.sim_helpers import random_specs, run

runner = CliRunner()


@pytest.fixture(scope="module")
def telemetry(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tel")
    paths = []
    for seed in (1, 2):
        table = run(random_specs(40, seed=seed, turns=(3, 8)), "static", slots=2).telemetry
        ids = pa.array([f"run{seed}"] * table.num_rows, pa.string())
        # Keep the field exactly as in the schema, so the file keeps prorsa.source.
        field = pa.field("run_id", pa.string(), nullable=False)
        table = table.set_column(table.schema.get_field_index("run_id"), field, ids)
        path = folder / f"run{seed}.parquet"
        write_parquet(table, path)
        paths.append(path)
    return paths


class FakeClient:
    """Stands in for mlflow's MlflowClient; records what would be logged."""

    calls: ClassVar[list] = []

    def __init__(self, tracking_uri: str) -> None:
        self.calls.append(("client", tracking_uri))

    def get_experiment_by_name(self, name):
        return None

    def create_experiment(self, name):
        self.calls.append(("experiment", name))
        return "1"

    def create_run(self, exp_id, run_name=None, tags=None):
        self.calls.append(("run", run_name))
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id="r1"))

    def log_param(self, run_id, key, value):
        self.calls.append(("param", key))

    def log_metric(self, run_id, key, value):
        self.calls.append(("metric", key))

    def log_artifacts(self, run_id, path, artifact_path=None):
        self.calls.append(("artifacts", artifact_path))

    def set_terminated(self, run_id, status=None):
        self.calls.append(("end", status))


@pytest.fixture
def fake_mlflow(monkeypatch):
    module = types.ModuleType("mlflow.tracking")
    module.MlflowClient = FakeClient
    monkeypatch.setitem(sys.modules, "mlflow", types.ModuleType("mlflow"))
    monkeypatch.setitem(sys.modules, "mlflow.tracking", module)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    FakeClient.calls = []
    return FakeClient


def test_dataset_train_backtest_list(telemetry, tmp_path, fake_mlflow, monkeypatch):
    data = tmp_path / "d.parquet"
    res = runner.invoke(
        app,
        ["forecast", "dataset", "--telemetry", str(telemetry[0]), "--out", str(data), "--json"],
    )
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output)
    assert summary["runs"] == 1 and summary["ticks"] >= 8
    assert (tmp_path / "d.snapshots.parquet").exists() and (tmp_path / "d.turns.parquet").exists()

    model = tmp_path / "m"
    args = ["forecast", "train", "--model", "lightgbm-aggregate", "--data", str(data)]
    args += ["--out", str(model), "--param", "n_estimators=5", "--validate", str(telemetry[1])]
    res = runner.invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    manifest = json.loads((model / "manifest.json").read_text())
    assert manifest["name"] == "lightgbm-aggregate" and manifest["params"]["n_estimators"] == 5
    assert manifest["data_hash"] == summary["data_hash"]
    assert "heldout_wape_prefill_tokens_h5" in manifest["metrics"]
    assert {"numpy", "lightgbm", "python"} <= set(manifest["versions"])
    assert fake_mlflow.calls == []  # no URI: nothing logged

    plots = tmp_path / "plots"
    res = runner.invoke(
        app,
        [
            "forecast",
            "backtest",
            "--model",
            str(model),
            "--telemetry",
            str(telemetry[1]),
            "--plots",
            str(plots),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert {s["target"] for s in out["scores"]} >= {"prefill_tokens", "decode_tokens"}
    assert out["plots"] and all(p.endswith(".png") for p in out["plots"])

    # With a tracking URI (environment), train and backtest log one finished run each.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///unused.db")
    res = runner.invoke(
        app,
        [
            "forecast",
            "backtest",
            "--model",
            "ewma",
            "--telemetry",
            str(telemetry[1]),
            "--plots",
            str(plots),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    kinds = [c[0] for c in fake_mlflow.calls]
    assert kinds[0] == "client" and fake_mlflow.calls[0][1] == "sqlite:///unused.db"
    assert "metric" in kinds and fake_mlflow.calls[-1] == ("end", "FINISHED")

    res = runner.invoke(app, ["forecast", "list", "--json"])
    assert res.exit_code == 0, res.output
    names = {r["name"] for r in json.loads(res.output)}
    assert {"lightgbm-trajectory", "oracle", "gru"} <= names


def test_cli_errors_are_one_line(telemetry, tmp_path):
    res = runner.invoke(
        app,
        [
            "forecast",
            "dataset",
            "--telemetry",
            str(telemetry[0]),
            "--out",
            str(tmp_path / "x"),
            "--horizons",
            "0,5",
        ],
    )
    assert res.exit_code == 1 and "positive" in res.output
    res = runner.invoke(app, ["forecast", "dataset", "--out", str(tmp_path / "x")])
    assert res.exit_code == 1 and "--from-sim" in res.output
    res = runner.invoke(
        app,
        [
            "forecast",
            "train",
            "--model",
            "nope",
            "--data",
            str(telemetry[0]),
            "--out",
            str(tmp_path / "m"),
        ],
    )
    assert res.exit_code == 1 and "not a forecast dataset" in res.output
    res = runner.invoke(
        app,
        [
            "forecast",
            "backtest",
            "--model",
            "oracle",
            "--telemetry",
            str(telemetry[0]),
            "--plots",
            str(tmp_path / "plots"),
        ],
    )
    assert res.exit_code == 0, res.output  # simulated telemetry: the oracle accepts it


def test_outputs_are_checked_before_any_work(telemetry, tmp_path):
    source = telemetry[0]
    before = source.read_bytes()
    res = runner.invoke(
        app, ["forecast", "dataset", "--telemetry", str(source), "--out", str(source)]
    )
    assert res.exit_code == 1 and "is also an input" in res.output
    assert source.read_bytes() == before  # the telemetry it was given is untouched
    blocker = tmp_path / "file"
    blocker.write_text("x")
    res = runner.invoke(
        app,
        ["forecast", "train", "--model", "ewma", "--data", str(source), "--out", str(blocker)],
    )
    # Refused for the output before the dataset is even read.
    assert res.exit_code == 1 and "not a directory" in res.output


def test_compose_saves_the_choice_and_refuses_a_single_candidate(tmp_path):
    from prorsa.forecast import TARGETS, load_forecaster

    out = tmp_path / "pt"
    result = runner.invoke(app, ["forecast", "compose", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.output)
    assert printed["out"] == str(out) and set(printed["targets"]) == set(TARGETS)
    model = load_forecaster(out)
    assert model.member_of() == {t: c["member"] for t, c in printed["targets"].items()}

    result = runner.invoke(
        app, ["forecast", "compose", "--from", "lightgbm-trajectory", "--out", str(out)]
    )
    assert result.exit_code != 0 and "two or more candidates" in result.output
