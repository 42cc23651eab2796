"""Agent runs report their tool calls here: the permit to execute a call, under the key's tool
policy, approvals, side-effect idempotency, loop stops and the run's ``max_tool_calls``.

``POST /v1/agent_runs/{run_id}/tool_calls``, authenticated with the run's API key. Two forms:

**A named tool call** — ``{"tool": "send_email", "arguments": {...} | "<JSON text>",
"idempotency_key": "...", "approval_id": "...", "call_id": "call_..."}`` (``tool`` required; the
others optional; ``Idempotency-Key`` may be sent as a header instead of ``idempotency_key``).
Decided by :meth:`kvmeter.serving.agents.AgentRuns.report_tool_call` (the order of the checks is
in :mod:`kvmeter.serving.agents.store`); the answer is::

    200 {"decision": "allowed", "tool_call_id": "...", "risk_class": "side_effect", "replayed": false,
         "tool_calls": 3, "max_tool_calls": 10, "policy_version": "...", "arguments_sha256": "...", ...}
    200 {"decision": "replayed", "tool_call_id": <the first permit's>, "replayed": true, ...}
         (+ header x-kvmeter-idempotent-replay: true) — the same side-effect call again: do not
         execute it a second time
    202 {"decision": "pending_approval", "approval_id": "...", "approval": {...}}
         (+ header location: /v1/approvals/{id}) — a high-risk call waits for an approver; report
         it again (optionally with its approval_id) once approved: that report gets the permit
    403 tool_blocked / tool_not_allowed (body: tool, rule) · 403 approval_rejected (approval_id, reason)
    404 approval_not_found · 409 approval_mismatch / approval_used / approval_expired
    409 agent_run_stopped (reason, detail) · 422 idempotency_key_reused
    429 run_budget_exceeded (level agent_run, dimension tool_calls) · 503 agent_store_unavailable

  (the codes are :mod:`kvmeter.serving.agents.errors`'; every 409 and the 429 carry
  ``x-should-retry: false``).

**A count** (the original form, no tool named) — ``{"count": n}`` (default 1; an empty body counts
one call): counts ``n`` calls against the run's budget without policy; the answer is the run's
total and whether it is now over its budget, whose *next model call* is then refused
(``run_budget_exceeded`` / ``tool_calls``).

Input checks (each an OpenAI-style error; nothing is counted or decided for a refused report):

* 401 without a valid API key;
* 415 for an explicit non-JSON Content-Type, 413 for a body over 128 KiB, 408 for a body that
  does not arrive within the gateway's ``body_read_timeout_s``, 400 ``invalid_json`` for a body
  that is not a JSON object;
* 400 ``unknown_parameter`` for any other field (a misspelt ``"cnt": 5`` would otherwise count
  one call);
* 400 ``invalid_value`` (``param`` ``count``) for a ``count`` that is not an integer (``true``,
  ``1.0``, ``"3"``, ``null``); 400 ``invalid_request`` (``param`` ``count``, ``dimension``
  ``tool_calls``) for one outside 1–10,000 (the quota's range), or other than 1 with a ``tool``;
* 400 ``invalid_value`` for a malformed ``tool``, ``arguments`` (not JSON, NaN), ids over 255
  characters, or an ``Idempotency-Key`` header that differs from the body's ``idempotency_key``;
* 400 ``invalid_request`` (``param`` ``run_id``) for a run id that is missing
  (``/v1/agent_runs//tool_calls``), over 256 characters, or has spaces or unprintable characters.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmeter.errors import Refusal
from kvmeter.serving.agents import AgentRefusal, AgentRuns
from kvmeter.serving.gateway.body import CLIENT_CLOSED, json_type, read_json_object, single_header
from kvmeter.serving.gateway.errors import ApiError, api_error, error_response
from kvmeter.serving.gateway.handler import Gateway
from kvmeter.serving.quota import HierarchicalQuota, QuotaRejected

__all__ = ["tool_call_routes", "MAX_REPORT_BYTES"]

#: Largest tool-call report body (bytes): arguments up to 64 Ki characters, JSON-escaped.
MAX_REPORT_BYTES = 128 * 1024
_FIELDS = ("count", "tool", "arguments", "idempotency_key", "approval_id", "call_id")
_ENDPOINT = "agent_runs.tool_calls"


def _string(data: dict[str, Any], name: str) -> str:
    value = data.get(name, "")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ApiError(400, f"{name} must be a string, got {json_type(value)}", param=name, code="invalid_value")
    return value


def tool_call_routes(gateway: Gateway, quota: HierarchicalQuota, agents: AgentRuns | None = None) -> list[Route]:
    """The tool-call report route, bound to the gateway's authentication, the quota and (for
    named tool calls) the agent-run policy; without ``agents`` a named call is refused 400."""

    async def report(request: Request) -> Response:
        principal = None
        try:
            principal = gateway.authenticate(request)
            run_id = request.path_params.get("run_id", "")
            if not run_id:
                raise ApiError(400, "the agent run id is missing: POST /v1/agent_runs/{run_id}/tool_calls",
                               param="run_id", code="invalid_request")
            header_key = single_header(request, "idempotency-key", "Idempotency-Key", code="invalid_idempotency_key")
            data = await read_json_object(request, MAX_REPORT_BYTES,
                                          timeout_s=gateway.settings.body_read_timeout_s, allow_empty=True)
            unknown = [k for k in data if k not in _FIELDS]
            if unknown:
                name = unknown[0][:100]
                raise ApiError(400, f"unknown field {name!r}; a tool-call report takes only "
                                    f"{', '.join(repr(f) for f in _FIELDS)}", param=name, code="unknown_parameter")
            count = data.get("count", 1)
            if type(count) is not int:  # a JSON true is not 1, nor 1.0
                raise ApiError(400, f"count must be an integer, got {json_type(count)}", param="count",
                               code="invalid_value")
            if "tool" in data:
                return await _named(request, principal, run_id, data, count, header_key)
            result = await quota.report_tool_call(principal, run_id, count)
        except Refusal as refusal:
            param = None
            if isinstance(refusal, QuotaRejected) and refusal.status_code == 400:
                # the quota checks the range of count and the run id's form; name the field it means
                if refusal.dimension == "tool_calls":
                    param = "count"
                elif refusal.level == "agent_run":
                    param = "run_id"
            err = api_error(refusal, param=param)
            if err.status == CLIENT_CLOSED:  # left mid-body: the app logs it; nothing to answer
                raise ClientDisconnect() from None
            if not isinstance(refusal, AgentRefusal) or refusal.status_code in (400, 503):
                gateway.refused(err, _ENDPOINT, principal)  # policy decisions are counted as tool calls
            return error_response(err)
        return JSONResponse({"agent_run_id": result.agent_run_id, "tool_calls": result.tool_calls,
                             "max_tool_calls": result.max_tool_calls, "exceeded": result.exceeded})

    async def _named(request: Request, principal: Any, run_id: str, data: dict[str, Any], count: int,
                     header_key: str) -> Response:
        if agents is None:
            raise ApiError(400, "this gateway decides no named tool calls (no agent-run policy is wired)",
                           param="tool", code="invalid_request")
        if count != 1:
            raise QuotaRejected("a named tool call reports exactly one call (count must be 1)", status_code=400,
                                reason="invalid_request", level="agent_run", dimension="tool_calls")
        tool = data.get("tool")
        if not isinstance(tool, str):
            raise ApiError(400, f"tool must be a string, got {json_type(tool)}", param="tool", code="invalid_value")
        body_key = _string(data, "idempotency_key")
        if header_key and body_key and header_key != body_key:
            raise ApiError(400, "the Idempotency-Key header and the body's idempotency_key differ",
                           param="idempotency_key", code="invalid_value")
        decision = await agents.report_tool_call(
            principal, run_id, tool, data.get("arguments"), idempotency_key=body_key or header_key,
            approval_id=_string(data, "approval_id"), call_id=_string(data, "call_id"))
        headers: dict[str, str] = {}
        if decision.decision == "replayed":
            headers["x-kvmeter-idempotent-replay"] = "true"
        if decision.decision == "pending_approval" and decision.approval is not None:
            headers["location"] = f"/v1/approvals/{decision.approval.approval_id}"
        return JSONResponse(decision.to_dict(gateway.clock.wall()), status_code=decision.status_code, headers=headers)

    return [Route("/v1/agent_runs/{run_id}/tool_calls", report, methods=["POST"]),
            # an empty run id ("/v1/agent_runs/" + "" + "/tool_calls"): a 400 naming it, not "no route"
            Route("/v1/agent_runs//tool_calls", report, methods=["POST"])]
