"""The tool policy where tools cross the chat path, on a real ``kvmeter serve`` (uvicorn on
loopback, vLLM's OpenAI serving layer over the instant engine, chDB ledger) through the official
``openai`` SDK: declared tools refused with 403 before any quota is reserved; tool calls the model
emits (vLLM's hermes parser over a scripted answer, streamed token by token) withheld when blocked
or high-risk, with the refusal in their place, a metric and a ledger record; the approval flow
from the model's own tool call (the Agents SDK pattern: interrupted, approved, resumed); the
repeated-prompt stop on the rendered prompt's digest.
"""

from __future__ import annotations

import json

import openai
import pytest

from kvmeter.serving.engines.instant import InstantEngine
from tests.serving.quota_http.conftest import MODEL, tenants
from tests.serving.quota_http.test_agent_policy_http import metric

CFG = tenants("""
acme:
  tool_policy:
    block: ["shell_*"]
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
""", extra_top="tiers: {paid_interactive: {loop_stops: {max_repeated_prompts: 2}}}")
AGENT, OPS = "sk-test-agent-0001", "sk-test-opsop-0001"


def fn(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}, "version": {"type": "string"}}}}}


TOOLS = [fn("search_web"), fn("deploy_service")]


def hermes(*calls: tuple[str, dict], text: str = "") -> str:
    """A hermes-format answer: ``text`` then one ``<tool_call>`` per call."""
    return text + "".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>' for n, a in calls)


class Script:
    """What the instant engine answers next (the model's "choice" of tool calls)."""

    def __init__(self) -> None:
        self.text: str | None = None

    def __call__(self, request) -> str | None:
        return self.text


@pytest.fixture
async def stack(serve, tokenizer):
    script = Script()

    async def start(quota_store: str = "memory://"):
        engine = InstantEngine(tokenizer, MODEL, max_model_len=4096, reply=script)
        s = await serve(CFG, engine=engine, quota_store=quota_store)
        s.script, s.engine = script, engine
        s.sdk = openai.AsyncOpenAI(base_url=f"{s.base_url}/v1", api_key=AGENT, max_retries=0)
        return s

    return start


def ask(content: str = "ship checkout 1.4.2") -> list[dict]:
    return [{"role": "user", "content": content}]


def emitted_rows(s, run: str = "") -> list[tuple]:
    rows = s.rows("SELECT tool, decision, reason, rule, agent_run_id FROM tool_calls FINAL "
                  "WHERE source = 'emitted' ORDER BY ts, tool")
    return [(r["tool"], r["decision"], r["reason"], r["rule"]) for r in rows if not run or r["agent_run_id"] == run]


async def test_a_declared_blocked_tool_is_a_403_naming_tool_and_rule_before_any_reservation(stack):
    s = await stack()
    with pytest.raises(openai.PermissionDeniedError) as refused:
        await s.sdk.chat.completions.create(model=MODEL, messages=ask(), max_tokens=8,
                                            tools=[fn("search_web"), fn("shell_exec")],
                                            extra_headers={"X-Agent-Run-Id": "run-d"})
    err = refused.value.body
    assert (refused.value.code, err["tool"], err["rule"], err["param"]) == (
        "tool_blocked", "shell_exec", "orgs.acme.tool_policy.block 'shell_*'", "tools")
    assert s.engine.requests_total == 0  # nothing ran, nothing was billed or reserved
    assert s.billed(tenant_id="acme") == []
    [attempt] = s.attempts(tenant_id="acme")
    assert (attempt["status_code"], attempt["reason"], attempt["agent_run_id"]) == (403, "tool_blocked", "run-d")
    rows = s.rows("SELECT tool, source, decision, rule FROM tool_calls FINAL")
    assert [(r["tool"], r["source"], r["decision"]) for r in rows] == [("shell_exec", "declared", "blocked")]
    assert await metric(s, "kvmeter_agent_tool_calls_total", source="declared", decision="blocked") == 1
    # the same request with allowed tools only runs
    ok = await s.sdk.chat.completions.create(model=MODEL, messages=ask(), max_tokens=8, tools=TOOLS)
    assert ok.choices[0].message.content and s.engine.requests_total == 1


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_an_emitted_blocked_call_is_withheld_with_the_refusal_in_its_place(stack, stream):
    s = await stack()
    s.script.text = hermes(("search_web", {"q": "release notes"}), ("shell_exec", {"q": "rm -rf /"}),
                           text="Let me look.")
    message, finish = await chat(s, stream, run="run-b")
    # the allowed call is handed over whole; the blocked one is not there at all
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("search_web", {"q": "release notes"})]
    assert finish == "tool_calls"
    assert message.content.startswith("Let me look.\nkvmeter refused this tool call:")
    assert "shell_exec" in message.content and "orgs.acme.tool_policy.block" in message.content
    assert emitted_rows(s) == [("shell_exec", "blocked", "tool_blocked", "orgs.acme.tool_policy.block 'shell_*'")]
    assert await metric(s, "kvmeter_agent_tool_calls_total", source="emitted", decision="blocked") == 1
    assert await metric(s, "kvmeter_agent_tool_calls_total", source="emitted", decision="allowed") == 1
    # the model's tokens are billed as generated, withheld call included
    [row] = s.billed(tenant_id="acme")
    assert row["output_tokens"] == len(s.engine.tokenizer.encode(s.script.text))

    # only blocked calls: no tool call is left, so the choice no longer ends in tool_calls
    s.script.text = hermes(("shell_exec", {"q": "ls"}))
    message, finish = await chat(s, stream, run="run-b2")
    assert not message.tool_calls and finish == "stop"
    assert message.content.startswith("kvmeter refused this tool call:")


async def chat(s, stream: bool, *, run: str = "", messages: list[dict] | None = None):
    """One chat call with TOOLS; the assistant message and finish reason (a stream accumulated as
    the SDK's users do: tool calls by index, content concatenated)."""
    headers = {"X-Agent-Run-Id": run} if run else {}
    kwargs = dict(model=MODEL, messages=messages or ask(), max_tokens=200, tools=TOOLS, extra_headers=headers)
    if not stream:
        reply = await s.sdk.chat.completions.create(**kwargs)
        return reply.choices[0].message, reply.choices[0].finish_reason
    content, calls, finish, deltas = "", {}, None, 0
    async for chunk in await s.sdk.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for part in delta.tool_calls or ():
                deltas += 1
                call = calls.setdefault(part.index, {"id": part.id, "name": "", "arguments": ""})
                call["name"] += part.function.name or ""
                call["arguments"] += part.function.arguments or ""
            finish = choice.finish_reason or finish
    # each handed-over call arrives in one delta, whole, once decided
    assert deltas == len(calls)
    from openai.types.chat import ChatCompletionMessage

    message = ChatCompletionMessage(role="assistant", content=content or None, tool_calls=[
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for _, c in sorted(calls.items())] or None)
    return message, finish


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_high_risk_call_without_a_run_is_refused(stack, stream):
    s = await stack()
    s.script.text = hermes(("deploy_service", {"version": "1.4.2"}))
    message, finish = await chat(s, stream)
    assert not message.tool_calls and finish == "stop"
    assert "needs an approval" in message.content and "X-Agent-Run-Id" in message.content
    assert emitted_rows(s) == [("deploy_service", "approval_refused", "approval_requires_run", "")]


async def test_approval_flow_from_the_models_own_tool_call(stack, quota_store):
    """The OpenAI Agents SDK's approval pattern with the gateway holding the decision: the model
    emits a high-risk call; the run is interrupted (the call withheld, the approval id given); the
    approver approves; the run resumes and the same call is handed over, then permitted once."""
    s = await stack(quota_store)
    ops = openai.AsyncOpenAI(base_url=f"{s.base_url}/v1", api_key=OPS, max_retries=0)
    run = "sdk-run-emitted"
    args = {"version": "1.4.2"}
    s.script.text = hermes(("deploy_service", args))
    message, finish = await chat(s, True, run=run)
    assert not message.tool_calls and finish == "stop"
    assert "waits for approval" in message.content
    [pending] = (await ops.get("/approvals", cast_to=object))["data"]
    approval_id = pending["approval_id"]
    assert approval_id in message.content
    assert (pending["tool"], pending["agent_run_id"], pending["status"]) == ("deploy_service", run, "pending")
    # while it waits, the run's next model call is refused with the approval id (409, not retried)
    with pytest.raises(openai.ConflictError) as waiting:
        await chat(s, False, run=run, messages=ask("any news?"))
    assert (waiting.value.code, waiting.value.body["approval_id"]) == ("approval_pending", approval_id)
    await ops.post(f"/approvals/{approval_id}/approve", body={"reason": "release train"}, cast_to=object)
    # resumed: the model emits the same call; it is handed over now, bound to the approval
    message, finish = await chat(s, False, run=run, messages=ask("go on"))
    [call] = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments), finish) == ("deploy_service", args, "tool_calls")
    permit = await s.sdk.post(f"/agent_runs/{run}/tool_calls", cast_to=object, body={
        "tool": call.function.name, "arguments": call.function.arguments, "call_id": call.id,
        "approval_id": approval_id})
    assert (permit["decision"], permit["approval"]["status"]) == ("allowed", "consumed")
    # other arguments are a new high-risk call: withheld again, a new approval
    s.script.text = hermes(("deploy_service", {"version": "9.9.9"}))
    message, _ = await chat(s, False, run=run, messages=ask("and the next one"))
    assert not message.tool_calls and "waits for approval" in message.content and approval_id not in message.content
    assert [r[:2] for r in emitted_rows(s, run)] == [("deploy_service", "pending_approval"),
                                                     ("deploy_service", "pending_approval")]
    refused = [a for a in s.attempts(agent_run_id=run) if a["status"] == "rejected"]
    assert [(a["reason"], a["status_code"]) for a in refused] == [("approval_pending", 409)]
    await ops.close()


async def test_the_same_rendered_prompt_again_and_again_stops_the_run(stack):
    s = await stack()
    run = "loop-run"
    for _ in range(2):  # max_repeated_prompts: 2
        await chat(s, False, run=run, messages=ask("same thing"))
    await chat(s, False, run="another-run", messages=ask("same thing"))  # another run counts apart
    with pytest.raises(openai.ConflictError) as stopped:
        await chat(s, False, run=run, messages=ask("same thing"))
    body = stopped.value.body
    assert (stopped.value.code, body["reason"]) == ("agent_run_stopped", "repeated_prompt")
    # stopped for good: a new prompt is refused too, with no engine call
    ran = s.engine.requests_total
    with pytest.raises(openai.ConflictError):
        await chat(s, False, run=run, messages=ask("something new"))
    assert s.engine.requests_total == ran
    [stop] = s.rows("SELECT reason FROM agent_run_stops FINAL WHERE agent_run_id = {r:String}", r=run)
    assert stop["reason"] == "repeated_prompt"
    assert await metric(s, "kvmeter_agent_stopped_runs_total", reason="repeated_prompt") == 1


async def test_a_prompt_that_changes_keeps_the_run_going(stack):
    s = await stack()
    for i in range(5):
        await chat(s, False, run="progress", messages=ask(f"step {i}"))
    assert s.engine.requests_total == 5
