"""The agent's local tools, the tool plan and spec fitting (no engines needed)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from prorsa.runtime.ray.specs import TokenSource, fit_length, fit_specs
from prorsa.runtime.ray.tools import (
    BM25,
    LatencyTool,
    PythonEvalTool,
    SearchTool,
    make_tools,
    plan_call,
    trajectory_rng,
)
from prorsa.runtime.ray.tools.python_eval import check_expression
from prorsa.workload import get_scenario


def run(coro):
    return asyncio.run(coro)


def test_python_tool_evaluates_in_a_limited_subprocess():
    tool = PythonEvalTool(timeout_s=1.0)
    ok = run(tool.call({"expression": "sum(i * i for i in range(10)) + math.floor(2.5)"}))
    assert ok.ok and ok.text == "287"
    refused = run(tool.call({"expression": "__import__('os').system('true')"}))
    assert not refused.ok and refused.text.startswith("refused")
    assert check_expression("().__class__") is not None
    assert check_expression("open('x')") is not None
    started = time.perf_counter()
    slow = run(tool.call({"expression": "sum(range(10**12))"}))
    assert not slow.ok and "TimeoutError" in slow.text
    assert time.perf_counter() - started < 3.0  # killed at the timeout, not left running
    memory = run(tool.call({"expression": "len([0] * 10**9)"}))
    assert not memory.ok


def test_bm25_ranks_the_matching_passage_first(tmp_path):
    index = BM25(
        [
            "prefill engines compute the prompt",
            "decode engines write one token at a time",
            "tools run between turns",
        ]
    )
    assert index.search("decode token", 2)[0][0] == 1
    assert index.search("nothing matches", 2) == []
    (tmp_path / "a.md").write_text("The KV cache moves from prefill to decode over NIXL.\n")
    tool = SearchTool(corpus_dir=tmp_path)
    answer = run(tool.call({"query": "kv cache nixl"}))
    assert answer.ok and "NIXL" in answer.text
    assert SearchTool().index.documents  # the project's own docs are the default corpus


def test_tool_plan_is_seeded_and_follows_the_task_mix():
    vocabulary = ["prefill", "decode", "router", "engine"]
    tools = ["latency", "python", "search"]

    def calls(seed: int) -> list:
        rng = trajectory_rng(seed, "traj-1")
        return [plan_call("swe", rng, vocabulary, 0.5, tools) for _ in range(20)]

    assert calls(0) == calls(0) and calls(0) != calls(1)
    rng = trajectory_rng(0, "m")
    assert {plan_call("math-tool", rng, vocabulary, 0.5, tools).tool for _ in range(10)} == {
        "python"
    }
    latency = [c for c in calls(0) if c.tool == "latency"]
    assert latency and all(c.args["seconds"] == 0.5 for c in latency)
    only = plan_call("math-tool", rng, vocabulary, 0.5, ["search"])
    assert only.tool == "search"


def test_latency_tool_waits_its_time():
    started = time.perf_counter()
    result = run(LatencyTool().call({"seconds": 0.05, "job": "pytest"}))
    assert result.ok and time.perf_counter() - started >= 0.05
    assert set(make_tools()) == {"python", "search", "latency"}


@pytest.mark.parametrize("scenario", ["swe", "math-tool", "tau2"])
def test_fitted_specs_fit_the_engine_and_share_group_prompts(scenario):
    raw = get_scenario(scenario).sample(12, 3, group_size=4)
    specs = fit_specs(
        raw, max_context_tokens=512, max_output_tokens=32, max_turns=5, tool_time_scale=0.1
    )
    assert [s.trajectory_id for s in specs] == [s.trajectory_id for s in raw]
    for spec, original in zip(specs, raw, strict=True):
        assert spec.num_turns <= 5
        assert int(spec.new_tokens.sum() + spec.output_tokens.sum()) < 512
        assert spec.output_tokens.max() <= 32
        turns = spec.num_turns
        assert np.allclose(spec.tool_latency_s[:-1], original.tool_latency_s[: turns - 1] * 0.1)
    for group in {s.group_id for s in specs}:
        prompts = {int(s.new_tokens[0]) for s in specs if s.group_id == group}
        assert len(prompts) == 1


class _Chars:
    """A tokenizer stand-in: one token per character."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 500 + 3 for c in text]


def test_token_source_gives_exact_lengths_and_shared_prompts():
    source = TokenSource(_Chars(), ["first passage about prefill", "second about decode"])
    a = source.prompt("group-1", "swe", 100)
    assert len(a) == 100 and a == source.prompt("group-1", "swe", 100)
    assert source.prompt("group-2", "swe", 100) != a
    assert len(source.observation("391", 37)) == 37
    assert len(source.observation("x" * 500, 10)) == 10
    assert fit_length([1, 2], 5) == [1, 2, 1, 2, 1]
