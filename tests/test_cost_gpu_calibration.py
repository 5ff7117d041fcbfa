"""The GPU calibration pipeline: its CPU dry run, and loading what it measures."""

from __future__ import annotations

import json

import pytest

from prorsa.errors import ConfigError, InputError
from prorsa.runtime.sim.cost import LayoutCost, get_layout_cost, get_layout_terms
from prorsa.runtime.sim.cost.calibration import (
    apply_measured_terms,
    load_measured,
    measured_terms,
    predicted_device_s,
)


def test_full_grid_covers_decode_prefill_and_mixed_steps():
    pytest.importorskip("torch")
    from benchmarks.gpu_calibration import GRID, grid_points

    points = grid_points(GRID)
    assert len(points) == len(set(points)) == 3 * (3 + 4 * 3)
    decode = [p for p in points if p[2] == 0]
    prefill = [p for p in points if p[0] == 0]
    mixed = [p for p in points if p[0] and p[2]]
    assert {p[0] for p in decode} == {32, 64, 128}
    assert {p[2] for p in prefill} == {512, 2048, 8192}
    assert len(mixed) == 3 * 3 * 3
    assert {p[1] for p in points} == {8192, 16384, 32768}


def test_dry_run_writes_measurements_terms_and_report(tmp_path):
    pytest.importorskip("torch")
    from benchmarks.gpu_calibration import DRY_GRID, grid_points, main

    assert main(["--dry-run", "--models", "qwen2.5-7b,qwen3-30b-a3b", "--out", str(tmp_path)]) == 0
    measured = load_measured(tmp_path / "measured.json")
    assert measured["dry_run"] is True
    assert len(measured["points"]) == 2 * len(grid_points(DRY_GRID))
    assert {p["model"] for p in measured["points"]} == {"qwen2.5-7b", "qwen3-30b-a3b"}
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report["rows"]) == len(measured["points"])
    assert all(r["rel_error"] is not None for r in report["rows"])
    terms = json.loads((tmp_path / "terms" / "h200-qwen3-30b-a3b-tp1.json").read_text())
    assert terms["dry_run"] is True and terms["device_scale"] > 0
    calibrated = apply_measured_terms(get_layout_terms("h200-qwen3-30b-a3b-tp1"), terms)
    assert calibrated.source == "timings"
    assert LayoutCost(calibrated).decode_step_s(8, 8 * 1024) > 0


def test_measured_terms_scale_the_device_time_and_replace_the_graph_loss():
    name = "h200-qwen3-30b-a3b-tp1-dp8-ep8"
    cost = get_layout_cost(name)
    layers = cost.terms.num_layers
    points = []
    for batch, chunk in ((32, 0), (64, 0), (0, 2048), (64, 512)):
        device = predicted_device_s(cost, batch, 8192, chunk)
        # a GPU 1.5x slower than the tables, measured on 4 of the layers
        graph = 1.5 * device * 4 / layers
        points.append(
            {
                "model": "qwen3-30b-a3b",
                "layout": "tp1-dp8-ep8",
                "batch": batch,
                "context": 8192,
                "chunk": chunk,
                "layers": 4,
                "graph_s": graph,
                "eager_s": graph + 4 * 50e-6,
                "lm_head_s": 0.0,
            }
        )
    measured = {"schema": "prorsa.gpu_calibration/1", "points": points, "device": "test"}
    terms = measured_terms(measured, "qwen3-30b-a3b", "tp1-dp8-ep8", cost)
    assert terms["device_scale"] == pytest.approx(1.5, rel=1e-9)
    assert terms["graph_loss_per_layer_s"] == pytest.approx(50e-6, rel=1e-9)
    calibrated = LayoutCost(apply_measured_terms(cost.terms, terms))
    assert predicted_device_s(calibrated, 64, 8192, 0) == pytest.approx(
        1.5 * predicted_device_s(cost, 64, 8192, 0), rel=1e-6
    )
    assert calibrated.graph_loss_s == pytest.approx(layers * 50e-6)
    with pytest.raises(ConfigError, match=r"not qwen2\.5-7b"):
        apply_measured_terms(get_layout_terms("h200-qwen2.5-7b-tp1"), terms)


def test_load_measured_names_the_bad_record(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"schema": "other"}))
    with pytest.raises(InputError, match="schema"):
        load_measured(path)
    good = {
        "model": "m",
        "layout": "tp1",
        "batch": 1,
        "context": 1,
        "chunk": 0,
        "layers": 1,
        "graph_s": 1.0,
        "eager_s": 1.0,
    }
    bad = {**good, "eager_s": 0.0}
    path.write_text(json.dumps({"schema": "prorsa.gpu_calibration/1", "points": [good, bad]}))
    with pytest.raises(InputError, match="record 1") as info:
        load_measured(path)
    assert info.value.field == "eager_s"


def test_dry_run_components_time_the_attention_kernels_alone(tmp_path):
    pytest.importorskip("torch")
    from benchmarks.gpu_calibration import main

    out = tmp_path / "c"
    assert main(["--dry-run", "--components", "--models", "qwen2.5-7b", "--out", str(out)]) == 0
    measured = load_measured(out / "measured.json")
    assert all(p["attention_core_s"] > 0 for p in measured["points"])
    assert all(p["attention"] for p in measured["points"])  # the kernel mode is recorded
    rows = json.loads((out / "report.json").read_text())["rows"]
    assert all(r["attention_model_s"] > 0 and r["attention_measured_s"] > 0 for r in rows)
    assert {r["kind"] for r in rows} == {"decode", "prefill", "mixed"}
    assert (out / "model-vs-measured.png").stat().st_size > 0


def test_a_run_out_of_time_still_writes_what_it_has(tmp_path):
    pytest.importorskip("torch")
    from benchmarks.gpu_calibration import main

    assert (
        main(["--dry-run", "--models", "qwen2.5-7b", "--max-wall-s", "0", "--out", str(tmp_path)])
        == 0
    )
    measured = json.loads((tmp_path / "measured.json").read_text())
    assert measured["points"] == []
    assert measured["failed"] and all("max-wall-s" in f["error"] for f in measured["failed"])


def _point(graph, eager, **kw):
    base = {"model": "qwen2.5-7b", "layout": "tp1", "batch": 32, "context": 8192, "chunk": 0}
    return {**base, "layers": 4, "graph_s": graph, "eager_s": eager, "lm_head_s": 1e-4, **kw}


def test_repeated_runs_merge_to_the_median_graph_and_smallest_eager_time():
    from prorsa.runtime.sim.cost.calibration import merge_measured

    runs = [
        {"schema": "prorsa.gpu_calibration/1", "device": "d", "points": [_point(1.0, 2.0)]},
        {"schema": "prorsa.gpu_calibration/1", "device": "d", "points": [_point(1.2, 1.5)]},
        {
            "schema": "prorsa.gpu_calibration/1",
            "device": "d",
            "points": [_point(1.1, 9.0, attention_core_s=0.5)],
        },
    ]
    merged = merge_measured(runs)
    assert merged["runs"] == 3 and len(merged["points"]) == 1
    (p,) = merged["points"]
    assert p["graph_s"] == pytest.approx(1.1)
    assert p["eager_s"] == pytest.approx(1.5)
    assert p["attention_core_s"] == pytest.approx(0.5) and p["runs"] == 3
    with pytest.raises(ConfigError):
        merge_measured([])


def test_points_over_the_step_budget_are_kept_but_not_scored():
    from prorsa.runtime.sim.cost.calibration import report_rows

    cost = get_layout_cost("h200-qwen2.5-7b-tp1")
    over = _point(1.0, 1.1, batch=128, chunk=cost.max_step_tokens)
    inside = _point(1.0, 1.1)
    rows = report_rows({"points": [over, inside]}, {("qwen2.5-7b", "tp1"): cost})
    assert rows[0]["rel_error"] is None and "max_step_tokens" in rows[0]["skipped"]
    assert rows[0]["measured_s"] > 0
    assert rows[1]["rel_error"] is not None
    terms = measured_terms({"points": [over, inside]}, "qwen2.5-7b", "tp1", cost)
    assert terms["points"] == 1


def test_prefill_attention_is_never_faster_than_fa3():
    from prorsa.runtime.sim.cost.calibration import predicted_attention_s
    from prorsa.runtime.sim.cost.kernel_tables import attention_prefill_efficiency

    cost = get_layout_cost("h200-qwen3-30b-a3b-tp1")
    heads, head_dim, layers = 32, 128, cost.terms.num_layers
    for chunk in (2048, 8192):
        flops = layers * 2 * heads * head_dim * chunk**2  # causal, no prior context
        fa3_s = flops / (989.4e12 * attention_prefill_efficiency(chunk))
        assert predicted_attention_s(cost, 0, 0, chunk) >= 0.9 * fa3_s
    assert 0.4 < attention_prefill_efficiency(512) < attention_prefill_efficiency(16384) < 0.7
