"""Token-in/token-out routes: ``/inference/v1/generate`` and ``/finish_session``.

The request and response follow vLLM 0.32's ``/inference/v1/generate`` (what SkyRL's
``RemoteInferenceClient`` and prime-rl's renderer client send and parse): ``token_ids`` and
``sampling_params`` in; ``choices[0].token_ids``, ``choices[0].logprobs.content[i].logprob``,
``finish_reason`` and ``prompt_logprobs`` out. The session comes from the ``X-Session-ID``
header (or a ``session_id`` body field); prorsa adds the weight version, the path and the
engines in a ``prorsa`` field, and accepts an optional ``routing`` object.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from prorsa.serve.http_errors import HTTPError, json_object
from prorsa.serve.sampling import parse_sampling

router = APIRouter()

SESSION_HEADER = "x-session-id"
#: Body fields of vLLM's GenerateRequest that change nothing here (token-in/token-out,
#: prefix cache already salted by weight version per engine).
_IGNORED_FIELDS = frozenset(
    {"cache_salt", "priority", "output_mode", "return_token_ids", "stream_options"}
)
_FIELDS = frozenset(
    {"token_ids", "sampling_params", "model", "request_id", "stream", "session_id", "routing"}
)


def session_id(request: Request, body: dict[str, Any]) -> str | None:
    """The session a request belongs to: ``X-Session-ID`` header, else body ``session_id``."""
    value = request.headers.get(SESSION_HEADER) or body.get("session_id")
    if value is None:
        return None
    if not isinstance(value, str | int):
        raise HTTPError(400, "session_id must be a string", param="session_id")
    return str(value)


def check_model(request: Request, model: Any) -> None:
    """404 for a model this server does not serve (None means the served one)."""
    if model is None:
        return
    names = request.app.state.model_names
    if model not in names:
        raise HTTPError(
            404, f"model {model!r} does not exist; this server serves {names[0]!r}", param="model"
        )


def token_ids(value: Any, field: str) -> list[int]:
    """A non-empty list of non-negative token ids (range checked by the router)."""
    if not isinstance(value, list) or not value:
        raise HTTPError(400, f"{field} must be a non-empty list of token ids", param=field)
    if not all(type(t) is int for t in value) or min(value) < 0:  # bools are not token ids
        raise HTTPError(400, f"{field} must hold non-negative integers only", param=field)
    return value


def reject_unknown(body: dict[str, Any], known: frozenset[str], ignored: frozenset[str]) -> None:
    unknown = sorted(set(body) - known - ignored)
    if unknown:
        raise HTTPError(400, f"unknown field(s) {unknown}", param=unknown[0])


def json_response(payload: dict[str, Any]) -> Response:
    """A JSON response encoded once by the C encoder (the hot routes skip FastAPI's
    model-driven serialization, which costs more than the rest of the route)."""
    return Response(json.dumps(payload, separators=(",", ":")), media_type="application/json")


async def generate(request: Request) -> Response:
    """``POST /inference/v1/generate`` (a plain Starlette route: the data-plane hot path)."""
    body = await json_object(request)
    reject_unknown(body, _FIELDS, _IGNORED_FIELDS | {"kv_transfer_params"})
    if body.get("kv_transfer_params"):
        raise HTTPError(
            400, "kv_transfer_params are set by prorsa's router, not by clients",
            param="kv_transfer_params",
        )  # fmt: skip
    if body.get("stream"):
        raise HTTPError(400, "streaming is not supported on this route", param="stream")
    check_model(request, body.get("model"))
    prompt = token_ids(body.get("token_ids"), "token_ids")
    sampling = parse_sampling(body.get("sampling_params"), source="sampling_params")
    service = request.app.state.service
    result = await service.generate(
        session_id(request, body), prompt, sampling, routing=body.get("routing")
    )
    return json_response(
        {
            "request_id": body.get("request_id") or f"gen-{uuid.uuid4().hex}",
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
                        {"version": v, "start": a, "end": b} for v, a, b in result.weight_versions
                    ],
                }
            ],
            "prompt_logprobs": prompt_logprobs(result, prompt),
            "usage": usage(result),
            "prorsa": prorsa_fields(result),
        }
    )


router.add_route("/inference/v1/generate", generate, methods=["POST"])


@router.post("/finish_session")
async def finish_session(request: Request) -> dict[str, Any]:
    body = await json_object(request)
    value = request.query_params.get("session_id") or body.get("session_id")
    value = value or request.headers.get(SESSION_HEADER)
    if not value:
        raise HTTPError(400, "finish_session needs a session_id", param="session_id")
    if not await request.app.state.service.end_session(str(value)):
        raise HTTPError(
            404,
            f"unknown session {value!r} (never started, or already finished)",
            param="session_id",
        )
    return {"status": "finished", "session_id": str(value)}


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
        "path": result.path,
        "decode_engine_id": result.decode_engine_id,
        "prefill_engine_id": result.prefill_engine_id,
        "num_cached_tokens": result.num_cached_tokens,
        "latency_s": result.latency_s,
        "ttft_s": result.ttft_s,
        "engine_s": result.engine_s,
    }
