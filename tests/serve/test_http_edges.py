"""HTTP edges over fake engines: chat templates, malformed control calls, the weight
update window, auth headers, and the prefill leg's sampling."""

from __future__ import annotations

import asyncio
import contextlib

import pyarrow.compute as pc
import pytest

from prorsa.errors import ConfigError
from prorsa.runtime.ray.turns import NoEngineAvailable
from prorsa.serve.http_errors import error_for
from tests.serve.fakes import tokens_for
from tests.serve.test_http_fake import ADMIN, PROMPT, TOKEN, client, run

#: The tiny model's template, plus a variable a trainer sets through chat_template_kwargs
#: (as Qwen3's enable_thinking) and a refusal (as templates that check role order).
TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'bad' %}{{ raise_exception('roles must alternate') }}{% endif %}"
    "{{ '<s>' + message['role'] + ': ' + message['content'] + '</s>' }}"
    "{% if message.tool_calls %}{{ 'call:' + message.tool_calls[0].function.arguments.cmd }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ ' /no_think' }}{% endif %}"
    "{% if tools %}{{ ' tools: ' + (tools | map(attribute='function.name') | join(',')) }}"
    "{% endif %}"
    "{% if add_generation_prompt %}{{ '<s>assistant: ' }}{% endif %}"
)
CHAT = [{"role": "user", "content": "run the tests"}]


def _with_tokenizer(tmp_path):
    """The fake model folder with a locally trained tokenizer and ``TEMPLATE``."""
    from transformers import PreTrainedTokenizerFast

    from prorsa.runtime.ray.tiny_model import train_tokenizer

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(512), bos_token="<s>", eos_token="</s>"
    )
    tokenizer.chat_template = TEMPLATE
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    tokenizer.save_pretrained(folder)
    return tokenizer


def test_chat_renders_the_template_with_its_kwargs_and_fills_the_context(tmp_path):
    tokenizer = _with_tokenizer(tmp_path)

    def expected(**kwargs) -> list[int]:
        text = tokenizer.apply_chat_template(
            CHAT, add_generation_prompt=True, tokenize=False, **kwargs
        )
        return tokenizer.encode(text, add_special_tokens=False)

    async def go():
        async with client(tmp_path, max_model_len=96) as (http, _):
            tokenized = await http.post("/tokenize", json={"messages": CHAT})
            chat = await http.post(
                "/v1/chat/completions",
                json={"messages": CHAT, "return_token_ids": True,
                      "chat_template_kwargs": {"enable_thinking": False}},
            )  # fmt: skip
            bad = {
                "refused by the template": await http.post(
                    "/v1/chat/completions", json={"messages": [{"role": "bad", "content": "x"}]}
                ),
                "kwargs not an object": await http.post(
                    "/v1/chat/completions", json={"messages": CHAT, "chat_template_kwargs": 1}
                ),
            }
            return tokenized, chat, bad

    tokenized, chat, bad = run(go())
    assert tokenized.status_code == 200
    assert tokenized.json()["tokens"] == expected()
    assert chat.status_code == 200, chat.text
    body = chat.json()
    prompt = expected(enable_thinking=False)
    assert body["prompt_token_ids"] == prompt != expected()
    # No max_tokens: as vLLM's chat route, the turn may fill what the context leaves.
    assert body["usage"]["completion_tokens"] == 96 - len(prompt)
    assert body["choices"][0]["token_ids"] == tokens_for(prompt, 96 - len(prompt), 0)
    assert {name: r.status_code for name, r in bad.items()} == dict.fromkeys(bad, 400)
    assert "roles must alternate" in bad["refused by the template"].json()["error"]["message"]
    assert bad["kwargs not an object"].json()["error"]["param"] == "chat_template_kwargs"


def test_malformed_sampling_and_control_calls_are_refused_before_anything_changes(tmp_path):
    async def go():
        async with client(tmp_path) as (http, (svc, _)):
            gen = "/inference/v1/generate"
            bad = {
                "sleep level": await http.post("/sleep", params={"level": 3}, headers=ADMIN),
                "sleep mode": await http.post("/sleep", params={"mode": "x"}, headers=ADMIN),
                "ignore_eos text": await http.post(
                    gen, json={"token_ids": PROMPT,
                               "sampling_params": {"max_tokens": 2, "ignore_eos": "false"}}),
                "min_tokens over max": await http.post(
                    gen, json={"token_ids": PROMPT,
                               "sampling_params": {"max_tokens": 2, "min_tokens": 3}}),
                "penalty text": await http.post(
                    "/v1/completions", json={"prompt": PROMPT, "presence_penalty": "high"}),
                # vLLM's ranges (and JSON's numbers), refused before the session counts a turn
                "repetition penalty zero": await http.post(
                    gen, headers={"X-Session-ID": "s"},
                    json={"token_ids": PROMPT, "sampling_params": {"repetition_penalty": 0}}),
                "frequency penalty over 2": await http.post(
                    "/v1/completions", headers={"X-Session-ID": "s"},
                    json={"prompt": PROMPT, "frequency_penalty": 2.5}),
                "temperature nan": await http.post(
                    gen, headers={"X-Session-ID": "s"},
                    content=b'{"token_ids": [5, 6], "sampling_params": {"temperature": NaN}}'),
                "routing not an object": await http.post(
                    "/v1/completions", json={"prompt": PROMPT, "routing": "abc"}),
                "switch drain text": await http.post(
                    "/prorsa/switch_role", headers=ADMIN,
                    json={"engine_id": 1, "role": "prefill", "drain_timeout_s": "5"}),
                "rpc timeout": await http.post(
                    "/collective_rpc", headers=ADMIN, json={"method": "x", "timeout": -1}),
            }  # fmt: skip
            asleep = svc.sleeping
            served = await asyncio.wait_for(
                http.post(
                    gen,
                    headers={"X-Session-ID": "s"},
                    json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}},
                ),
                10,
            )
            return bad, asleep, served, svc.router.telemetry.log.to_table()

    bad, asleep, served, table = run(go())
    assert {name: r.status_code for name, r in bad.items()} == dict.fromkeys(bad, 400)
    params = {name: r.json()["error"]["param"] for name, r in bad.items()}
    assert params["sleep level"] == "level" and params["sleep mode"] == "mode"
    assert params["repetition penalty zero"] == "sampling_params.repetition_penalty"
    assert params["frequency penalty over 2"] == "frequency_penalty"
    assert "not valid JSON" in bad["temperature nan"].json()["error"]["message"]
    # the session's first served turn is its turn 0: the refused ones counted nothing
    queued = table.filter(pc.equal(table.column("kind"), "prefill_queued")).to_pylist()
    assert [(r["trajectory_id"], r["turn"]) for r in queued] == [("s", 0)]
    assert params["routing not an object"] == "routing"
    assert params["switch drain text"] == "drain_timeout_s"
    # The refused sleep left nothing asleep or closed behind it.
    assert not asleep and served.status_code == 200


def test_min_tokens_reach_the_decode_leg_of_a_disaggregated_turn(tmp_path):
    # The prefill leg samples one token; vLLM refuses min_tokens above max_tokens there.
    async def go():
        async with client(tmp_path) as (http, _):
            reply = await http.post(
                "/inference/v1/generate",
                json={"token_ids": PROMPT,
                      "sampling_params": {"max_tokens": 5, "min_tokens": 4},
                      "routing": {"mode": "disaggregated"}},
            )  # fmt: skip
            return reply

    reply = run(go())
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["token_ids"] == tokens_for(PROMPT, 5, 0)
    assert reply.json()["prorsa"]["path"] == "disaggregated"


def test_an_open_weight_update_window_refuses_calls_that_would_wait_on_it(tmp_path):
    # Found by review: /resume inside a window waited for /finish_weight_update, which a
    # crashed trainer never sends; every turn then waited at the closed gate for good.
    async def go():
        async with client(tmp_path) as (http, (svc, _)):
            opened = await http.post("/start_weight_update", headers=ADMIN)
            calls = {
                route: await asyncio.wait_for(http.post(route, headers=ADMIN, **kw), 5)
                for route, kw in [
                    ("/pause", {}), ("/resume", {}), ("/sleep", {}), ("/wake_up", {}),
                    ("/update_weights", {"json": {"weight_dir": str(tmp_path / "model")}}),
                ]
            }  # fmt: skip
            cancelled = await http.post("/prorsa/cancel_weight_update", headers=ADMIN)
            again = await http.post("/prorsa/cancel_weight_update", headers=ADMIN)
            served = await asyncio.wait_for(
                http.post("/inference/v1/generate",
                          json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}),
                10,
            )  # fmt: skip
            return opened, calls, cancelled, again, served, svc.weight_version

    opened, calls, cancelled, again, served, version = run(go())
    assert opened.status_code == 200
    assert {route: r.status_code for route, r in calls.items()} == dict.fromkeys(calls, 409)
    assert "cancel_weight_update" in calls["/resume"].json()["error"]["message"]
    assert cancelled.status_code == 200 and again.status_code == 409
    assert served.status_code == 200 and version == 0


def test_admin_auth_takes_any_header_bytes_and_a_token_read_with_its_newline(tmp_path):
    async def go():
        async with client(tmp_path, admin_token=TOKEN + "\n") as (http, _):
            return {
                "non-ascii": await http.post(
                    "/pause", headers={"Authorization": "Bearer \u00e9t\u00e9".encode()}),
                "right token": await http.post("/pause", headers=ADMIN),
            }  # fmt: skip

    replies = run(go())
    assert replies["non-ascii"].status_code == 401
    assert replies["right token"].status_code == 200


def test_no_engine_to_act_is_a_503():
    assert error_for(NoEngineAvailable("no live engine to update")).status_code == 503


def test_an_engine_a_weight_push_failed_on_leaves_instead_of_taking_the_new_version(tmp_path):
    # Found by review: the finish stamped the new version on every engine, the one still
    # holding the old weights included, and served from it under the new label.
    async def go():
        async with client(tmp_path) as (http, (svc, fakes)):
            fakes[2].failing_rpcs.add("update_weights")
            await http.post("/start_weight_update", headers=ADMIN)
            push = await http.post("/update_weights", json={"update_info": {}}, headers=ADMIN)
            finish = await http.post(
                "/finish_weight_update", json={"weight_version": "1"}, headers=ADMIN
            )
            served = await http.post(
                "/inference/v1/generate",
                json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}},
            )
            return push, finish, served, svc.live_engines(), fakes[2].version

    push, finish, served, live, stale_version = run(go())
    assert push.status_code == 500 and "update_weights" in push.json()["error"]["message"]
    assert finish.status_code == 200 and list(finish.json()["failed"]) == ["2"]
    assert 2 not in live and stale_version == 0
    assert served.status_code == 200 and served.json()["prorsa"]["weight_version"] == 1


def test_a_decode_engine_made_colocated_during_the_prefill_leg_still_decodes_the_turn(tmp_path):
    # Found by review: after the prefill leg the router took only a decode engine, so a
    # turn whose decode engine moved to colocation meanwhile (an instant relabel) waited
    # the 120 s route timeout and failed.
    async def go():
        async with client(tmp_path, engines=2) as (http, (svc, fakes)):
            fakes[0].transit_s = 0.3  # the prefill leg is still on its way
            turn = asyncio.ensure_future(
                http.post(
                    "/inference/v1/generate",
                    json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 3},
                          "routing": {"mode": "disaggregated", "engine_id": 1}},
                )
            )  # fmt: skip
            while not svc.router.pools.get(0).leases:  # the prefill leg is on its way
                await asyncio.sleep(0.005)
            await svc.switch_role(1, "colocated")
            role = svc.status()["roles"][1]
            reply = await asyncio.wait_for(turn, 10)
            return role, reply

    role, reply = run(go())
    assert role == "colocated"
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["choices"][0]["token_ids"] == tokens_for(PROMPT, 3, 0)
    assert body["prorsa"]["decode_engine_id"] == 1 and body["prorsa"]["path"] == "disaggregated"


def test_a_switch_that_fails_part_way_leaves_the_engine_serving_in_its_old_role(tmp_path):
    # Found by review: an error other than a dead engine after the pause labelled the
    # engine with its new role, still paused, and every leg routed there waited.
    async def go():
        async with client(tmp_path) as (http, (svc, fakes)):
            fakes[2].refusing.add("reset_prefix_cache")
            try:
                await svc.switch_role(2, "prefill")
            except RuntimeError as exc:
                error = str(exc)
            reply = await asyncio.wait_for(
                http.post(
                    "/inference/v1/generate",
                    json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 3},
                          "routing": {"mode": "disaggregated", "engine_id": 2}},
                ),
                10,
            )  # fmt: skip
            return error, svc.status()["roles"][2], fakes[2].paused, reply

    error, role, paused, reply = run(go())
    assert "refused the reset" in error
    assert role == "decode" and not paused
    assert reply.status_code == 200 and reply.json()["prorsa"]["decode_engine_id"] == 2


def test_a_session_finished_mid_turn_ends_when_its_turn_returns(tmp_path):
    # Found by review: the trajectory ended at once, then the turn's own events brought
    # it back in the router (a phantom live trajectory, events after traj_end). A turn
    # queued behind it, or a new turn under the same id, must not run after its end.
    async def go():
        async with client(tmp_path) as (http, (svc, fakes)):

            def turn(tokens: int):
                return asyncio.ensure_future(
                    http.post(
                        "/inference/v1/generate",
                        json={"token_ids": PROMPT, "sampling_params": {"max_tokens": tokens}},
                        headers={"X-Session-ID": "slow"},
                    )
                )

            first = turn(150)
            while not any(f.requests for f in fakes):  # the turn is in an engine
                await asyncio.sleep(0.005)
            queued = turn(2)
            await asyncio.sleep(0.02)
            finished = await http.post("/finish_session", params={"session_id": "slow"})
            live_then = svc.status()["trajectory_states"]
            reused = await turn(2)  # the old turn is still running
            replies = await asyncio.wait_for(asyncio.gather(first, queued), 10)
            events = svc.router.telemetry.log.to_table(0, len(svc.router.telemetry.log))
            return finished, live_then, reused, replies, svc.status(), events

    finished, live_then, reused, (first, queued), status, events = run(go())
    assert finished.status_code == 200 and first.status_code == 200
    assert queued.status_code == 409 and reused.status_code == 409
    assert sum(live_then.values()) == 1 and sum(status["trajectory_states"].values()) == 0
    kinds = [k for k, t in zip(events.column("kind").to_pylist(),
                               events.column("trajectory_id").to_pylist(), strict=True)
             if t == "slow"]  # fmt: skip
    assert kinds[-1] == "traj_end" and kinds.count("traj_end") == 1
    assert kinds.count("decode_end") == 1 and "tool_start" not in kinds


def test_a_push_that_fails_everywhere_retires_no_engine_and_a_retry_clears_a_failure(tmp_path):
    # Found by review of the fix above: a push failing on every engine (a malformed
    # update_info) retired them all at finish or cancel and the service was gone.
    async def go():
        async with client(tmp_path) as (http, (svc, fakes)):
            for fake in fakes:
                fake.failing_rpcs.add("update_weights")
            await http.post("/start_weight_update", headers=ADMIN)
            await http.post("/update_weights", json={"update_info": {}}, headers=ADMIN)
            refused = await http.post("/finish_weight_update", headers=ADMIN)
            for fake in fakes:  # the trainer fixes its request and pushes again
                fake.failing_rpcs.clear()
            retried = await http.post("/update_weights", json={"update_info": {}}, headers=ADMIN)
            finished = await http.post("/finish_weight_update", headers=ADMIN)
            # And a push failing everywhere, then cancelled: every engine stays.
            for fake in fakes:
                fake.failing_rpcs.add("update_weights")
            await http.post("/start_weight_update", headers=ADMIN)
            await http.post("/update_weights", json={"update_info": {}}, headers=ADMIN)
            cancelled = await http.post("/prorsa/cancel_weight_update", headers=ADMIN)
            return refused, retried, finished, cancelled, svc.live_engines()

    refused, retried, finished, cancelled, live = run(go())
    assert refused.status_code == 409 and "every engine" in refused.json()["error"]["message"]
    assert retried.status_code == 200
    assert finished.status_code == 200 and finished.json()["failed"] == {}
    assert cancelled.status_code == 200 and live == [0, 1, 2]


def test_a_second_cancel_during_a_failed_switch_s_resume_keeps_the_engine(tmp_path):
    # Found by review: a switch cancelled part-way resumes its engine; a second cancel
    # (a shutdown) while that resume ran marked a healthy engine dead.
    async def until(condition):
        async with asyncio.timeout(10):
            while not condition():
                await asyncio.sleep(0.005)

    async def go():
        async with client(tmp_path) as (_, (svc, fakes)):
            fake, resumed = fakes[2], asyncio.Event()
            fake.calls.clear()
            fake.hanging.add("pause")
            fake.gates["resume"] = resumed
            switch = asyncio.ensure_future(svc.switch_role(2, "prefill"))
            await until(lambda: "pause" in fake.calls)  # the pause that never answers
            switch.cancel()
            await until(lambda: "resume" in fake.calls)  # the resume is under way
            switch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await switch
            engine = svc.router.pools.get(2)
            role_while_resuming = engine.role.value
            resumed.set()  # the resume answers
            await until(lambda: engine.role.value != "switching")
            return role_while_resuming, engine.alive, engine.role.value, fake.paused

    role_while_resuming, alive, role, paused = run(go())
    # Not routable while still paused; back in its old role once the resume answers.
    assert role_while_resuming == "switching"
    assert alive and role == "decode" and not paused


TOOLS = [
    {"type": "function", "function": {"name": "run", "description": "run a command",
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}
]  # fmt: skip


def test_chat_tools_reach_the_template_and_vllm_s_parser_returns_tool_calls(tmp_path):
    # Found by review: tools, tool_choice, parallel_tool_calls and reasoning_effort were
    # each a 400, so agentic clients (prime-rl's environments, SkyRL's harnesses) could
    # not call the chat route with tools.
    tokenizer = _with_tokenizer(tmp_path)
    call = '<tool_call>{"name": "run", "arguments": {"cmd": "ls"}}</tool_call>'
    reply = tokenizer.encode("I will look." + call, add_special_tokens=False)
    history = [
        *CHAT,
        {"role": "assistant", "tool_calls": [{"id": "c0", "type": "function",
         "function": {"name": "run", "arguments": '{"cmd": "pwd"}'}}]},
        {"role": "tool", "tool_call_id": "c0", "content": "ok"},
    ]  # fmt: skip

    async def go():
        async with client(tmp_path, tool_call_parser="hermes") as (http, (_, fakes)):
            for fake in fakes:
                fake.reply = reply

            def chat(**fields):
                body = {"messages": CHAT, "return_token_ids": True, **fields}
                return http.post("/v1/chat/completions", json=body)

            called = await chat(tools=TOOLS, reasoning_effort="low", parallel_tool_calls=False)
            counted = await http.post(
                "/tokenize",
                json={"messages": CHAT, "tools": TOOLS, "return_token_strs": True,
                      "chat_template_kwargs": {"enable_thinking": False}},
            )  # fmt: skip
            bad_count = await http.post("/tokenize", json={"messages": CHAT, "tools": {"x": 1}})
            unserved = await http.post(
                "/tokenize", json={"messages": CHAT, "continue_final_message": True}
            )
            plain = await chat(tools=TOOLS, tool_choice="none")
            after_tool = await chat(messages=history, tools=TOOLS)
            served = sum(f.steps for f in fakes)
            bad = {
                "required": await chat(tools=TOOLS, tool_choice="required"),
                "not a list": await chat(tools={"run": 1}),
                "not a tool": await chat(tools=[{"type": "function"}]),
            }
            bad["tokenize tools"] = bad_count
            bad["continue_final_message"] = unserved
            return called, plain, after_tool, bad, served == sum(f.steps for f in fakes), counted

    called, plain, after_tool, bad, bad_served_nothing, counted = run(go())
    assert called.status_code == 200, called.text
    body = called.json()
    prompt = tokenizer.apply_chat_template(
        CHAT, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith(" tools: run<s>assistant: ")  # the template saw the tools
    assert body["prompt_token_ids"] == tokenizer.encode(prompt, add_special_tokens=False)
    # /tokenize renders a chat with its tools and template variables as the chat route
    # does (it dropped both: a client counting its prompt there got a shorter one)
    thinking_off = tokenizer.apply_chat_template(
        CHAT, tools=TOOLS, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert counted.status_code == 200, counted.text
    tokens = tokenizer.encode(thinking_off, add_special_tokens=False)
    assert counted.json()["tokens"] == tokens and counted.json()["count"] == len(tokens)
    assert counted.json()["token_strs"] == tokenizer.convert_ids_to_tokens(tokens)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "I will look."
    [tool_call] = choice["message"]["tool_calls"]
    assert tool_call["function"] == {"name": "run", "arguments": '{"cmd": "ls"}'}
    # tool_choice none: the tools are shown, the text is not parsed.
    assert plain.json()["choices"][0]["message"] == {
        "role": "assistant", "content": tokenizer.decode(reply)
    }  # fmt: skip
    assert after_tool.status_code == 200, after_tool.text
    # The history's arguments reach the template as an object, as vLLM hands them over.
    history_prompt = tokenizer.decode(after_tool.json()["prompt_token_ids"])
    assert "call:pwd" in history_prompt.replace(" ", "")
    assert {k: (r.status_code, r.json()["error"]["param"]) for k, r in bad.items()} == {
        "required": (400, "tool_choice"), "not a list": (400, "tools"),
        "not a tool": (400, "tools"), "tokenize tools": (400, "tools"),
        "continue_final_message": (400, "continue_final_message"),
    }  # fmt: skip
    assert bad_served_nothing  # refused before any engine worked on them


def test_an_unknown_tool_call_parser_is_refused_before_engines_start(tmp_path):
    _with_tokenizer(tmp_path)

    async def go():
        async with client(tmp_path, tool_call_parser="no-such-parser"):
            pass

    with pytest.raises(ConfigError, match="no-such-parser") as err:
        run(go())
    assert "hermes" in str(err.value.hint)


def test_tokenize_and_detokenize_refuse_what_they_cannot_answer(tmp_path):
    # Found by review: a huge id was a 500, an id past the vocabulary decoded to "", no
    # tokenizer answered 200 with "", and a non-boolean add_special_tokens was a 500.
    async def go():
        async with client(tmp_path) as (http, _):
            no_tokenizer = await http.post("/detokenize", json={"tokens": [1, 2]})
        _with_tokenizer(tmp_path)
        async with client(tmp_path) as (http, (svc, _)):
            vocab = svc.router.pools.vocab_size
            answers = {
                "huge": await http.post("/detokenize", json={"tokens": [2**40]}),
                "past": await http.post("/detokenize", json={"tokens": [1, vocab]}),
                "flag": await http.post(
                    "/tokenize", json={"prompt": "a", "add_special_tokens": "x"}
                ),
                "fine": await http.post("/detokenize", json={"tokens": [5, 6]}),
            }
        return no_tokenizer, vocab, answers

    no_tokenizer, vocab, answers = run(go())
    assert no_tokenizer.status_code == 400 and "tokenizer" in no_tokenizer.text
    assert vocab  # the engines report theirs
    assert {k: r.status_code for k, r in answers.items()} == {
        "huge": 400, "past": 400, "flag": 400, "fine": 200
    }  # fmt: skip
    assert "add_special_tokens" in answers["flag"].text


def test_the_context_reported_is_what_every_engine_accepts(tmp_path):
    # Found by review: /v1/models and the chat route's default max_tokens read the
    # configured length, not the engines' (an adopted fleet may run a shorter one).
    async def go():
        async with client(tmp_path, max_model_len=4096) as (http, (svc, _)):
            models = await http.get("/v1/models")
            return svc.router.pools.max_model_len, models.json()

    engines, models = run(go())
    assert engines < 4096 and models["data"][0]["max_model_len"] == engines


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": float("inf")}, "top_p"),
        ({"temperature": 10**400}, "temperature"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
    ],
)
def test_sampling_numbers_must_be_finite_and_in_vllms_ranges(values, field):
    # Python callers (the Ray actor, RolloutService.generate) skip JSON's checks.
    from prorsa.errors import InputError
    from prorsa.serve.sampling import parse_sampling

    with pytest.raises(InputError) as err:
        parse_sampling(values)
    assert err.value.field == field


def test_a_failing_stop_callback_does_not_skip_the_clean_up():
    # Found by review: `prorsa serve | tee log` and Ctrl-C: the CLI's "stopping" line
    # raised BrokenPipeError and the engines and Ray were never shut down.
    from prorsa.serve.server import shut_down

    class Service:
        stopped = False

        async def shutdown(self):
            self.stopped = True

    def printing_to_a_dead_pipe():
        raise BrokenPipeError("[Errno 32] Broken pipe")

    service = Service()
    asyncio.run(shut_down(service, printing_to_a_dead_pipe))
    assert service.stopped
