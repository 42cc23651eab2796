"""The ASGI application: OpenAI-compatible routes plus health, metrics and mounted extras.

Routes:
    POST /v1/chat/completions, POST /v1/completions  — streaming (SSE) and not
    GET  /v1/models                                   — the served model (needs an API key)
    GET  /healthz                                     — 200 when the engine is up, else 503
    GET  /metrics                                     — Prometheus text (when a metrics app is given)
    extra routes (the ledger's read API, the quota's tool-call report, ...) as given.

Every error, including unknown routes, wrong methods and unexpected exceptions, is an OpenAI-style
JSON error; an unexpected exception is logged and answered 500 without taking the process down. A
client that closes the connection while a route reads its body is logged at info, not as an error
(status 499, never sent).
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Callable, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp

from kvmeter.serving.gateway.body import CLIENT_CLOSED
from kvmeter.serving.gateway.errors import ApiError, error_response
from kvmeter.serving.gateway.handler import CompletionEndpoint, Gateway

__all__ = ["create_app"]

log = logging.getLogger(__name__)


def create_app(gateway: Gateway, *, extra_routes: Sequence[BaseRoute] = (),
               metrics_app: ASGIApp | None = None,
               on_startup: Sequence[Callable[[], Awaitable[None]]] = (),
               on_shutdown: Sequence[Callable[[], Awaitable[None]]] = (),
               ready: Callable[[], bool] | None = None) -> Starlette:
    """Build the gateway's Starlette app.

    Args:
        gateway: the wired request path.
        extra_routes: more routes (mounted before the catch-all error handling).
        metrics_app: an ASGI app serving ``/metrics`` (Prometheus text).
        on_startup / on_shutdown: awaited in order in the lifespan (engine start, ledger open...).
        ready: health predicate for ``/healthz`` (default: always ready).
    """

    async def models(request: Request) -> Response:
        try:
            gateway.authenticate(request)
        except ApiError as err:
            return error_response(err)
        engine = gateway.engine
        return JSONResponse({"object": "list", "data": [{
            "id": engine.model_name, "object": "model", "created": 0, "owned_by": "kvmeter",
            "max_model_len": engine.max_model_len}]})

    async def healthz(request: Request) -> Response:
        ok = ready() if ready is not None else True
        return JSONResponse({"status": "ok" if ok else "starting"}, status_code=200 if ok else 503)

    routes: list[BaseRoute] = [
        Route("/v1/chat/completions", CompletionEndpoint(gateway, chat=True).handle, methods=["POST"]),
        Route("/v1/completions", CompletionEndpoint(gateway, chat=False).handle, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        *extra_routes,
    ]
    if metrics_app is not None:
        routes.append(Route("/metrics", endpoint=metrics_app, methods=["GET"]))

    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} not allowed on {request.url.path}"}.get(
            exc.status_code, str(exc.detail))
        return error_response(ApiError(exc.status_code, message, code=code), dict(exc.headers or {}))

    async def client_gone(request: Request, exc: Exception) -> Response:
        # the client's own doing, not a server fault (any route that reads a body: tool calls,
        # the ledger's read API; the completion routes record the attempt themselves)
        log.info("client closed the connection during %s %s", request.method, request.url.path)
        return Response(status_code=CLIENT_CLOSED)

    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(ApiError(500, "internal error; the request was not billed",
                                       code="internal_error"))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        for hook in on_startup:
            await hook()
        try:
            yield
        finally:
            for hook in on_shutdown:
                try:
                    await hook()
                except Exception:  # noqa: BLE001 — shut down the rest regardless
                    log.exception("shutdown hook %r failed", hook)

    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPException: http_error, ClientDisconnect: client_gone,
                                         Exception: unexpected})
