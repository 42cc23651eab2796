"""The engine pool's operator API (admin keys only): each replica's state, and drain.

======================================  ==========================================================
``GET  /v1/replicas[?model=name]``     ``{"object": "list", "data": [replica, ...]}``, each
                                        ``{"model", "replica": url, "index", "healthy",
                                        "draining", "available", "reason",
                                        "outstanding_requests"}``: every served model's pool in
                                        order (``model``: that model's only)
``POST /v1/replicas/drain``             body ``{"replica": url or index, "model": name,
                                        "draining": true}`` (``draining`` optional, default true;
                                        false puts it back; ``model`` optional with one pool or a
                                        URL, needed for an index among several pools): the
                                        replica's state after it
======================================  ==========================================================

With several models (``engine.models``) each model has its own pool; ``index`` is the replica's
place in its model's pool, and a replica's URL belongs to one pool only.

A draining replica takes no new requests; what it runs goes on
(:mod:`kvmeter.serving.engines.pool`). Errors: 401 no key, 403 ``permission_denied`` (not an admin
key), 404 ``not_found`` (no engine pool on this server, or no such replica; an unknown ``model``:
vLLM's ``model_not_found`` naming the served ones), 400 ``invalid_value``
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
from kvmeter.serving.gateway.models import ServedModel
from kvmeter.serving.tenancy import Principal

__all__ = ["replica_routes"]

#: Largest drain body (bytes).
_MAX_BODY_BYTES = 4 * 1024


def replica_routes(gateway: Gateway, outstanding: Callable[[str, int], int] = lambda model, idx: 0) -> list[Route]:
    """The routes, bound to the gateway's authentication and served models; ``outstanding(model,
    idx)``: the requests dispatched to replica ``idx`` of ``model``'s pool and not ended (its
    scheduler's count)."""

    def pools(model: str | None = None) -> list[tuple[str, EnginePool]]:
        served = gateway.served()
        chosen: list[ServedModel] = [served.get(model)] if model else list(served)
        out = [(m.name, m.engine) for m in chosen if isinstance(m.engine, EnginePool)]
        if not out:
            raise ApiError(404, "this server runs no engine pool (engine.replicas or engine.models)",
                           code="not_found")
        return out

    def state(model: str, p: EnginePool, i: int) -> dict[str, Any]:
        return {"model": model, "replica": p.names[i], "index": i, "healthy": p.healthy[i],
                "draining": p.draining[i], "available": p.available(i), "reason": p.reasons[i],
                "outstanding_requests": outstanding(model, i)}

    def find(model: str | None, which: str | int) -> tuple[str, EnginePool, int]:
        candidates = pools(model)
        if isinstance(which, int) and len(candidates) > 1:
            raise ApiError(400, "a replica by index needs its model (several models are served): "
                           + ", ".join(n for n, _ in candidates), param="model", code="invalid_value")
        for name, p in candidates:
            try:
                return name, p, p.index_of(which)
            except KeyError as exc:
                missing = exc
        if len(candidates) == 1:
            raise ApiError(404, str(missing.args[0]), param="replica", code="not_found") from None
        raise ApiError(404, f"no replica {which!r} in the pools of " + ", ".join(n for n, _ in candidates),
                       param="replica", code="not_found") from None

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
            return {"object": "list", "data": [state(name, p, i) for name, p in
                                               pools(request.query_params.get("model") or None)
                                               for i in range(len(p))]}
        return await answer(request, work)

    async def drain(request: Request) -> Response:
        async def work() -> dict[str, Any]:
            pools()  # 404 before the body without any pool
            data = await read_json_object(request, _MAX_BODY_BYTES, timeout_s=gateway.settings.body_read_timeout_s)
            unknown = [k for k in data if k not in ("replica", "model", "draining")]
            if unknown:
                raise ApiError(400, f"unknown field {unknown[0][:100]!r}", param=unknown[0][:100],
                               code="unknown_parameter")
            which, draining, model = data.get("replica"), data.get("draining", True), data.get("model")
            if not isinstance(which, (str, int)) or isinstance(which, bool):
                raise ApiError(400, "replica must be a replica's URL or index", param="replica", code="invalid_value")
            if not isinstance(draining, bool):
                raise ApiError(400, "draining must be true or false", param="draining", code="invalid_value")
            if model is not None and not isinstance(model, str):
                raise ApiError(400, "model must be a served model's name", param="model", code="invalid_value")
            name, p, idx = find(model, which)
            p.drain(idx, draining)
            return state(name, p, idx)
        return await answer(request, work)

    return [Route("/v1/replicas", list_, methods=["GET"]), Route("/v1/replicas/drain", drain, methods=["POST"])]
