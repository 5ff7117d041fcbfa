from __future__ import annotations

import numpy as np
import pytest

from prorsa.errors import ConfigError, InputError
from prorsa.telemetry.views import turn_table
from prorsa.workload import (
    SCENARIOS,
    MixtureProfile,
    TaskProfile,
    TrajectorySpec,
    get_scenario,
    load_profile,
    profile_from_trace,
    specs_from_trace,
)
from tests.conftest import REPO

SWE_TRACE = REPO / "datasets" / "traces" / "mini-swe-agent-swebench.parquet"


def test_spec_context_arithmetic():
    spec = TrajectorySpec("t", [100, 30, 50], [20, 10, 5], [2.0, 1.0, 9.0])
    assert spec.num_turns == 3
    assert list(spec.context_by_turn) == [100, 150, 210]
    assert spec.context_tokens(2) == 210
    assert spec.tool_latency_s[-1] == 0.0  # the last turn has no tool call
    assert TrajectorySpec.from_dict(spec.to_dict()).to_dict() == spec.to_dict()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"new_tokens": [], "output_tokens": [], "tool_latency_s": []},
        {"new_tokens": [1, 2], "output_tokens": [1], "tool_latency_s": [0, 0]},
        {"new_tokens": [-1], "output_tokens": [1], "tool_latency_s": [0]},
        {"new_tokens": [1], "output_tokens": [0], "tool_latency_s": [0]},
        {"new_tokens": [1, 1], "output_tokens": [1, 1], "tool_latency_s": [-1, 0]},
    ],
)
def test_spec_rejects_bad_shapes(kwargs):
    with pytest.raises(ConfigError):
        TrajectorySpec("t", **kwargs)


def test_sampling_is_seeded_and_grouped():
    profile = get_scenario("swe")
    a = profile.sample(40, seed=3, group_size=8)
    b = profile.sample(40, seed=3, group_size=8)
    c = profile.sample(40, seed=4, group_size=8)
    assert [s.to_dict() for s in a] == [s.to_dict() for s in b]
    assert [s.to_dict() for s in a] != [s.to_dict() for s in c]
    groups = {}
    for s in a:
        groups.setdefault(s.group_id, []).append(s)
    assert len(groups) == 5 and all(len(g) == 8 for g in groups.values())
    for members in groups.values():  # one prompt per group, shared by every sample
        assert len({int(m.new_tokens[0]) for m in members}) == 1
        assert all(m.shared_prompt_tokens == m.new_tokens[0] for m in members)


def test_group_correlation_makes_siblings_alike():
    profile = get_scenario("swe")
    tight = TaskProfile.from_dict({**profile.to_dict(), "group_rho": 0.95})
    loose = TaskProfile.from_dict({**profile.to_dict(), "group_rho": 0.0})

    def within_group_spread(p):
        specs = p.sample(800, seed=0, group_size=8)
        turns = np.array([s.num_turns for s in specs], dtype=float).reshape(-1, 8)
        return np.log(turns).std(axis=1).mean()

    assert within_group_spread(tight) < 0.6 * within_group_spread(loose)


def _stats(turns_per_traj, ctx, out, tool):
    return {
        "turns_p50": np.percentile(turns_per_traj, 50),
        "context_p50": np.percentile(ctx, 50),
        "context_p90": np.percentile(ctx, 90),
        "output_p50": np.percentile(out, 50),
        "output_p90": np.percentile(out, 90),
        "tool_p50": np.percentile(tool, 50),
        "tool_p90": np.percentile(tool, 90),
    }


def test_fit_sample_round_trip_matches_source_statistics():
    import pyarrow.parquet as pq

    table = pq.read_table(SWE_TRACE)
    turns = turn_table(table)
    profile = profile_from_trace("swe", table)
    specs = profile.sample(4000, seed=11, group_size=8)
    source = _stats(
        turns.groupby("trajectory_id").size(),
        turns["context_tokens"],
        turns["output_tokens"],
        turns["tool_latency_s"].dropna(),
    )
    sampled = _stats(
        [s.num_turns for s in specs],
        np.concatenate([s.context_by_turn for s in specs]),
        np.concatenate([s.output_tokens for s in specs]),
        np.concatenate([s.tool_latency_s[:-1] for s in specs]),
    )
    for key, value in source.items():
        assert sampled[key] == pytest.approx(value, rel=0.35), key


def test_replay_reproduces_real_trajectories():
    import pyarrow.parquet as pq

    table = pq.read_table(SWE_TRACE)
    specs = specs_from_trace(table)
    turns = turn_table(table)
    assert len(specs) == 25 and sum(s.num_turns for s in specs) == 926
    one = specs[0]
    rows = turns[turns["trajectory_id"] == one.trajectory_id].sort_values("turn")
    assert list(one.output_tokens) == list(rows["output_tokens"].clip(lower=1))
    assert one.new_tokens[0] == rows["context_tokens"].iloc[0]
    # Replayed contexts never fall below the real ones (reasoning-drop clamp only adds).
    assert (one.context_by_turn >= rows["context_tokens"].to_numpy()).all()


def test_shipped_scenarios_load_and_sample():
    for name in SCENARIOS:
        profile = get_scenario(name)
        specs = profile.sample(16, seed=0, group_size=4)
        assert len(specs) == 16
        assert all(s.task for s in specs)
    mixed = get_scenario("mixed")
    assert isinstance(mixed, MixtureProfile)
    tasks = {s.task for s in mixed.sample(400, seed=0, group_size=8)}
    assert tasks == {"swe", "search", "math-tool"}


def test_hand_set_profiles_document_their_sources():
    for name in ("search", "math-tool"):
        profile = get_scenario(name)
        for key in ("turns", "new_tokens", "output_tokens", "tool_latency_s"):
            assert profile.sources.get(key)
    assert get_scenario("math-tool").output_tokens.mu > get_scenario("swe").output_tokens.mu


def test_bad_profiles_and_traces(tmp_path):
    with pytest.raises(ConfigError, match="unknown scenario"):
        get_scenario("nope")
    bad = tmp_path / "p.json"
    bad.write_text('{"name": "x"}')
    with pytest.raises(InputError, match="field 'turns': missing"):
        load_profile(bad)
    bad.write_text("{not json")
    with pytest.raises(InputError, match="cannot read"):
        load_profile(bad)
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(SWE_TRACE)
    first = table.column("trajectory_id")[0]
    one_traj = table.filter(pc.equal(table.column("trajectory_id"), first))
    with pytest.raises(InputError, match="two trajectories"):
        profile_from_trace("x", one_traj)


def test_a_trace_file_too_small_to_fit_is_named(tmp_path):
    # Found by review: the error named a placeholder "trace", not the file.
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(SWE_TRACE)
    first = table.column("trajectory_id")[0]
    path = tmp_path / "one.parquet"
    pq.write_table(table.filter(pc.equal(table.column("trajectory_id"), first)), path)
    with pytest.raises(InputError, match="two trajectories") as err:
        profile_from_trace("x", path, allow_partial=True)
    assert err.value.source == str(path)
