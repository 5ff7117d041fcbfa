"""Real multi-turn rollouts: tiny-model vLLM engines in Ray, real tools, live controller.

One fleet of three engines for the module; each test hands it to ``run_rollout``, which
sets the roles its policy starts with. Tool times are scaled down (x0.02) and outputs
capped so a rollout takes a few seconds. The last test goes through the CLI and shuts the
fleet down, then checks that no engine process is left.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from prorsa.runtime.ray.rollout import run_rollout
from prorsa.runtime.ray.rollout_config import RolloutConfig
from prorsa.telemetry import ARROW_SCHEMA, find_violations, read_telemetry
from tests.runtime.checks import check_turns
from tests.runtime.fleets import start_tiny_fleet

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def fleet(ray_session, tiny_model_dir, tmp_path_factory):
    fleet = start_tiny_fleet(
        tiny_model_dir,
        tmp_path_factory.mktemp("kv"),
        ["prefill", "decode", "decode"],
        max_num_seqs=16,
    )
    yield fleet
    fleet.shutdown()


def config(model, **overrides) -> RolloutConfig:
    base = dict(
        engines=3,
        profile="cpu-tiny-llama-tp1",
        scenario="search",
        trajectories=6,
        group_size=3,
        max_tokens=12,
        max_turns=3,
        tool_time_scale=0.02,
        interval_s=0.05,
        min_dwell_s=0.0,
        drain_timeout_s=1.0,
    )
    return RolloutConfig.of(str(model), **{**base, **overrides})


def test_static_rollout_writes_complete_valid_telemetry(fleet, tiny_model_dir, tmp_path):
    from prorsa.forecast.dataset import build_dataset

    cfg = config(tiny_model_dir, policy="static", policy_params={"prefill_gpus": 1})
    result = run_rollout(cfg, tmp_path, fleet=fleet)
    assert result.errors == []
    table, report = read_telemetry(tmp_path / "telemetry.parquet", validate=True)
    assert report.clean and find_violations(table) == []
    assert table.schema.names == ARROW_SCHEMA.names
    check_turns(table, result.specs)
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["trajectories_completed"] == 6 and m["makespan_s"] > 0
    assert m["turn_paths"] == {"disaggregated": sum(s.num_turns for s in result.specs)}
    assert sum(m["tool_calls"].values()) == sum(s.num_turns - 1 for s in result.specs)
    assert m["kv_source"] == ["vllm"] and max(m["peak_kv_usage"].values()) > 0
    assert m["initial_roles"] == ["prefill", "decode", "decode"] and m["switches_completed"] == 0
    assert m["stages"]["transfer"]["turns"] == m["turns"]
    # GRPO groups share their prompt: one turn-0 context length per group.
    rows = table.to_pylist()
    first = {
        (r["group_id"], r["context_tokens"])
        for r in rows
        if r["kind"] == "prefill_queued" and r["turn"] == 0
    }
    assert len(first) == len({s.group_id for s in result.specs})
    assert len((tmp_path / "specs.jsonl").read_text().splitlines()) == 6
    # Forecasters train on it like on simulator telemetry.
    data = build_dataset(table, horizons=[0.2, 0.5], tick_s=0.1)
    assert data.meta["sources"] == {"rollout": "ray-vllm"} and len(data.ticks)
    # The start allocation (one GPU per CPU engine here) gives the per-GPU load features.
    assert rows[0]["kind"] == "allocation" and json.loads(rows[0]["detail"]) == {
        "gpus": {"colocated": 0, "decode": 2, "prefill": 1},
        "reason": "start",
    }
    live = data.ticks["live"] * data.ticks["scale"]
    np.testing.assert_allclose(data.ticks["live_per_gpu"], live / 3)


def test_threshold_policy_switches_roles_live_without_losing_turns(fleet, tiny_model_dir, tmp_path):
    # Any prefill backlog grows prefill; decode never counts as hot (see the fake test).
    cfg = config(
        tiny_model_dir,
        policy="threshold",
        policy_params={
            "prefill_wait_high_s": 1e-6,
            "prefill_wait_low_s": 5e-7,
            "batch_high": 1e9,
            "kv_high": 1.0,
        },
        trajectories=9,
        interval_s=0.02,
    )
    result = run_rollout(cfg, tmp_path, fleet=fleet)
    assert result.errors == []
    table = result.telemetry
    check_turns(table, result.specs)
    m = result.metrics
    assert m["switches_completed"] >= 1 and m["controller_ticks"] >= 1
    rows = table.to_pylist()
    start = min(r["time"] for r in rows if r["kind"] == "traj_start")
    end = max(r["time"] for r in rows if r["kind"] == "traj_end")
    switch_ends = [r for r in rows if r["kind"] == "role_switch_end"]
    assert any(start < r["time"] < end for r in switch_ends)
    assert all(not json.loads(r["detail"]).get("error") for r in switch_ends)
    print(f"\nthreshold: {m['switches_completed']} live switches, final roles {m['final_roles']}")


def test_sigterm_mid_rollout_ends_interrupted_and_engines_keep_serving(
    fleet, tiny_model_dir, tmp_path
):
    import signal

    from prorsa.errors import PartialRunError
    from prorsa.runtime.ray.rollout import RolloutInterrupted
    from prorsa.telemetry.manifest import check_complete, read_manifest

    # Two groups in flight and up to six turns each, so that when the first trajectory ends
    # others are surely mid-way (with one group of short trajectories in flight, its partner
    # could end before the signal lands and nothing would be left to interrupt).
    cfg = config(
        tiny_model_dir, mode="async", max_in_flight=4, trajectories=8, group_size=2, max_turns=6
    )

    def progress(done: int, total: int) -> None:
        if done == 1:
            signal.raise_signal(signal.SIGTERM)

    with pytest.raises(RolloutInterrupted, match="SIGTERM"):
        run_rollout(cfg, tmp_path, fleet=fleet, progress=progress)
    manifest = read_manifest(tmp_path)
    assert manifest.status == "interrupted" and manifest.counts["trajectories_interrupted"] >= 1
    table, _ = read_telemetry(tmp_path / "telemetry.parquet", validate=True)
    ends = [json.loads(r["detail"]) for r in table.to_pylist() if r["kind"] == "traj_end"]
    assert any(d.get("status") == "interrupted" and d["turns"] < d["planned_turns"] for d in ends)
    with pytest.raises(PartialRunError):
        check_complete(tmp_path / "telemetry.parquet")
    # The shared engines were not harmed: the next test runs on them.


def test_cli_async_predictive_rollout_then_no_orphans(fleet, tiny_model_dir, tmp_path, monkeypatch):
    import psutil
    from typer.testing import CliRunner

    from prorsa.cli.main import app
    from prorsa.runtime.ray import rollout

    # The CLI starts its own engines; hand it this module's (it shuts them down at the end).
    monkeypatch.setattr(rollout, "start_fleet", lambda config, roles, out: (fleet, False))
    pids = fleet.pids()
    out = tmp_path / "cli"
    options = (
        "rollout --engines 3 --profile cpu-tiny-llama-tp1 --policy predictive --forecaster ewma "
        "--param horizon_s=1.0 "
        "--scenario math-tool --mode async --in-flight 2 --trajectories 4 --group-size 2 "
        "--max-tokens 12 --max-turns 3 --tool-time-scale 0.02 --interval-s 0.05 "
        "--min-dwell-s 0 --json"
    )
    args = [*options.split(), "--model", str(tiny_model_dir), "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    m = json.loads((out / "metrics.json").read_text())
    assert m["mode"] == "async" and m["trajectories_completed"] == 4
    assert m["controller_ticks"] >= 1 and m["tool_calls"] == {"python": m["turns"] - 4}
    table, _ = read_telemetry(out / "telemetry.parquet", validate=True)
    assert table.num_rows > 0
    deadline = time.monotonic() + 20
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and _running(p)]
        time.sleep(0.2)
    assert alive == []


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
