"""Agent runs report their tool calls here, so run budgets (max tool calls) can stop a runaway run.

``POST /v1/agent_runs/{run_id}/tool_calls`` with ``{"count": n}`` (default 1; an empty body counts
one call), authenticated with the run's API key. The answer is the run's total and whether it is
now over its budget; a run over budget has its *next model call* refused
(``run_budget_exceeded`` / ``tool_calls``).

Input checks (each an OpenAI-style error; nothing is counted for a refused report):

* 401 without a valid API key;
* 415 for an explicit non-JSON Content-Type, 413 for a body over 4,096 bytes, 408 for a body that
  does not arrive within the gateway's ``body_read_timeout_s``, 400 ``invalid_json`` for a body
  that is not a JSON object;
* 400 ``unknown_parameter`` for any field but ``count`` (a misspelt ``"cnt": 5`` would otherwise
  count one call);
* 400 ``invalid_value`` (``param`` ``count``) for a ``count`` that is not an integer (``true``,
  ``1.0``, ``"3"``, ``null``); 400 ``invalid_request`` (``param`` ``count``, ``dimension``
  ``tool_calls``) for one outside 1–10,000 (the quota's range);
* 400 ``invalid_request`` (``param`` ``run_id``) for a run id that is missing
  (``/v1/agent_runs//tool_calls``), over 256 characters, or has spaces or unprintable characters.
"""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmeter.errors import Refusal
from kvmeter.serving.gateway.body import CLIENT_CLOSED, json_type, read_json_object
from kvmeter.serving.gateway.errors import ApiError, api_error, error_response
from kvmeter.serving.gateway.handler import Gateway
from kvmeter.serving.quota import HierarchicalQuota, QuotaRejected

__all__ = ["tool_call_routes", "MAX_REPORT_BYTES"]

#: Largest tool-call report body (bytes).
MAX_REPORT_BYTES = 4096
_FIELDS = ("count",)
_ENDPOINT = "agent_runs.tool_calls"


def tool_call_routes(gateway: Gateway, quota: HierarchicalQuota) -> list[Route]:
    """The tool-call report route, bound to the gateway's authentication and the quota."""

    async def report(request: Request) -> Response:
        principal = None
        try:
            principal = gateway.authenticate(request)
            run_id = request.path_params.get("run_id", "")
            if not run_id:
                raise ApiError(400, "the agent run id is missing: POST /v1/agent_runs/{run_id}/tool_calls",
                               param="run_id", code="invalid_request")
            data = await read_json_object(request, MAX_REPORT_BYTES,
                                          timeout_s=gateway.settings.body_read_timeout_s, allow_empty=True)
            unknown = [k for k in data if k not in _FIELDS]
            if unknown:
                name = unknown[0][:100]
                raise ApiError(400, f"unknown field {name!r}; a tool-call report takes only 'count'",
                               param=name, code="unknown_parameter")
            count = data.get("count", 1)
            if type(count) is not int:  # a JSON true is not 1, nor 1.0
                raise ApiError(400, f"count must be an integer, got {json_type(count)}", param="count",
                               code="invalid_value")
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
            gateway.refused(err, _ENDPOINT, principal)
            return error_response(err)
        return JSONResponse({"agent_run_id": result.agent_run_id, "tool_calls": result.tool_calls,
                             "max_tool_calls": result.max_tool_calls, "exceeded": result.exceeded})

    return [Route("/v1/agent_runs/{run_id}/tool_calls", report, methods=["POST"]),
            # an empty run id ("/v1/agent_runs/" + "" + "/tool_calls"): a 400 naming it, not "no route"
            Route("/v1/agent_runs//tool_calls", report, methods=["POST"])]
