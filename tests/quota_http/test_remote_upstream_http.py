"""The gateway in front of a remote OpenAI-compatible upstream (``--engine remote``): usage comes
from the upstream's final usage chunk, and the upstream connection is kept alive across requests
(a stream closed before ``[DONE]`` was read used to cost a new TCP connection per request)."""

from __future__ import annotations

import asyncio

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from kvmeter.serving.engines.remote import RemoteEngine
from tests.conftest import free_port
from tests.quota_http.conftest import MODEL, tenants

CFG = tenants("""
acme:
  workspaces:
    ws:
      projects:
        p:
          api_keys:
            k1: {key: sk-test-remote-001, limits: {requests_per_minute: 100}}
""")


def upstream_app(client_ports: set[int]) -> Starlette:
    """A real OpenAI-compatible upstream that answers at once and records its clients' ports."""

    async def models(request: Request) -> Response:
        return Response(orjson.dumps({"data": [{"id": MODEL, "max_model_len": 4096}]}),
                        media_type="application/json")

    async def completions(request: Request) -> Response:
        client_ports.add(request.client.port)
        body = orjson.loads(await request.body())
        n_in, n_out = len(body["prompt"]), body["max_tokens"]
        chunks = [{"choices": [{"index": 0, "text": "ok " * n_out, "token_ids": [7] * n_out,
                                "finish_reason": "length"}]},
                  {"choices": [], "usage": {"prompt_tokens": n_in, "completion_tokens": n_out,
                                            "prompt_tokens_details": {"cached_tokens": 2}}}]

        async def stream():
            for c in chunks:
                yield b"data: " + orjson.dumps(c) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])])


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
            resp = await s.complete("sk-test-remote-001", n_prompt=30, max_tokens=4)
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["prompt_tokens"] == 30
            assert resp.json()["usage"]["completion_tokens"] == 4
            assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 2
        assert len(ports) == 1, f"{len(ports)} upstream connections for 5 requests"
        events = s.billed(api_key_id="k1")
        assert [(e["prompt_tokens"], e["completion_tokens"], e["cached_prompt_tokens"]) for e in events] == [(30, 4, 2)] * 5
    finally:
        server.should_exit = True
        await task
