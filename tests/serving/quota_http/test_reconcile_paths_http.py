"""Every admitted request gives its reservation back, whatever its end: a client that leaves
while queued or before its stream starts, an engine that fails. The key's limit of one (or two)
concurrent requests makes a leaked hold visible as a 429 on the next request."""

from __future__ import annotations

import asyncio

import orjson

from kvmeter.stats import AdmissionDecision
from tests.serving.quota_http.conftest import bearer, completion, tenants, until
from tests.serving.quota_http.engines import FailingEngine, GatedEngine

CFG = tenants("""
acme:
  workspaces:
    ws:
      projects:
        p:
          api_keys:
            two: {key: sk-test-two-00001, limits: {concurrent_requests: 2}}
            one: {key: sk-test-one-00001, limits: {concurrent_requests: 1}}
""")
TWO, ONE = "sk-test-two-00001", "sk-test-one-00001"
MODEL = "SmolLM2-135M-Instruct"


async def test_client_leaving_while_queued_releases_everything(serve, tokenizer):
    engine = GatedEngine(tokenizer, MODEL, max_model_len=4096)
    s = await serve(CFG, engine=engine, scheduler_options={"max_engine_running": 1})
    scheduler = s.runtime.scheduler
    running = asyncio.create_task(s.complete(TWO))
    await engine.wait_in_flight(1)
    queued = asyncio.create_task(s.complete(TWO, headers={"idempotency-key": "left-1"}))
    await until(lambda: scheduler.snapshot().queued_total == 1, "the second request to queue")
    queued.cancel()  # the client goes away: the connection closes
    await until(lambda: scheduler.snapshot().queued_total == 0, "the queued request to leave")
    await until(lambda: len(s.billed(idempotency_key="left-1")) == 1, "its usage event")

    # its concurrency hold came back: a new request of the key is queued, not refused
    third = asyncio.create_task(s.complete(TWO))
    await until(lambda: scheduler.snapshot().queued_total == 1, "the third request to queue")
    engine.gate.set()
    assert (await running).status_code == 200 and (await third).status_code == 200
    # its idempotency ticket was abandoned: the retry runs (attempt 2) instead of 409 in progress
    retry = await s.complete(TWO, headers={"idempotency-key": "left-1"})
    assert retry.status_code == 200 and "x-kvmeter-idempotent-replay" not in retry.headers
    attempts = s.attempts(idempotency_key="left-1")
    assert [(a["attempt"], a["status"], a["status_code"]) for a in attempts] == [
        (1, "error", 499), (2, "admitted", 200)]
    [billed] = s.billed(idempotency_key="left-1")  # one logical request, billed once
    assert (billed["outcome"], billed["output_tokens"], billed["attempt"]) == ("ok", 5, 2)


async def test_engine_failure_releases_the_hold_and_the_ticket(serve, tokenizer):
    engine = FailingEngine(tokenizer, MODEL, max_model_len=4096)
    s = await serve(CFG, engine=engine)
    decisions: list[AdmissionDecision] = []
    unsubscribe = s.runtime.bus.subscribe(AdmissionDecision, decisions.append)
    try:
        for _attempt in (1, 2):  # the same key twice: the failed attempt was abandoned, not stored
            failed = await s.complete(ONE, headers={"idempotency-key": "boom"})
            assert failed.status_code == 503 and failed.json()["error"]["code"] == "engine_error"
        for _ in range(2):  # streaming: headers were sent, the error arrives in the stream, as
            # vLLM's serving layer sends it (an error event, then [DONE])
            async with s.client.stream("POST", "/v1/completions", headers=bearer(ONE),
                                       json=completion(10, 5, stream=True)) as resp:
                assert resp.status_code == 200
                body = b"".join([c async for c in resp.aiter_bytes()])
            assert b'"InternalServerError"' in body and b"instant engine told to fail" in body
            assert body.endswith(b"data: [DONE]\n\n")
    finally:
        unsubscribe()
    assert engine.requests_total == 4  # each one ran: never refused for a leaked concurrency hold
    assert [d.admitted for d in decisions] == [True] * 4  # one decision per request
    rows = s.usage_rows(api_key_id="one")  # every attempt is recorded, each its own row ...
    assert len(rows) == 4 and len({r["event_id"] for r in rows}) == 3  # "boom"'s two are one logical request
    assert {(r["outcome"], r["input_tokens"], r["output_tokens"], r["undelivered_cause"], r["bill_class"])
            for r in rows} == {("error", 0, 0, "server_failure", "undelivered_absorbed")}
    assert s.billed(api_key_id="one") == []  # ... and a server failure is the platform's (the default)
    assert [a["attempt"] for a in s.attempts(idempotency_key="boom")] == [1, 2]


async def test_client_gone_before_the_stream_starts_releases_the_hold(serve):
    """The ASGI app called directly with a client whose socket is already closed: sending the
    response start fails, so the stream's body is never iterated (its ``finally`` never runs)."""
    s = await serve(CFG)
    app = s.runtime.app()  # the same gateway objects, without a second lifespan
    body = orjson.dumps(completion(10, 5, stream=True))
    sent_body = False
    forever = asyncio.Event()

    async def receive() -> dict:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await forever.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            raise OSError("connection reset by peer")

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "headers": [(b"authorization", f"Bearer {ONE}".encode()), (b"idempotency-key", b"gone-1"),
                         (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    try:
        await app(scope, receive, send)
    except Exception:  # noqa: BLE001 — the app may re-raise the client's disconnect
        pass
    [event] = s.billed(idempotency_key="gone-1")
    assert (event["outcome"], event["output_tokens"]) == ("aborted", 0)
    # the key's single concurrency slot is free and the idempotency key can run again
    retry = await s.complete(ONE, headers={"idempotency-key": "gone-1"}, stream=True)
    assert retry.status_code == 200 and "x-kvmeter-idempotent-replay" not in retry.headers
    assert retry.content.endswith(b"data: [DONE]\n\n")
