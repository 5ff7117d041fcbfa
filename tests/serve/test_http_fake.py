"""HTTP routes over fake engines, driven with the payloads SkyRL, prime-rl and AReaL send.

The request bodies, headers, query parameters and the response fields read back are the
ones in each trainer's client (SkyRL ``RemoteInferenceClient``, prime-rl
``utils/client.py``, AReaL ``VLLMBackend``); their packages do not install beside
prorsa's pins (see prorsa/integrations/README.md), so the payloads are reproduced here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx

from prorsa.integrations.verl import ProrsaLLMClient
from prorsa.serve.app import create_app
from tests.serve.fakes import tokens_for
from tests.serve.helpers import fake_service, weights_folder

TOKEN = "s3cret"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = [5, 6, 7, 8]


@contextlib.asynccontextmanager
async def client(tmp_path, **config) -> AsyncIterator[tuple[httpx.AsyncClient, object]]:
    config = {"admin_token": TOKEN, **config}
    async with fake_service(tmp_path, **config) as (svc, fakes):
        transport = httpx.ASGITransport(app=create_app(svc), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://prorsa") as http:
            yield http, (svc, fakes)


def run(coro):
    return asyncio.run(coro)


def test_skyrl_generate_session_and_control_plane(tmp_path):
    async def go():
        async with client(tmp_path) as (http, (svc, fakes)):
            # RemoteInferenceClient._generate_single
            payload = {
                "sampling_params": {
                    "temperature": 0.0, "max_tokens": 5, "logprobs": 0,
                    "skip_special_tokens": True, "include_stop_str_in_output": True,
                },
                "model": "model",
                "token_ids": PROMPT,
            }  # fmt: skip
            headers = {"Content-Type": "application/json", "X-Session-ID": "traj-1"}
            first = (
                await http.post("/inference/v1/generate", json=payload, headers=headers)
            ).json()
            payload["token_ids"] = PROMPT + first["choices"][0]["token_ids"] + [9]
            second = (
                await http.post("/inference/v1/generate", json=payload, headers=headers)
            ).json()
            status = svc.status()
            finished = await http.post("/finish_session", params={"session_id": "traj-1"})
            # control plane, fanned out to server_urls (here: the same server)
            paused = await http.post(
                "/pause", params={"mode": "keep", "clear_cache": "false"}, headers=ADMIN
            )
            engines_paused = all(f.paused for f in fakes)
            resumed = await http.post("/resume", headers=ADMIN)
            world = await http.request("GET", "/get_world_size", json={}, headers=ADMIN)
            reset = await http.post(
                "/reset_prefix_cache", json={"reset_running_requests": False}, headers=ADMIN
            )
            slept = await http.post("/sleep", params={"level": "2"}, headers=ADMIN)
            # SkyRL's HTTP client sends the tags in a JSON body: a partial wake
            half = await http.post("/wake_up", json={"tags": ["weights"]}, headers=ADMIN)
            bad_tags = await http.post("/wake_up", json={"tags": "weights"}, headers=ADMIN)
            assert half.json() == {"status": "sleeping", "tags": ["weights"], "fully_awake": False}
            assert bad_tags.status_code == 400 and bad_tags.json()["error"]["param"] == "tags"
            woke = await http.post("/wake_up", headers=ADMIN)
            return (
                first,
                second,
                status,
                finished,
                paused,
                engines_paused,
                resumed,
                world,
                reset,
                slept,
                woke,
            )

    first, second, status, finished, paused, engines_paused, resumed, world, reset, slept, woke = (
        run(go())
    )
    choice = first["choices"][0]  # what SkyRL reads
    assert choice["token_ids"] == tokens_for(PROMPT, 5, 0) and choice["finish_reason"] == "length"
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == [-1.0] * 5
    assert first["prorsa"]["turn"] == 0 and second["prorsa"]["turn"] == 1
    assert second["prorsa"]["session_id"] == "traj-1" and status["sessions"] == 1
    assert finished.status_code == 200
    assert paused.status_code == resumed.status_code == 200 and engines_paused
    assert world.json() == {"world_size": 3} and reset.status_code == 200
    assert slept.json()["level"] == 2 and woke.json()["fully_awake"] is True


def test_prime_rl_weight_update_sequence(tmp_path):
    async def go():
        async with client(tmp_path, served_model_name="Qwen/Qwen3-0.6B") as (http, (_svc, fakes)):
            health = await http.get("/health")
            models = (await http.get("/v1/models")).json()
            weight_dir = weights_folder(tmp_path, "step_3")
            # a rollout in flight while the orchestrator updates the policy
            rollout = asyncio.ensure_future(
                http.post(
                    "/inference/v1/generate",
                    json={
                        "token_ids": PROMPT,
                        "sampling_params": {"max_tokens": 60, "logprobs": 0},
                    },
                    headers={"X-Session-ID": "trajectory-7"},
                )
            )
            await asyncio.sleep(0.03)
            steps = [
                await http.post(
                    "/pause", params={"mode": "keep", "clear_cache": "false"}, headers=ADMIN
                ),
                await http.post(
                    "/update_weights", json={"weight_dir": str(weight_dir)}, headers=ADMIN
                ),
                await http.post("/resume", headers=ADMIN),
            ]
            done = (await rollout).json()
            after = (await http.post(
                "/inference/v1/generate",
                json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 3}},
            )).json()  # fmt: skip
            return health, models, steps, done, after, fakes

    health, models, steps, done, after, fakes = run(go())
    assert health.status_code == 200
    assert any(m["id"] == "Qwen/Qwen3-0.6B" for m in models["data"])  # prime-rl's model check
    assert [s.status_code for s in steps] == [200, 200, 200]
    assert steps[1].json()["version"] == 1
    # The rollout frozen by the keep pause finished under the old weights, all of it.
    assert done["prorsa"]["weight_version"] == 0
    assert [s["version"] for s in done["choices"][0]["weight_versions"]] == ["0"]
    assert after["prorsa"]["weight_version"] == 1 and not any(f.violations for f in fakes)


def test_areal_completions_and_disk_update(tmp_path):
    async def go():
        async with client(tmp_path, admin_token=None) as (http, _):
            # VLLMBackend.build_generation_request (text-only branch)
            payload = {
                "top_p": 1.0, "top_k": -1, "max_tokens": 6, "temperature": 1.0,
                "stop_token_ids": [], "ignore_eos": False, "skip_special_tokens": True,
                "return_tokens_as_token_ids": True, "logprobs": 0, "use_beam_search": False,
                "stream": False, "prompt": PROMPT,
            }  # fmt: skip
            completion = (await http.post("/v1/completions", json=payload)).json()
            pause = await http.post("/areal_pause_generation", json={})
            update = await http.post(
                "/areal_update_weights", json={"model_path": str(weights_folder(tmp_path, "w"))}
            )
            cont = await http.post("/areal_continue_generation", json={})
            again = (await http.post("/v1/completions", json=payload)).json()
            return completion, pause, update, cont, again

    completion, pause, update, cont, again = run(go())
    meta = completion["choices"][0]  # VLLMBackend.parse_generation_response
    tokens = [int(t.split(":")[1]) for t in meta["logprobs"]["tokens"]]
    assert tokens == tokens_for(PROMPT, 6, 0)
    assert meta["logprobs"]["token_logprobs"] == [-1.0] * 6 and meta["finish_reason"] == "length"
    assert pause.json()["success"] and update.json()["success"] and cont.json()["success"]
    assert [int(t.split(":")[1]) for t in again["choices"][0]["logprobs"]["tokens"]] == tokens_for(
        PROMPT, 6, 1
    )


def test_verl_client_sends_turns_through_prorsa(tmp_path):
    async def go():
        async with client(tmp_path) as (http, (svc, _)):
            verl = ProrsaLLMClient("http://prorsa", max_tokens=4, prompt_length=6)
            verl._clients[id(asyncio.get_running_loop())] = http  # reuse the in-process app
            sampling = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0,
                        "logprobs": True}  # fmt: skip
            out = await verl.generate("req-1", prompt_ids=PROMPT, sampling_params=sampling)
            out2 = await verl.generate(
                "req-1", prompt_ids=PROMPT + out.token_ids, sampling_params=sampling
            )
            # a trainer's label on the weights (spans carry it): verl still reads steps
            relabelled = await http.post(
                "/update_weight_version", json={"new_version": "base"}, headers=ADMIN
            )
            out3 = await verl.generate("req-2", prompt_ids=PROMPT, sampling_params=sampling)
            assert relabelled.status_code == 200 and out3.extra_fields["global_steps"] == 0
            return out, out2, svc.status()

    out, out2, status = run(go())
    assert out.token_ids == tokens_for(PROMPT, 4, 0) and out.log_probs == [-1.0] * 4
    assert out.stop_reason == "completed" and out.extra_fields["weight_version"] == 0
    steps = ("global_steps", "min_global_steps", "max_global_steps")  # verl's staleness
    assert [out.extra_fields[k] for k in steps] == [0, 0, 0]
    # verl's budget: the second turn's 8-token prompt leaves 6 + 4 - 8 = 2 tokens.
    assert status["sessions"] == 2 and len(out2.token_ids) == 2


def test_malformed_requests_get_4xx_and_leave_other_sessions_alone(tmp_path):
    async def go():
        async with client(tmp_path) as (http, _):
            good = asyncio.ensure_future(
                http.post(
                    "/inference/v1/generate",
                    json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 80}},
                    headers={"X-Session-ID": "good"},
                )
            )
            await asyncio.sleep(0.02)
            bad = {
                "bad json": await http.post("/inference/v1/generate", content=b"{'token_ids': [1",
                                            headers={"content-type": "application/json"}),
                "negative max_tokens": await http.post(
                    "/inference/v1/generate",
                    json={"token_ids": PROMPT, "sampling_params": {"max_tokens": -3}}),
                "unknown model": await http.post(
                    "/v1/completions", json={"model": "gpt-9", "prompt": PROMPT, "max_tokens": 2}),
                "over context": await http.post(
                    "/inference/v1/generate",
                    json={"token_ids": [1] * 1024, "sampling_params": {"max_tokens": 2}}),
                "unknown session": await http.post(
                    "/finish_session", params={"session_id": "nope"}),
                "not a list": await http.post("/inference/v1/generate", json={"token_ids": "1 2"}),
                "unknown field": await http.post(
                    "/inference/v1/generate", json={"token_ids": PROMPT, "sampling": {}}),
                "admin, no token": await http.post("/pause"),
                "admin, wrong token": await http.post(
                    "/update_weights", json={"weight_dir": "/x"},
                    headers={"Authorization": "Bearer no"}),
            }  # fmt: skip
            return bad, (await good).json()

    bad, good = run(go())
    codes = {name: r.status_code for name, r in bad.items()}
    assert codes == {
        "bad json": 400, "negative max_tokens": 400, "unknown model": 404, "over context": 400,
        "unknown session": 404, "not a list": 400, "unknown field": 400,
        "admin, no token": 401, "admin, wrong token": 401,
    }  # fmt: skip
    messages = {name: r.json()["error"]["message"] for name, r in bad.items()}
    assert "not valid JSON" in messages["bad json"]
    assert "max_tokens must be >= 1" in messages["negative max_tokens"]
    assert "'gpt-9' does not exist" in messages["unknown model"]
    assert "1024 tokens" in messages["over context"]
    assert "unknown session 'nope'" in messages["unknown session"]
    assert "Bearer" in messages["admin, no token"]
    # Errors name the field as each route's client sent it.
    params = {name: r.json()["error"]["param"] for name, r in bad.items()}
    assert params["over context"] == "token_ids"
    assert params["negative max_tokens"] == "sampling_params.max_tokens"
    assert good["choices"][0]["token_ids"] == tokens_for(PROMPT, 80, 0)


def test_generate_body_errors_name_the_field_and_element(tmp_path):
    """The token route's body is type-checked as it is decoded; each error is a 400 that
    names the field (and the list element), and nothing reaches an engine."""
    bodies = {
        "bool token": {"token_ids": [5, True]},
        "negative token": {"token_ids": [5, -1]},
        "float token": {"token_ids": [5.0]},
        "empty prompt": {"token_ids": []},
        "no prompt": {"sampling_params": {"max_tokens": 2}},
        "unknown field": {"token_ids": PROMPT, "sampling": {}},
        "session not a string": {"token_ids": PROMPT, "session_id": [1]},
        "not an object": [1, 2],
    }

    async def go():
        async with client(tmp_path) as (http, (svc, _)):
            replies = {
                name: await http.post("/inference/v1/generate", json=body)
                for name, body in bodies.items()
            }
            return replies, svc.status()["sessions_started"]

    replies, sessions_started = run(go())
    assert {name: r.status_code for name, r in replies.items()} == dict.fromkeys(bodies, 400)
    errors = {name: r.json()["error"] for name, r in replies.items()}
    assert "$.token_ids[1]" in errors["bool token"]["message"]
    assert ">= 0" in errors["negative token"]["message"]
    assert "got `float`" in errors["float token"]["message"]
    params = {name: e["param"] for name, e in errors.items()}
    assert params == {
        "bool token": "token_ids", "negative token": "token_ids", "float token": "token_ids",
        "empty prompt": "token_ids", "no prompt": "token_ids", "unknown field": "sampling",
        "session not a string": "session_id", "not an object": None,
    }  # fmt: skip
    assert sessions_started == 0  # refused before a session or an engine saw it


def test_metrics_report_roles_versions_and_latencies(tmp_path):
    async def go():
        async with client(tmp_path) as (http, _):
            await http.post(
                "/inference/v1/generate",
                json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 4}},
            )
            await http.post(
                "/update_weights",
                json={"weight_dir": str(weights_folder(tmp_path, "w"))},
                headers=ADMIN,
            )
            return (await http.get("/metrics")).text

    text = run(go())
    lines = set(text.splitlines())
    assert "prorsa_weight_version 1.0" in lines
    assert (
        'prorsa_engines{role="prefill"} 1.0' in lines
        and 'prorsa_engines{role="decode"} 2.0' in lines
    )
    assert 'prorsa_turns_total{path="disaggregated"} 1.0' in lines
    assert "prorsa_time_to_first_token_seconds_count 1.0" in lines
    assert "prorsa_weight_syncs_total 1.0" in lines
    assert {"prorsa_turn_retries_total 0.0", "prorsa_kv_handoffs_lost_total 0.0"} <= lines
    assert 'prorsa_http_requests_total{route="/inference/v1/generate",status="200"} 1.0' in lines


def test_weight_transfer_window_never_stays_open_after_an_error(tmp_path):
    async def go():
        async with client(tmp_path) as (http, (svc, fakes)):
            for fake in fakes:
                fake.failing_rpcs.add("start_weight_update")
            failed = await http.post("/start_weight_update", headers=ADMIN)
            stray = await http.post("/update_weights", json={"update_info": {}}, headers=ADMIN)
            served = await asyncio.wait_for(
                http.post("/inference/v1/generate",
                          json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}),
                10,
            )  # fmt: skip
            return failed, stray, served, svc.weight_version

    failed, stray, served, version = run(go())
    assert failed.status_code == 500 and "start_weight_update" in failed.json()["error"]["message"]
    assert stray.status_code == 409  # no window is open any more
    assert served.status_code == 200 and version == 0


def test_a_trainer_tells_the_policy_its_workload_shape(tmp_path):
    from prorsa.workload.shape import scenario_shape

    shape = {
        "turns_per_trajectory": 4.5,
        "prompt_tokens": 400,
        "new_tokens_per_turn": 480.0,
        "output_tokens_per_turn": 220.0,
        "tool_s_per_call": 1.0,
        "final_context_tokens": 3100.0,
    }

    async def go():
        async with client(tmp_path, workload_scenario="search") as (http, (svc, _)):
            at_start = svc.actuator.observe().workload
            refused = [
                await http.post("/prorsa/workload", json=shape),  # no token
                await http.post("/prorsa/workload", json={**shape, "turns": 3}, headers=ADMIN),
                await http.post(
                    "/prorsa/workload", json={**shape, "tool_s_per_call": -1}, headers=ADMIN
                ),
                await http.post(
                    "/prorsa/workload", json={**shape, "prompt_tokens": "many"}, headers=ADMIN
                ),
            ]
            kept = svc.actuator.observe().workload  # a refused post changes nothing
            posted = await http.post("/prorsa/workload", json=shape, headers=ADMIN)
            seen = svc.actuator.observe().workload
            status = (await http.get("/prorsa/status", headers=ADMIN)).json()
            await http.delete("/prorsa/workload", headers=ADMIN)
            return at_start, refused, kept, posted, seen, status, svc.actuator.observe().workload

    at_start, refused, kept, posted, seen, status, forgotten = run(go())
    assert at_start == kept == scenario_shape("search")
    assert [r.status_code for r in refused] == [401, 400, 400, 400]
    assert "turns" in refused[1].json()["error"]["message"]
    assert "tool_s_per_call" in refused[2].json()["error"]["message"]
    assert posted.status_code == 200 and seen.prompt_tokens == 400.0
    assert status["workload"]["turns_per_trajectory"] == 4.5
    assert forgotten is None


def test_sessions_read_the_same_way_on_every_route_and_an_empty_model_is_the_served_one(
    tmp_path,
):
    async def go():
        async with client(tmp_path) as (http, _):
            body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}, "model": ""}
            served = await http.post(
                "/inference/v1/generate", json=body, headers={"X-Session-ID": "a"}
            )
            # The header names the session on /finish_session too, ahead of the body.
            finished = await http.post(
                "/finish_session", json={"session_id": "b"}, headers={"X-Session-ID": "a"}
            )
            again = await http.post("/finish_session", json={"session_id": "a"})
            as_bool = await http.post(
                "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "session_id": True}
            )
            as_list = await http.post("/finish_session", json={"session_id": ["a"]})
            dashed = await http.post(
                "/inference/v1/generate", json={"token_ids": PROMPT, "max-tokens": 3}
            )
            return served, finished, again, as_bool, as_list, dashed

    served, finished, again, as_bool, as_list, dashed = run(go())
    assert served.status_code == 200, served.text
    assert finished.json() == {"status": "finished", "session_id": "a"}
    assert again.status_code == 404  # "a" already ended
    assert as_bool.status_code == 400 and as_bool.json()["error"]["param"] == "session_id"
    assert as_list.status_code == 400 and as_list.json()["error"]["param"] == "session_id"
    assert dashed.status_code == 400 and dashed.json()["error"]["param"] == "max-tokens"


def test_the_fast_path_serves_the_apps_own_data_plane_routes(tmp_path):
    from prorsa.serve import routes_openai, routes_tokens
    from prorsa.serve.app import _hot_routes

    async def go():
        async with fake_service(tmp_path) as (svc, _):
            return _hot_routes(create_app(svc))

    assert run(go()) == {
        "/inference/v1/generate": routes_tokens.generate,
        "/v1/completions": routes_openai.completions,
    }


def test_skyrl_weight_sync_through_its_worker_extension_calls(tmp_path):
    # SkyRL's push: /get_world_size, /init_weight_transfer_engine (one rank offset for the
    # server), then collective_rpc skyrl_start_weight_update -> update_weights_* ->
    # skyrl_finish_weight_update (its worker extension; remote_inference_client and
    # weight_sync/broadcast_strategy).
    async def go():
        async with client(tmp_path) as (http, (svc, fakes)):

            def rpc(method: str, **kwargs):
                return http.post(
                    "/collective_rpc", json={"method": method, "kwargs": kwargs}, headers=ADMIN
                )

            world = (await http.get("/get_world_size", headers=ADMIN)).json()["world_size"]
            info = {"master_address": "10.0.0.1", "master_port": 29600, "rank_offset": 1,
                    "world_size": 1 + world}  # fmt: skip
            init = await http.post(
                "/init_weight_transfer_engine", json={"init_info": info}, headers=ADMIN
            )
            outside = await rpc("update_weights_ipc", update_info={"names": ["w"]})
            started = await rpc("skyrl_start_weight_update", is_checkpoint_format=True)
            open_then, paused_then = svc.weight_update_open, all(f.paused for f in fakes)
            pushed = await rpc("update_weights_ipc", update_info={"names": ["w"]})
            finished = await rpc("skyrl_finish_weight_update")
            after = (await http.post(
                "/inference/v1/generate",
                json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 3}},
            )).json()  # fmt: skip
            return (
                world,
                init,
                outside,
                started,
                open_then,
                paused_then,
                pushed,
                finished,
                (after, svc, fakes),
            )

    world, init, outside, started, open_then, paused_then, pushed, finished, rest = run(go())
    after, svc, fakes = rest
    assert world == 3 and init.status_code == 200
    # Each engine's worker takes its own NCCL rank after the trainer's (rank 0).
    offsets = [f.rpc_kwargs[0]["init_info"]["rank_offset"] for f in fakes]
    assert offsets == [1, 2, 3]
    assert all(f.rpc_kwargs[0]["init_info"]["world_size"] == 4 for f in fakes)
    assert outside.status_code == 409 and "outside a weight update" in outside.text
    assert started.status_code == pushed.status_code == finished.status_code == 200
    assert open_then and paused_then and not svc.weight_update_open
    assert [f.rpc_calls[1:] for f in fakes] == [
        ["skyrl_start_weight_update", "update_weights_ipc", "skyrl_finish_weight_update"]
    ] * 3
    assert svc.weight_version == 1 and after["prorsa"]["weight_version"] == 1
    assert not any(f.paused for f in fakes)
