"""429s at the gateway: Retry-After from the binding limit's refill, x-ratelimit-* headers, a
machine-readable reason, nothing billed and the engine never touched for a refused request."""

from __future__ import annotations

from kvmeter.stats import AdmissionDecision
from tests.serving.quota_http.conftest import bearer, completion, tenants

CFG = tenants("""
acme:
  workspaces:
    ws:
      projects:
        p:
          api_keys:
            slow: {key: sk-test-slow-0001, limits: {requests_per_minute: 2}}
            fast: {key: sk-test-fast-0001, limits: {requests_per_minute: 6}}
        tok:
          limits: {input_tokens_per_minute: 600}
          api_keys:
            t1: {key: sk-test-tok1-0001}
            t2: {key: sk-test-tok2-0001}
        out:
          api_keys:
            o1: {key: sk-test-out1-0001, limits: {output_tokens_per_minute: 100}}
""")
SLOW, FAST, T1, T2, O1 = ("sk-test-slow-0001", "sk-test-fast-0001", "sk-test-tok1-0001", "sk-test-tok2-0001",
                          "sk-test-out1-0001")


def _error(resp) -> dict:
    return resp.json()["error"]


async def test_retry_after_follows_the_binding_request_limit(serve):
    s = await serve(CFG)
    decisions: list[AdmissionDecision] = []
    unsubscribe = s.runtime.bus.subscribe(AdmissionDecision, decisions.append)
    try:
        for secret, limit in ((SLOW, 2), (FAST, 6)):
            for i in range(limit):
                ok = await s.complete(secret)
                assert ok.status_code == 200, ok.text
                assert ok.headers["x-ratelimit-limit-requests"] == str(limit)
                assert ok.headers["x-ratelimit-remaining-requests"] == str(limit - 1 - i)
            refused = await s.complete(secret)
            assert refused.status_code == 429
            # GCRA: one request's worth of the 60 s bucket refills in 60 / limit seconds
            assert refused.headers.get_list("retry-after") == [str(60 // limit)]
            assert refused.headers["retry-after-ms"] == str(60_000 // limit)
            assert refused.headers["x-ratelimit-limit-requests"] == str(limit)
            assert refused.headers["x-ratelimit-remaining-requests"] == "0"
            assert refused.headers["x-kvmeter-quota-level"] == "api_key"
            assert refused.headers["x-kvmeter-quota-dimension"] == "requests_per_minute"
            err = _error(refused)
            assert (err["type"], err["code"], err["level"], err["dimension"]) == (
                "rate_limit_error", "rate_limited", "api_key", "requests_per_minute")

        s.clock.advance(10)  # the fast key has refilled one request; the slow key not yet
        assert (await s.complete(FAST)).status_code == 200
        still = await s.complete(SLOW)
        assert still.status_code == 429 and still.headers["retry-after"] == "20"
        s.clock.advance(20)
        assert (await s.complete(SLOW)).status_code == 200
    finally:
        unsubscribe()

    assert s.runtime.engine.requests_total == 2 + 6 + 1 + 1, "a refused request never reaches the engine"
    assert len(s.billed(tenant_id="acme")) == 10
    rejected = s.attempts(status="rejected")
    assert [a["reason"] for a in rejected] == ["rate_limited"] * 3
    assert {a["status_code"] for a in rejected} == {429}
    # one decision per request: the quota and the gateway do not both publish
    assert sum(d.admitted for d in decisions) == 10
    refused = [d for d in decisions if not d.admitted]
    assert [(d.level, d.dimension, d.status_code) for d in refused] == [
        ("api_key", "requests_per_minute", 429)] * 3


async def test_token_limit_of_an_ancestor_binds_both_siblings(serve):
    s = await serve(CFG)
    for _ in range(3):  # 3 × 200 prompt tokens = the project's 600 per minute
        ok = await s.complete(T1, n_input=200, max_tokens=1)
        assert ok.status_code == 200
    assert ok.headers["x-ratelimit-limit-input-tokens"] == "600"
    assert ok.headers["x-ratelimit-remaining-input-tokens"] == "0"
    big, small = await s.complete(T2, n_input=200, max_tokens=1), await s.complete(T2, n_input=50, max_tokens=1)
    for resp, wait_s in ((big, 20), (small, 5)):  # 600 tokens / 60 s: 10 tokens per second
        assert resp.status_code == 429
        assert resp.headers["retry-after"] == str(wait_s)
        assert resp.headers["x-ratelimit-limit-input-tokens"] == "600"
        assert resp.headers["x-ratelimit-remaining-input-tokens"] == "0"
        err = _error(resp)
        assert (err["code"], err["level"], err["dimension"]) == ("rate_limited", "project",
                                                                  "input_tokens_per_minute")
    s.clock.advance(5)
    assert (await s.complete(T2, n_input=50, max_tokens=1)).status_code == 200
    assert (await s.complete(T1, n_input=50, max_tokens=1)).status_code == 429


async def test_output_reservation_is_reconciled_to_what_the_engine_produced(serve, tokenizer):
    from kvmeter.serving.engines.instant import InstantEngine

    engine = InstantEngine(tokenizer, "SmolLM2-135M-Instruct", max_model_len=4096, max_output_tokens=10)
    s = await serve(CFG, engine=engine)
    first = await s.complete(O1, max_tokens=60)  # reserves 60, the engine makes 10
    assert first.status_code == 200 and first.json()["usage"]["completion_tokens"] == 10
    assert first.headers["x-ratelimit-remaining-output-tokens"] == "40"  # after the reservation
    second = await s.complete(O1, max_tokens=60)  # fits only because 50 came back
    assert second.status_code == 200
    third = await s.complete(O1, max_tokens=90)  # 10 + 10 used, 90 more would pass 100
    assert third.status_code == 429
    assert _error(third)["dimension"] == "output_tokens_per_minute"
    too_big = await s.complete(O1, max_tokens=101)  # can never fit: refused without Retry-After
    assert too_big.status_code == 400 and _error(too_big)["code"] == "request_exceeds_limit"
    assert "retry-after" not in too_big.headers
    events = s.billed(api_key_id="o1")
    assert [(e["reserved_output_tokens"], e["output_tokens"]) for e in events] == [(60, 10), (60, 10)]


async def test_streamed_responses_carry_the_headers_too(serve):
    s = await serve(CFG)
    async with s.client.stream("POST", "/v1/completions", headers=bearer(SLOW),
                               json=completion(10, 3, stream=True)) as resp:
        assert resp.status_code == 200
        assert resp.headers["x-ratelimit-remaining-requests"] == "1"
        assert resp.headers["content-type"].startswith("text/event-stream")
        body = b"".join([chunk async for chunk in resp.aiter_bytes()])
    assert body.endswith(b"data: [DONE]\n\n")
