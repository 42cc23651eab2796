"""A real slow client on loopback: uvicorn + the instant engine streaming one token per event, and
a raw socket with a tiny receive buffer that reads the response headers and then stops reading.
The stream must be cut after the (small) configured stall limit, billed as a disconnect with the
engine's tokens, and counted for the tenant. Without the cut the stream would wait for the reader
forever, holding the engine request."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from tests.serving.gateway.conftest import KEYS, MemoryRecorder

STALL_S = 0.5
MAX_TOKENS = 3_000


async def _until(predicate, timeout_s: float = 30.0) -> None:
    """Wait (polling) until ``predicate()`` holds; waiting for a server, not timing logic."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


@pytest.fixture
async def slow_stack(model_dir):
    from kvmeter.model import DEFAULT_MODEL_NAME
    from kvmeter.serving.config import load_serve_config
    from kvmeter.serving.engines.hf_tokenizer import HFTokenizer
    from kvmeter.serving.engines.instant import InstantEngine
    from kvmeter.serving.gateway.app import create_app
    from kvmeter.serving.runtime import ServeRuntime

    from kvmeter.net import free_port, listening_socket

    port = free_port()
    # the server's kernel send buffer, small (server.send_buffer_bytes; accepted sockets inherit
    # it), so a stalled reader blocks the server's sends after tens of KiB
    config = load_serve_config(None, {("engine", "kind"): "instant", ("server", "port"): port,
                                      ("server", "stream_stall_timeout_s"): STALL_S,
                                      ("server", "send_buffer_bytes"): 4096}, env={})
    engine = InstantEngine(HFTokenizer(model_dir), DEFAULT_MODEL_NAME, max_model_len=4096,
                           reply=lambda request: "tokens and time, not requests. " * 1_000)  # one event per token
    await engine.start()
    runtime = ServeRuntime(config, registry=CollectorRegistry(), engine=engine)
    runtime.gateway.recorder = recorder = MemoryRecorder()
    app = create_app(runtime.gateway, on_startup=[runtime.scheduler.start], on_shutdown=[runtime.scheduler.stop])
    uv_config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    listener = listening_socket(uv_config, config.server.send_buffer_bytes)  # as kvmeter serve listens
    server = uvicorn.Server(uv_config)
    task = asyncio.create_task(server.serve(sockets=[listener]))
    await _until(lambda: server.started or task.done())
    assert server.started
    yield runtime, recorder, port
    server.should_exit = True
    await task
    runtime.exporter.close()
    await engine.shutdown()
    listener.close()


async def test_a_client_that_stops_reading_is_cut_and_billed_as_a_disconnect(slow_stack):
    runtime, recorder, port = slow_stack
    assert runtime.gateway.settings.stream_stall_timeout_s == STALL_S  # from the serve config
    sock = socket.socket()
    try:  # closed on every exit: a stream left uncut must not hold the server's shutdown
        await _stall_and_check(runtime, recorder, port, sock)
    finally:
        sock.close()


async def _stall_and_check(runtime, recorder, port: int, sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connect: the window stays tiny
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    body = json.dumps({"model": runtime.engine.model_name, "stream": True, "max_tokens": MAX_TOKENS,
                       "messages": [{"role": "user", "content": "say a lot"}]}).encode()
    await loop.sock_sendall(sock, (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {KEYS['acme']}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body)
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = await asyncio.wait_for(loop.sock_recv(sock, 1024), 30)
        assert chunk, "the server closed before its headers"
        got += chunk
    head = got.split(b"\r\n\r\n", 1)[0].decode()
    assert head.startswith("HTTP/1.1 200"), head
    rid = next(line.split(":", 1)[1].strip() for line in head.split("\r\n")
               if line.lower().startswith("x-kvmeter-request-id:"))
    # the client now reads nothing: the server's sends block, and past the stall limit it cuts
    await _until(lambda: any(e.request_id == rid for e in recorder.events))
    (event,) = [e for e in recorder.events if e.request_id == rid]
    assert event.outcome == "aborted" and event.finish_reason == "abort" and event.stream
    assert (event.undelivered_cause, event.undelivered_billing) == ("client_abandoned", "billed")
    # billed for the engine's work: what the engine generated before the cut, not the ceiling
    assert event.tokens.input_tokens > 0 and 0 < event.tokens.output_tokens < MAX_TOKENS
    assert event.e2e_s >= STALL_S

    tier = event.attribution.tier
    registry = runtime.registry

    def cuts() -> float | None:
        return registry.get_sample_value("kvmeter_stream_stall_cut_requests_total", {"tier": tier, "tenant": "acme"})

    await _until(lambda: cuts() is not None)
    assert cuts() == 1
    blocked = registry.get_sample_value("kvmeter_stream_send_blocked_seconds_total", {"tier": tier, "tenant": "acme"})
    assert blocked is not None and blocked >= STALL_S
    assert registry.get_sample_value("kvmeter_stream_send_blocked_bytes_total", {"tier": tier, "tenant": "acme"}) > 0
    assert registry.get_sample_value("kvmeter_stream_duration_seconds_count", {"tier": tier, "tenant": "acme"}) == 1
    assert registry.get_sample_value("kvmeter_requests_total",
                                     {"tier": tier, "tenant": "acme", "outcome": "aborted"}) == 1

    # the client reads again: what the server had buffered, then the end of the connection, no [DONE]
    rest = got
    while True:
        chunk = await asyncio.wait_for(loop.sock_recv(sock, 65536), 30)
        if not chunk:
            break
        rest += chunk
    assert b"data: " in rest and b"[DONE]" not in rest
