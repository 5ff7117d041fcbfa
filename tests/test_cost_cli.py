"""`prorsa profile` commands through typer's CliRunner."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from prorsa.cli.profile import app

runner = CliRunner()


def test_show_json():
    result = runner.invoke(app, ["show", "h200-qwen2.5-7b-tp1", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["name"] == "h200-qwen2.5-7b-tp1"
    assert data["source"] == "aiconfigurator"
    assert set(data["prefill_ms"]) == {"2048", "8192"}
    assert set(data["decode_step_ms_at_2k_context"]) == {"1", "64", "128"}
    assert 30 < data["prefill_ms"]["2048"] < 45
    assert 4 < data["decode_step_ms_at_2k_context"]["1"] < 5
    assert data["kv_capacity_tokens"] > 1_000_000


def test_show_table():
    result = runner.invoke(app, ["show", "h100-llama-3-8b-tp2-roofline"])
    assert result.exit_code == 0, result.output
    for text in ("prefill 8192 tokens", "decode step, batch 128", "KV capacity", "roofline"):
        assert text in result.stdout


def test_list_json_and_unknown_profile():
    result = runner.invoke(app, ["list", "--json"])
    assert result.exit_code == 0
    assert "h200-llama-3-8b-tp1" in json.loads(result.stdout)
    result = runner.invoke(app, ["show", "nope"])
    assert result.exit_code == 1
    assert "unknown cost profile 'nope'" in result.output


def test_layouts_json_lists_fitted_layouts_with_throughput():
    result = runner.invoke(
        app, ["layouts", "qwen3-235b-a22b", "--batch", "16", "--context", "16384", "--json"]
    )
    assert result.exit_code == 0, result.output
    rows = {r["layout"]: r for r in json.loads(result.stdout)}
    assert {"tp4", "tp8", "tp1-dp8-ep8"} <= set(rows)
    assert rows["tp1-dp8-ep8"]["gpus"] == 8
    assert rows["tp1-dp8-ep8"]["decode_tokens_per_s_per_gpu"] > 0
    # 16 x 16k tokens do not fit in a TP2 rank's KV: reported as missing, not invented
    assert rows["tp2-dp2"]["decode_tokens_per_s_per_gpu"] is None
    assert rows["tp2-dp2"]["kv_capacity_tokens_per_rank"] < 16 * 16384
