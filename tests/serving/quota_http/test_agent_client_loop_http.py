"""An agent's client loop on the real OpenAI Python SDK against ``kvmeter serve``: the approval
pattern of the OpenAI Agents SDK (a tool marked ``needs_approval`` interrupts the run; the
application approves or rejects; the run resumes) with the decision held by the gateway.

The loop below is the equivalent written with ``openai.AsyncOpenAI`` (the Agents SDK's own tool
loop through kvmeter, on the real engine, is ``tests/serving/gateway/test_agent_clients.py``): model calls through
``chat.completions`` with the run id in ``X-Agent-Run-Id``, tool calls through the report
endpoint (the permit), decisions through the approvals API. Here the loop plays the model's tool
choice itself (the calls are reported, not emitted); ``test_agent_emitted_http.py`` runs the same
pattern from tool calls the model emits (a scripted instant engine through vLLM's hermes parser).
"""

from __future__ import annotations

import openai
import pytest

from tests.serving.quota_http.conftest import MODEL, tenants

CFG = tenants("""
acme:
  tool_policy:
    risk: {"deploy_*": high_risk, "search_*": read_only}
  approvers: [acme-ops]
  workspaces:
    ws:
      projects:
        bot:
          api_keys:
            acme-agent: {key: sk-test-agent-0001}
        ops:
          api_keys:
            acme-ops: {key: sk-test-opsop-0001}
""")
AGENT, OPS = "sk-test-agent-0001", "sk-test-opsop-0001"
RUN = "sdk-run-1"


class Interrupted(Exception):
    """The run waits for an approval (the Agents SDK's ``result.interruptions``)."""

    def __init__(self, approval_id: str) -> None:
        super().__init__(approval_id)
        self.approval_id = approval_id


async def call_tool(agent: openai.AsyncOpenAI, name: str, arguments: str, approval_id: str = "") -> dict:
    """Ask the gateway for the permit of one tool call; raise :class:`Interrupted` while it waits."""
    body = {"tool": name, "arguments": arguments, **({"approval_id": approval_id} if approval_id else {})}
    answer = await agent.post(f"/agent_runs/{RUN}/tool_calls", body=body, cast_to=object)
    if answer["decision"] == "pending_approval":
        raise Interrupted(answer["approval_id"])
    return answer


def tool_result(text: str) -> dict:
    """A tool's result for the next model call, as a user message (the calls here are not the
    model's, so there is no ``tool_call_id`` to answer)."""
    return {"role": "user", "content": f"tool result: {text}"}


async def model_turn(agent: openai.AsyncOpenAI, messages: list[dict]) -> str:
    reply = await agent.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                                extra_headers={"X-Agent-Run-Id": RUN})
    return reply.choices[0].message.content or ""


async def test_approval_flow_from_the_openai_sdk(serve):
    s = await serve(CFG)
    agent = openai.AsyncOpenAI(base_url=f"{s.base_url}/v1", api_key=AGENT)  # default retries (2) kept on
    ops = openai.AsyncOpenAI(base_url=f"{s.base_url}/v1", api_key=OPS)
    messages = [{"role": "user", "content": "ship checkout 1.4.2"}]
    messages.append({"role": "assistant", "content": await model_turn(agent, messages)})
    # the "model" picks a read-only tool: permitted at once
    found = await call_tool(agent, "search_releases", '{"service": "checkout"}')
    assert found["decision"] == "allowed"
    messages.append(tool_result("1.4.2 is green"))
    # then a high-risk one: the run is interrupted, waiting for an approver
    deploy_args = '{"service": "checkout", "version": "1.4.2"}'
    with pytest.raises(Interrupted) as pending:
        await call_tool(agent, "deploy_service", deploy_args)
    approval_id = pending.value.approval_id
    # while it waits, the run's model calls are refused with the approval id, and not retried
    with pytest.raises(openai.ConflictError) as waiting:
        await model_turn(agent, messages)
    assert waiting.value.code == "approval_pending"
    assert waiting.value.body["approval_id"] == approval_id
    # the application side: list the interruptions, approve
    listed = await ops.get("/approvals", cast_to=object)
    assert [a["approval_id"] for a in listed["data"]] == [approval_id]
    approved = await ops.post(f"/approvals/{approval_id}/approve", body={"reason": "release train"}, cast_to=object)
    assert approved["status"] == "approved"
    # resume: the same call gets its one permit; the tool runs; the model continues
    permit = await call_tool(agent, "deploy_service", deploy_args, approval_id=approval_id)
    assert permit["decision"] == "allowed" and permit["approval"]["status"] == "consumed"
    messages.append(tool_result("deployed"))
    messages.append({"role": "assistant", "content": await model_turn(agent, messages)})
    # a second high-risk call is rejected: the loop hands the reason back to the model
    with pytest.raises(Interrupted) as second:
        await call_tool(agent, "deploy_database", '{"migration": "drop users"}')
    await ops.post(f"/approvals/{second.value.approval_id}/reject", body={"reason": "not in a release"},
                   cast_to=object)
    with pytest.raises(openai.PermissionDeniedError) as rejected:
        await call_tool(agent, "deploy_database", '{"migration": "drop users"}')
    assert rejected.value.code == "approval_rejected" and rejected.value.body["reason"] == "not in a release"
    messages.append(tool_result("rejected: not in a release"))
    assert await model_turn(agent, messages)
    # the SDK did not retry the 409 (x-should-retry: false): one refused attempt in the ledger
    refused = [a for a in s.attempts(agent_run_id=RUN) if a["status"] == "rejected"]
    assert [(a["reason"], a["status_code"]) for a in refused] == [("approval_pending", 409)]
    decisions = s.rows("SELECT tool, decision FROM tool_calls FINAL WHERE agent_run_id = {r:String}", r=RUN)
    assert sorted((d["tool"], d["decision"]) for d in decisions) == [
        ("deploy_database", "approval_rejected"), ("deploy_database", "pending_approval"),
        ("deploy_service", "allowed"), ("deploy_service", "pending_approval"), ("search_releases", "allowed")]
    await agent.close()
    await ops.close()
