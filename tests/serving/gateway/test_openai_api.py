"""The OpenAI-compatible API on the real engine, metered into the real ledger."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvmeter.stats import EngineRequestStats
from tests.serving.gateway.conftest import auth

pytestmark = [pytest.mark.engine]


def _chat(model: str, n: int = 8, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": n, "min_tokens": n, "temperature": 0.0, **extra}


async def _sse_events(resp: httpx.Response) -> list[dict]:
    events = []
    async for line in resp.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[6:]))
    return events


async def test_non_streaming_chat_bills_engine_true_tokens(stack, client):
    finished: list[EngineRequestStats] = []
    unsub = stack.runtime.bus.subscribe(EngineRequestStats, finished.append)
    try:
        resp = await client.post("/v1/chat/completions", headers=auth("acme"), json=_chat(stack.model, 12))
    finally:
        unsub()
    assert resp.status_code == 200, resp.text
    body = resp.json()
    rid = resp.headers["x-request-id"]
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] == 12
    engine = next(f for f in finished if f.request_id == rid)
    [event] = stack.usage(rid)
    assert event["outcome"] == "ok" and event["token_source"] == "engine_hooks"
    assert event["input_tokens"] == engine.tokens.input_tokens == body["usage"]["prompt_tokens"]
    assert event["output_tokens"] == engine.tokens.output_tokens == 12
    assert engine.attribution.tenant_id == "acme"  # the engine record carries the request's attribution
    assert event["tenant_id"] == "acme" and event["tier"] == "enterprise"
    assert event["ttft_s"] > 0 and event["e2e_s"] >= event["ttft_s"]


async def test_streaming_usage_is_a_total_not_a_sum(stack, client):
    async with client.stream("POST", "/v1/chat/completions", headers=auth("globex"),
                             json=_chat(stack.model, 20, stream=True,
                                        stream_options={"include_usage": True})) as resp:
        assert resp.status_code == 200
        rid = resp.headers["x-request-id"]
        events = await _sse_events(resp)
    with_usage = [e for e in events if e.get("usage")]
    assert len(with_usage) == 1, "exactly one chunk carries usage"
    assert with_usage[0]["choices"] == []
    assert all(e.get("usage") is None for e in events if e is not with_usage[0])
    usage = with_usage[0]["usage"]
    assert usage["completion_tokens"] == 20
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    [event] = stack.usage(rid)
    assert (event["input_tokens"], event["output_tokens"]) == (usage["prompt_tokens"], 20)
    assert event["stream"] is True
    assert event["itl_mean_s"] is not None and event["itl_mean_s"] > 0


async def test_completions_endpoint_both_modes(stack, client):
    body = {"model": stack.model, "prompt": "The capital of France is", "max_tokens": 6, "min_tokens": 6,
            "temperature": 0.0}
    resp = await client.post("/v1/completions", headers=auth("acme"), json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["object"] == "text_completion" and resp.json()["usage"]["completion_tokens"] == 6
    async with client.stream("POST", "/v1/completions", headers=auth("acme"),
                             json={**body, "stream": True}) as sresp:
        events = await _sse_events(sresp)
    assert events and all(e["object"] == "text_completion" for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


async def test_client_disconnect_mid_stream_bills_once_what_the_engine_did(stack):
    seen_chunks = 0
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as c:
        async with c.stream("POST", "/v1/chat/completions", headers=auth("umbrella"),
                            json=_chat(stack.model, 600, stream=True)) as resp:
            assert resp.status_code == 200
            rid = resp.headers["x-request-id"]
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    seen_chunks += 1
                if seen_chunks >= 5:
                    break
        # leaving both context managers closes the connection mid-stream
    engine = stack.runtime.engine
    for _ in range(200):  # the engine must let go of the request (abort), not run to 600 tokens
        await asyncio.sleep(0.05)
        if engine.load().num_running == 0 and stack.usage(rid):
            break
    events = stack.usage(rid)
    assert len(events) == 1, "exactly one usage event for the aborted request"
    event = events[0]
    assert event["outcome"] == "aborted" and event["finish_reason"] == "abort"
    assert event["token_source"] == "engine_hooks"  # the engine's account of the abort
    assert seen_chunks - 1 <= event["output_tokens"] < 600  # what the engine generated by then
    (engine_row,) = stack.rows("SELECT * FROM engine_requests FINAL WHERE request_id = {rid:String}", rid=rid)
    assert (event["input_tokens"], event["output_tokens"]) == \
        (engine_row["input_tokens"], engine_row["output_tokens"])
    assert engine_row["tenant_id"] == event["tenant_id"]  # the engine's account carries the attribution
    assert event["input_tokens"] == event["reserved_input_tokens"]  # it was decoding: all prefilled
    assert engine.load().num_running == 0


async def test_models_health_and_metrics(stack, client):
    models = await client.get("/v1/models", headers=auth("acme"))
    assert models.status_code == 200 and models.json()["data"][0]["id"] == stack.model
    assert (await client.get("/v1/models")).status_code == 401
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    await client.post("/v1/chat/completions", headers=auth("acme"), json=_chat(stack.model, 3))
    text = (await client.get("/metrics")).text
    for name in ("kvmeter_engine_kv_watermark_ratio", "kvmeter_request_ttft_seconds_bucket",
                 'kvmeter_tokens_total{', "kvmeter_engine_running_requests"):
        assert name in text, f"{name} missing from /metrics"
    assert 'type="output"' in text and 'tier="enterprise"' in text


async def test_idempotent_retries_are_billed_once(stack, client):
    headers = {**auth("globex"), "idempotency-key": "retry-test-sequential"}
    first = await client.post("/v1/chat/completions", headers=headers, json=_chat(stack.model, 5))
    again = await client.post("/v1/chat/completions", headers=headers, json=_chat(stack.model, 5))
    assert first.status_code == again.status_code == 200
    assert again.headers.get("x-kvmeter-idempotent-replay") == "true"
    assert again.json() == first.json()
    rows = stack.rows("SELECT count() AS n FROM usage_events FINAL WHERE idempotency_key = {k:String}",
                      k="retry-test-sequential")
    assert rows[0]["n"] == 1
    attempts = stack.rows("SELECT status FROM attempts FINAL WHERE idempotency_key = {k:String} ORDER BY ts",
                          k="retry-test-sequential")
    assert [a["status"] for a in attempts] == ["admitted", "replayed"]

    headers = {**auth("globex"), "idempotency-key": "retry-test-concurrent"}
    answers = await asyncio.gather(*(client.post("/v1/chat/completions", headers=headers,
                                                 json=_chat(stack.model, 16)) for _ in range(4)))
    assert all(a.status_code == 200 for a in answers)
    assert len({a.json()["id"] for a in answers}) == 1
    rows = stack.rows("SELECT count() AS n FROM usage_events FINAL WHERE idempotency_key = {k:String}",
                      k="retry-test-concurrent")
    assert rows[0]["n"] == 1
    reused = await client.post("/v1/chat/completions", headers=headers, json=_chat(stack.model, 7))
    assert reused.status_code == 422  # the same key with a different body


async def test_client_disconnect_before_a_non_streaming_answer_aborts_and_bills_what_the_engine_did(stack):
    from kvmeter.stats import EngineStepStats

    engine = stack.runtime.engine
    generated: list[int] = []
    unsub = stack.runtime.bus.subscribe(EngineStepStats, lambda s: generated.append(s.output_tokens))
    before = {r["request_id"] for r in stack.rows(
        "SELECT request_id FROM usage_events FINAL WHERE tenant_id = 'umbrella' AND status_code = 499")}
    try:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as c:
            call = asyncio.create_task(c.post("/v1/chat/completions", headers=auth("umbrella"),
                                              json=_chat(stack.model, 600)))
            for _ in range(1200):  # until the engine has generated a few tokens of it
                await asyncio.sleep(0.05)
                if sum(generated) >= 5:
                    break
            assert sum(generated) >= 5, "the engine never ran the request"
            call.cancel()  # the client goes away: its connection closes before any answer
            with pytest.raises(asyncio.CancelledError):
                await call
    finally:
        unsub()
    rows: list[dict] = []
    for _ in range(400):  # the engine must let go of the request (abort), not run to 600 tokens
        await asyncio.sleep(0.05)
        rows = [r for r in stack.rows("SELECT * FROM usage_events FINAL WHERE tenant_id = 'umbrella' "
                                      "AND status_code = 499") if r["request_id"] not in before]
        if engine.load().num_running == 0 and rows:
            break
    [event] = rows
    assert event["outcome"] == "aborted" and event["finish_reason"] == "abort"
    assert event["stream"] is False and event["token_source"] == "engine_hooks"  # the engine's account
    assert 1 <= event["output_tokens"] < 600  # what the engine generated by then
    assert event["input_tokens"] > 0
    (engine_row,) = stack.rows("SELECT * FROM engine_requests FINAL WHERE request_id = {rid:String}",
                               rid=event["request_id"])
    assert (engine_row["tenant_id"], engine_row["input_tokens"], engine_row["output_tokens"]) == (
        "umbrella", event["input_tokens"], event["output_tokens"])
    assert engine.load().num_running == 0
