"""``prorsa serve`` on real vLLM engines: logprobs, weight updates across roles, GRPO.

One server for the module (3 tiny-model engines: one prefill, two decode), reached over
real HTTP. Tests run in file order; weights change along the way (versions only go up),
and the GRPO run comes last, after the original weights are loaded again.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import httpx
import pytest

from prorsa.runtime.ray.engine import free_port
from prorsa.serve import ServeConfig
from prorsa.serve.server import BackgroundServer
from tests.runtime.fleets import start_tiny_fleet

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT = [1, 88, 319, 29, 224, 75, 76, 2, 1, 305, 86, 381, 414, 87, 29, 224]
ATOL = 2e-3


@pytest.fixture(scope="module")
def server(ray_session, tiny_model_dir, tmp_path_factory):
    fleet = start_tiny_fleet(
        tiny_model_dir, tmp_path_factory.mktemp("kv"), ["prefill", "decode", "decode"],
        max_num_seqs=16,
    )  # fmt: skip
    config = ServeConfig(
        model=str(tiny_model_dir), engines=3, policy="static",
        policy_params={"prefill_gpus": 1}, port=free_port(), sync_drain_timeout_s=30.0,
        # These tests check weights and roles, not the watchdogs: on a loaded machine an
        # engine may answer slower than the defaults allow and must not leave service.
        engine_control_timeout_s=300.0, engine_stall_timeout_s=600.0,
    )  # fmt: skip
    background = BackgroundServer(config, fleet=fleet).start()
    yield background
    background.stop()
    fleet.shutdown()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory):
    from prorsa.runtime.ray.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("seed1"), seed=1)


def generate(http, session, prompt, routing=None, **sampling):
    body = {"token_ids": prompt, "sampling_params": {"temperature": 0.0, **sampling}}
    if routing:
        body["routing"] = routing
    r = http.post("/inference/v1/generate", json=body, headers={"X-Session-ID": session})
    assert r.status_code == 200, r.text
    return r.json()


def forward_logprobs(model_dir, tokens):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).float()
    with torch.no_grad():
        x = torch.tensor([tokens])
        rows = torch.log_softmax(model(x).logits[0, :-1], -1)
    return rows.gather(1, x[0, 1:, None])[:, 0].tolist(), rows.argmax(-1).tolist()


def test_the_start_up_heap_stays_out_of_full_collections_while_serving(server):
    assert server.config.freeze_startup_heap
    assert gc.get_freeze_count() > 0


def test_logprobs_match_the_model_and_parse_as_vllm_responses(http, tiny_model_dir):
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateTokensResponse

    disagg = generate(http, "lp-d", PROMPT, {"mode": "disaggregated"}, max_tokens=8,
                      logprobs=2, prompt_logprobs=0, ignore_eos=True)  # fmt: skip
    pinned = generate(http, "lp-p", PROMPT, {"mode": "disaggregated", "engine_id": 2},
                      max_tokens=8, logprobs=0, ignore_eos=True)  # fmt: skip
    for body in (disagg, pinned):
        GenerateTokensResponse.model_validate(body)  # vLLM's own response model accepts it
    tokens = disagg["choices"][0]["token_ids"]
    expected, argmax = forward_logprobs(tiny_model_dir, PROMPT + tokens)
    n = len(PROMPT) - 1
    output_lp = [e["logprob"] for e in disagg["choices"][0]["logprobs"]["content"]]
    prompt_lp = [next(iter(e.values()))["logprob"] for e in disagg["prompt_logprobs"][1:]]
    assert disagg["prorsa"]["path"] == "disaggregated" and disagg["prompt_logprobs"][0] is None
    assert max(abs(a - b) for a, b in zip(output_lp, expected[n:], strict=True)) < ATOL
    assert max(abs(a - b) for a, b in zip(prompt_lp, expected[:n], strict=True)) < ATOL
    assert tokens == argmax[n:]  # greedy
    tops = disagg["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert len(tops) == 2 and tops[0]["logprob"] >= tops[1]["logprob"]
    assert pinned["prorsa"]["decode_engine_id"] == 2
    assert pinned["choices"][0]["token_ids"] == tokens and pinned["prorsa"]["weight_version"] == 0


def test_malformed_requests_get_4xx_while_a_session_decodes(http, server):
    results = {}
    good = threading.Thread(
        target=lambda: results.setdefault(
            "good", generate(http, "busy", PROMPT, max_tokens=150, ignore_eos=True)
        )
    )
    good.start()
    time.sleep(0.2)
    codes = {
        "bad json": http.post("/inference/v1/generate", content=b"{oops",
                              headers={"content-type": "application/json"}).status_code,
        "negative max_tokens": http.post("/inference/v1/generate", json={
            "token_ids": PROMPT, "sampling_params": {"max_tokens": -1}}).status_code,
        "unknown model": http.post("/v1/completions", json={
            "model": "nope", "prompt": PROMPT, "max_tokens": 2}).status_code,
        "prompt over context": http.post("/inference/v1/generate", json={
            "token_ids": [5] * 1100, "sampling_params": {"max_tokens": 2}}).status_code,
        "unknown session": http.post("/finish_session", params={"session_id": "x"}).status_code,
    }  # fmt: skip
    good.join(120)
    assert codes == {"bad json": 400, "negative max_tokens": 400, "unknown model": 404,
                     "prompt over context": 400, "unknown session": 404}  # fmt: skip
    alone = generate(http, "alone", PROMPT, max_tokens=150, ignore_eos=True)
    assert results["good"]["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]


def run_during_update(http, update, prompts, max_tokens, mode=None):
    """Start one session per prompt, run ``update`` once they decode; all results."""
    out: dict[int, dict] = {}

    def one(i, prompt):
        routing = {"mode": mode} if mode else None
        out[i] = generate(http, f"live-{time.monotonic_ns()}-{i}", prompt, routing,
                          max_tokens=max_tokens, ignore_eos=True, logprobs=0)  # fmt: skip

    threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    summary = update()
    for t in threads:
        t.join(300)
    return summary, [out[i] for i in range(len(prompts))]


def versions_of(result):
    return {span["version"] for span in result["choices"][0]["weight_versions"]}


def test_sessions_in_flight_during_updates_all_complete_on_one_version(http, other_weights):
    prompts = [[*PROMPT, 7 + i] for i in range(4)]
    before = generate(http, "before", PROMPT, max_tokens=6)
    # Turns finish under the old weights (drained) ...
    summary, drained = run_during_update(
        http, lambda: http.post("/update_weights", json={"weight_dir": str(other_weights)}).json(),
        prompts, max_tokens=60,
    )  # fmt: skip
    assert summary["drained"] and summary["version"] == 1 and not summary["failed"]
    assert all(len(r["choices"][0]["token_ids"]) == 60 for r in drained)
    assert all(versions_of(r) in ({"0"}, {"1"}) for r in drained)
    after = generate(http, "after", PROMPT, max_tokens=6)
    assert after["prorsa"]["weight_version"] == 1
    assert after["choices"][0]["token_ids"] != before["choices"][0]["token_ids"]
    # ... or, past the drain timeout, are aborted and served again under the new weights.
    summary, reserved = run_during_update(
        http, lambda: http.post("/prorsa/update_weights", json={
            "path": str(other_weights), "drain_timeout_s": 0.2}).json(),
        prompts, max_tokens=400, mode="disaggregated",
    )  # fmt: skip
    assert not summary["drained"] and summary["aborted_turns"] >= 1 and summary["version"] == 2
    assert all(len(r["choices"][0]["token_ids"]) == 400 for r in reserved)
    assert all(len(versions_of(r)) == 1 for r in reserved)  # never mixed
    assert {r["prorsa"]["weight_version"] for r in reserved} == {2}


def test_versions_never_go_backwards(http, other_weights):
    r = http.post("/update_weights", json={"weight_dir": str(other_weights), "version": 1})
    assert r.status_code == 400 and "never go backwards" in r.json()["error"]["message"]
    assert http.get("/weight_info").json()["weight_version"] == "2"


def test_sleep_holds_turns_until_wake_up(http, server):
    slept = http.post("/sleep", params={"level": "1"}).json()
    assert slept["status"] == "sleeping"
    assert all(e["freed"] == [] for e in slept["engines"].values())  # vLLM CPU keeps memory
    result = {}
    t = threading.Thread(
        target=lambda: result.setdefault("r", generate(http, "zz", PROMPT, max_tokens=4))
    )
    t.start()
    time.sleep(1.0)
    assert "r" not in result
    assert http.post("/wake_up").json()["fully_awake"] is True
    t.join(60)
    assert len(result["r"]["choices"][0]["token_ids"]) == 4


def test_grpo_loop_end_to_end(http, server, tiny_model_dir, tmp_path):
    from examples.grpo_tiny import GRPOConfig, train

    # Back to the weights the trainer starts from (a new version: versions only go up).
    restored = http.post("/update_weights", json={"weight_dir": str(tiny_model_dir)}).json()
    assert restored["version"] == 3
    status = http.get("/prorsa/status").json()
    assert status["out_of_service"] == {}, status  # the loop rotates all three engines
    history = asyncio.run(train(server.url, str(tiny_model_dir), tmp_path, GRPOConfig(steps=4)))
    rewards = [h["mean_reward"] for h in history]
    assert max(rewards[-2:]) > rewards[0], rewards  # learning at a fixed seed
    assert [h["weight_version"] for h in history] == [4, 5, 6, 7]
    for h in history:
        assert h["rollout_versions"] == [h["weight_version"] - 1]  # a step sees one version
        assert len(h["switches"]) == 3 and h["max_logprob_diff_engine_vs_trainer"] < ATOL
    covered = set()
    for h in history:
        for check in h["checks"]:
            assert check["version"] == h["weight_version"] and check["greedy_matches"], check
            assert (
                check["output_logprob_max_diff"] < ATOL and check["prompt_logprob_max_diff"] < ATOL
            )
            assert check.get("changed_since_previous_version", True), check
            if check["kind"] == "disaggregated":
                covered |= {
                    (check["prefill_engine"], "prefill"),
                    (check["decode_engine"], "decode"),
                }
            else:
                covered.add((check["decode_engine"], "colocated"))
    assert covered == {(e, r) for e in range(3) for r in ("prefill", "decode", "colocated")}
