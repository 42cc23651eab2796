"""The approvals API: list, read, approve and reject approvals of high-risk tool calls.

=============================================  ===================================================
``GET  /v1/approvals``                         pending, unexpired approvals the key may read:
                                               ``{"object": "list", "data": [approval, ...]}``;
                                               query ``agent_run_id``, ``tenant_id`` (admin keys),
                                               ``limit`` (1–1000, default 100)
``GET  /v1/approvals/{approval_id}``           one approval (its ``status``: pending, approved,
                                               rejected, consumed, expired)
``POST /v1/approvals/{approval_id}/approve``   body ``{"reason": "..."}`` (optional)
``POST /v1/approvals/{approval_id}/reject``    body ``{"reason": "..."}`` (required)
=============================================  ===================================================

Who may read and decide is :mod:`kvmeter.serving.agents.approvals`' rule (an admin key, or a key
in the ``approvers`` of the requesting key's chain; never the requesting key itself; the
requesting key may read its own). Errors: 401 no key, 403 ``approval_forbidden``, 404
``approval_not_found``, 409 ``approval_already_decided`` / ``approval_expired`` (with
``x-should-retry: false``), 400 ``invalid_value`` / ``unknown_parameter`` / ``invalid_json``,
503 ``agent_store_unavailable``. Every decision is a ledger record before the answer.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmeter.errors import Refusal
from kvmeter.serving.agents import ApprovalDesk
from kvmeter.serving.gateway.body import CLIENT_CLOSED, read_json_object
from kvmeter.serving.gateway.errors import ApiError, api_error, error_response
from kvmeter.serving.gateway.handler import Gateway
from kvmeter.serving.gateway.body import json_type
from kvmeter.serving.tenancy import Principal

__all__ = ["approval_routes", "MAX_DECISION_BYTES"]

#: Largest decision body (bytes).
MAX_DECISION_BYTES = 16 * 1024
_ENDPOINT = "approvals"
_QUERY = ("agent_run_id", "tenant_id", "limit")

#: a route's work for the authenticated caller: the answer's JSON content
_Work = Callable[[Principal], Awaitable[object]]


def approval_routes(gateway: Gateway, desk: ApprovalDesk) -> list[Route]:
    """The approvals API's routes, bound to the gateway's authentication and the approval desk."""

    async def answer(request: Request, work: _Work) -> Response:
        principal: Principal | None = None
        try:
            principal = gateway.authenticate(request)
            return JSONResponse(await work(principal))
        except Refusal as refusal:
            err = api_error(refusal)
            if err.status == CLIENT_CLOSED:
                raise ClientDisconnect() from None
            gateway.refused(err, _ENDPOINT, principal)
            return error_response(err)

    async def list_(request: Request) -> Response:
        async def work(principal: Principal) -> dict[str, Any]:
            q = request.query_params
            unknown = [k for k in q if k not in _QUERY]
            if unknown:
                raise ApiError(400, f"unknown query parameter {unknown[0][:100]!r}", param=unknown[0][:100],
                               code="unknown_parameter")
            raw = q.get("limit", "100")
            if not raw.isdigit():
                raise ApiError(400, "limit must be an integer", param="limit", code="invalid_value")
            data = await desk.list_pending(principal, tenant_id=q.get("tenant_id") or None,
                                           run_id=q.get("agent_run_id") or None, limit=int(raw[:6]))
            return {"object": "list", "data": data}
        return await answer(request, work)

    async def get(request: Request) -> Response:
        return await answer(request, lambda principal: desk.get(principal, request.path_params["approval_id"]))

    def decider(approve: bool) -> Callable[[Request], Awaitable[Response]]:
        async def decide(request: Request) -> Response:
            async def work(principal: Principal) -> dict[str, Any]:
                data = await read_json_object(request, MAX_DECISION_BYTES,
                                              timeout_s=gateway.settings.body_read_timeout_s, allow_empty=True)
                unknown = [k for k in data if k != "reason"]
                if unknown:
                    raise ApiError(400, f"unknown field {unknown[0][:100]!r}; a decision takes only 'reason'",
                                   param=unknown[0][:100], code="unknown_parameter")
                reason = data.get("reason", "")
                if not isinstance(reason, str):
                    raise ApiError(400, f"reason must be a string, got {json_type(reason)}", param="reason",
                                   code="invalid_value")
                return await desk.decide(principal, request.path_params["approval_id"], approve=approve,
                                         reason=reason)
            return await answer(request, work)
        return decide

    return [Route("/v1/approvals", list_, methods=["GET"]),
            Route("/v1/approvals/{approval_id}", get, methods=["GET"]),
            Route("/v1/approvals/{approval_id}/approve", decider(True), methods=["POST"]),
            Route("/v1/approvals/{approval_id}/reject", decider(False), methods=["POST"])]
