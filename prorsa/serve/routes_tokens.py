"""Token-in/token-out routes: ``/inference/v1/generate`` and ``/finish_session``.

The request and response follow vLLM 0.32's ``/inference/v1/generate`` (what SkyRL's
``RemoteInferenceClient`` and prime-rl's renderer client send and parse): ``token_ids`` and
``sampling_params`` in; ``choices[0].token_ids``, ``choices[0].logprobs.content[i].logprob``,
``finish_reason`` and ``prompt_logprobs`` out. The session comes from the ``X-Session-ID``
header (or a ``session_id`` body field); prorsa adds the weight version, the path and the
engines in a ``prorsa`` field, and accepts an optional ``routing`` object.
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response

from prorsa.serve.http_errors import HTTPError, json_object, typed_body
from prorsa.serve.sampling import parse_sampling

router = APIRouter()

SESSION_HEADER = "x-session-id"

TokenId = Annotated[int, msgspec.Meta(ge=0)]


class GenerateBody(msgspec.Struct, forbid_unknown_fields=True):
    """The body of ``/inference/v1/generate``, checked field by field as it is decoded.

    Decoding into this type costs a third of ``json.loads`` plus a per-token check in
    Python (measured: 23 against 71 µs for an 800-token prompt), which matters because a
    trainer resends the whole context every turn. Bools and floats are not token ids.
    """

    token_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1)]
    sampling_params: dict[str, Any] | None = None
    model: str | None = None
    request_id: str | None = None
    stream: bool | None = None
    session_id: str | int | None = None
    routing: dict[str, Any] | None = None
    kv_transfer_params: Any = None  # refused when set: prorsa's router sets these
    # vLLM GenerateRequest fields that change nothing here (token-in/token-out, prefix
    # cache already salted by weight version per engine).
    cache_salt: Any = None
    priority: Any = None
    output_mode: Any = None
    return_token_ids: Any = None
    stream_options: Any = None


_GENERATE_BODY = msgspec.json.Decoder(GenerateBody)

#: Response ids: a random tag per server process, then a counter (uuid4 per response
#: costs a system call for randomness on every turn).
_ID_TAG = uuid.uuid4().hex[:12]
_ID_COUNTER = itertools.count()


def _new_id_tag() -> None:
    # A forked process would otherwise repeat its parent's ids.
    global _ID_TAG, _ID_COUNTER
    _ID_TAG, _ID_COUNTER = uuid.uuid4().hex[:12], itertools.count()


os.register_at_fork(after_in_child=_new_id_tag)


def response_id(prefix: str) -> str:
    """A response id unique to this server process (and, by its random tag, across them)."""
    return f"{prefix}-{_ID_TAG}{next(_ID_COUNTER):x}"


def session_id(request: Request, from_body: Any) -> str | None:
    """The session a request belongs to: ``X-Session-ID`` header, else the body's
    ``session_id`` (``from_body``; a string, or an integer id). Every route reads it here."""
    value = request.headers.get(SESSION_HEADER) or from_body
    if value is None:
        return None
    if not isinstance(value, str | int) or isinstance(value, bool):
        raise HTTPError(400, "session_id must be a string", param="session_id")
    return str(value)


def check_model(request: Request, model: Any) -> None:
    """404 for a model this server does not serve (None or empty means the served one,
    as vLLM's server takes it)."""
    if model is None or model == "":
        return
    names = request.app.state.model_names
    if model not in names:
        raise HTTPError(
            404, f"model {model!r} does not exist; this server serves {names[0]!r}", param="model"
        )


#: Token ids beyond this cannot be any tokenizer's (and overflow the tokenizers' int32).
MAX_TOKEN_ID = 2**31 - 1


def token_ids(value: Any, field: str) -> list[int]:
    """A non-empty list of non-negative token ids below :data:`MAX_TOKEN_ID` (the
    vocabulary's own range is checked by the router, or by the route that decodes)."""
    if not isinstance(value, list) or not value:
        raise HTTPError(400, f"{field} must be a non-empty list of token ids", param=field)
    # bools are not token ids; type() runs in C over the list
    if set(map(type, value)) != {int} or min(value) < 0:
        raise HTTPError(400, f"{field} must hold non-negative integers only", param=field)
    if max(value) > MAX_TOKEN_ID:
        raise HTTPError(400, f"{field} holds an id above {MAX_TOKEN_ID}", param=field)
    return value


def json_response(payload: dict[str, Any]) -> Response:
    """A JSON response encoded once by msgspec's C encoder (the hot routes skip FastAPI's
    model-driven serialization, which costs more than the rest of the route). A
    non-finite float is written as null, as strict JSON requires."""
    return Response(msgspec.json.encode(payload), media_type="application/json")


async def generate(request: Request) -> Response:
    """``POST /inference/v1/generate`` (a plain Starlette route: the data-plane hot path)."""
    body = await typed_body(request, _GENERATE_BODY)
    if body.kv_transfer_params:
        raise HTTPError(
            400, "kv_transfer_params are set by prorsa's router, not by clients",
            param="kv_transfer_params",
        )  # fmt: skip
    if body.stream:
        raise HTTPError(400, "streaming is not supported on this route", param="stream")
    check_model(request, body.model)
    sampling = parse_sampling(body.sampling_params, source="sampling_params")
    service = request.app.state.service
    result = await service.generate(
        session_id(request, body.session_id), body.token_ids, sampling, routing=body.routing
    )
    return json_response(
        {
            "request_id": body.request_id or response_id("gen"),
            "model": request.app.state.model_names[0],
            "created": int(time.time()),
            "choices": [
                {
                    "index": 0,
                    "finish_reason": result.finish_reason,
                    "stop_reason": None,
                    "token_ids": result.output_token_ids,
                    "logprobs": logprobs_content(result),
                    "weight_versions": [
                        {"version": v, "start": a, "end": b, "version_number": n}
                        for v, a, b, n in result.weight_versions
                    ],
                }
            ],
            "prompt_logprobs": prompt_logprobs(result, body.token_ids),
            "usage": usage(result),
            "prorsa": prorsa_fields(result),
        }
    )


router.add_route("/inference/v1/generate", generate, methods=["POST"])


@router.post("/finish_session")
async def finish_session(request: Request) -> dict[str, Any]:
    body = await json_object(request)
    value = session_id(request, request.query_params.get("session_id") or body.get("session_id"))
    if not value:
        raise HTTPError(400, "finish_session needs a session_id", param="session_id")
    if not await request.app.state.service.end_session(value):
        raise HTTPError(
            404,
            f"unknown session {value!r} (never started, or already finished)",
            param="session_id",
        )
    return {"status": "finished", "session_id": value}


def logprobs_content(result: Any) -> dict[str, Any] | None:
    """vLLM's ``GenerateLogProbs``: one entry per output token."""
    if result.output_logprobs is None:
        return None
    tops = result.top_logprobs or [[] for _ in result.output_logprobs]
    return {
        "content": [
            {
                "token_id": token,
                "logprob": logprob,
                "top_logprobs": [
                    {"token_id": t, "logprob": lp, "rank": rank + 1}
                    for rank, (t, lp) in enumerate(top)
                ],
            }
            for token, logprob, top in zip(
                result.output_token_ids, result.output_logprobs, tops, strict=False
            )
        ]
    }


def prompt_logprobs(result: Any, prompt: list[int]) -> list[dict[str, dict] | None] | None:
    """vLLM's prompt logprobs: per prompt token ``{token_id: {"logprob", "rank"}}``."""
    if result.prompt_logprobs is None:
        return None
    tops = result.prompt_top_logprobs or [[] for _ in prompt]
    out: list[dict[str, dict] | None] = []
    for token, logprob, top in zip(prompt, result.prompt_logprobs, tops, strict=False):
        if logprob is None:
            out.append(None)
            continue
        entry = {str(token): {"logprob": logprob, "rank": None}}
        for rank, (t, lp) in enumerate(top):
            entry.setdefault(str(t), {"logprob": lp, "rank": rank + 1})
        out.append(entry)
    return out


def usage(result: Any) -> dict[str, int]:
    completion = len(result.output_token_ids)
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": result.prompt_tokens + completion,
    }


def prorsa_fields(result: Any) -> dict[str, Any]:
    return {
        "session_id": result.session_id,
        "turn": result.turn,
        "weight_version": result.weight_version,
        "weight_version_label": result.weight_version_label,
        "path": result.path,
        "decode_engine_id": result.decode_engine_id,
        "prefill_engine_id": result.prefill_engine_id,
        "num_cached_tokens": result.num_cached_tokens,
        "latency_s": result.latency_s,
        "ttft_s": result.ttft_s,
        "engine_s": result.engine_s,
    }
