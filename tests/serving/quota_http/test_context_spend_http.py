"""400 for a request over a node's context limit, 402 for an exhausted spend budget."""

from __future__ import annotations

from decimal import Decimal

import pytest

from tests.serving.quota_http.conftest import MODEL, bearer, tenants

CFG = tenants("""
acme:
  limits: {spend_per_day: "0.0005", spend_per_month: "0.0020"}
  workspaces:
    ws:
      projects:
        p:
          api_keys:
            short: {key: sk-test-short-0001, limits: {max_context_tokens: 64}}
            spender: {key: sk-test-spend-0001}
other:
  workspaces:
    ws:
      projects:
        p:
          api_keys:
            o1: {key: sk-test-other-0001}
""")
SHORT, SPENDER, OTHER = "sk-test-short-0001", "sk-test-spend-0001", "sk-test-other-0001"


async def test_context_limit_of_a_node_is_a_400_before_the_engine(serve):
    s = await serve(CFG)
    long_prompt = await s.complete(SHORT, n_input=80, max_tokens=5)
    too_much = await s.complete(SHORT, n_input=50, max_tokens=20)
    for resp in (long_prompt, too_much):
        assert resp.status_code == 400
        err = resp.json()["error"]
        assert (err["type"], err["code"], err["level"], err["dimension"]) == (
            "invalid_request_error", "context_length_exceeded", "api_key", "max_context_tokens")
        assert "64 tokens" in err["message"]
        assert "retry-after" not in resp.headers
    assert "the prompt has 80 tokens" in long_prompt.json()["error"]["message"]
    assert "70 tokens" in too_much.json()["error"]["message"]
    assert s.runtime.engine.requests_total == 0

    # a completion without max_tokens runs to vLLM's default of 16 (OpenAI's): 50 + 16 > 64, refused
    default = await s.complete(SHORT, n_input=50, max_tokens=None)
    assert default.status_code == 400 and "66 tokens" in default.json()["error"]["message"]
    # a chat without an output ceiling (vLLM's default: what the window leaves) has its output
    # reservation bounded by the node's limit, not refused
    fits = await s.client.post("/v1/chat/completions", headers=bearer(SHORT),
                               json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert fits.status_code == 200, fits.text
    usage = fits.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 64
    [event] = s.billed(api_key_id="short")
    assert (event["reserved_input_tokens"], event["reserved_output_tokens"]) == (
        usage["prompt_tokens"], 64 - usage["prompt_tokens"])
    # the engine's own window still answers its own 400 (no quota level)
    over_engine = await s.complete(SPENDER, n_input=50, max_tokens=5000)
    assert over_engine.status_code == 400 and "level" not in over_engine.json()["error"]


async def test_context_limit_is_per_sequence_not_times_n_or_summed_over_prompts(serve):
    """``max_context_tokens`` is "prompt + max_tokens of one request" per sequence: ``n`` choices
    and several prompts each have their own context. It was checked against the reservation (all
    sequences), so a chat with ``n`` = 5 was refused 400 for 5 × max_tokens; the reservation (and
    the bill's reserved counts) still hold every sequence."""
    s = await serve(CFG)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 5, "max_tokens": 20,
            "temperature": 1.0, "seed": 1}
    five = await s.client.post("/v1/chat/completions", headers=bearer(SHORT), json=chat)
    assert five.status_code == 200, five.text
    prompt = five.json()["usage"]["prompt_tokens"]
    assert prompt + 20 <= 64 < prompt + 5 * 20  # one sequence fits; the five together would not
    [event] = s.billed(api_key_id="short")
    assert (event["reserved_input_tokens"], event["reserved_output_tokens"]) == (prompt, 100)
    # /v1/completions with two prompts: each prompt + max_tokens (30 + 20) fits, their sum does not
    two = await s.client.post("/v1/completions", headers=bearer(SHORT), json={
        "model": MODEL, "prompt": [[100 + i for i in range(30)], [200 + i for i in range(30)]], "max_tokens": 20})
    assert two.status_code == 200, two.text
    # one sequence over the limit is refused, named by its own prompt and ceiling
    over = await s.client.post("/v1/completions", headers=bearer(SHORT), json={
        "model": MODEL, "prompt": [[100 + i for i in range(30)], [200 + i for i in range(50)]], "max_tokens": 20})
    assert over.status_code == 400
    err = over.json()["error"]
    assert (err["code"], err["dimension"]) == ("context_length_exceeded", "max_context_tokens")
    assert "you requested 70 tokens (50 in the prompt, 20 for the completion)" in err["message"]
    assert s.runtime.engine.requests_total == 5 + 2  # (vLLM runs each choice as its own engine request)


async def test_exhausted_spend_budget_is_a_402_until_the_next_utc_day(serve):
    s = await serve(CFG)
    # prices: 1.00 / 2.00 per 1M input / output tokens → 100 + 2 × 100 = 0.0003 per request
    assert (await s.complete(SPENDER, n_input=100, max_tokens=100)).status_code == 200
    refused = await s.complete(SPENDER, n_input=100, max_tokens=100)  # 0.0006 > 0.0005
    assert refused.status_code == 402
    err = refused.json()["error"]
    assert (err["type"], err["code"], err["level"], err["dimension"]) == (
        "insufficient_quota", "spend_exhausted", "org", "spend_per_day")
    assert "0.0005" in err["message"] and "0.0003" in err["message"]
    assert refused.headers.get_list("retry-after") == [str(12 * 3600)]  # T0 is 12:00 UTC
    # the budget is money, not requests: a cheaper request still fits (0.0003 + 0.0001)
    assert (await s.complete(SPENDER, n_input=50, max_tokens=25)).status_code == 200
    assert (await s.complete(OTHER, n_input=100, max_tokens=100)).status_code == 200  # another org

    s.clock.advance(12 * 3600)  # the next UTC day: the daily budget is back
    assert (await s.complete(SPENDER, n_input=100, max_tokens=100)).status_code == 200
    events = s.billed(tenant_id="acme")
    spent = sum(Decimal(e["input_tokens"]) / 10**6 + 2 * Decimal(e["output_tokens"]) / 10**6
                for e in events)
    assert len(events) == 3 and spent == Decimal("0.0007")  # 0.0003 + 0.0001 + 0.0003
    assert s.runtime.engine.requests_total == 4
    [attempt] = s.attempts(status="rejected")
    assert (attempt["reason"], attempt["status_code"]) == ("spend_exhausted", 402)


async def test_monthly_budget_binds_when_the_daily_one_does_not(serve):
    s = await serve(CFG)
    for _ in range(5):  # 200 + 2 × 100 = 0.0004 a request: one a day fits 0.0005, five the month
        assert (await s.complete(SPENDER, n_input=200, max_tokens=100)).status_code == 200
        daily = await s.complete(SPENDER, n_input=200, max_tokens=100)
        assert daily.status_code == 402 and daily.json()["error"]["dimension"] == "spend_per_day"
        s.clock.advance(24 * 3600)
    refused = await s.complete(SPENDER, n_input=200, max_tokens=100)  # 0.0024 > 0.0020
    assert refused.status_code == 402
    assert refused.json()["error"]["dimension"] == "spend_per_month"
    # T0 + 5 days is 2024-05-22 12:00 UTC: 9.5 days to June 1st
    assert refused.headers["retry-after"] == str(int(9.5 * 86400))
    assert len(s.billed(api_key_id="spender")) == 5


async def test_a_request_costlier_than_the_whole_cap_is_a_400_the_openai_sdk_does_not_retry(serve):
    """Issue 15 item 7: a request whose reserved cost alone exceeds the spend cap can never fit.
    It was a 429 ``request_too_large``, which OpenAI's SDKs retry (408, 409, 429, 5xx) until their
    retry budget runs out; now a 400 the real SDK raises at once, after one request."""
    import httpx
    import openai

    s = await serve(CFG)
    sent: list[httpx.Request] = []

    async def count(request: httpx.Request) -> None:
        sent.append(request)

    async with httpx.AsyncClient(event_hooks={"request": [count]}) as http:
        client = openai.AsyncOpenAI(base_url=f"{s.base_url}/v1", api_key=SPENDER, max_retries=3, timeout=60,
                                    http_client=http)
        # 100 + 2 × 300 tokens = 0.0007 reserved > the 0.0005 daily cap, with nothing spent yet
        with pytest.raises(openai.BadRequestError) as raised:
            await client.completions.create(model=MODEL, prompt=[100 + i for i in range(100)], max_tokens=300)
    assert len(sent) == 1  # not retried
    err = raised.value.body
    assert (raised.value.status_code, err["code"], err["level"], err["dimension"]) == (
        400, "request_exceeds_limit", "org", "spend_per_day")
    assert "retry-after" not in raised.value.response.headers
    # the same request that fits under the cap still runs: nothing was held by the refusal
    assert (await s.complete(SPENDER, n_prompt=100, max_tokens=200)).status_code == 200
    [attempt] = s.attempts(status="rejected")
    assert (attempt["reason"], attempt["status_code"]) == ("request_exceeds_limit", 400)
    assert s.runtime.engine.requests_total == 1
