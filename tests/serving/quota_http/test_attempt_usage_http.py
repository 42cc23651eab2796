"""No attempt erases another, through the real gateway (issue 15, item 3): each attempt's work is
its own usage row, the logical request's bill is its successful attempt's, and a key reused with
another body is another logical request.

A "restart of serve" is what a restart loses with the embedded defaults: the in-memory
idempotency store (``MemoryIdempotencyManager``). The tests put a fresh one in the running
gateway — the ledger, like a restarted server's, keeps everything it had. On the previous version
the first three tests ended with the bill at the failed retry's 0/0 (or the second body's
counts): ``usage_events`` kept one row per (tenant, event id), the last attempt's.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import httpx
import orjson
import uvicorn
from prometheus_client import CollectorRegistry

from kvmeter.ledger import parse_period
from kvmeter.ledger.billing import build_invoice
from kvmeter.serving.config import load_serve_config
from kvmeter.serving.engines.base import EngineError, EngineOutput, EngineRequest
from kvmeter.serving.engines.instant import InstantEngine
from kvmeter.serving.gateway.app import create_app
from kvmeter.serving.quota.idempotency import MemoryIdempotencyManager
from kvmeter.serving.runtime import ServeRuntime
from tests.conftest import free_port, start_uvicorn
from tests.serving.gateway.conftest import MemoryRecorder
from tests.serving.quota_http.conftest import MODEL, bearer, completion, tenants, until

CFG = tenants("""
acme:
  workspaces:
    ws:
      projects:
        p:
          api_keys:
            k1: {key: sk-test-attempts-01}
""")
SECRET = "sk-test-attempts-01"
PERIOD = parse_period("2024-05")  # the stacks' ManualClock starts at 2024-05-17


class ScriptedEngine(InstantEngine):
    """The instant engine, told by the test to fail every request (:attr:`fail`: an upstream
    error, HTTP 500) or to stream ``n`` tokens and then hold the stream open until the client
    leaves (:meth:`stall`; :attr:`stalled` is set once it holds)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fail = False
        self.stall_after: int | None = None
        self.stalled = asyncio.Event()

    def stall(self, n: int | None) -> None:
        """Stream ``n`` tokens, one delta each, then hold (``None``: answer at once again)."""
        self.stall_after = n
        self.streams_tokens = n is not None  # vLLM's layer then gets one output per delta

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        if self.fail:
            self.requests_total += 1
            raise EngineError("the upstream failed", retryable=False)
        if self.stall_after is None:
            async for out in super().generate(request):
                yield out
            return
        prompt = len(request.prompt_token_ids)
        for i in range(self.stall_after):
            token = self._sentence[i]
            yield EngineOutput(new_token_ids=[token], new_text=self._tokenizer.decode([token]),
                               num_output_tokens=i + 1, num_input_tokens=prompt)
        self.stalled.set()
        await asyncio.Event().wait()  # held until the stream is closed (the client left)


def _restart_forgets_the_keys(stack) -> None:  # noqa: ANN001 — a QuotaStack
    stack.clock.advance(60.0)  # the restart takes a while
    stack.runtime.gateway.idempotency = MemoryIdempotencyManager(clock=stack.clock)


def _usage_line(stack) -> tuple[int, int]:  # noqa: ANN001
    stack.ledger.flush(30.0)
    lines = build_invoice(stack.ledger.queries, PERIOD, stack.ledger.prices, "acme").rows()
    [usage] = [r for r in lines if r["line_type"] == "usage"]
    return usage["input_tokens"], usage["output_tokens"]


async def test_a_retry_after_a_restart_whose_upstream_fails_keeps_the_billed_success(serve, tokenizer):
    engine = ScriptedEngine(tokenizer, MODEL, max_model_len=4096)
    s = await serve(CFG, engine=engine)
    key = {"idempotency-key": "order-42"}
    first = await s.complete(SECRET, n_input=200, max_tokens=80, headers=key)
    assert first.status_code == 200 and first.json()["usage"]["completion_tokens"] == 80
    _restart_forgets_the_keys(s)
    engine.fail = True
    retry = await s.complete(SECRET, n_input=200, max_tokens=80, headers=key)
    assert retry.status_code == 500, retry.text
    assert _usage_line(s) == (200, 80)
    rows = s.usage_rows(idempotency_key="order-42")
    assert [(r["attempt"], r["outcome"], r["bill_class"], r["undelivered_cause"]) for r in rows] == [
        (1, "ok", "usage", ""), (1, "error", "undelivered_absorbed", "server_failure")]
    assert len({r["event_id"] for r in rows}) == 1  # one logical request, two attempts


async def test_an_aborted_stream_then_a_retry_the_upstream_fails_bills_the_abandoned_work(serve, tokenizer):
    engine = ScriptedEngine(tokenizer, MODEL, max_model_len=4096)
    s = await serve(CFG, engine=engine)
    key = {"idempotency-key": "stream-7"}
    engine.stall(3)
    body = completion(200, 80, stream=True)
    seen = 0
    async with s.client.stream("POST", "/v1/completions", headers=bearer(SECRET, **key), json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: {") and orjson.loads(line[6:])["choices"]:
                seen += 1
                if seen == 3:
                    break  # the client gives up: the connection closes
    await until(lambda: s.ledger.stats().events_ingested_total.get("new", 0) >= 1, "the aborted stream's record")
    s.clock.advance(5.0)  # the client retries a little later
    engine.stall(None)
    engine.fail = True
    # the same request again (same body); the upstream fails it: the stream's headers were sent, so
    # the error arrives in the stream, as vLLM's serving layer sends it
    async with s.client.stream("POST", "/v1/completions", headers=bearer(SECRET, **key), json=body) as resp:
        assert resp.status_code == 200
        answer = b"".join([c async for c in resp.aiter_bytes()])
    assert b"the upstream failed" in answer and answer.endswith(b"data: [DONE]\n\n")
    s.ledger.flush(30.0)
    lines = build_invoice(s.ledger.queries, PERIOD, s.ledger.prices, "acme").rows()
    assert (sum(r["input_tokens"] for r in lines), sum(r["output_tokens"] for r in lines)) == (200, 3)
    rows = s.usage_rows(idempotency_key="stream-7")
    assert [(r["attempt"], r["outcome"], r["input_tokens"], r["output_tokens"], r["undelivered_cause"],
             r["bill_class"]) for r in rows] == [
        (1, "aborted", 200, 3, "client_abandoned", "undelivered_billed"),
        (2, "error", 0, 0, "server_failure", "undelivered_absorbed")]
    assert rows[1]["status_code"] == 200 and rows[1]["finish_reason"] == "error"
    billed = [(r["line_type"], r["undelivered_cause"], r["input_tokens"], r["output_tokens"]) for r in lines
              if r["input_tokens"] or r["output_tokens"]]
    assert billed == [("undelivered_billed", "client_abandoned", 200, 3)]
    assert sum(r["cost"] for r in lines) > 0


async def test_a_key_reused_with_another_body_after_a_restart_is_billed_apart(serve, tokenizer):
    engine = ScriptedEngine(tokenizer, MODEL, max_model_len=4096)
    s = await serve(CFG, engine=engine)
    key = {"idempotency-key": "reused-1"}
    assert (await s.complete(SECRET, n_input=200, max_tokens=80, headers=key)).status_code == 200
    _restart_forgets_the_keys(s)
    other = await s.complete(SECRET, n_input=50, max_tokens=5, headers=key)
    assert other.status_code == 200
    rows = s.billed(idempotency_key="reused-1")
    assert [(r["input_tokens"], r["output_tokens"]) for r in rows] == [(200, 80), (50, 5)]
    assert len({r["event_id"] for r in rows}) == 2  # two logical requests: the first bill is untouched
    assert _usage_line(s) == (250, 85)
    # without the restart the store still refuses the reuse (422), and nothing more is billed
    third = await s.complete(SECRET, n_input=60, max_tokens=5, headers=key)
    assert third.status_code == 422
    assert _usage_line(s) == (250, 85)


async def test_a_stream_cut_by_a_shutdown_is_recorded_as_shutdown_and_absorbed(tokenizer):
    engine = ScriptedEngine(tokenizer, MODEL, max_model_len=4096)
    engine.stall(1)
    await engine.start()
    port = free_port()
    config = load_serve_config(None, {("engine", "kind"): "instant", ("server", "port"): port}, env={})
    runtime = ServeRuntime(config, registry=CollectorRegistry(), engine=engine)
    recorder = runtime.gateway.recorder = MemoryRecorder()
    app = create_app(runtime.gateway, on_startup=[runtime.scheduler.start], on_shutdown=[runtime.scheduler.stop])
    # uvicorn cancels what still runs once its graceful period is over (here at once)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=0))
    task = await start_uvicorn(server)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            secret = "sk-demo-acme-0001"  # the default tenants file's enterprise key
            async with client.stream("POST", "/v1/completions", headers=bearer(secret),
                                     json=completion(100, 50, stream=True)) as resp:
                assert resp.status_code == 200
                await engine.stalled.wait()
                server.should_exit = True  # the server stops while the stream is held open
                try:
                    async for _ in resp.aiter_lines():
                        pass
                except httpx.HTTPError:
                    pass  # the connection was cut
            await task
        # uvicorn does not wait for the tasks it cancelled: the cut stream finalizes on its own
        await until(lambda: bool(recorder.events), "the cut stream's usage event")
    finally:
        server.should_exit = True
        await task
        runtime.exporter.close()
        await engine.shutdown()
    [event] = recorder.events
    assert (event.outcome, event.undelivered_cause, event.undelivered_billing) == ("aborted", "shutdown", "absorbed")
    assert (event.tokens.input_tokens, event.tokens.output_tokens) == (100, 1)
