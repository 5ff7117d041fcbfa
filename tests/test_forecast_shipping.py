"""The shipping library: simulated runs for datasets, the recipe, the simulator version."""

from __future__ import annotations

import shutil

from prorsa.forecast.shipping import (
    HELDOUT_CELLS,
    SHIP_MODES,
    SHIP_SCENARIOS,
    SHIP_TRACES,
    TRAIN_CELLS,
    SimPlan,
    SimRun,
    recipe_runs,
    simulate_runs,
    simulator_version,
)
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.cluster.control import ControlConfig
from prorsa.workload.config import WorkloadConfig
from prorsa.workload.scenarios import datasets_dir
from tests.conftest import REPO


def test_a_run_simulates_its_load_per_gpu():
    work = WorkloadConfig(scenario="math-tool", mode="sync", seed=3)
    run = SimRun.at_load(3, work, ClusterConfig(num_slots=2), ControlConfig(policy="static"))
    (table,) = simulate_runs([run])
    assert set(table.column("run_id").to_pylist()) == {run.run_id}
    ids = set(table.column("trajectory_id").to_pylist()) - {""}  # "": cluster events
    assert len(ids) == 6  # 3 per GPU x 2 GPUs
    meta = table.schema.metadata or {}
    assert meta.get(b"prorsa.source") == b"simulator"


def test_plan_and_recipe_run_ids_are_unique(tmp_path):
    plan = SimPlan(
        ["swe", "search"], [], ["sync", "async"], (0, 1), 4, WorkloadConfig(group_size=4)
    )
    ids = [r.run_id for r in plan.runs()]
    assert len(ids) == len(set(ids)) == 8
    # Each run takes the plan's configs; the workload is sized by the load per GPU.
    by_mode = {r.work.mode: r for r in plan.runs() if r.work.seed == 1}
    assert by_mode["sync"].work.trajectories == 4 * ClusterConfig().total_gpus
    assert by_mode["async"].work.trajectories == 2 * by_mode["async"].work.max_in_flight
    assert all(r.work.group_size == 4 and r.cluster == plan.cluster for r in plan.runs())
    train = recipe_runs(REPO / "datasets" / "traces", tmp_path, TRAIN_CELLS, "train")
    heldout = recipe_runs(REPO / "datasets" / "traces", tmp_path, HELDOUT_CELLS, "heldout")
    per_cell = len(SHIP_MODES) * (len(SHIP_SCENARIOS) + len(SHIP_TRACES))
    assert len(train) == per_cell * len(TRAIN_CELLS)
    assert len(heldout) == per_cell * len(HELDOUT_CELLS)
    assert not {r.run_id for r in train} & {r.run_id for r in heldout}
    assert {r.cluster.reuse_mode for r in train} == {"reprefill", "kv-store"}
    assert {r.control.policy for r in train} == {"static", "colocate", "threshold"}
    # The regime map's four models, the MoE ones on data-parallel-attention engines.
    families = {r.cluster.profile.rsplit("-", 1)[0] for r in train}
    assert len(families) == 4 and any(r.cluster.layouts for r in heldout)
    assert {r.cluster.layouts.get("decode") for r in train} >= {"tp1-dp4-ep4", "tp1-dp8-ep8"}
    loads = {c.load_per_gpu for c in TRAIN_CELLS}
    assert min(loads) == 4 and max(loads) == 128
    assert any(c.load_per_gpu == 128 for c in HELDOUT_CELLS)
    # Held-out replays read the other half of each trace.
    assert all("heldout" in r.work.trace for r in heldout if r.work.trace)


def test_simulator_version_is_stable_and_names_the_sources(tmp_path, monkeypatch):
    a, b = simulator_version(), simulator_version()
    assert a == b and len(a["source_sha256"]) == 64 and a["prorsa"]
    # The data a run reads counts too: a refit profile or workload is another simulator.
    data = tmp_path / "datasets"
    shutil.copytree(datasets_dir(), data)
    monkeypatch.setenv("PRORSA_DATASETS", str(data))
    copied = simulator_version()["source_sha256"]
    profile = next((data / "profiles").glob("*.json"))
    profile.write_text(profile.read_text() + " ")
    assert simulator_version()["source_sha256"] != copied


def test_ship_end_to_end_on_a_tiny_recipe(tmp_path, monkeypatch):
    """The whole recipe's wiring (simulate train, validation and held-out cells, train,
    recalibrate the quantiles and choose the point on validation, backtest
    held out, write the card) on a tiny plan."""
    import json

    from prorsa.forecast import load_forecaster, shipping

    monkeypatch.setattr(shipping, "SHIP_SCENARIOS", ["math-tool"])
    monkeypatch.setattr(shipping, "SHIP_TRACES", ["swe-agent"])
    monkeypatch.setattr(shipping, "TRAIN_CELLS", (shipping.Cell(2, 4, 0), shipping.Cell(2, 6, 1)))
    monkeypatch.setattr(shipping, "VALIDATION_CELLS", (shipping.Cell(2, 5, 200),))
    monkeypatch.setattr(shipping, "HELDOUT_CELLS", (shipping.Cell(2, 4, 100),))
    fast = {"n_estimators": 5, "calibration_estimators": 5}
    monkeypatch.setitem(
        shipping.SHIP_PARAMS, "lightgbm-trajectory",
        {**shipping.SHIP_PARAMS["lightgbm-trajectory"], **fast},
    )  # fmt: skip
    report = shipping.ship(
        tmp_path / "models", keep_data=tmp_path / "data", models=["lightgbm-trajectory"],
        validate_every=1,
    )  # fmt: skip
    assert report.train_runs == 2 * 2 * 2  # cells x workloads x modes
    assert report.heldout_runs == 2 * 2
    validation = shipping._read_table(tmp_path / "data" / "validation-telemetry.parquet")
    runs = set(validation.column("run_id").to_pylist())
    assert len(runs) == 2 and all(r.startswith("math-tool-") for r in runs)  # no replay
    manifest = json.loads(
        (tmp_path / "models" / "lightgbm-trajectory" / "manifest.json").read_text()
    )
    fit = manifest["validation_fit"]
    assert fit["runs"] == 2 and manifest["state"]["point"] == fit["point"]["chosen"]
    assert set(fit["quantiles"]) == {"0.1", "0.5", "0.9"}
    moved = [abs(m) for e in fit["quantiles"].values() for v in e["moved_by"].values() for m in v]
    assert max(moved) > 0  # the validation runs moved the training runs' shifts
    assert manifest["params"]["queue_wait"] is True
    assert manifest["recipe"]["validation_cells"][0]["seed"] == 200
    card = (tmp_path / "models" / "README.md").read_text()
    assert "## Fitted on validation cells" in card and "Quantile coverage at 5 s" in card
    load_forecaster(tmp_path / "models" / "lightgbm-trajectory")
    # A partial ship lists the model it did not retrain with its own manifest's scores.
    shipping.ship(tmp_path / "models", keep_data=tmp_path / "data", models=["lightgbm-aggregate"])
    card = (tmp_path / "models" / "README.md").read_text()
    metrics = manifest["metrics"]
    row = next(
        line for line in card.splitlines() if "`lightgbm-trajectory` (not retrained)" in line
    )
    assert f"{metrics['heldout_wape_prefill_tokens_h5']:.3f}" in row
    assert "`lightgbm-aggregate` |" in card and "was not retrained" in card
    # With both candidates shipped, the composite is composed from them and carded.
    composite = load_forecaster(tmp_path / "models" / "per-target")
    assert set(composite.member_of().values()) <= {"lightgbm-trajectory", "lightgbm-aggregate"}
    assert "## Per target" in card


def test_validation_seeds_count_as_seen_and_validation_cells_are_their_own():
    from prorsa.forecast.shipping import TRAINING_SEEDS, VALIDATION_CELLS

    assert {c.seed for c in VALIDATION_CELLS} <= TRAINING_SEEDS
    others = {(c.engines, c.load_per_gpu, c.profile, c.layout) for c in TRAIN_CELLS + HELDOUT_CELLS}
    assert not others & {(c.engines, c.load_per_gpu, c.profile, c.layout) for c in VALIDATION_CELLS}
