"""The HTTP face of a :class:`~prorsa.serve.service.RolloutService` (FastAPI).

:func:`create_app` wires the data-plane routes (:mod:`.routes_tokens`,
:mod:`.routes_openai`), the admin routes (:mod:`.routes_admin`, bearer-token protected),
``/health`` and Prometheus ``/metrics`` around a service that is already started; the
server (:mod:`.server`) owns the service's lifecycle.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prorsa.serve.http_errors import error_for, install_handlers
from prorsa.serve.metrics import CONTENT_TYPE, ServiceMetrics
from prorsa.serve.routes_admin import TOKEN_BLANKS


def create_app(service: Any) -> FastAPI:
    """A FastAPI app over ``service`` (started; its config names the model and token)."""
    from prorsa.serve import routes_admin, routes_openai, routes_tokens

    app = FastAPI(title="prorsa rollout service", docs_url=None, redoc_url=None)
    app.state.service = service
    token = service.config.admin_token
    # Stripped as the header's value is (a secret read from a file often ends in a newline).
    app.state.admin_token = token.strip(TOKEN_BLANKS).encode() if token is not None else None
    app.state.model_names = _model_names(service.config)
    app.state.metrics = service.metrics = ServiceMetrics(service)
    install_handlers(app)
    app.include_router(routes_tokens.router)
    app.include_router(routes_openai.router)
    app.include_router(routes_admin.router)

    @app.get("/health")
    async def health(request: Request) -> Response:
        alive = service.live_engines() if service.router is not None else []
        body = {"status": "ok" if alive else "no engines", "engines": len(alive)}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(app.state.metrics.render(), media_type=CONTENT_TYPE)

    app.add_middleware(_DataPlane, metrics=app.state.metrics, hot_routes=_hot_routes(app))
    return app


def _hot_routes(app: FastAPI) -> dict[str, Any]:
    """Path -> handler of the POST routes :class:`_DataPlane` dispatches: the handlers
    every turn goes through (both take the raw request, no dependencies), found among
    the app's own routes so that a renamed or prefixed route moves with them."""
    from prorsa.serve import routes_openai, routes_tokens

    handlers = (routes_tokens.generate, routes_openai.completions)
    hot = {
        route.path: route.endpoint
        for route in app.routes
        if getattr(route, "endpoint", None) in handlers
        and "POST" in (getattr(route, "methods", None) or ())
    }
    if sorted(hot.values(), key=handlers.index) != list(handlers):
        raise RuntimeError(f"the data-plane routes are not each served once: {sorted(hot)}")
    return hot


def _model_names(config: Any) -> list[str]:
    """Names a request's ``model`` may carry: the served name first, then the folder."""
    from pathlib import Path

    folder = Path(config.model).expanduser()
    names = [config.model_name, config.model, str(folder.resolve())]
    return list(dict.fromkeys(names))


class _DataPlane:
    """Pure ASGI middleware (ahead of FastAPI's router and exception middleware; only
    Starlette's server-error layer sits outside it): counts responses by route and
    status, and sends the hot data-plane routes (POST) straight to their handlers.

    An engine answers the turns of its batch together, so each reply waits behind the
    server's CPU for the others; FastAPI's exception middleware, exit stack and router
    match cost about a tenth of a turn's Python (profiled on the serve benchmark), so the
    routes every turn takes skip them. Their errors get the same responses
    (:func:`~prorsa.serve.http_errors.error_for`) as through FastAPI.
    """

    def __init__(self, app: Any, metrics: ServiceMetrics, hot_routes: dict[str, Any]) -> None:
        self.app = app
        self.metrics = metrics
        self.hot_routes = hot_routes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        handler = self.hot_routes.get(scope["path"]) if scope["method"] == "POST" else None
        if handler is not None:
            request = Request(scope, receive)
            try:
                response = await handler(request)
            except Exception as exc:
                response = error_for(exc, request)
            await response(scope, receive, send)
            self.metrics.requests.labels(scope["path"], str(response.status_code)).inc()
            return
        status = {"code": 500}

        async def send_status(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(path, str(status["code"])).inc()
