"""The ASGI application: OpenAI-compatible routes plus health, metrics and mounted extras.

Routes:
    POST /v1/chat/completions, POST /v1/completions  — streaming (SSE) and not
    GET  /v1/models                                   — the served models (needs an API key)
    GET  /healthz                                     — 200 when the engine is up, else 503
    GET  /metrics                                     — Prometheus text (when a metrics app is given)
    extra routes (the ledger's read API, the quota's tool-call report, ...) as given.

Every error, including unknown routes, wrong methods and unexpected exceptions, is an OpenAI-style
JSON error; an unexpected exception is logged and answered 500 without taking the process down. A
client that closes the connection while a route reads its body is logged at info, not as an error
(status 499, never sent). Refusals (401 on ``/v1/models``, unknown routes, wrong methods) are
published on the gateway's bus as :class:`~kvmeter.stats.RequestRefused`.

A request still unanswered when the server stops (uvicorn cancels it once its graceful-shutdown
period is over, e.g. a body still being waited for) is answered 503 ``server_shutting_down`` with
``Connection: close`` and one info line, instead of uvicorn's plain-text 500 and a
``CancelledError`` traceback; one whose response had already started is cut off (the connection
closes; a stream's usage is recorded by its handler) with one warning line.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Callable, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvmeter.errors import Refusal
from kvmeter.serving.gateway.body import CLIENT_CLOSED
from kvmeter.serving.gateway.errors import ApiError, api_error, error_response
from kvmeter.serving.gateway.handler import CompletionEndpoint, Gateway

__all__ = ["create_app"]

log = logging.getLogger(__name__)


class _AnswerCancelledRequests:
    """ASGI middleware: a request cancelled by the server (shutdown) ends without a traceback.

    uvicorn cancels the requests still running when its graceful-shutdown period is over, then
    logs each ``CancelledError`` as "Exception in ASGI application" and answers a plain-text 500.
    Here such a request is answered 503 (if nothing was sent yet) and ends normally. Only a
    cancellation of this request's own task is absorbed (``Task.cancelling()``); handlers below
    have already released what they held (their ``finally`` blocks ran on the way out).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling() == 0:
                raise  # not a cancellation of this request (a cancel scope's own): not ours
            task.uncancel()
            where = f"{scope.get('method', '')} {scope.get('path', '')[:200]}"
            if started:  # part of the answer is out: nothing valid can follow it
                log.warning("%s: cut off by server shutdown after its response started", where)
                return
            log.info("%s: cancelled by server shutdown before its response; answered 503", where)
            err = ApiError(503, "the server is shutting down; retry the request",
                           code="server_shutting_down", headers={"connection": "close", "retry-after": "1"})
            await error_response(err)(scope, receive, send)


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
        on_startup / on_shutdown: awaited in order in the lifespan (engine start, ledger open...);
            then, for an in-process engine, vLLM's serving layer is built (``gateway.openai``).
        ready: health predicate for ``/healthz`` (default: always ready).
    """

    async def models(request: Request) -> Response:
        try:
            gateway.authenticate(request)
        except Refusal as refusal:
            err = api_error(refusal)
            gateway.refused(err, "models")
            return error_response(err)
        # every served model (a multi-model gateway's in its configured order), vLLM's list shape
        return JSONResponse({"object": "list", "data": [{
            "id": m.name, "object": "model", "created": 0, "owned_by": "kvmeter",
            "max_model_len": m.engine.max_model_len} for m in gateway.served()]})

    async def healthz(request: Request) -> Response:
        ok = ready() if ready is not None else True
        return JSONResponse({"status": "ok" if ok else "starting"}, status_code=200 if ok else 503)

    endpoint: type[CompletionEndpoint]
    if gateway.openai is not None:  # an in-process engine: vLLM's serving layer
        from kvmeter.serving.gateway.openai_path import OpenAIEndpoint
        endpoint = OpenAIEndpoint
    else:  # the remote engine's path
        from kvmeter.serving.gateway.remote_path import RemoteEndpoint
        endpoint = RemoteEndpoint
    routes: list[BaseRoute] = [
        Route("/v1/chat/completions", endpoint(gateway, chat=True).handle, methods=["POST"]),
        Route("/v1/completions", endpoint(gateway, chat=False).handle, methods=["POST"]),
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
        err = ApiError(exc.status_code, message, code=code)
        if exc.status_code < 500:
            gateway.refused(err, "other")
        return error_response(err, dict(exc.headers or {}))

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
        if gateway.openai is not None:  # vLLM's serving objects, before the first request (the
            await gateway.openai.layer()  # engine is started by now; built once)
        try:
            yield
        finally:
            for hook in on_shutdown:
                try:
                    await hook()
                except Exception:  # noqa: BLE001 — shut down the rest regardless
                    log.exception("shutdown hook %r failed", hook)

    # Starlette types every handler as taking Exception; it calls each with its own class only
    return Starlette(routes=routes, lifespan=lifespan, middleware=[Middleware(_AnswerCancelledRequests)],
                     exception_handlers={HTTPException: http_error,  # type: ignore[dict-item]
                                         ClientDisconnect: client_gone, Exception: unexpected})
