"""The official ``openai`` SDK against kvmeter on the real vLLM CPU engine: every shape vLLM's
serving layer answers — sync and async chat, streaming with ``include_usage``, a tool loop that
sends the tool result back, ``n=2``, logprobs, ``response_format`` ``json_schema``, completions
with ``echo`` and a prompt list — and for each, the ledger's usage equals the SDK's usage, counted
by the engine (its finished stats, merged into one engine record per request).
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from kvmeter.stats import EngineRequestStats
from tests.serving.gateway.conftest import KEYS

pytestmark = [pytest.mark.engine]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture
def engine_records(stack):
    """The engine records published while the test runs (the ledger's engine view)."""
    seen: list[EngineRequestStats] = []
    unsubscribe = stack.runtime.bus.subscribe(EngineRequestStats, seen.append)
    yield seen
    unsubscribe()


def _client(stack, tenant: str = "acme") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key=KEYS[tenant], max_retries=0, timeout=300)


def _billed(stack, request_id: str, usage, records: list[EngineRequestStats] | None = None) -> dict:
    """The one ledger row of ``request_id``: its tokens are the SDK's ``usage``, counted by the
    engine; with ``records``, exactly one engine record of the request carries the same counts."""
    [row] = stack.usage(request_id)
    assert (row["input_tokens"], row["output_tokens"]) == (usage.prompt_tokens, usage.completion_tokens)
    assert row["outcome"] == "ok" and row["token_source"] == "engine_hooks"
    if records is not None:
        [engine] = [r for r in records if r.request_id == request_id]
        assert (engine.tokens.input_tokens, engine.tokens.output_tokens) == (
            usage.prompt_tokens, usage.completion_tokens)
        assert engine.attribution.tenant_id == row["tenant_id"]  # stamped on the merged engine record
    return row


async def test_sync_chat_usage_is_what_the_ledger_bills(stack, engine_records):
    sync = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=KEYS["acme"], max_retries=0, timeout=300)

    def call():
        return sync.chat.completions.with_raw_response.create(
            model=stack.model, messages=ASK, max_tokens=12, temperature=0)

    raw = await asyncio.to_thread(call)  # the server runs on this event loop
    completion = raw.parse()
    assert completion.object == "chat.completion" and completion.choices[0].message.content
    assert completion.id.startswith("chatcmpl-") and completion.system_fingerprint
    rid = raw.headers["x-kvmeter-request-id"]
    assert raw.headers["x-request-id"] == rid  # none sent: kvmeter's own, as vLLM sends a new one
    _billed(stack, rid, completion.usage, engine_records)


async def test_async_stream_with_include_usage_is_billed_as_its_usage_chunk(stack, engine_records):
    client = _client(stack, "globex")
    async with client.chat.completions.with_streaming_response.create(
            model=stack.model, messages=ASK, max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True}) as resp:
        rid = resp.headers["x-kvmeter-request-id"]
        chunks = [c async for c in await resp.parse()]
    assert chunks[0].choices[0].delta.role == "assistant"
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and chunks[-1].choices == []
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    row = _billed(stack, rid, chunks[-1].usage, engine_records)
    assert row["stream"] is True and row["itl_mean_s"] > 0


async def test_tool_loop_required_call_then_the_result_then_a_message(stack):
    client = _client(stack)
    first = await client.chat.completions.with_raw_response.create(
        model=stack.model, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=48, temperature=0)
    call = first.parse()
    [tool_call] = call.choices[0].message.tool_calls
    assert tool_call.function.name == "get_weather"
    json.loads(tool_call.function.arguments)  # JSON, as the schema vLLM's structured outputs enforce
    assert call.choices[0].finish_reason == "tool_calls"
    _billed(stack, first.headers["x-kvmeter-request-id"], call.usage)  # tool-call tokens are output tokens

    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [tool_call.model_dump()]},
            {"role": "tool", "tool_call_id": tool_call.id, "content": json.dumps({"temperature_c": 21})}]
    second = await client.chat.completions.with_raw_response.create(
        model=stack.model, messages=turn, tools=[WEATHER], tool_choice="none", max_tokens=24, temperature=0)
    answer = second.parse()
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    # the tool result is part of the prompt the engine counted
    assert answer.usage.prompt_tokens > call.usage.prompt_tokens
    _billed(stack, second.headers["x-kvmeter-request-id"], answer.usage)


async def test_n2_bills_every_choice_and_the_prompt_once(stack, engine_records):
    client = _client(stack)
    raw = await client.chat.completions.with_raw_response.create(
        model=stack.model, messages=ASK, n=2, max_tokens=8, temperature=1.0, seed=42, extra_body={"top_k": 1})
    completion = raw.parse()
    assert [c.index for c in completion.choices] == [0, 1]
    outputs = completion.usage.completion_tokens
    assert outputs == 16  # 2 × 8: two sequences, neither stopped early at top_k=1 on this prompt
    row = _billed(stack, raw.headers["x-kvmeter-request-id"], completion.usage, engine_records)
    assert row["reserved_output_tokens"] == 16  # n × max_tokens reserved


async def test_logprobs_and_top_logprobs(stack):
    client = _client(stack)
    raw = await client.chat.completions.with_raw_response.create(
        model=stack.model, messages=ASK, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    completion = raw.parse()
    content = completion.choices[0].logprobs.content
    assert len(content) == completion.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    _billed(stack, raw.headers["x-kvmeter-request-id"], completion.usage)


async def test_response_format_json_schema_gives_json_and_is_billed(stack):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    client = _client(stack)
    raw = await client.chat.completions.with_raw_response.create(
        model=stack.model, max_tokens=32, temperature=0,
        messages=[{"role": "user", "content": "Give the capital of France and its country as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "strict": True, "schema": schema}})
    completion = raw.parse()
    data = json.loads(completion.choices[0].message.content)
    assert set(data) == {"city", "country"}
    _billed(stack, raw.headers["x-kvmeter-request-id"], completion.usage)


async def test_completions_echo_and_a_prompt_list(stack, engine_records):
    client = _client(stack)
    raw = await client.completions.with_raw_response.create(
        model=stack.model, prompt=["Hello", "The capital of France is"], max_tokens=4, temperature=0, echo=True)
    completion = raw.parse()
    assert [c.index for c in completion.choices] == [0, 1]
    assert completion.choices[0].text.startswith("Hello")
    assert completion.choices[1].text.startswith("The capital of France is")
    assert completion.usage.completion_tokens == 8
    rid = raw.headers["x-kvmeter-request-id"]
    # one logical request: both prompts in one ledger row and one merged engine record
    _billed(stack, rid, completion.usage, engine_records)


async def test_a_reused_x_request_id_is_echoed_and_never_shared_by_engine_requests(stack, engine_records):
    client = _client(stack)

    async def call():
        return await client.chat.completions.with_raw_response.create(
            model=stack.model, messages=ASK, max_tokens=4, temperature=0,
            extra_headers={"X-Request-Id": "agent-run-7"})

    first, second = await asyncio.gather(call(), call())
    for raw in (first, second):
        assert raw.headers["x-request-id"] == "agent-run-7"  # echoed, as vLLM echoes it
        assert raw.parse().id == "chatcmpl-agent-run-7"  # the id vLLM derives from it
    ids = {first.headers["x-kvmeter-request-id"], second.headers["x-kvmeter-request-id"]}
    assert len(ids) == 2
    for raw in (first, second):
        _billed(stack, raw.headers["x-kvmeter-request-id"], raw.parse().usage, engine_records)
