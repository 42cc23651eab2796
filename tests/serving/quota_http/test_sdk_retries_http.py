"""What the real OpenAI Python SDK does with kvmeter's refusals, with its retries on
(``max_retries=2``, its default) against a real ``kvmeter serve`` stack on loopback: a refusal that
retrying cannot fix (a spent agent-run budget) is sent exactly once — the 429 carries
``x-should-retry: false``, which the SDK obeys (``openai._base_client.BaseClient._should_retry``) —
while a plain rate limit is still retried after its ``Retry-After``. Every HTTP attempt is counted
in the ledger's ``attempts`` table (one row per attempt, each with its own request id)."""

from __future__ import annotations

import openai
import pytest

from tests.serving.quota_http.conftest import MODEL, tenants

CFG = tenants("""
acme:
  tool_policy:
    risk: {"search_*": read_only}
  workspaces:
    ws:
      projects:
        runs:
          run_budget: {max_model_calls: 1, max_tool_calls: 1}
          api_keys:
            runs: {key: sk-test-runs-00001}
        rate:
          api_keys:
            rate: {key: sk-test-rate-00001, limits: {input_tokens_per_minute: 3000}}
""")
RUNS, RATE = "sk-test-runs-00001", "sk-test-rate-00001"
RETRIES = 2


def sdk(base_url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=RETRIES)


def ids(n: int) -> list[int]:
    """A prompt of exactly ``n`` token ids."""
    return [100 + (i % 500) for i in range(n)]


async def test_a_spent_run_budget_is_sent_once_by_the_sdk(serve):
    s = await serve(CFG)
    client = sdk(s.base_url, RUNS)
    run = {"X-Agent-Run-Id": "r-once"}
    first = await client.completions.create(model=MODEL, prompt="hello", max_tokens=2, extra_headers=run)
    assert first.usage is not None and first.usage.completion_tokens == 2
    with pytest.raises(openai.RateLimitError) as refused:  # the status OpenAI clients expect: 429
        await client.completions.create(model=MODEL, prompt="hello", max_tokens=2, extra_headers=run)
    assert refused.value.code == "run_budget_exceeded" and refused.value.body["dimension"] == "model_calls"
    assert refused.value.response.headers["x-should-retry"] == "false"
    attempts = s.attempts(agent_run_id="r-once")  # (the test's clock stands still: same ts, any order)
    assert sorted((a["status"], a["reason"], a["status_code"]) for a in attempts) == [
        ("admitted", "admitted", 200), ("rejected", "run_budget_exceeded", 429)]  # sent once, not 1 + 2

    # the run's tool calls spent (reported through the SDK's own client): its next model call is refused once
    other = {"X-Agent-Run-Id": "r-tools"}
    report = await client.post("/agent_runs/r-tools/tool_calls", body={"count": 2}, cast_to=object)
    assert report["exceeded"] is True
    with pytest.raises(openai.RateLimitError) as stopped:
        await client.completions.create(model=MODEL, prompt="hello", max_tokens=2, extra_headers=other)
    assert stopped.value.body["dimension"] == "tool_calls"
    assert [(a["status"], a["reason"]) for a in s.attempts(agent_run_id="r-tools")] == [
        ("rejected", "run_budget_exceeded")]
    await client.close()


async def test_a_named_tool_call_over_the_run_budget_is_reported_once(serve):
    s = await serve(CFG)
    client = sdk(s.base_url, RUNS)
    body = {"tool": "search_docs", "arguments": '{"q": "retries"}'}
    allowed = await client.post("/agent_runs/r-named/tool_calls", body=body, cast_to=object)
    assert allowed["decision"] == "allowed"
    with pytest.raises(openai.RateLimitError) as refused:
        await client.post("/agent_runs/r-named/tool_calls", body=body, cast_to=object)
    assert refused.value.code == "run_budget_exceeded" and refused.value.response.headers["x-should-retry"] == "false"
    decisions = s.rows("SELECT decision FROM tool_calls FINAL WHERE agent_run_id = {r:String}", r="r-named")
    assert sorted(d["decision"] for d in decisions) == ["allowed", "budget_exceeded"]  # one refused report
    await client.close()


async def test_a_plain_rate_limit_is_still_retried(serve):
    s = await serve(CFG)
    client = sdk(s.base_url, RATE)
    # 3,000 input tokens: the key's whole minute (GCRA bucket of 3,000 tokens, 50 per second)
    await client.completions.create(model=MODEL, prompt=ids(3000), max_tokens=1)
    with pytest.raises(openai.RateLimitError) as limited:  # the server's clock is the test's: it stays full
        await client.completions.create(model=MODEL, prompt=ids(10), max_tokens=1)
    assert limited.value.code == "rate_limited"
    assert "x-should-retry" not in limited.value.response.headers
    # 10 tokens at 50 per second: 0.2 s (rounded up to the millisecond from the GCRA's float arithmetic)
    assert 200 <= int(limited.value.response.headers["retry-after-ms"]) <= 201
    rejected = s.attempts(api_key_id="rate", status="rejected")
    assert [(a["reason"], a["status_code"]) for a in rejected] == [("rate_limited", 429)] * (1 + RETRIES)
    await client.close()
