"""The HTTP surface on a real uvicorn server with the instant engine: bad input is a 400 naming the
field as vLLM's OpenAI server names it (the instant engine runs vLLM's serving layer), a client
that leaves mid-body is a quiet 499, over-long headers never break the attempt record, and nothing
refused is billed."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tests.serving.gateway.conftest import KEYS, auth

GOOD = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def _eventually(predicate: Callable[[], bool], timeout_s: float = 15.0) -> None:
    """Wait for the server (same event loop) to get to ``predicate``; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the server never got there"
        await asyncio.sleep(0.02)


@pytest.fixture
async def iclient(instant_stack):
    async with httpx.AsyncClient(base_url=instant_stack.base_url, timeout=60) as c:
        yield c


def _no_server_errors(caplog) -> None:
    bad = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not bad, [f"{r.levelname} {r.name}: {r.getMessage()[:200]}" for r in bad]


async def test_seed_beyond_int64_is_a_400_naming_seed_and_bills_nothing(instant_stack, iclient, caplog):
    rec = instant_stack.recorder
    before = rec.billed("acme")
    body = {"model": instant_stack.model, **GOOD}
    for seed in (2**64, 2**70, 2**63, -(2**63) - 1):
        resp = await iclient.post("/v1/chat/completions", headers=auth("acme"), json={**body, "seed": seed})
        assert resp.status_code == 400, (seed, resp.text)
        err = resp.json()["error"]
        # vLLM's answer to a body its pydantic model refuses (FastAPI's loc under "body")
        assert (err["type"], err["param"], err["code"]) == ("Bad Request", "body.seed", 400)
        assert str(seed) not in err["message"]  # the offending value is never echoed
        assert rec.attempt(resp.headers["x-kvmeter-request-id"]).status == "invalid"
    # an integer literal too long for Python's int() is malformed JSON (vLLM's answer), not a 500
    resp = await iclient.post("/v1/chat/completions", headers={**auth("acme"), "content-type": "application/json"},
                              content=b'{"seed": 1' + b"0" * 5000 + b"}")
    err = resp.json()["error"]
    assert (resp.status_code, err["type"], err["code"], err["param"]) == (400, "Bad Request", 400, "body")
    assert "number is too long" in err["message"]
    assert rec.billed("acme") == before
    ok = await iclient.post("/v1/chat/completions", headers=auth("acme"), json={**body, "seed": 2**63 - 1})
    assert ok.status_code == 200 and rec.billed("acme") == before + 1
    _no_server_errors(caplog)


@pytest.mark.parametrize("field", ["n", "max_tokens", "min_tokens", "seed"])
async def test_json_true_is_read_as_vllm_reads_it_and_billed_by_that_value(instant_stack, iclient, field):
    """vLLM's request models are lax (``true`` is 1, as pydantic reads it): kvmeter answers as vLLM's
    server does, and reserves and bills by the value vLLM runs with."""
    rec = instant_stack.recorder
    body = {"model": instant_stack.model, "messages": GOOD["messages"], "max_tokens": 3, "min_tokens": 0,
            field: True}
    resp = await iclient.post("/v1/chat/completions", headers=auth("acme"), json=body)
    assert resp.status_code == 200, resp.text
    out = 1 if field == "max_tokens" else 3
    assert len(resp.json()["choices"]) == 1 and resp.json()["usage"]["completion_tokens"] == out
    [event] = [e for e in rec.events if e.request_id == resp.headers["x-kvmeter-request-id"]]
    assert (event.tokens.output_tokens, event.reserved.output_tokens) == (out, out)


@pytest.mark.parametrize("prompt, param", [([-1], "body.prompt.0"), (None, "prompt"), ("", "prompt"),
                                           ({"text": "hi"}, "body.prompt"), ([10**9], None)])
async def test_completion_prompt_error_names_prompt(instant_stack, iclient, prompt, param):
    rec = instant_stack.recorder
    before = rec.billed("acme")
    resp = await iclient.post("/v1/completions", headers=auth("acme"),
                              json={"model": instant_stack.model, "prompt": prompt, "max_tokens": 2})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert (err["param"], err["code"]) == (param, 400)
    assert "prompt" in err["message"] or "vocabulary" in err["message"]
    # refused before admission (a token id outside the vocabulary too): nothing reserved or billed
    assert rec.attempt(resp.headers["x-kvmeter-request-id"]).status == "invalid"
    assert rec.billed("acme") == before


async def _send_and_hang_up(port: int, path: str, tenant: str) -> None:
    """Headers announcing a 62-byte body, 10 bytes of it, then close (a raw socket)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEYS[tenant]}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: 62\r\n\r\n".encode() + b'{"model": ')
    await writer.drain()
    writer.close()
    await writer.wait_closed()


async def test_client_leaving_mid_body_is_a_quiet_499_and_bills_nothing(instant_stack, caplog):
    caplog.set_level(logging.INFO)
    rec = instant_stack.recorder
    before = rec.billed("globex")
    gone = lambda: [a for a in rec.attempts if a.tenant_id == "globex" and a.status_code == 499]  # noqa: E731
    for n, path in enumerate(("/v1/chat/completions", "/v1/completions"), start=1):
        await _send_and_hang_up(instant_stack.port, path, "globex")
        await _eventually(lambda n=n: len(gone()) == n)
    assert {(a.status, a.reason, a.attribution.endpoint) for a in gone()} == {
        ("error", "client_disconnected", "chat.completions"), ("error", "client_disconnected", "completions")}
    # any other route that reads a body (here the tool-call report) is as quiet
    await _send_and_hang_up(instant_stack.port, "/v1/agent_runs/run-1/tool_calls", "globex")
    await _eventually(lambda: any("client closed the connection during POST" in r.getMessage()
                                  for r in caplog.records))
    assert rec.billed("globex") == before
    _no_server_errors(caplog)


@pytest.mark.parametrize("header", ["idempotency-key", "x-agent-run-id"])
async def test_over_long_header_is_refused_and_its_attempt_recorded_bounded(instant_stack, iclient, caplog,
                                                                            header):
    rec = instant_stack.recorder
    before = rec.billed("acme")
    value = "x" * 10_000
    resp = await iclient.post("/v1/chat/completions", headers={**auth("acme"), header: value},
                              json={"model": instant_stack.model, **GOOD})
    assert resp.status_code == 400, resp.text
    attempt = rec.attempt(resp.headers["x-kvmeter-request-id"])  # recorded, not dropped as InvalidRecord
    kept = attempt.idempotency_key if header == "idempotency-key" else attempt.attribution.agent_run_id
    assert kept.startswith("sha256:") and len(kept) == 71
    assert (attempt.status, attempt.status_code) == ("invalid" if header == "idempotency-key" else "rejected", 400)
    assert rec.billed("acme") == before
    assert not any(value[:300] in r.getMessage() for r in caplog.records), "a huge header reached the log"
    _no_server_errors(caplog)


@pytest.mark.parametrize("env_model, label", [(None, "SmolLM2-135M-Instruct"), ("served-as", "served-as")])
async def test_engine_series_carry_the_served_model_name(model_dir, monkeypatch, tmp_path, env_model, label):
    from kvmeter.model import DEFAULT_MODEL_NAME
    from kvmeter.serving.config import load_serve_config
    from kvmeter.serving.engines.hf_tokenizer import HFTokenizer
    from kvmeter.serving.engines.instant import InstantEngine
    from kvmeter.serving.runtime import ServeRuntime
    from kvmeter.stats import EngineStepStats

    if env_model is None:
        monkeypatch.delenv("KVMETER_PROM_MODEL", raising=False)
    else:  # the operator's explicit label wins over the served name
        monkeypatch.setenv("KVMETER_PROM_MODEL", env_model)
    config = load_serve_config(None, {("engine", "kind"): "instant",
                                      ("ledger_dsn",): f"chdb://{tmp_path}/chdb"}, env={})
    engine = InstantEngine(HFTokenizer(model_dir), DEFAULT_MODEL_NAME)
    runtime = ServeRuntime(config, registry=CollectorRegistry(), engine=engine)  # not started: no ledger
    try:
        runtime.bus.publish(EngineStepStats(wall_ts=time.time(), num_running=3, num_waiting=1))
        labels = {"engine": "0", "model": label}
        assert runtime.registry.get_sample_value("kvmeter_engine_running_requests", labels) == 3
        text = generate_latest(runtime.registry).decode()
        assert f'kvmeter_engine_waiting_requests{{engine="0",model="{label}"}} 1.0' in text
        assert 'model=""' not in text
    finally:
        runtime.exporter.close()


async def test_one_attribution_object_is_carried_from_admission_to_every_record(instant_stack, iclient):
    from kvmeter.stats import AdmissionDecision, RequestCompletion

    seen: list = []
    bus = instant_stack.runtime.bus
    unsubscribe = [bus.subscribe(AdmissionDecision, seen.append), bus.subscribe(RequestCompletion, seen.append)]
    try:
        resp = await iclient.post("/v1/chat/completions", headers={**auth("acme"), "x-agent-run-id": "run-42"},
                                  json={"model": instant_stack.model, **GOOD})
        assert resp.status_code == 200, resp.text
        rid = resp.headers["x-request-id"]
        await _eventually(lambda: any(isinstance(s, RequestCompletion) for s in seen))
    finally:
        for u in unsubscribe:
            u()
    (event,) = [e for e in instant_stack.recorder.events if e.request_id == rid]
    attempt = instant_stack.recorder.attempt(rid)
    a = event.attribution
    # built once from the principal, the run id header, the served model and the endpoint...
    assert (a.tenant_id, a.agent_run_id, a.model, a.endpoint) == ("acme", "run-42", instant_stack.model,
                                                                  "chat.completions")
    assert a.api_key_id and a.tier and a.workspace_id and a.project_id
    # ...and the same object everywhere it went (a copy would be equal, not identical)
    assert attempt.attribution is a
    assert all(s.attribution is a for s in seen), seen
    assert event.reserved == attempt.reserved and event.tokens.output_tokens == 2
    assert resp.json()["usage"]["completion_tokens"] == event.tokens.output_tokens  # wire name on the wire only


async def test_an_unknown_model_is_a_404_naming_the_served_models(instant_stack, iclient):
    import openai

    listed = (await iclient.get("/v1/models", headers=auth("acme"))).json()["data"]
    assert [m["id"] for m in listed] == [instant_stack.model]
    sdk = openai.AsyncOpenAI(base_url=f"{instant_stack.base_url}/v1", api_key=KEYS["acme"], max_retries=0)
    with pytest.raises(openai.NotFoundError) as refused:
        await sdk.chat.completions.create(model="no-such-model", messages=GOOD["messages"], max_tokens=2)
    # (vLLM's own answer on the in-process path, which the remote path and an engine pool give too)
    said = refused.value.body["message"]
    assert said == f"The model `no-such-model` does not exist. Valid aliases: {instant_stack.model}."
    assert refused.value.body["param"] == "model"
