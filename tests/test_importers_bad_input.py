"""Malformed trace records: a clear InputError without --skip-bad, counted skips with it."""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime
from pathlib import Path

import pytest

from prorsa.errors import ConfigError, InputError
from prorsa.telemetry.importers import import_trace
from prorsa.telemetry.validation import find_violations

DATA = Path(__file__).resolve().parent / "data" / "importers"
SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
MINI = "traces/mini-swe-agent-swebench"
GOOD_MINI = "django__django-16667.traj.json"  # 19 calls
OTHER_MINI = "django__django-14559.traj.json"  # 24 calls


def _copy_mini(shared_data: Path, folder: Path, *names: str) -> Path:
    folder.mkdir(exist_ok=True)
    for name in names:
        shutil.copy(shared_data / MINI / name, folder / name)
    return folder


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _assistant(data: dict, nth: int) -> dict:
    return [m for m in data["messages"] if m["role"] == "assistant"][nth]


# ---------------------------------------------------------------- mini-swe-agent
def test_truncated_json_names_file_and_line(shared_data, tmp_path):
    folder = _copy_mini(shared_data, tmp_path / "trajs", GOOD_MINI)
    text = (shared_data / MINI / OTHER_MINI).read_text()
    (folder / OTHER_MINI).write_text(text[: len(text) // 2])
    with pytest.raises(InputError) as err:
        import_trace(folder, "mini-swe-agent")
    assert err.value.source.endswith(OTHER_MINI)
    assert str(err.value.record).startswith("line ")
    assert "truncated JSON" in err.value.reason

    result = import_trace(folder, "mini-swe-agent", skip_bad=True)
    assert (result.trajectories, result.turns, result.skipped) == (1, 19, 1)
    assert OTHER_MINI in result.skipped_examples[0]
    assert "skipped trajectory 'django__django-14559'" in result.skipped_examples[0]
    assert find_violations(result.table) == []


@pytest.mark.parametrize(
    ("edit", "field", "reason"),
    [
        (
            lambda m: m["extra"]["response"]["usage"].__setitem__("prompt_tokens", "12"),
            "extra.response.usage.prompt_tokens",
            "non-negative integer",
        ),
        (
            lambda m: m["extra"]["response"]["usage"].__setitem__("completion_tokens", -4),
            "extra.response.usage.completion_tokens",
            "non-negative integer",
        ),
        (
            lambda m: m["extra"]["response"].pop("usage"),
            "extra.response.usage.prompt_tokens",
            "missing",
        ),
        (
            lambda m: m["extra"]["response"].__setitem__("created", "yesterday"),
            "extra.response.created",
            "must be a number",
        ),
        (
            lambda m: m["extra"]["response"]["usage"]["prompt_tokens_details"].__setitem__(
                "cached_tokens", 10**9
            ),
            "extra.response.usage.prompt_tokens_details.cached_tokens",
            "exceed",
        ),
    ],
)
def test_mini_swe_agent_bad_fields(shared_data, tmp_path, edit, field, reason):
    folder = _copy_mini(shared_data, tmp_path / "trajs", GOOD_MINI, OTHER_MINI)
    _edit_json(folder / OTHER_MINI, lambda d: edit(_assistant(d, 3)))
    with pytest.raises(InputError) as err:
        import_trace(folder, "mini-swe-agent")
    assert err.value.field == field and reason in err.value.reason
    assert err.value.record == "messages[8]"  # system, user, then 3 x (assistant, user)
    result = import_trace(folder, "mini-swe-agent", skip_bad=True)
    assert (result.trajectories, result.skipped) == (1, 1)
    assert result.skipped_examples[0].startswith(f"{folder / OTHER_MINI}:messages[8]: {field}:")


def test_single_bad_file_with_skip_bad_still_fails(shared_data, tmp_path):
    path = tmp_path / GOOD_MINI
    path.write_text((shared_data / MINI / GOOD_MINI).read_text()[:1000])
    with pytest.raises(InputError, match="truncated JSON"):
        import_trace(path, "mini-swe-agent", skip_bad=True)


# ---------------------------------------------------------------- mooncake / azure fixtures
def test_mooncake_bad_lines():
    path = DATA / "mooncake_bad.jsonl"
    with pytest.raises(InputError) as err:
        import_trace(path, "mooncake")
    assert (err.value.record, err.value.field) == ("line 2", "input_length")
    result = import_trace(path, "mooncake", skip_bad=True)
    # lines 1 and 3 share block 0: one session of two turns
    assert (result.trajectories, result.turns, result.skipped) == (1, 2, 4)
    fields = [example.split(": ")[1] for example in result.skipped_examples]
    assert fields == ["input_length", "output_length", "hash_ids[1]", "-"]
    assert result.skipped_examples[3].startswith(f"{path}:6: -: invalid or truncated JSON")
    cached = result.table.to_pandas().query("kind == 'prefill_start'")["cached_tokens"]
    assert cached.tolist() == [0, 1000]  # 2 shared blocks x 512, capped at the 1000 input
    assert result.table.to_pandas().query("kind == 'prefill_start'")["new_tokens"].tolist() == [
        1000,
        0,
    ]


def test_azure_bad_rows():
    path = DATA / "azure_bad.csv"
    with pytest.raises(InputError) as err:
        import_trace(path, "azure")
    assert (err.value.record, err.value.field) == ("line 3", "ContextTokens")
    result = import_trace(path, "azure", skip_bad=True)
    assert (result.trajectories, result.skipped) == (2, 4)
    fields = [example.split(": ")[1] for example in result.skipped_examples]
    assert fields == ["ContextTokens", "TIMESTAMP", "GeneratedTokens", "GeneratedTokens"]


def test_azure_missing_column(tmp_path):
    path = tmp_path / "trace_code.csv"
    path.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:17:03.9,10\n")
    with pytest.raises(InputError) as err:
        import_trace(path, "azure")
    assert err.value.field == "GeneratedTokens" and err.value.record == "line 1"


# ---------------------------------------------------------------- tracelab
def _tracelab_lines(shared_data: Path) -> list[dict]:
    text = (shared_data / "traces" / "tracelab" / "round_trace.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def _write_lines(path: Path, records: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def test_tracelab_wrong_type_skips_its_session(shared_data, tmp_path):
    rows = _tracelab_lines(shared_data)
    rows[12]["output_tokens"] = 59.5  # a codex round
    path = _write_lines(tmp_path / "rounds.jsonl", rows)
    with pytest.raises(InputError) as err:
        import_trace(path, "tracelab")
    assert (err.value.record, err.value.field) == ("line 13", "output_tokens")
    result = import_trace(path, "tracelab", skip_bad=True)
    # the bad round names its session, which is skipped whole; claude stays
    assert (result.trajectories, result.turns, result.skipped) == (1, 10, 1)
    assert "output_tokens: must be a non-negative integer, got 59.5" in result.skipped_examples[0]
    assert "[skipped session 'codex:" in result.skipped_examples[0]


def test_tracelab_truncated_line_and_bad_timestamp(shared_data, tmp_path):
    rows = _tracelab_lines(shared_data)
    rows[3]["timing_events"][1]["timestamp"] = "soon"
    lines = [json.dumps(r) for r in rows]
    lines[5] = lines[5][:40]  # both bad lines belong to the claude session (lines 1-10)
    path = _write_lines(tmp_path / "rounds.jsonl", lines)
    with pytest.raises(InputError) as err:
        import_trace(path, "tracelab")
    assert err.value.field == "timing_events[1].timestamp" and err.value.record == "line 4"
    result = import_trace(path, "tracelab", skip_bad=True)
    # the claude session (named by line 4), then line 6 whose session is unknown
    assert (result.trajectories, result.turns, result.skipped) == (1, 9, 2)
    assert "[skipped session 'claude:" in result.skipped_examples[0]
    assert result.skipped_examples[1].startswith(f"{path}:6: -: invalid or truncated JSON")


def test_tracelab_unreadable_line_leaving_a_gap_skips_its_session(shared_data, tmp_path):
    lines = [json.dumps(r) for r in _tracelab_lines(shared_data)]
    lines[12] = lines[12][:30]  # codex round 2: its session shows only as a gap
    path = _write_lines(tmp_path / "rounds.jsonl", lines)
    result = import_trace(path, "tracelab", skip_bad=True)
    assert (result.trajectories, result.turns, result.skipped) == (1, 10, 2)
    assert "round 2 is missing" in result.skipped_examples[1]
    assert "[skipped session 'codex:" in result.skipped_examples[1]


def test_nothing_left_after_skipping_raises_the_first_error(shared_data, tmp_path):
    rows = _tracelab_lines(shared_data)
    rows[0]["output_tokens"] = -1
    rows[10]["output_tokens"] = -1
    path = _write_lines(tmp_path / "rounds.jsonl", rows)
    with pytest.raises(InputError) as err:
        import_trace(path, "tracelab", skip_bad=True)
    assert (err.value.record, err.value.field) == ("line 1", "output_tokens")


def test_tracelab_token_split_must_add_up(shared_data, tmp_path):
    rows = _tracelab_lines(shared_data)
    rows[0]["prefix_tokens"] += 1
    path = _write_lines(tmp_path / "rounds.jsonl", rows)
    with pytest.raises(InputError, match="input_tokens_total") as err:
        import_trace(path, "tracelab")
    assert err.value.field == "newly_append_tokens"


# ---------------------------------------------------------------- tau2 / swe-agent
def test_tau2_bad_usage_skips_one_simulation(shared_data, tmp_path):
    path = tmp_path / "tau2.json"
    shutil.copy(shared_data / "traces" / "tau2-bench" / "tau2_telecom_gpt4o.json", path)
    _edit_json(path, lambda d: d["simulations"][4]["messages"][2]["usage"].pop("prompt_tokens"))
    with pytest.raises(InputError) as err:
        import_trace(path, "tau2")
    assert err.value.record == "simulations[4].messages[2]"
    assert err.value.field == "usage.prompt_tokens"
    result = import_trace(path, "tau2", skip_bad=True)
    assert (result.trajectories, result.turns, result.skipped) == (19, 217 - 9, 1)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        # A JSON \ud800 escape loads as a lone surrogate Parquet cannot store.
        (lambda d: d["simulations"][4].update(id="sim-\ud800"), "id"),
        (lambda d: d["simulations"][4]["messages"][2].update(tool_calls=1), "tool_calls"),
    ],
)
def test_tau2_unstorable_id_or_odd_tool_calls_skip_one_simulation(
    shared_data, tmp_path, edit, field
):
    path = tmp_path / "tau2.json"
    shutil.copy(shared_data / "traces" / "tau2-bench" / "tau2_telecom_gpt4o.json", path)
    _edit_json(path, lambda d: edit(d))
    with pytest.raises(InputError) as err:
        import_trace(path, "tau2")
    assert err.value.field == field and str(err.value.record).startswith("simulations[4]")
    result = import_trace(path, "tau2", skip_bad=True)
    assert (result.trajectories, result.skipped) == (19, 1)


def test_a_file_name_that_is_not_utf8_is_named_not_a_crash(tmp_path):
    path = tmp_path / "caf\udce9.jsonl"  # how Python spells the undecodable byte 0xe9
    path.write_text(_mooncake_line() + "\n")
    with pytest.raises(InputError, match=r"run id .* not valid UTF-8") as err:
        import_trace(path, "mooncake")
    assert "rename the file" in err.value.hint
    # Mooncake also names its trajectories after the file: a run id alone does not do.
    with pytest.raises(InputError, match=r"trajectory id .* not valid UTF-8"):
        import_trace(path, "mooncake", run_id="cafe")
    (tmp_path / "cafe.jsonl").write_text(path.read_text())
    assert import_trace(tmp_path / "cafe.jsonl", "mooncake").trajectories == 1


def test_swe_agent_negative_execution_time(shared_data, tmp_path):
    folder = tmp_path / "swe"
    shutil.copytree(shared_data / "traces" / "swe-agent", folder)
    _edit_json(folder / "swea_marsh.traj", lambda d: d["trajectory"][5].update(execution_time=-1))
    with pytest.raises(InputError) as err:
        import_trace(folder, "swe-agent")
    assert (err.value.record, err.value.field) == ("trajectory[5]", "execution_time")
    result = import_trace(folder, "swe-agent", skip_bad=True)
    assert (result.trajectories, result.turns, result.skipped) == (1, 12, 1)


def test_swe_agent_history_must_match_steps(shared_data, tmp_path):
    path = tmp_path / "one.traj"
    shutil.copy(shared_data / "traces" / "swe-agent" / "swea_pydicom.traj", path)
    _edit_json(path, lambda d: d["trajectory"].pop())
    with pytest.raises(InputError, match="12 assistant messages but 11 trajectory steps"):
        import_trace(path, "swe-agent")


# ---------------------------------------------------------------- entry point
def test_unknown_format_and_missing_source(tmp_path):
    with pytest.raises(ConfigError, match="unknown trace format"):
        import_trace(tmp_path, "nope")
    with pytest.raises(InputError, match="no such file"):
        import_trace(tmp_path / "absent", "tau2")
    with pytest.raises(InputError, match=r"no \*\.traj\.json files"):
        import_trace(tmp_path, "mini-swe-agent")


# ---------------------------------------------------------------- never a silent change
BIG = 2**31  # one past the schema's int32


def _mooncake_line(**change) -> str:
    return json.dumps(
        {"timestamp": 0, "input_length": 600, "output_length": 20, "hash_ids": [1, 2], **change}
    )


@pytest.mark.parametrize(
    ("fmt", "make", "field"),
    [
        (
            "mooncake",
            lambda d: _write_lines(
                d / "m.jsonl", [_mooncake_line(), _mooncake_line(input_length=BIG)]
            ),
            "input_length",
        ),
        (
            "azure",
            lambda d: _write_lines(
                d / "a.csv",
                [
                    "TIMESTAMP,ContextTokens,GeneratedTokens",
                    "2023-11-16 18:17:03,10,2",
                    f"2023-11-16 18:17:04,{BIG},2",
                ],
            ),
            "ContextTokens",
        ),
        (
            "tracelab",
            lambda d: _write_lines(
                d / "t.jsonl",
                [
                    {**r, "output_tokens": BIG} if i == 12 else r
                    for i, r in enumerate(_tracelab_lines(SHARED))
                ],
            ),
            "output_tokens",
        ),
        (  # written as a float (3e9): the same limit, not a crash when the table is built
            "mooncake",
            lambda d: _write_lines(
                d / "m.jsonl", [_mooncake_line(), _mooncake_line(input_length=float(BIG))]
            ),
            "input_length",
        ),
    ],
)
def test_token_counts_beyond_int32_are_clear_errors(tmp_path, fmt, make, field):
    path = make(tmp_path)
    with pytest.raises(InputError, match="int32 limit 2147483647") as err:
        import_trace(path, fmt)
    assert err.value.field == field and err.value.source == str(path)
    result = import_trace(path, fmt, skip_bad=True)
    assert result.skipped == 1 and "int32 limit" in result.skipped_examples[0]
    assert find_violations(result.table) == []


def test_mini_swe_agent_tokens_beyond_int32(shared_data, tmp_path):
    folder = _copy_mini(shared_data, tmp_path / "trajs", GOOD_MINI, OTHER_MINI)
    _edit_json(
        folder / OTHER_MINI,
        lambda d: _assistant(d, 2)["extra"]["response"]["usage"].update(prompt_tokens=BIG),
    )
    with pytest.raises(InputError, match="int32 limit") as err:
        import_trace(folder, "mini-swe-agent")
    assert err.value.field == "extra.response.usage.prompt_tokens"
    assert import_trace(folder, "mini-swe-agent", skip_bad=True).trajectories == 1


def test_tracelab_round_years_before_the_previous_is_an_error(shared_data, tmp_path):
    rows = _tracelab_lines(shared_data)
    for event in rows[4]["timing_events"]:  # claude round 4: six years earlier
        event["timestamp"] = "2019" + event["timestamp"][4:]
    path = _write_lines(tmp_path / "rounds.jsonl", rows)
    with pytest.raises(InputError, match="before the previous round's first output") as err:
        import_trace(path, "tracelab")
    assert (err.value.record, err.value.field) == ("line 5", "timing_events")
    result = import_trace(path, "tracelab", skip_bad=True)
    assert (result.trajectories, result.skipped) == (1, 1)  # the codex session stays
    assert "[skipped session 'claude:" in result.skipped_examples[0]


def test_tracelab_small_overlap_is_moved_and_says_so(shared_data, tmp_path):
    rows = _tracelab_lines(shared_data)
    clean = import_trace(_write_lines(tmp_path / "clean.jsonl", rows), "tracelab")
    assert not any("still streaming" in note for note in clean.notes)
    # round 3's tool result arrives 0.1 s before round 2's 18 s response ended
    before = rows[2]["timing_events"]
    last_out = max(
        e["timestamp"] for e in before if e["event_type"] not in ("user_message", "tool_result")
    )
    from prorsa.telemetry.importers.fields import parse_iso

    moved = datetime.fromtimestamp(parse_iso(last_out) - 0.1, tz=UTC).isoformat()
    for event in rows[3]["timing_events"]:
        if event["event_type"] in ("user_message", "tool_result"):
            event["timestamp"] = moved
    result = import_trace(_write_lines(tmp_path / "overlap.jsonl", rows), "tracelab")
    assert any("1 round(s)" in note and "0.100 s" in note for note in result.notes)


def _azure(tmp_path, *stamps: str) -> Path:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"] + [f"{s},100,10" for s in stamps]
    return _write_lines(tmp_path / "AzureLLMInferenceTrace_code.csv", lines)


def test_azure_placeholder_year_is_refused_not_stretched(tmp_path):
    path = _azure(tmp_path, "0001-01-01 00:00:00", "2023-11-16 18:17:03", "2023-11-16 18:17:04")
    with pytest.raises(InputError, match="implausible time") as err:
        import_trace(path, "azure")
    assert (err.value.record, err.value.field) == ("line 2", "TIMESTAMP")
    result = import_trace(path, "azure", skip_bad=True)
    assert (result.trajectories, result.skipped) == (2, 1)
    assert max(result.table.column("time").to_pylist()) < 2.0  # not 2,000 years


def test_azure_row_out_of_order_is_refused(tmp_path):
    # Dropping either of the last two restores the order: the one whose removal leaves
    # the shorter span (:05) is blamed.
    path = _azure(tmp_path, "2023-11-16 18:17:03", "2023-11-16 18:17:05", "2023-11-16 18:17:04")
    with pytest.raises(InputError, match="later than line 4") as err:
        import_trace(path, "azure")
    assert err.value.record == "line 3"


def test_duplicate_session_ids_name_both_places(shared_data, tmp_path):
    folder = tmp_path / "tl"
    folder.mkdir()
    rows = _tracelab_lines(shared_data)
    _write_lines(folder / "a.jsonl", rows)
    _write_lines(folder / "b.jsonl", rows[10:])  # the codex session again
    with pytest.raises(InputError, match="duplicate trajectory id 'codex:") as err:
        import_trace(folder, "tracelab")
    assert err.value.source == str(folder / "b.jsonl") and err.value.field == "session_id"
    assert str(folder / "a.jsonl") in str(err.value)
    result = import_trace(folder, "tracelab", skip_bad=True)
    assert (result.trajectories, result.skipped) == (2, 1)
    assert find_violations(result.table) == []


def test_tau2_duplicate_simulation_ids(shared_data, tmp_path):
    path = tmp_path / "tau2.json"
    shutil.copy(shared_data / "traces" / "tau2-bench" / "tau2_telecom_gpt4o.json", path)
    _edit_json(path, lambda d: d["simulations"][3].update(id=d["simulations"][1]["id"]))
    with pytest.raises(InputError, match="duplicate trajectory id") as err:
        import_trace(path, "tau2")
    assert err.value.record == "simulations[3]" and "simulations[1]" in str(err.value)


@pytest.mark.parametrize(
    ("fmt", "shared", "pattern", "junk_name"),
    [
        ("tracelab", "tracelab/round_trace.jsonl", "*.jsonl", "zz.jsonl"),
        ("mooncake", "mooncake/synthetic_trace.jsonl", "*.jsonl", "aa.jsonl"),
        ("azure", "azure-llm-2023/AzureLLMInferenceTrace_code.csv", "*.csv", "junk.csv"),
        ("mini-swe-agent", f"mini-swe-agent-swebench/{GOOD_MINI}", "*.traj.json", "junk.traj.json"),
    ],
)
def test_one_binary_file_in_a_folder_is_named_and_skippable(
    shared_data, tmp_path, fmt, shared, pattern, junk_name
):
    folder = tmp_path / "traces"
    folder.mkdir()
    good = shared_data / "traces" / shared
    shutil.copy(good, folder / good.name)
    (folder / junk_name).write_bytes(bytes(range(256)) * 64)  # NUL bytes, invalid UTF-8
    with pytest.raises(InputError) as err:
        import_trace(folder, fmt)
    assert err.value.source == str(folder / junk_name)
    result = import_trace(folder, fmt, skip_bad=True)
    reference = import_trace(good, fmt)
    assert result.skipped == 1 and junk_name in result.skipped_examples[0]
    assert result.trajectories == reference.trajectories


def test_text_garbage_line_in_jsonl_is_a_skipped_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(
        (_mooncake_line() + "\n" + _mooncake_line() + "\n").encode() + b"\xff garbage\n"
    )
    with pytest.raises(InputError, match="not UTF-8") as err:
        import_trace(path, "mooncake")
    assert err.value.record == "line 3"
    assert import_trace(path, "mooncake", skip_bad=True).skipped == 1


@pytest.mark.parametrize("at", [1, 2])
def test_azure_forward_jump_blames_that_row_alone(tmp_path, at):
    # At 2, the jump and the row after it are equally long sorted runs with the rest:
    # the one spanning less time is kept (found by review).
    stamps = ["2023-11-16 18:17:03", "2023-11-16 18:17:05", "2023-11-16 18:17:06",
              "2023-11-16 18:17:07"]  # fmt: skip
    stamps.insert(at, "2024-11-16 18:17:04")  # one year ahead: the damaged row
    path = _azure(tmp_path, *stamps)
    with pytest.raises(InputError, match=f"later than line {at + 3}") as err:
        import_trace(path, "azure")
    assert (err.value.record, err.value.field) == (f"line {at + 2}", "TIMESTAMP")
    result = import_trace(path, "azure", skip_bad=True)
    assert (result.trajectories, result.skipped) == (4, 1)
    assert max(result.table.column("time").to_pylist()) < 10.0  # not a year


@pytest.mark.parametrize("at", [1, 2])
def test_azure_backward_jump_blames_that_row_alone(tmp_path, at):
    stamps = ["2023-11-16 18:17:03", "2023-11-16 18:17:05", "2023-11-16 18:17:06"]
    stamps.insert(at, "2023-11-16 18:10:00")  # minutes back: the damaged row
    path = _azure(tmp_path, *stamps)
    with pytest.raises(InputError, match=f"earlier than line {at + 1}") as err:
        import_trace(path, "azure")
    assert err.value.record == f"line {at + 2}"
    result = import_trace(path, "azure", skip_bad=True)
    assert (result.trajectories, result.skipped) == (3, 1)
    assert min(result.table.column("time").to_pylist()) == 0.0  # from the first row


def test_tau2_end_time_before_the_last_message_is_refused(shared_data, tmp_path):
    # Found by review: the tail after the last message was clamped to 0 without a word.
    path = tmp_path / "tau2.json"
    shutil.copy(shared_data / "traces" / "tau2-bench" / "tau2_telecom_gpt4o.json", path)
    _edit_json(path, lambda d: d["simulations"][1].update(end_time="2000-01-02T00:00:00"))
    with pytest.raises(InputError) as err:
        import_trace(path, "tau2")
    assert (err.value.record, err.value.field) == ("simulations[1]", "end_time")


def test_mooncake_says_how_many_requests_it_reordered(tmp_path):
    # Found by review: out-of-order timestamps were sorted without a word.
    lines = [
        {"timestamp": t, "input_length": 600, "output_length": 20, "hash_ids": [i]}
        for i, t in enumerate((0, 5000, 1000, 7000))
    ]
    path = _write_lines(tmp_path / "m.jsonl", lines)
    result = import_trace(path, "mooncake")
    assert any("1 request(s) earlier than the line before" in note for note in result.notes)
