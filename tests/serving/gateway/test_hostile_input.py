"""Hostile input on a real uvicorn server with the instant engine: a body that stalls is a 408 (and a
server that stops while waiting for one answers 503, no traceback), non-JSON media types are 415,
conflicting header lines are 400, ``max_completion_tokens`` is checked on both endpoints, the
tool-call report refuses what it cannot use, and every refusal before admission is counted on
``/metrics`` by status and code, never billed."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvmeter.serving.config import ServeConfigError, load_serve_config
from kvmeter.serving.gateway.handler import GatewaySettings
from kvmeter.stats import REFUSAL_CODES
from tests.conftest import free_port, start_uvicorn
from tests.serving.gateway.conftest import KEYS, MemoryRecorder, auth
from tests.serving.gateway.test_instant_http import _eventually, _no_server_errors

GOOD = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
REFUSED = "kvmeter_gateway_refused_requests"


@pytest.fixture
async def iclient(instant_stack):
    async with httpx.AsyncClient(base_url=instant_stack.base_url, timeout=60) as c:
        yield c


async def _stall(port: int, path: str, tenant: str, *, trickle: bool = False,
                 wait_s: float = 15.0) -> tuple[int, dict, float]:
    """Headers announcing a 62-byte body, then 10 bytes of it and silence (or, with ``trickle``,
    one more byte every 50 ms, never finishing); return the status, JSON body and seconds until
    the server answered and closed. Fails after ``wait_s`` (the server never answered)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.monotonic()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEYS[tenant]}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: 62\r\n\r\n".encode() + b'{"model": ')
    await writer.drain()

    async def drip() -> None:
        try:
            for _ in range(51):  # 10 + 51 bytes < 62: the body never completes
                await asyncio.sleep(0.05)
                writer.write(b" ")
                await writer.drain()
        except (ConnectionError, OSError):
            pass  # the server answered and closed

    dripping = asyncio.create_task(drip()) if trickle else None
    try:
        raw = await asyncio.wait_for(reader.read(), wait_s)  # until the server closes
    finally:
        if dripping is not None:
            dripping.cancel()
        writer.close()
    elapsed = time.monotonic() - start
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"connection: close" in head.lower(), head
    return status, json.loads(body), elapsed


# -- 1. the body-read time limit ----------------------------------------------------------------


async def test_stalled_body_is_a_408_logged_in_one_line_and_bills_nothing(instant_stack, caplog, monkeypatch):
    monkeypatch.setattr(instant_stack.runtime.gateway.settings, "body_read_timeout_s", 0.2)
    caplog.set_level(logging.INFO)
    rec = instant_stack.recorder
    before = rec.billed("umbrella")
    for path, trickle in (("/v1/chat/completions", False), ("/v1/completions", False),
                          ("/v1/chat/completions", True)):
        status, body, elapsed = await _stall(instant_stack.port, path, "umbrella", trickle=trickle)
        assert status == 408, (path, body)
        err = body["error"]
        assert (err["code"], err["type"]) == ("request_timeout", "invalid_request_error")
        assert "0.2 s" in err["message"] and "of 62 bytes" in err["message"], err["message"]
        assert 0.2 <= elapsed < 5, elapsed  # the deadline covers the whole body: a trickle too
    timed_out = [a for a in rec.attempts if a.tenant_id == "umbrella" and a.status_code == 408]
    assert [(a.status, a.reason) for a in timed_out] == [("invalid", "request_timeout")] * 3
    assert {a.attribution.endpoint for a in timed_out} == {"chat.completions", "completions"}
    lines = [r for r in caplog.records if "request body not received within 0.2 s" in r.getMessage()]
    assert len(lines) == 3 and not any(r.exc_info for r in lines)
    # the tool-call report reads its body under the same limit
    status, body, _ = await _stall(instant_stack.port, "/v1/agent_runs/run-408/tool_calls", "umbrella")
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert rec.billed("umbrella") == before
    _no_server_errors(caplog)
    # a body that arrives in time is served as before
    async with httpx.AsyncClient(base_url=instant_stack.base_url, timeout=60) as c:
        ok = await c.post("/v1/chat/completions", headers=auth("umbrella"), json={"model": instant_stack.model, **GOOD})
        assert ok.status_code == 200, ok.text
        report = await c.post("/v1/agent_runs/run-408/tool_calls", headers=auth("umbrella"))
        assert report.json()["tool_calls"] == 1  # the timed-out report counted nothing


async def test_server_stopping_during_a_body_read_answers_503_without_a_traceback(model_dir, caplog):
    from kvmeter.model import DEFAULT_MODEL_NAME
    from kvmeter.serving.engines.hf_tokenizer import HFTokenizer
    from kvmeter.serving.engines.instant import InstantEngine
    from kvmeter.serving.gateway.app import create_app
    from kvmeter.serving.runtime import ServeRuntime

    caplog.set_level(logging.INFO)
    port = free_port()
    config = load_serve_config(None, {("engine", "kind"): "instant", ("server", "port"): port}, env={})
    engine = InstantEngine(HFTokenizer(model_dir), DEFAULT_MODEL_NAME, max_model_len=4096)
    await engine.start()
    runtime = ServeRuntime(config, registry=CollectorRegistry(), engine=engine)
    runtime.gateway.recorder = recorder = MemoryRecorder()
    runtime.gateway.settings.body_read_timeout_s = 600  # the shutdown comes first
    app = create_app(runtime.gateway, on_startup=[runtime.scheduler.start], on_shutdown=[runtime.scheduler.stop])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="info", log_config=None,
                                           lifespan="on", timeout_graceful_shutdown=0.2))
    task = await start_uvicorn(server)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS['acme']}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: 62\r\n\r\n".encode() + b'{"model": ')
        await writer.drain()
        await _eventually(lambda: len(server.server_state.tasks) == 1)  # the request is running
        server.should_exit = True
        raw = await asyncio.wait_for(reader.read(), 15)
        writer.close()
        await asyncio.wait_for(task, 15)
    finally:
        server.should_exit = True
        await task
        runtime.exporter.close()
        await engine.shutdown()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), raw[:300]
    assert json.loads(body)["error"]["code"] == "server_shutting_down"
    assert any("cancelled by server shutdown before its response; answered 503" in r.getMessage()
               for r in caplog.records)
    assert not any(r.exc_info for r in caplog.records), "a traceback was logged"
    assert not any("Exception in ASGI application" in r.getMessage() for r in caplog.records)
    assert recorder.events == []


def test_body_read_timeout_is_a_server_setting():
    assert load_serve_config(None, {}, env={}).server.body_read_timeout_s == 30.0
    cfg = load_serve_config(None, {("server", "body_read_timeout_s"): 0.5}, env={})
    assert cfg.server.body_read_timeout_s == 0.5
    for bad in (0, -1):
        with pytest.raises(ServeConfigError, match="server.body_read_timeout_s"):
            load_serve_config(None, {("server", "body_read_timeout_s"): bad}, env={})
    assert GatewaySettings().body_read_timeout_s == 30.0
    assert GatewaySettings(body_read_timeout_s=None).body_read_timeout_s is None
    with pytest.raises(ValueError, match="body_read_timeout_s"):
        GatewaySettings(body_read_timeout_s=0)


# -- 2. max_completion_tokens on both endpoints -------------------------------------------------


async def test_max_completion_tokens_is_checked_on_chat_and_refused_on_completions(instant_stack, iclient):
    rec = instant_stack.recorder
    before = rec.billed("globex")
    model = instant_stack.model
    # on chat, checked as vLLM checks it: a value its model cannot read, or one past the window,
    # names max_completion_tokens; below 1 it is refused as the max_tokens vLLM would run with
    for value, param in ((-5, "max_tokens"), (0, "max_tokens"), (10**12, "max_completion_tokens"),
                         (100_000, "max_completion_tokens"), ("x", "body.max_completion_tokens"),
                         (1.5, "body.max_completion_tokens"), ([3], "body.max_completion_tokens")):
        resp = await iclient.post("/v1/chat/completions", headers=auth("globex"),
                                  json={"model": model, **GOOD, "max_completion_tokens": value})
        assert resp.status_code == 400, (value, resp.text)
        err = resp.json()["error"]
        assert (err["param"], err["code"]) == (param, 400), (value, err)
    # OpenAI's completions API has no such field (vLLM would ignore it and run to max_tokens'
    # default of 16): any value is refused, pointing at max_tokens
    for value in (-5, 0, 10**12, "10", 5):
        resp = await iclient.post("/v1/completions", headers=auth("globex"),
                                  json={"model": model, "prompt": "hi", "max_completion_tokens": value})
        assert resp.status_code == 400, (value, resp.text)
        err = resp.json()["error"]
        assert (err["param"], err["code"], err["type"]) == ("max_completion_tokens", 400, "BadRequestError"), err
        assert "max_tokens" in err["message"]
    assert rec.billed("globex") == before
    # null means "not set", as on OpenAI's API
    ok = await iclient.post("/v1/completions", headers=auth("globex"),
                            json={"model": model, "prompt": "hi", "max_tokens": 2, "max_completion_tokens": None})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    ok = await iclient.post("/v1/chat/completions", headers=auth("globex"),
                            json={"model": model, "messages": GOOD["messages"], "max_completion_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


# -- 3. media types -------------------------------------------------------------------------------


@pytest.mark.parametrize("ctype", ["text/plain", "text/plain; charset=utf-8", "application/xml",
                                   "application/octet-stream", "multipart/form-data; boundary=x", "json"])
async def test_non_json_content_type_is_a_415(instant_stack, iclient, ctype):
    rec = instant_stack.recorder
    before = rec.billed("acme")
    body = json.dumps({"model": instant_stack.model, **GOOD}).encode()
    for path in ("/v1/chat/completions", "/v1/agent_runs/run-415/tool_calls"):
        resp = await iclient.post(path, headers={**auth("acme"), "content-type": ctype}, content=body)
        assert resp.status_code == 415, (path, resp.text)
        err = resp.json()["error"]
        assert err["code"] == "unsupported_media_type" and ctype.split(";")[0] in err["message"]
        assert "application/json" in err["message"]
    assert rec.billed("acme") == before


@pytest.mark.parametrize("ctype", [None, "application/json", "application/json; charset=utf-8",
                                   "Application/JSON", "application/vnd.kvmeter+json",
                                   "application/x-www-form-urlencoded"])  # the last: curl -d without -H
async def test_json_and_missing_content_types_are_accepted(instant_stack, iclient, ctype):
    headers = auth("acme") if ctype is None else {**auth("acme"), "content-type": ctype}
    resp = await iclient.post("/v1/chat/completions", headers=headers,
                              content=json.dumps({"model": instant_stack.model, **GOOD}).encode())
    assert resp.status_code == 200, resp.text
    assert ctype is not None or "content-type" not in resp.request.headers


# -- 4. conflicting header lines ------------------------------------------------------------------


@pytest.mark.parametrize("header, display, code", [("idempotency-key", "Idempotency-Key", "invalid_idempotency_key"),
                                                   ("x-agent-run-id", "X-Agent-Run-Id", "invalid_request")])
async def test_one_header_sent_twice_with_different_values_is_a_400(instant_stack, iclient, header, display,
                                                                    code):
    rec = instant_stack.recorder
    before = rec.billed("acme")
    body = json.dumps({"model": instant_stack.model, **GOOD}).encode()
    twice = [("authorization", f"Bearer {KEYS['acme']}"), ("content-type", "application/json"),
             (header, f"dup-{header}-a"), (header, f"dup-{header}-b")]
    resp = await iclient.post("/v1/chat/completions", headers=twice, content=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert (err["param"], err["code"]) == (display, code)
    assert display in err["message"] and "different values" in err["message"]
    assert rec.attempt(resp.headers["x-request-id"]).status == "invalid"
    assert rec.billed("acme") == before
    # the same value twice is one header (a proxy may repeat it)
    same = twice[:3] + [(header, f"dup-{header}-a")]
    ok = await iclient.post("/v1/chat/completions", headers=same, content=body)
    assert ok.status_code == 200, ok.text
    assert rec.billed("acme") == before + 1


@pytest.mark.parametrize("header, first, second, display, code", [
    ("authorization", "Bearer {acme}", "Bearer {globex}", "Authorization", "invalid_api_key"),
    ("x-api-key", "{acme}", "{globex}", "x-api-key", "invalid_api_key"),
    ("content-type", "application/json", "text/plain", "Content-Type", "invalid_request")])
async def test_credentials_or_media_type_sent_twice_with_different_values_is_a_400(
        instant_stack, iclient, header, first, second, display, code):
    rec = instant_stack.recorder
    before = {t: rec.billed(t) for t in ("acme", "globex")}
    body = json.dumps({"model": instant_stack.model, **GOOD}).encode()
    base = [] if header == "content-type" else [("content-type", "application/json")]
    if header != "authorization" and header != "x-api-key":
        base.append(("authorization", f"Bearer {KEYS['acme']}"))
    twice = base + [(header, first.format(**KEYS)), (header, second.format(**KEYS))]
    for order in (twice, base + twice[len(base):][::-1]):  # whichever comes first: refused
        resp = await iclient.post("/v1/chat/completions", headers=order, content=body)
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert (err["param"], err["code"]) == (display, code)
        assert KEYS["acme"] not in resp.text and KEYS["globex"] not in resp.text  # keys never echoed
    assert {t: rec.billed(t) for t in ("acme", "globex")} == before


# -- 5. refusals on /metrics ---------------------------------------------------------------------


async def _counts(client: httpx.AsyncClient, family_name: str, *labels: str) -> dict[tuple[str, ...], float]:
    """``label values -> count`` of counter ``family_name`` (summed over the other labels), read
    from the server's ``/metrics``."""
    text = (await client.get("/metrics")).text
    out: dict[tuple[str, ...], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == family_name:
            for s in family.samples:
                if s.name == family_name + "_total":
                    key = tuple(s.labels[name] for name in labels)
                    out[key] = out.get(key, 0.0) + s.value
    return out


async def _refused(client: httpx.AsyncClient) -> dict[tuple[str, ...], float]:
    return await _counts(client, REFUSED, "status", "code")


async def test_refusals_before_admission_are_counted_by_status_and_code(instant_stack, iclient):
    model = instant_stack.model
    before = await _refused(iclient)
    h = auth("acme")
    sent = [
        await iclient.post("/v1/chat/completions", json={"model": model, **GOOD}),  # no key
        await iclient.get("/v1/models", headers={"authorization": "Bearer sk-nope-nope-nope"}),
        await iclient.post("/v1/chat/completions", headers=h, json={"model": model, **GOOD, "max_tokens": -1}),
        await iclient.post("/v1/completions", headers=h, json={"model": model, **GOOD, "max_tokens": -1}),
        await iclient.post("/v1/chat/completions", headers={**h, "content-type": "text/plain"}, content=b"{}"),
        # a client-chosen model name and route never become label values
        await iclient.post("/v1/chat/completions", headers=h, json={**GOOD, "model": 'evil"} 1\nx{'}),
        await iclient.get('/v1/evil"route'),
        await iclient.post("/v1/agent_runs/r-1/tool_calls", headers=h, json={"evil_field": 1}),
    ]
    assert [r.status_code for r in sent] == [401, 401, 400, 400, 415, 404, 404, 400]
    after = await _refused(iclient)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    assert delta == {("401", "missing_api_key"): 1, ("401", "invalid_api_key"): 1, ("400", "invalid_value"): 2,
                     ("415", "unsupported_media_type"): 1, ("404", "model_not_found"): 1, ("404", "not_found"): 1,
                     ("400", "unknown_parameter"): 1}
    for status, code in after:
        assert (status.isdigit() or status == "other") and code in REFUSAL_CODES | {"other", "none"}
    # admitted requests, and refusals by the quota (published as admission decisions), are not refusals here
    rejected = "kvmeter_admission_rejected_requests"
    quota_before = await _counts(iclient, rejected, "reason", "level")
    quota_refused = await iclient.post("/v1/chat/completions", headers={**h, "x-agent-run-id": "has space"},
                                       json={"model": model, **GOOD})
    assert quota_refused.status_code == 400 and quota_refused.json()["error"]["level"] == "agent_run"
    assert (await iclient.post("/v1/chat/completions", headers=h, json={"model": model, **GOOD})).status_code == 200
    assert await _refused(iclient) == after
    quota_after = await _counts(iclient, rejected, "reason", "level")
    key = ("invalid_request", "agent_run")
    assert quota_after[key] == quota_before.get(key, 0.0) + 1


# -- 6. the tool-call report --------------------------------------------------------------------


@pytest.mark.parametrize("body, param, code", [
    ({"cnt": 5}, "cnt", "unknown_parameter"),
    ({"count": 1, "run_id": "other"}, "run_id", "unknown_parameter"),
    ({"count": True}, "count", "invalid_value"),
    ({"count": 1.0}, "count", "invalid_value"),
    ({"count": "3"}, "count", "invalid_value"),
    ({"count": None}, "count", "invalid_value"),
    ({"count": -5}, "count", "invalid_request"),
    ({"count": 0}, "count", "invalid_request"),
    ({"count": 10**30}, "count", "invalid_request"),
    ([1, 2], None, "invalid_json"),
])
async def test_bad_tool_call_reports_are_400s_naming_the_field_and_count_nothing(instant_stack, iclient, body,
                                                                                param, code):
    run = f"run-bad-{abs(hash(json.dumps(body))) % 10**8}"
    resp = await iclient.post(f"/v1/agent_runs/{run}/tool_calls", headers=auth("acme"), json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert (err["param"], err["code"]) == (param, code), err
    assert err["message"]
    ok = await iclient.post(f"/v1/agent_runs/{run}/tool_calls", headers=auth("acme"))
    assert ok.status_code == 200 and ok.json()["tool_calls"] == 1  # the refused report counted nothing


@pytest.mark.parametrize("run", ["", "%20a", "a%09b", "r" * 300])
async def test_tool_call_report_with_a_missing_or_bad_run_id_is_a_400(instant_stack, iclient, run):
    resp = await iclient.post(f"/v1/agent_runs/{run}/tool_calls", headers=auth("acme"), json={"count": 1})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "run_id" and "run id" in err["message"]
    assert ("is missing" in err["message"]) == (run == "")


async def test_tool_call_report_without_a_key_is_a_401(instant_stack, iclient):
    resp = await iclient.post("/v1/agent_runs/r-1/tool_calls", json={"count": 1})
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "missing_api_key"


def test_refusal_labels_come_from_fixed_sets_only():
    from kvmeter.bus import StatsBus
    from kvmeter.exporters.prometheus import install_prometheus
    from kvmeter.stats import RequestRefused

    bus, registry = StatsBus(), CollectorRegistry()
    exporter = install_prometheus(bus, registry)
    try:
        for status, code in ((400, "invalid_value"), (400, "made up by someone"), (200, ""), (999, "not_found")):
            bus.publish(RequestRefused(status, code, "other"))
        got = {(s.labels["status"], s.labels["code"]): s.value
               for family in registry.collect() if family.name == REFUSED
               for s in family.samples if s.name == REFUSED + "_total"}
        assert got == {("400", "invalid_value"): 1, ("400", "other"): 1, ("other", "none"): 1,
                       ("other", "not_found"): 1}
    finally:
        exporter.close()
