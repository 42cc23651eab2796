"""The gateway in front of a remote OpenAI-compatible upstream (``--engine remote``): usage comes
from the upstream's usage block, the upstream connection is kept alive across requests
(a stream closed before ``[DONE]`` was read used to cost a new TCP connection per request), and
the upstream's KV load, scraped from its vLLM ``/metrics``, gates dispatch as the in-process
engine's does (``--engine remote`` used to run with no KV gating)."""

from __future__ import annotations

import asyncio
import re

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from kvmeter.bus import StatsBus
from kvmeter.serving.engines.remote import RemoteEngine
from kvmeter.serving.tenancy import DEFAULT_TIERS
from kvmeter.traces import data_dir
from tests.conftest import free_port, start_uvicorn
from tests.serving.quota_http.conftest import MODEL, tenants, until

CFG = tenants("""
acme:
  workspaces:
    ws:
      projects:
        p:
          api_keys:
            k1: {key: sk-test-remote-001, limits: {requests_per_minute: 100}}
""")


def upstream_app(client_ports: set[int], metrics: dict[str, str] | None = None) -> Starlette:
    """A real OpenAI-compatible upstream that answers at once (a JSON answer, or a stream when the
    body asks for one) and records its clients' ports; with ``metrics``, it serves
    ``metrics["page"]`` at ``/metrics``."""

    async def models(request: Request) -> Response:
        return Response(orjson.dumps({"data": [{"id": MODEL, "max_model_len": 4096}]}),
                        media_type="application/json")

    async def completions(request: Request) -> Response:
        client_ports.add(request.client.port)
        body = orjson.loads(await request.body())
        n_in, n_out = len(body["prompt"]), body["max_tokens"]
        usage = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out,
                 "prompt_tokens_details": {"cached_tokens": 2}}
        if not body.get("stream"):
            return Response(orjson.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL,
                                          "choices": [{"index": 0, "text": "ok " * n_out, "finish_reason": "length"}],
                                          "usage": usage}), media_type="application/json")
        chunks = [{"choices": [{"index": 0, "text": "ok " * n_out, "token_ids": [7] * n_out,
                                "finish_reason": "length"}]},
                  {"choices": [], "usage": usage}]

        async def stream():
            for c in chunks:
                yield b"data: " + orjson.dumps(c) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def prometheus(request: Request) -> Response:
        if metrics is None:
            return Response(b"not found", status_code=404)
        return Response(metrics["page"].encode(), media_type="text/plain; version=0.0.4")

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"]),
                             Route("/metrics", prometheus)])


async def test_remote_engine_reuses_its_upstream_connection(serve, model_dir):
    ports: set[int] = set()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(upstream_app(ports), host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:  # server start-up, not timing logic
            await asyncio.sleep(0.02)
        engine = RemoteEngine(f"http://127.0.0.1:{port}", model_dir=model_dir, model_name=MODEL)
        s = await serve(CFG, engine=engine)
        for _ in range(5):
            resp = await s.complete("sk-test-remote-001", n_input=30, max_tokens=4)
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["prompt_tokens"] == 30
            assert resp.json()["usage"]["completion_tokens"] == 4
            assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 2
        assert len(ports) == 1, f"{len(ports)} upstream connections for 5 requests"
        events = s.billed(api_key_id="k1")
        assert [(e["input_tokens"], e["output_tokens"], e["cached_input_tokens"]) for e in events] == [(30, 4, 2)] * 5
    finally:
        server.should_exit = True
        await task


def vllm_metrics(kv: float) -> str:
    """The real vLLM exposition of the data folder (V0 engine: 81,767 KV blocks of 16 tokens),
    relabelled with the served model, at KV usage ``kv``."""
    text = (data_dir() / "vllm_metrics" / "vllm_v0_metrics_qwen2.5-coder-1.5b_aibrix_docs.prom").read_text()
    text = re.sub(r'model_name="[^"]*"', f'model_name="{MODEL}"', text)
    return re.sub(r"^(vllm:gpu_cache_usage_perc\{[^}]*\}) \S+$", rf"\g<1> {kv!r}", text, flags=re.M)


async def test_the_upstreams_kv_load_holds_dispatch_back_until_it_has_room(serve, model_dir, clock):
    ports: set[int] = set()
    metrics = {"page": vllm_metrics(0.95)}  # near full: above the scheduler's kv_watermark_high (0.90)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = uvicorn.Server(uvicorn.Config(upstream_app(ports, metrics), host="127.0.0.1", port=port,
                                           log_level="warning"))
    task = await start_uvicorn(server)
    try:
        bus = StatsBus()
        engine = RemoteEngine(url, model_dir=model_dir, model_name=MODEL, bus=bus, clock=clock,
                              scrape_interval_s=3600.0)  # scraped at start, then when the test says
        s = await serve(CFG, engine=engine, bus=bus)
        scheduler = s.runtime.scheduler
        assert scheduler.snapshot().engines_kv_watermark == [0.95]  # the gate sees the upstream's KV
        request = asyncio.create_task(s.complete("sk-test-remote-001", n_input=30, max_tokens=4))
        for _ in range(500):  # until the request waits in the scheduler (real time: the HTTP round trip)
            if scheduler.snapshot().queued_total == 1:
                break
            await asyncio.sleep(0.02)
        assert scheduler.snapshot().queued_total == 1 and not request.done()
        assert ports == set()  # held back: the upstream has not seen it
        metrics["page"] = vllm_metrics(0.30)
        load = await engine.scrape()
        assert load.kv_capacity_tokens == 81_767 * 16 and load.kv_watermark_ratio == 0.30
        resp = await request
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 4 and len(ports) == 1
        assert scheduler.snapshot().engines_kv_watermark == [0.30]
        # what the engine scraped is on the bus: the exporters show the upstream's engine
        assert s.runtime.registry.get_sample_value(
            "kvmeter_engine_kv_watermark_ratio", {"engine": f"{url}/metrics#0", "model": MODEL}) == 0.30
        assert s.runtime.registry.get_sample_value(
            "kvmeter_engine_kv_capacity_blocks", {"engine": f"{url}/metrics#0", "model": MODEL}) == 81_767
    finally:
        server.should_exit = True
        await task


async def test_a_request_still_queued_at_its_deadline_is_dropped_having_done_no_engine_work(serve, model_dir, clock):
    """The scheduler's deadline drop (issue 15 item 1's "deadline drop"): the only one kvmeter
    makes is of a request still queued — a dispatched request is never dropped at its deadline —
    so the engine never saw it and there is no engine work to record: the client gets 429
    ``deadline``, the attempt record says ``rejected`` for ``deadline``, no usage row is written."""
    ports: set[int] = set()
    metrics = {"page": vllm_metrics(0.95)}  # near full: the request waits in the scheduler's queue
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(upstream_app(ports, metrics), host="127.0.0.1", port=port,
                                           log_level="warning"))
    task = await start_uvicorn(server)
    try:
        bus = StatsBus()
        engine = RemoteEngine(f"http://127.0.0.1:{port}", model_dir=model_dir, model_name=MODEL, bus=bus,
                              clock=clock, scrape_interval_s=3600.0)
        s = await serve(CFG, engine=engine, bus=bus)
        scheduler = s.runtime.scheduler
        request = asyncio.create_task(s.complete("sk-test-remote-001", n_input=30, max_tokens=4))
        await until(lambda: scheduler.snapshot().queued_total == 1, "the request queued")
        wait = DEFAULT_TIERS["paid_interactive"].deadline_s(0.0)  # the tier's rule: 3 x its 2 s TTFT SLO
        assert wait == 6.0
        clock.advance(wait)
        scheduler.tick()  # the periodic tick, now (on the injected clock)
        resp = await request
        assert resp.status_code == 429, resp.text
        assert resp.json()["error"]["code"] == "deadline"
        assert ports == set() and scheduler.snapshot().queued_total == 0  # the upstream never saw it
        assert s.usage_rows(api_key_id="k1") == []  # no engine work: nothing to record or bill
        [attempt] = s.attempts(api_key_id="k1")
        assert (attempt["status"], attempt["reason"], attempt["status_code"]) == ("rejected", "deadline", 429)
    finally:
        server.should_exit = True
        await task
