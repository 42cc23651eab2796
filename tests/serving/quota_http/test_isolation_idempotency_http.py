"""Isolation between keys and orgs, and idempotent retries billed exactly once — on the in-memory
quota store and on Redis (which then also holds the idempotency records)."""

from __future__ import annotations

import asyncio

from tests.serving.quota_http.conftest import tenants, until
from tests.serving.quota_http.engines import GatedEngine

CFG = tenants("""
acme:
  workspaces:
    ws:
      projects:
        p:
          api_keys:
            noisy: {key: sk-test-noisy-001, limits: {requests_per_minute: 30, input_tokens_per_minute: 2000}}
            sibling: {key: sk-test-sibling-1, limits: {requests_per_minute: 30, input_tokens_per_minute: 2000}}
other:
  workspaces:
    ws:
      projects:
        p:
          api_keys:
            o1: {key: sk-test-other-001, limits: {requests_per_minute: 30, input_tokens_per_minute: 2000}}
""")
NOISY, SIBLING, OTHER = "sk-test-noisy-001", "sk-test-sibling-1", "sk-test-other-001"


async def test_a_noisy_key_exhausts_only_its_own_limits(serve, quota_store):
    s = await serve(CFG, quota_store=quota_store)
    noisy = [s.complete(NOISY, n_input=100, max_tokens=2) for _ in range(60)]
    quiet = [s.complete(secret, n_input=100, max_tokens=2) for secret in (SIBLING, OTHER) for _ in range(10)]
    answers = await asyncio.gather(*noisy, *quiet)
    noisy_answers, quiet_answers = answers[:60], answers[60:]
    assert sum(a.status_code == 200 for a in noisy_answers) == 20  # 2000 tokens / 100 per request
    refused = [a for a in noisy_answers if a.status_code != 200]
    assert len(refused) == 40 and {a.status_code for a in refused} == {429}
    assert {(a.json()["error"]["level"], a.json()["error"]["dimension"]) for a in refused} == {
        ("api_key", "input_tokens_per_minute")}
    assert all(a.status_code == 200 for a in quiet_answers), [a.text for a in quiet_answers if a.status_code != 200]
    # and they keep being admitted after the noisy key is exhausted
    for secret in (SIBLING, OTHER):
        assert (await s.complete(secret, n_input=100, max_tokens=2)).status_code == 200
    assert (await s.complete(NOISY, n_input=100, max_tokens=2)).status_code == 429
    billed = {k: len(s.billed(api_key_id=k)) for k in ("noisy", "sibling", "o1")}
    assert billed == {"noisy": 20, "sibling": 11, "o1": 11}


async def test_sequential_retry_is_replayed_and_billed_once(serve, quota_store):
    s = await serve(CFG, quota_store=quota_store)
    key = {"idempotency-key": "seq-1"}
    first = await s.complete(SIBLING, n_input=100, max_tokens=4, headers=key)
    again = await s.complete(SIBLING, n_input=100, max_tokens=4, headers=key)
    assert first.status_code == again.status_code == 200
    assert again.json() == first.json()
    assert again.headers["x-kvmeter-idempotent-replay"] == "true"
    assert "x-kvmeter-idempotent-replay" not in first.headers
    # the replay reserved nothing: the next new request sees one earlier request, not two
    nxt = await s.complete(SIBLING, n_input=100, max_tokens=4)
    assert nxt.headers["x-ratelimit-remaining-requests"] == "28"
    assert nxt.headers["x-ratelimit-remaining-input-tokens"] == "1800"
    [event] = s.billed(idempotency_key="seq-1")
    assert (event["input_tokens"], event["output_tokens"]) == (100, 4)
    assert sorted(a["status"] for a in s.attempts(idempotency_key="seq-1")) == ["admitted", "replayed"]
    assert s.runtime.engine.requests_total == 2
    reused = await s.complete(SIBLING, n_input=99, max_tokens=4, headers=key)  # same key, new body
    assert reused.status_code == 422


async def test_concurrent_retries_join_the_running_attempt_and_are_billed_once(serve, quota_store, tokenizer):
    engine = GatedEngine(tokenizer, "SmolLM2-135M-Instruct", max_model_len=4096)
    s = await serve(CFG, quota_store=quota_store, engine=engine)
    key = {"idempotency-key": "conc-1"}
    tasks = [asyncio.create_task(s.complete(OTHER, n_input=100, max_tokens=4, headers=key)) for _ in range(6)]
    await engine.wait_in_flight(1)
    await until(lambda: s.runtime.idempotency.waiting == 5, "five retries joining the running attempt")
    engine.gate.set()
    answers = await asyncio.gather(*tasks)
    assert all(a.status_code == 200 for a in answers)
    assert len({a.json()["id"] for a in answers}) == 1
    assert sum(a.headers.get("x-kvmeter-idempotent-replay") == "true" for a in answers) == 5
    assert engine.requests_total == 1
    assert len(s.billed(idempotency_key="conc-1")) == 1
    assert sorted(a["status"] for a in s.attempts(idempotency_key="conc-1")) == ["admitted"] + ["replayed"] * 5
    nxt = await s.complete(OTHER, n_input=100, max_tokens=4)
    assert nxt.headers["x-ratelimit-remaining-requests"] == "28"
