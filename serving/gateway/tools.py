"""Agent runs report their tool calls here, so run budgets (max tool calls) can stop a runaway run.

``POST /v1/agent_runs/{run_id}/tool_calls`` with ``{"count": n}`` (default 1), authenticated with
the run's API key. The answer is the run's total and whether it is now over its budget; a run over
budget has its *next model call* refused (``run_budget_exceeded`` / ``tool_calls``).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmeter.serving.gateway.body import read_json_object
from kvmeter.serving.gateway.errors import ApiError, error_response
from kvmeter.serving.gateway.handler import Gateway
from kvmeter.serving.quota import HierarchicalQuota, QuotaRejected

__all__ = ["tool_call_routes"]


def tool_call_routes(gateway: Gateway, quota: HierarchicalQuota) -> list[Route]:
    """The tool-call report route, bound to the gateway's authentication and the quota."""

    async def report(request: Request) -> Response:
        try:
            principal = gateway.authenticate(request)
            data = await read_json_object(request, 4096) if await request.body() else {}
            count = data.get("count", 1)
            if not isinstance(count, int) or isinstance(count, bool):
                raise ApiError(400, "count must be an integer", param="count", code="invalid_value")
            result = await quota.report_tool_call(principal, request.path_params["run_id"], count)
        except ApiError as err:
            return error_response(err)
        except QuotaRejected as rej:
            return error_response(ApiError(rej.status_code, rej.message, code=rej.reason,
                                           headers=rej.headers,
                                           extra={"level": rej.level, "dimension": rej.dimension}))
        return JSONResponse({"agent_run_id": result.agent_run_id, "tool_calls": result.tool_calls,
                             "max_tool_calls": result.max_tool_calls, "exceeded": result.exceeded})

    return [Route("/v1/agent_runs/{run_id}/tool_calls", report, methods=["POST"])]
