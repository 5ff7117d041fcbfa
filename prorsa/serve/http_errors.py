"""Errors over HTTP: one JSON shape, the right status, a message that says what to fix.

The body follows the OpenAI error object (``{"error": {"message", "type", "param",
"code"}}``), which SkyRL's and the OpenAI clients read. Bad requests are 4xx and touch
nothing else; an engine that cannot serve is 503; anything unexpected is 500 with the
exception's one-line summary (the log has the traceback).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from prorsa.errors import ConfigError, InputError

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
        body = json.loads(raw)
    except ValueError as exc:
        raise HTTPError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise HTTPError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


def install_handlers(app: FastAPI) -> None:
    """Map prorsa's and FastAPI's exceptions to :func:`error_response`."""
    from prorsa.runtime.ray.client import EngineUnavailable
    from prorsa.runtime.ray.turns import RoutingError

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError) -> JSONResponse:
        return error_response(exc.status, exc.message, param=exc.param)

    @app.exception_handler(InputError)
    async def _input_error(request: Request, exc: InputError) -> JSONResponse:
        return error_response(400, _with_hint(exc), param=exc.field)

    @app.exception_handler(ConfigError)
    async def _config_error(request: Request, exc: ConfigError) -> JSONResponse:
        return error_response(400, _with_hint(exc))

    @app.exception_handler(RoutingError)
    async def _routing_error(request: Request, exc: RoutingError) -> JSONResponse:
        return error_response(503, str(exc), kind="service_unavailable")

    @app.exception_handler(EngineUnavailable)
    async def _engine_down(request: Request, exc: EngineUnavailable) -> JSONResponse:
        return error_response(503, str(exc), kind="service_unavailable")

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(400, f"{where}: {first.get('msg', 'invalid request')}", param=where)

    @app.exception_handler(StarletteHTTPException)
    async def _starlette(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("%s %s failed", request.method, request.url.path)
        return error_response(500, f"{type(exc).__name__}: {exc}")


def _with_hint(exc: Exception) -> str:
    hint = getattr(exc, "hint", None)
    return f"{exc} (hint: {hint})" if hint else str(exc)
