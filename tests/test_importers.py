"""Importers on the real shared traces: exact counts, spot-checked values, valid events.

Counts were verified by hand against the raw files (e.g. the 25 mini-swe-agent files hold
926 assistant messages; tau2 has 217 assistant messages with `usage`; Mooncake's 3,993
requests start with 2,211 distinct first blocks, i.e. 2,211 sessions).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from prorsa.errors import ConfigError
from prorsa.telemetry.importers import IMPORTERS, import_trace, shared_data_dir
from prorsa.telemetry.reader import read_telemetry
from prorsa.telemetry.schema import ARROW_SCHEMA
from prorsa.telemetry.validation import find_violations
from prorsa.telemetry.views import trajectory_table, turn_table

# format -> (trajectories, turns); every turn gives 5 stage events, every turn but the
# last a tool_start/tool_end pair, plus traj_start/traj_end: 7 events per turn.
EXPECTED = {
    "mini-swe-agent": (25, 926),
    "tracelab": (2, 19),
    "tau2": (20, 217),
    "mooncake": (2211, 3993),
    "azure": (8819, 8819),
    "swe-agent": (2, 25),
}
STAGE_ORDER = [
    "prefill_queued",
    "prefill_start",
    "prefill_end",
    "decode_start",
    "decode_end",
    "tool_start",
    "tool_end",
]


@pytest.fixture(scope="module")
def imported(shared_data: Path) -> dict:
    return {
        name: import_trace(shared_data / IMPORTERS.get(name).shared_path, name)
        for name in IMPORTERS
    }


def _turns(imported: dict, fmt: str, trajectory: str):
    turns = turn_table(imported[fmt].table)
    return turns[turns["trajectory_id"] == trajectory].reset_index(drop=True)


def test_every_format_is_registered_and_has_expected_counts():
    assert set(IMPORTERS) == set(EXPECTED)


@pytest.mark.parametrize("fmt", sorted(EXPECTED))
def test_counts_and_validity(imported, fmt):
    result = imported[fmt]
    trajectories, turns = EXPECTED[fmt]
    assert (result.trajectories, result.turns, result.skipped) == (trajectories, turns, 0)
    assert result.events == 7 * turns
    table = result.table
    assert table.schema.equals(ARROW_SCHEMA)
    assert find_violations(table) == []
    times = table.column("time").to_numpy()
    assert times.min() == 0.0 and np.all(np.diff(times) >= 0)  # a time-ordered stream
    assert set(table.column("engine_id").to_pylist()) == {-1}
    assert table.column("run_id").unique().to_pylist() == [result.table["run_id"][0].as_py()]
    per_traj = trajectory_table(table)
    assert len(per_traj) == trajectories and per_traj["done"].all()
    assert per_traj["turns"].sum() == turns


@pytest.mark.parametrize("fmt", sorted(EXPECTED))
def test_lifecycle_order_within_each_turn(imported, fmt):
    df = imported[fmt].table.to_pandas()
    df["kind"] = df["kind"].astype(str)
    stages = df[~df["kind"].isin(["traj_start", "traj_end"])]
    for (_, turn), kinds in stages.groupby(["trajectory_id", "turn"], sort=False)["kind"]:
        assert list(kinds) == STAGE_ORDER[: len(kinds)], (fmt, turn)
    firsts = df.groupby("trajectory_id", sort=False)["kind"].first()
    lasts = df.groupby("trajectory_id", sort=False)["kind"].last()
    assert (firsts == "traj_start").all() and (lasts == "traj_end").all()


@pytest.mark.parametrize("fmt", sorted(EXPECTED))
def test_details_are_json_and_derived_fields_declared(imported, fmt):
    result = imported[fmt]
    details = [d for d in result.table.column("detail").unique().to_pylist() if d]
    marked = set()
    for detail in details:
        marked.update(json.loads(detail).get("derived", []))
    assert marked and marked <= set(result.derived)


def test_mini_swe_agent_values(imported):
    turns = _turns(imported, "mini-swe-agent", "django__django-16145")
    assert len(turns) == 39
    # messages[2]: prompt 1478, cached 0, completion 243 (198 of them reasoning), created
    # 1763509896; messages[6]: prompt 5944, cached 3935.
    first, third = turns.iloc[0], turns.iloc[2]
    assert (first.context_tokens, first.new_tokens, first.cached_tokens) == (1478, 1478, 0)
    assert first.output_tokens == 243
    assert (third.context_tokens, third.new_tokens, third.cached_tokens) == (5944, 2009, 3935)
    # gap 10 s to the next call; generation = 1 + 1478/10000 + 243/100 s
    assert first.tool_latency_s == pytest.approx(10 - (1 + 0.1478 + 2.43))
    assert first.prefill_queued == 1763509896 - 1763508908  # the folder's first call
    assert np.isnan(turns.iloc[-1].tool_latency_s)
    decode_end = imported["mini-swe-agent"].table.to_pandas()
    decode_end = decode_end[
        (decode_end["trajectory_id"] == "django__django-16145") & (decode_end["turn"] == 0)
    ]
    detail = json.loads(decode_end[decode_end["kind"] == "decode_end"]["detail"].iloc[0])
    assert detail["reasoning_tokens"] == 198


def test_tracelab_values(imported):
    turns = _turns(imported, "tracelab", "claude:92ee5b8a-429c-e80b-5db6-5381512f4697")
    assert len(turns) == 10
    first = turns.iloc[0]
    assert (first.context_tokens, first.new_tokens, first.cached_tokens) == (32272, 5055, 27217)
    assert first.output_tokens == 931
    # response complete 05:40:31.647 (last tool_call), next request 05:40:50.938
    assert first.decode_end == pytest.approx(31.647 - 20.151)
    assert first.tool_latency_s == pytest.approx(50.938 - 31.647)
    codex = _turns(imported, "tracelab", "codex:a611041f-625d-6fad-5e59-845850dc6543")
    assert len(codex) == 9 and codex.iloc[0].prefill_queued == 0.0


def test_tau2_values(imported):
    turns = _turns(imported, "tau2", "ed931b77-75ae-4289-8aab-9ee521d35703")
    assert len(turns) == 13
    first, second = turns.iloc[0], turns.iloc[1]
    assert (first.context_tokens, first.cached_tokens, first.output_tokens) == (6281, 0, 31)
    # cached = previous prompt + completion = 6281 + 31
    assert (second.context_tokens, second.cached_tokens, second.new_tokens) == (6333, 6312, 21)
    # call 0 runs from the user message (02:44:08.371896) to its own (02:44:09.580591)
    assert first.decode_end - first.prefill_queued == pytest.approx(1.208695, abs=1e-6)
    assert imported["tau2"].table["task"][0].as_py() == "tau2-telecom"


def test_mooncake_values(imported):
    turns = turn_table(imported["mooncake"].table)
    assert turns["turn"].max() == 23  # the longest session: 24 requests sharing 76 blocks
    first = turns[turns["trajectory_id"] == "synthetic_trace-s00000"].iloc[0]
    assert (first.context_tokens, first.output_tokens, first.cached_tokens) == (40160, 6, 0)
    second = turns[turns["trajectory_id"] == "synthetic_trace-s00001"].iloc[1]
    assert second.cached_tokens == 67 * 512 and second.prefill_queued == pytest.approx(34.569)


def test_azure_values(imported):
    turns = turn_table(imported["azure"].table)
    first = turns[turns["trajectory_id"] == "AzureLLMInferenceTrace_code-r00000"].iloc[0]
    assert (first.context_tokens, first.new_tokens, first.output_tokens) == (4808, 4808, 10)
    assert first.prefill_queued == 0.0
    assert turns["tool_latency_s"].isna().all()
    assert imported["azure"].table["task"][0].as_py() == "azure-code"


def test_swe_agent_values(imported):
    pydicom = _turns(imported, "swe-agent", "swea_pydicom")
    # info.model_stats: tokens_sent 122612, tokens_received 1369 over 12 calls
    assert pydicom["context_tokens"].sum() == 122612
    assert pydicom["output_tokens"].sum() == 1369
    assert pydicom["context_tokens"].is_monotonic_increasing
    marsh = _turns(imported, "swe-agent", "swea_marsh")
    assert marsh.iloc[0].tool_latency_s == pytest.approx(0.11605553800109192)


def test_run_id_default_and_override(shared_data):
    path = shared_data / "traces" / "tracelab" / "round_trace.jsonl"
    assert import_trace(path, "tracelab").table["run_id"][0].as_py() == "round_trace"
    assert import_trace(path, "tracelab", run_id="r7").table["run_id"][0].as_py() == "r7"


def test_one_mini_swe_agent_file(shared_data):
    path = shared_data / "traces" / "mini-swe-agent-swebench" / "django__django-16667.traj.json"
    result = import_trace(path, "mini-swe-agent")
    assert (result.trajectories, result.turns) == (1, 19)


def test_shared_data_dir(monkeypatch, tmp_path, shared_data):
    monkeypatch.delenv("PRORSA_SHARED_DATA", raising=False)
    assert shared_data_dir() == shared_data
    monkeypatch.setenv("PRORSA_SHARED_DATA", str(tmp_path))
    with pytest.raises(ConfigError, match="shared data folder not found"):
        shared_data_dir()
    (tmp_path / "traces").mkdir()
    assert shared_data_dir() == tmp_path.resolve()


SHIPPED = {
    "mini-swe-agent-swebench": ("mini-swe-agent", "traces/mini-swe-agent-swebench"),
    "tau2-telecom-gpt4o": ("tau2", "traces/tau2-bench/tau2_telecom_gpt4o.json"),
    "tracelab-round-trace": ("tracelab", "traces/tracelab/round_trace.jsonl"),
    "swe-agent": ("swe-agent", "traces/swe-agent"),
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_slices_match_a_fresh_import(shared_data, name):
    fmt, path = SHIPPED[name]
    shipped = Path(__file__).resolve().parents[1] / "datasets" / "traces" / f"{name}.parquet"
    table, _ = read_telemetry(shipped, validate=True)
    assert table.equals(import_trace(shared_data / path, fmt).table), (
        f"{shipped} is stale: regenerate it (datasets/traces/README.md)"
    )
