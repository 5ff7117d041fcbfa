"""Errors over HTTP: one JSON shape, the right status, a message that says what to fix.

The body follows the OpenAI error object (``{"error": {"message", "type", "param",
"code"}}``), which SkyRL's and the OpenAI clients read. Bad requests are 4xx and touch
nothing else; an engine that cannot serve is 503; anything unexpected is 500 with the
exception's one-line summary (the log has the traceback).
"""

from __future__ import annotations

import logging
import re
from typing import Any, TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from prorsa.errors import ConfigError, InputError, StateConflict

logger = logging.getLogger(__name__)


class HTTPError(Exception):
    """An error with its HTTP status, raised by route code."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_response(
    status: int, message: str, *, param: str | None = None, kind: str | None = None
) -> JSONResponse:
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


async def json_object(request: Request) -> dict[str, Any]:
    """The request body as a JSON object; 400 for anything else."""
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = msgspec.json.decode(raw)  # C decoder: ~2x json.loads on long token lists
    except msgspec.DecodeError as exc:
        raise HTTPError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise HTTPError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


Body = TypeVar("Body")


async def typed_body(request: Request, decoder: msgspec.json.Decoder[Body]) -> Body:
    """The request body decoded and type-checked in one pass by ``decoder`` (msgspec).

    A body that is not JSON, or whose fields have the wrong type, is a 400 whose message
    names the field (and the element of a list: ``$.token_ids[3]``).
    """
    raw = await request.body()
    try:
        return decoder.decode(raw or b"{}")
    except msgspec.ValidationError as exc:
        raise HTTPError(400, f"invalid request: {exc}", param=_field_of(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise HTTPError(400, f"request body is not valid JSON: {exc}") from None


#: The top-level field a msgspec error message is about.
_FIELD = re.compile(r"at `\$\.([^.\[`]+)|field `([^`]+)`")


def _field_of(message: str) -> str | None:
    found = _FIELD.search(message)
    return (found.group(1) or found.group(2)) if found else None


def error_for(exc: Exception, request: Request | None = None) -> JSONResponse:
    """The error response for an exception raised while serving ``request``."""
    from prorsa.runtime.ray.client import EngineUnavailable
    from prorsa.runtime.ray.turns import NoEngineAvailable, RoutingError

    if isinstance(exc, HTTPError):
        return error_response(exc.status, exc.message, param=exc.param)
    if isinstance(exc, StateConflict):
        return error_response(409, _with_hint(exc), param=_client_field(exc.field, request))
    if isinstance(exc, InputError):
        return error_response(400, _with_hint(exc), param=_client_field(exc.field, request))
    if isinstance(exc, ConfigError):
        return error_response(400, _with_hint(exc))
    if isinstance(exc, RoutingError | EngineUnavailable | NoEngineAvailable):
        return error_response(503, str(exc), kind="service_unavailable")
    if isinstance(exc, RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(400, f"{where}: {first.get('msg', 'invalid request')}", param=where)
    if isinstance(exc, StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))
    where = f"{request.method} {request.url.path}" if request is not None else "request"
    logger.error("%s failed", where, exc_info=exc)
    return error_response(500, f"{type(exc).__name__}: {exc}")


def install_handlers(app: FastAPI) -> None:
    """Map prorsa's and FastAPI's exceptions to :func:`error_for`'s responses."""
    from prorsa.runtime.ray.client import EngineUnavailable
    from prorsa.runtime.ray.turns import NoEngineAvailable, RoutingError

    async def handle(request: Request, exc: Exception) -> JSONResponse:
        return error_for(exc, request)

    for kind in (
        HTTPError, InputError, ConfigError, RoutingError, EngineUnavailable,
        NoEngineAvailable, RequestValidationError, StarletteHTTPException, Exception,
    ):  # fmt: skip
        app.add_exception_handler(kind, handle)


#: Where each route's client puts the prompt the service calls ``prompt_token_ids``.
_PROMPT_FIELD = {
    "/inference/v1/generate": "token_ids",
    "/v1/completions": "prompt",
    "/v1/chat/completions": "messages",
}


#: What each weight route calls the version (the service says ``version``).
_VERSION_FIELD = {
    "/finish_weight_update": "weight_version",
    "/update_weight_version": "new_version",
}


def _client_field(field: str | None, request: Request | None) -> str | None:
    """An error's field as the route's client named it (the service's own names differ:
    the prompt, and the token route's sampling fields under ``sampling_params``)."""
    if field is None or request is None:
        return field
    path = request.url.path
    if field == "prompt_token_ids":
        return _PROMPT_FIELD.get(path, field)
    if field == "version":
        return _VERSION_FIELD.get(path, field)
    if path == "/inference/v1/generate":
        from prorsa.serve.sampling import Sampling

        if field in Sampling.__dataclass_fields__:
            return f"sampling_params.{field}"
    return field


def _with_hint(exc: Exception) -> str:
    hint = getattr(exc, "hint", None)
    return f"{exc} (hint: {hint})" if hint else str(exc)
