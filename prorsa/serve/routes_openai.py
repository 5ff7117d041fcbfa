"""OpenAI-compatible routes: completions, chat completions, models, tokenize, detokenize.

``/v1/completions`` takes token-id prompts (what AReaL's ``RemoteInfEngine`` sends, with
``return_tokens_as_token_ids`` and ``logprobs``) or text; ``/v1/chat/completions`` renders
messages with the model folder's chat template. Each request is one turn of the session
named by ``X-Session-ID`` (a one-shot session without it). Logprob objects follow vLLM's
OpenAI server, so clients written against vLLM parse them unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Request
from jinja2 import TemplateError
from starlette.responses import Response

from prorsa.serve.http_errors import HTTPError, json_object
from prorsa.serve.routes_tokens import (
    check_model,
    json_response,
    response_id,
    session_id,
    token_ids,
)
from prorsa.serve.sampling import TEXT_ONLY_KEYS, Sampling, parse_sampling
from prorsa.serve.tool_calls import check_tools, template_messages

router = APIRouter()

_SAMPLING_FIELDS = frozenset(Sampling.__dataclass_fields__) | {"n", "stop"}
_COMPLETION_FIELDS = frozenset(
    {"model", "prompt", "stream", "echo", "return_tokens_as_token_ids", "return_token_ids",
     "session_id", "routing"}
)  # fmt: skip
_CHAT_FIELDS = frozenset(
    {"model", "messages", "stream", "return_tokens_as_token_ids", "return_token_ids",
     "session_id", "routing", "top_logprobs", "add_generation_prompt", "chat_template_kwargs",
     "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls", "reasoning_effort"}
)  # fmt: skip
#: Accepted and ignored: OpenAI bookkeeping, and vLLM options that change nothing here.
_IGNORED = frozenset(
    {"user", "cache_salt", "priority", "stream_options", "logit_bias", "suffix",
     "use_beam_search", "best_of"}
)  # fmt: skip


def _split(body: dict[str, Any], own: frozenset[str]) -> dict[str, Any]:
    """The sampling fields of an OpenAI body; 400 for a field nobody knows."""
    unknown = sorted(set(body) - own - _SAMPLING_FIELDS - TEXT_ONLY_KEYS - _IGNORED)
    if unknown:
        raise HTTPError(400, f"unknown field(s) {unknown}", param=unknown[0])
    if body.get("stream"):
        raise HTTPError(400, "streaming is not supported", param="stream")
    if body.get("use_beam_search") or body.get("best_of", 1) not in (1, None):
        raise HTTPError(400, "beam search is not supported", param="use_beam_search")
    if body.get("logit_bias"):
        raise HTTPError(400, "logit_bias is not supported", param="logit_bias")
    return {k: v for k, v in body.items() if k in _SAMPLING_FIELDS or k in TEXT_ONLY_KEYS}


def _tokenizer(request: Request) -> Any:
    tokenizer = request.app.state.service.tokenizer
    if tokenizer is None:
        raise HTTPError(400, "this model folder has no tokenizer; send token ids")
    return tokenizer


def _token_text(request: Request, token: int, as_ids: bool) -> str:
    if as_ids:
        return f"token_id:{token}"
    return _tokenizer(request).decode([token])


async def completions(request: Request) -> Response:
    """``POST /v1/completions`` (a plain Starlette route, like the token route)."""
    body = await json_object(request)
    sampling_fields = _split(body, _COMPLETION_FIELDS)
    check_model(request, body.get("model"))
    if body.get("echo"):
        raise HTTPError(400, "echo is not supported", param="echo")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompt = _tokenizer(request).encode(prompt)
        if not prompt:
            raise HTTPError(400, "prompt is empty", param="prompt")
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        if len(prompt) != 1:
            raise HTTPError(
                400, "one prompt per request (send a batch as separate requests)", param="prompt"
            )
        prompt = prompt[0]
    prompt = token_ids(prompt, "prompt")
    sampling = parse_sampling(sampling_fields, source="request")
    as_ids = bool(body.get("return_tokens_as_token_ids"))
    if sampling.logprobs is not None and not as_ids:
        _tokenizer(request)  # logprobs name their tokens by text: refused before serving
    service = request.app.state.service
    result = await service.generate(
        session_id(request, body.get("session_id")), prompt, sampling, routing=body.get("routing")
    )
    choice: dict[str, Any] = {
        "index": 0,
        "text": _decode(request, result.output_token_ids),
        "logprobs": _completion_logprobs(request, result, as_ids),
        "finish_reason": result.finish_reason,
        "stop_reason": None,
    }
    if body.get("return_token_ids"):
        choice["token_ids"] = result.output_token_ids
        choice["prompt_token_ids"] = prompt
    return json_response(
        {
            "id": response_id("cmpl"),
            "object": "text_completion",
            "created": int(time.time()),
            "model": request.app.state.model_names[0],
            "choices": [choice],
            "usage": _usage(result),
            "prorsa": {
                "weight_version": result.weight_version,
                "weight_version_label": result.weight_version_label,
                "path": result.path,
            },
        }
    )


router.add_route("/v1/completions", completions, methods=["POST"])


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> dict[str, Any]:
    body = await json_object(request)
    sampling_fields = _split(body, _CHAT_FIELDS)
    check_model(request, body.get("model"))
    if body.get("max_completion_tokens") is not None and "max_tokens" not in sampling_fields:
        sampling_fields["max_tokens"] = body["max_completion_tokens"]
    if sampling_fields.get("logprobs") is True:
        sampling_fields["logprobs"] = body.get("top_logprobs") or 0
    elif sampling_fields.get("logprobs") is False:
        sampling_fields["logprobs"] = None
    tools, tool_choice = body.get("tools"), body.get("tool_choice")
    check_tools(tools, tool_choice)
    parser = request.app.state.service.tool_parser
    parsing = parser is not None and bool(tools) and tool_choice != "none"
    parse_request = parser.request_for(body) if parsing else None  # checked before serving
    prompt = render_chat(
        request,
        body.get("messages"),
        body.get("add_generation_prompt", True),
        template_variables(body),
        tools=tools,
    )
    service = request.app.state.service
    if sampling_fields.get("max_tokens") is None:
        # As vLLM's chat route: without a limit, the turn may fill the context.
        sampling_fields["max_tokens"] = max(service.max_model_len - len(prompt), 1)
    sampling = parse_sampling(sampling_fields, source="request")
    result = await service.generate(
        session_id(request, body.get("session_id")), prompt, sampling, routing=body.get("routing")
    )
    as_ids = bool(body.get("return_tokens_as_token_ids"))
    text = _decode(request, result.output_token_ids)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    finish = result.finish_reason
    if parsing:
        message, called = parser.assistant_message(text, parse_request)
        if called and finish == "stop":
            finish = "tool_calls"
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": _chat_logprobs(request, result, as_ids),
        "finish_reason": finish,
        "stop_reason": None,
    }
    if body.get("return_token_ids"):
        choice["token_ids"] = result.output_token_ids
    return {
        "id": response_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.app.state.model_names[0],
        "choices": [choice],
        "usage": _usage(result),
        "prompt_token_ids": prompt if body.get("return_token_ids") else None,
        "prorsa": {
            "weight_version": result.weight_version,
            "weight_version_label": result.weight_version_label,
            "path": result.path,
        },
    }


def template_variables(body: dict[str, Any]) -> Any:
    """The chat template's extra variables a request asks for: ``chat_template_kwargs``
    and ``reasoning_effort`` (handed to templates that read it, as vLLM's server does);
    :func:`render_chat` checks them."""
    template_kwargs = body.get("chat_template_kwargs")
    if body.get("reasoning_effort") is not None and isinstance(template_kwargs or {}, dict):
        template_kwargs = {"reasoning_effort": body["reasoning_effort"], **(template_kwargs or {})}
    return template_kwargs


#: vLLM's tokenize-chat options prorsa does not serve: refused rather than ignored, so a
#: count never silently differs from vLLM's.
_TOKENIZE_UNSERVED = ("continue_final_message", "chat_template", "mm_processor_kwargs",
                      "media_io_kwargs", "add_special_tokens")  # fmt: skip


def render_chat(
    request: Request,
    messages: Any,
    add_generation_prompt: bool = True,
    template_kwargs: Any = None,
    *,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of ``messages`` under the model's chat template (``template_kwargs``:
    extra template variables, e.g. Qwen3's ``enable_thinking``; ``tools``: the
    functions the model may call, as the template shows them)."""
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise HTTPError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "messages must be a non-empty list", param="messages")
    for i, message in enumerate(messages):
        # An assistant turn that called tools may come without content (OpenAI's format).
        if (
            not isinstance(message, dict)
            or "role" not in message
            or ("content" not in message and not message.get("tool_calls"))
        ):
            raise HTTPError(400, f"messages[{i}] needs 'role' and 'content'", param="messages")
    messages = template_messages(messages)
    if tools:
        template_kwargs = {**(template_kwargs or {}), "tools": tools}
    tokenizer = _tokenizer(request)
    if not getattr(tokenizer, "chat_template", None):
        raise HTTPError(400, "the model folder's tokenizer has no chat template", param="messages")
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=bool(add_generation_prompt),
            tokenize=True,
            **(template_kwargs or {}),
        )
    except (TemplateError, TypeError, ValueError) as exc:  # the template refused them
        raise HTTPError(400, f"chat template: {exc}", param="messages") from None
    if isinstance(ids, Mapping):  # transformers >= 5 returns a BatchEncoding (a UserDict)
        ids = ids["input_ids"]
    return [int(t) for t in ids]


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    service = request.app.state.service
    return {
        "object": "list",
        "data": [
            {
                "id": request.app.state.model_names[0],
                "object": "model",
                "created": int(time.time()),
                "owned_by": "prorsa",
                "root": service.config.model,
                "max_model_len": service.max_model_len,
            }
        ],
    }


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    """vLLM's tokenize route: a text ``prompt``, or chat ``messages`` rendered exactly as
    the chat route renders them (``tools``, ``chat_template_kwargs``), so a client that
    counts a chat prompt's tokens here gets the count the chat route will serve."""
    body = await json_object(request)
    check_model(request, body.get("model"))
    if "messages" in body:
        unserved = [name for name in _TOKENIZE_UNSERVED if body.get(name)]
        if unserved:
            raise HTTPError(400, f"{unserved[0]} is not served by prorsa", param=unserved[0])
        tools = body.get("tools")
        check_tools(tools, None)
        tokens = render_chat(
            request,
            body["messages"],
            body.get("add_generation_prompt", True),
            template_variables(body),
            tools=tools,
        )
    elif isinstance(body.get("prompt"), str):
        tokenizer = _tokenizer(request)
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise HTTPError(
                400, "add_special_tokens must be true or false", param="add_special_tokens"
            )
        tokens = tokenizer.encode(body["prompt"], add_special_tokens=special)
    else:
        raise HTTPError(400, "tokenize needs a text 'prompt' or 'messages'", param="prompt")
    strings = None
    if body.get("return_token_strs"):
        strings = _tokenizer(request).convert_ids_to_tokens(list(tokens))
    return {
        "count": len(tokens),
        "max_model_len": request.app.state.service.max_model_len,
        "tokens": list(tokens),
        "token_strs": strings,
    }


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    body = await json_object(request)
    check_model(request, body.get("model"))
    tokens = token_ids(body.get("tokens"), "tokens")
    tokenizer = _tokenizer(request)  # a 400 without one: "" would read as a decoded text
    vocab = request.app.state.service.router.pools.vocab_size
    if vocab is not None and max(tokens) >= vocab:
        raise HTTPError(400, f"token ids must lie in [0, {vocab})", param="tokens")
    return {"prompt": tokenizer.decode(tokens)}


def _decode(request: Request, tokens: list[int]) -> str:
    tokenizer = request.app.state.service.tokenizer
    return tokenizer.decode(tokens) if tokenizer is not None else ""


def _completion_logprobs(request: Request, result: Any, as_ids: bool) -> dict[str, Any] | None:
    if result.output_logprobs is None:
        return None
    tokens = [_token_text(request, t, as_ids) for t in result.output_token_ids]
    tops = result.top_logprobs or [[] for _ in tokens]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": list(result.output_logprobs),
        "top_logprobs": [
            {_token_text(request, t, as_ids): lp for t, lp in top} if top else None for top in tops
        ],
        "text_offset": offsets,
    }


def _chat_logprobs(request: Request, result: Any, as_ids: bool) -> dict[str, Any] | None:
    if result.output_logprobs is None:
        return None
    tops = result.top_logprobs or [[] for _ in result.output_logprobs]

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = _token_text(request, token, as_ids)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(t, lp), "top_logprobs": [entry(tt, tlp) for tt, tlp in top]}
            for t, lp, top in zip(
                result.output_token_ids, result.output_logprobs, tops, strict=False
            )
        ]
    }


def _usage(result: Any) -> dict[str, int]:
    completion = len(result.output_token_ids)
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": result.prompt_tokens + completion,
    }
