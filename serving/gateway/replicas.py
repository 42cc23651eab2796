"""The engine pool's operator API (admin keys only): each replica's state, and drain.

======================================  ==========================================================
``GET  /v1/replicas``                   ``{"object": "list", "data": [replica, ...]}``, each
                                        ``{"replica": url, "index", "healthy", "draining",
                                        "available", "reason", "outstanding_requests"}``
``POST /v1/replicas/drain``             body ``{"replica": url or index, "draining": true}``
                                        (``draining`` optional, default true; false puts it back):
                                        the replica's state after it
======================================  ==========================================================

A draining replica takes no new requests; what it runs goes on
(:mod:`kvmeter.serving.engines.pool`). Errors: 401 no key, 403 ``permission_denied`` (not an admin
key), 404 ``not_found`` (no engine pool on this server, or no such replica), 400 ``invalid_value``
/ ``unknown_parameter`` / ``invalid_json``. Refusals count under the ``other`` endpoint.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmeter.errors import Refusal
from kvmeter.serving.engines.pool import EnginePool
from kvmeter.serving.gateway.body import CLIENT_CLOSED, read_json_object
from kvmeter.serving.gateway.errors import ApiError, api_error, error_response
from kvmeter.serving.gateway.handler import Gateway
from kvmeter.serving.tenancy import Principal

__all__ = ["replica_routes"]

#: Largest drain body (bytes).
_MAX_BODY_BYTES = 4 * 1024


def replica_routes(gateway: Gateway, outstanding: Callable[[int], int] = lambda idx: 0) -> list[Route]:
    """The routes, bound to the gateway's authentication and engine; ``outstanding(idx)``: the
    requests dispatched to replica ``idx`` and not ended (the scheduler's count)."""

    def pool() -> EnginePool:
        engine = gateway.engine
        if not isinstance(engine, EnginePool):
            raise ApiError(404, "this server runs no engine pool (engine.replicas)", code="not_found")
        return engine

    def state(p: EnginePool, i: int) -> dict[str, Any]:
        return {"replica": p.names[i], "index": i, "healthy": p.healthy[i], "draining": p.draining[i],
                "available": p.available(i), "reason": p.reasons[i], "outstanding_requests": outstanding(i)}

    async def answer(request: Request, work: Callable[[], Awaitable[object]]) -> Response:
        principal: Principal | None = None
        try:
            principal = gateway.authenticate(request)
            if not principal.admin:
                raise ApiError(403, "the replicas API needs an admin key", code="permission_denied")
            return JSONResponse(await work())
        except Refusal as refusal:
            err = api_error(refusal)
            if err.status == CLIENT_CLOSED:
                raise ClientDisconnect() from None
            gateway.refused(err, "other", principal)
            return error_response(err)

    async def list_(request: Request) -> Response:
        async def work() -> dict[str, Any]:
            p = pool()
            return {"object": "list", "data": [state(p, i) for i in range(len(p))]}
        return await answer(request, work)

    async def drain(request: Request) -> Response:
        async def work() -> dict[str, Any]:
            p = pool()
            data = await read_json_object(request, _MAX_BODY_BYTES, timeout_s=gateway.settings.body_read_timeout_s)
            unknown = [k for k in data if k not in ("replica", "draining")]
            if unknown:
                raise ApiError(400, f"unknown field {unknown[0][:100]!r}", param=unknown[0][:100],
                               code="unknown_parameter")
            which, draining = data.get("replica"), data.get("draining", True)
            if not isinstance(which, (str, int)) or isinstance(which, bool):
                raise ApiError(400, "replica must be a replica's URL or index", param="replica", code="invalid_value")
            if not isinstance(draining, bool):
                raise ApiError(400, "draining must be true or false", param="draining", code="invalid_value")
            try:
                idx = p.index_of(which)
            except KeyError as exc:
                raise ApiError(404, str(exc.args[0]), param="replica", code="not_found") from None
            p.drain(idx, draining)
            return state(p, idx)
        return await answer(request, work)

    return [Route("/v1/replicas", list_, methods=["GET"]), Route("/v1/replicas/drain", drain, methods=["POST"])]
