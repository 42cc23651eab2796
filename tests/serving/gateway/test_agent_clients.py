"""Agent frameworks as clients of kvmeter on the real vLLM CPU engine (issue 13 item 4):
langchain-openai's ``ChatOpenAI.bind_tools`` and the OpenAI Agents SDK (``openai-agents``), each
running a tool loop — a tool call parsed by vLLM's serving layer (tool-call parser ``hermes``),
its result sent back, a final message — with every model call billed as the engine counted it,
and the Agents SDK's run seen by the agent-run budget (the quota's run counters) and the ledger's
run rollup (``/v1/usage/agent_runs``) through ``X-Agent-Run-Id``.

SmolLM2-135M picks tools poorly; the prompts below are the ones it answers with a well-formed
call at ``tool_choice="required"`` (measured here, identically on vLLM's own server).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

import httpx
import openai
import pytest

from kvmeter.stats import EngineRequestStats
from tests.serving.gateway.conftest import KEYS, auth

pytestmark = [pytest.mark.engine]

ASK = "What is the weather like in Paris today?"


@pytest.fixture
def engine_records(stack):
    seen: list[EngineRequestStats] = []
    unsubscribe = stack.runtime.bus.subscribe(EngineRequestStats, seen.append)
    yield seen
    unsubscribe()


def _billed_as_engine(stack, request_id: str, records, input_tokens: int, output_tokens: int) -> None:
    [row] = stack.usage(request_id)
    assert (row["input_tokens"], row["output_tokens"]) == (input_tokens, output_tokens)
    assert row["outcome"] == "ok" and row["token_source"] == "engine_hooks"
    [engine] = [r for r in records if r.request_id == request_id]
    assert (engine.tokens.input_tokens, engine.tokens.output_tokens) == (input_tokens, output_tokens)


async def test_langchain_bind_tools_loop_is_billed_as_the_engine_counted(stack, engine_records):
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def search_weather(city: str) -> str:
        """Get the current weather in a city."""
        return json.dumps({"city": city, "temperature_c": 21, "sky": "sunny"})

    @tool
    def search_time(city: str) -> str:
        """Get the current local time in a city."""
        return json.dumps({"city": city, "time": "14:05"})

    tools = [search_weather, search_time]
    llm = ChatOpenAI(model=stack.model, base_url=f"{stack.base_url}/v1", api_key=KEYS["acme"], temperature=0,
                     max_tokens=128, max_retries=0, timeout=300, include_response_headers=True)
    messages = [SystemMessage('You answer questions about cities. To call a tool, write <tool_call>{"name": '
                              '"search_weather", "arguments": {"city": "Rome"}}</tool_call>'), HumanMessage(ASK)]
    call = await llm.bind_tools(tools, tool_choice="any").ainvoke(messages)  # "any": OpenAI's "required"
    [tool_call] = call.tool_calls
    assert tool_call["name"] in ("search_weather", "search_time") and isinstance(tool_call["args"], dict)
    result = {"search_weather": search_weather, "search_time": search_time}[tool_call["name"]].invoke(tool_call)
    assert isinstance(result, ToolMessage) and result.tool_call_id == tool_call["id"]
    final = await llm.bind_tools(tools, tool_choice="none").ainvoke([*messages, call, result])
    assert final.content and not final.tool_calls
    assert final.usage_metadata["input_tokens"] > call.usage_metadata["input_tokens"]  # the result is prompt
    for message in (call, final):
        rid = message.response_metadata["headers"]["x-kvmeter-request-id"]
        usage = message.usage_metadata
        _billed_as_engine(stack, rid, engine_records, usage["input_tokens"], usage["output_tokens"])


async def test_openai_agents_two_tool_loop_is_one_agent_run(stack, engine_records):
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                        set_tracing_disabled)

    set_tracing_disabled(True)  # the SDK's tracing exports to OpenAI's servers
    run_id = f"agents-sdk-{datetime.now(timezone.utc):%H%M%S%f}"
    called: list[tuple[str, str]] = []
    gateway = httpx.AsyncClient(base_url=stack.base_url, headers=auth("acme"), timeout=60)

    async def permit(tool: str, city: str) -> None:
        """The gateway's permit for one tool call (acme's search_* tools are read-only)."""
        answer = await gateway.post(f"/v1/agent_runs/{run_id}/tool_calls",
                                    json={"tool": tool, "arguments": {"city": city}})
        assert answer.status_code == 200 and answer.json()["decision"] == "allowed", answer.text
        called.append((tool, city))

    @function_tool
    async def search_weather(city: str) -> str:
        """Get the current weather in a city."""
        await permit("search_weather", city)
        return json.dumps({"city": city, "temperature_c": 21, "sky": "sunny"})

    @function_tool
    async def search_time(city: str) -> str:
        """Get the current local time in a city."""
        await permit("search_time", city)
        return json.dumps({"city": city, "time": "14:05"})

    client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key=KEYS["acme"], max_retries=0, timeout=300,
                                default_headers={"X-Agent-Run-Id": run_id})
    agent = Agent(name="assistant", instructions="You answer questions about cities with the tools.",
                  tools=[search_weather, search_time],
                  model=OpenAIChatCompletionsModel(model=stack.model, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=128))
    try:
        result = await Runner.run(agent, ASK, max_turns=4)
    finally:
        await gateway.aclose()
    # one tool call, its result sent back (the SDK resets tool_choice after a call), a final message
    assert len(called) == 1 and called[0][1]
    assert isinstance(result.final_output, str) and result.final_output
    assert len(result.raw_responses) == 2

    rows = stack.rows("SELECT * FROM usage_events FINAL WHERE agent_run_id = {r:String} ORDER BY arrival_ts",
                      r=run_id)
    assert len(rows) == 2 and all(r["tenant_id"] == "acme" and r["outcome"] == "ok" for r in rows)
    sdk = [(u.input_tokens, u.output_tokens) for u in result.context_wrapper.usage.request_usage_entries]
    assert [(r["input_tokens"], r["output_tokens"]) for r in rows] == sdk
    for row in rows:
        _billed_as_engine(stack, row["request_id"], engine_records, row["input_tokens"], row["output_tokens"])

    # the agent-run budget counted the run: two model calls, one tool call (the permit)
    principal = stack.runtime.directory.authenticate(KEYS["acme"])
    counters = await stack.runtime.quota.run_usage(principal, run_id)
    assert (counters.model_calls, counters.tool_calls) == (2, 1)
    # and the ledger's run rollup, through the read API
    assert stack.ledger.flush(30.0)
    stack.ledger.refresh_rollups()
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as c:
        answer = await c.get("/v1/usage/agent_runs", headers=auth("acme"),
                             params={"period": f"{datetime.now(timezone.utc):%Y-%m}", "agent_run_id": run_id})
    assert answer.status_code == 200, answer.text
    [run] = answer.json()
    assert (run["model_calls"], run["tool_calls"]) == (2, 1)
    assert run["tool_calls_by_tool"] == {called[0][0]: 1}
    assert run["input_tokens"] == sum(p for p, _ in sdk)
