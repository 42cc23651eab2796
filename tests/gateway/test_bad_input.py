"""Bad input: each gets the right 4xx with an OpenAI-style error, nothing is billed, and the server
keeps serving."""

from __future__ import annotations

import json

import pytest

from tests.gateway.conftest import KEYS, auth

pytestmark = [pytest.mark.engine]

GOOD = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def cases(model: str) -> list[tuple[str, dict, bytes | None, int, str | None]]:
    """(name, headers, raw body, expected status, expected error code)."""
    j = lambda d: json.dumps(d).encode()  # noqa: E731
    good = {"model": model, **GOOD}
    h = auth("hobbyist")
    return [
        ("malformed JSON", h, b'{"model": "x", ', 400, "invalid_json"),
        ("JSON array", h, b"[1, 2]", 400, "invalid_json"),
        ("empty body", h, b"", 400, "invalid_json"),
        ("invalid UTF-8", h, b'{"model": "\xff\xfe"}', 400, "invalid_encoding"),
        ("lone surrogate", h, j({**good, "messages": [{"role": "user", "content": "\ud800"}]}), 400,
         "invalid_encoding"),
        ("max_tokens as string", h, j({**good, "max_tokens": "10"}), 400, "invalid_value"),
        ("negative max_tokens", h, j({**good, "max_tokens": -5}), 400, "invalid_value"),
        ("absurd max_tokens", h, j({**good, "max_tokens": 10**12}), 400, "invalid_value"),
        ("max_tokens past the window", h, j({**good, "max_tokens": 100_000}), 400,
         "context_length_exceeded"),
        ("prompt past the window", h,
         j({**good, "messages": [{"role": "user", "content": "word " * 9000}]}), 400,
         "context_length_exceeded"),
        ("messages not a list", h, j({**good, "messages": "hi"}), 400, "invalid_value"),
        ("unknown role", h, j({**good, "messages": [{"role": "wizard", "content": "hi"}]}), 400,
         "invalid_value"),
        ("temperature out of range", h, j({**good, "temperature": 7}), 400, "invalid_value"),
        ("n = 3", h, j({**good, "n": 3}), 400, "unsupported_parameter"),
        ("tools", h, j({**good, "tools": [{"type": "function"}]}), 400, "unsupported_parameter"),
        ("unknown model", h, j({**good, "model": "gpt-17"}), 404, "model_not_found"),
        ("missing API key", {}, j(good), 401, "missing_api_key"),
        ("unknown API key", {"authorization": "Bearer sk-nope-nope-nope"}, j(good), 401, "invalid_api_key"),
        ("malformed auth header", {"authorization": "Basic abc"}, j(good), 401, "invalid_api_key"),
        ("oversized body", h, b'{"model": "' + b"x" * (5 * 1024 * 1024) + b'"}', 413, "request_too_large"),
        ("multipart body", {**h, "content-type": "multipart/form-data; boundary=x"}, b"--x--", 415,
         "unsupported_media_type"),
    ]


async def test_each_bad_input_gets_a_clear_4xx_and_bills_nothing(stack, client):
    before = stack.usage_count("hobbyist")
    for name, headers, raw, status, code in cases(stack.model):
        hdrs = {"content-type": "application/json", **headers}
        resp = await client.post("/v1/chat/completions", headers=hdrs, content=raw)
        assert resp.status_code == status, f"{name}: {resp.status_code} {resp.text[:200]}"
        err = resp.json()["error"]
        assert err["message"] and err["type"], name
        assert err["code"] == code, f"{name}: code {err['code']}"
        assert KEYS["hobbyist"] not in resp.text, f"{name}: the API key leaked into the response"
    assert stack.usage_count("hobbyist") == before, "bad input was billed"
    # still serving
    ok = await client.post("/v1/chat/completions", headers=auth("acme"), json={"model": stack.model, **GOOD})
    assert ok.status_code == 200


async def test_unknown_route_and_method_are_json_errors(stack, client):
    resp = await client.get("/v1/nothing-here")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"
    resp = await client.get("/v1/chat/completions")
    assert resp.status_code == 405 and resp.json()["error"]["type"] == "invalid_request_error"


async def test_rejections_and_invalid_requests_are_recorded_as_attempts(stack, client):
    resp = await client.post("/v1/chat/completions", headers=auth("hobbyist"),
                             json={"model": stack.model, **GOOD, "max_tokens": -1})
    rid = resp.headers["x-request-id"]
    rows = stack.rows("SELECT status, reason, status_code FROM attempts FINAL WHERE request_id = {r:String}", r=rid)
    assert rows == [{"status": "invalid", "reason": "invalid_value", "status_code": 400}]
