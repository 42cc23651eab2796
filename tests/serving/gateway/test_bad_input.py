"""Bad input: each gets the right 4xx — vLLM's own error object where vLLM's OpenAI server would
refuse it too (``type`` ``BadRequestError`` / ``Bad Request`` / ``NotFoundError``, the status as
the integer ``code``), kvmeter's OpenAI-style error for its own refusals (authentication, body
limits, encoding) — nothing is billed, and the server keeps serving."""

from __future__ import annotations

import json

import pytest

from tests.serving.gateway.conftest import KEYS, auth

pytestmark = [pytest.mark.engine]

GOOD = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


#: vLLM's error types
BAD, VALIDATION, NOT_FOUND = "BadRequestError", "Bad Request", "NotFoundError"


def cases(model: str) -> list[tuple[str, dict, bytes | None, int, str | int, str | None]]:
    """(name, headers, raw body, expected status, expected error code, expected type)."""
    j = lambda d: json.dumps(d).encode()  # noqa: E731
    good = {"model": model, **GOOD}
    h = auth("hobbyist")
    return [
        ("malformed JSON", h, b'{"model": "x", ', 400, 400, VALIDATION),
        ("JSON array", h, b"[1, 2]", 400, 400, VALIDATION),
        ("empty body", h, b"", 400, 400, VALIDATION),
        ("invalid UTF-8", h, b'{"model": "\xff\xfe"}', 400, "invalid_encoding", "invalid_request_error"),
        ("lone surrogate", h, j({**good, "messages": [{"role": "user", "content": "\ud800"}]}), 400,
         "invalid_encoding", "invalid_request_error"),
        ("max_tokens as words", h, j({**good, "max_tokens": "ten"}), 400, 400, VALIDATION),
        ("negative max_tokens", h, j({**good, "max_tokens": -5}), 400, 400, BAD),
        ("absurd max_tokens", h, j({**good, "max_tokens": 10**12}), 400, 400, BAD),
        ("max_tokens past the window", h, j({**good, "max_tokens": 100_000}), 400, 400, BAD),
        ("prompt past the window", h,
         j({**good, "messages": [{"role": "user", "content": "word " * 9000}]}), 400, 400, BAD),
        ("messages not a list", h, j({**good, "messages": "hi"}), 400, 400, VALIDATION),
        ("temperature out of range", h, j({**good, "temperature": 7}), 400, 400, BAD),
        ("n = 0", h, j({**good, "n": 0}), 400, 400, BAD),
        ("n = 2 with greedy sampling", h, j({**good, "n": 2, "temperature": 0}), 400, 400, BAD),
        ("a tool without a function", h, j({**good, "tools": [{"type": "function"}]}), 400, 400, VALIDATION),
        ("tool_choice naming no tool", h, j({**good, "tools": [{"type": "function", "function": {"name": "f"}}],
                                             "tool_choice": {"type": "function", "function": {"name": "g"}}}),
         400, 400, BAD),
        ("beam search", h, j({**good, "use_beam_search": True}), 400, 400, BAD),
        ("unknown model", h, j({**good, "model": "gpt-17"}), 404, 404, NOT_FOUND),
        ("missing API key", {}, j(good), 401, "missing_api_key", "authentication_error"),
        ("unknown API key", {"authorization": "Bearer sk-nope-nope-nope"}, j(good), 401, "invalid_api_key",
         "authentication_error"),
        ("malformed auth header", {"authorization": "Basic abc"}, j(good), 401, "invalid_api_key",
         "authentication_error"),
        ("oversized body", h, b'{"model": "' + b"x" * (5 * 1024 * 1024) + b'"}', 413, "request_too_large",
         "invalid_request_error"),
        ("multipart body", {**h, "content-type": "multipart/form-data; boundary=x"}, b"--x--", 415,
         "unsupported_media_type", "invalid_request_error"),
    ]


async def test_each_bad_input_gets_a_clear_4xx_and_bills_nothing(stack, client):
    before = stack.usage_count("hobbyist")
    for name, headers, raw, status, code, kind in cases(stack.model):
        hdrs = {"content-type": "application/json", **headers}
        resp = await client.post("/v1/chat/completions", headers=hdrs, content=raw)
        assert resp.status_code == status, f"{name}: {resp.status_code} {resp.text[:200]}"
        err = resp.json()["error"]
        assert err["message"], name
        assert (err["code"], err["type"]) == (code, kind), f"{name}: {err}"
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
    rid = resp.headers["x-kvmeter-request-id"]
    rows = stack.rows("SELECT status, reason, status_code FROM attempts FINAL WHERE request_id = {r:String}", r=rid)
    assert rows == [{"status": "invalid", "reason": "invalid_value", "status_code": 400}]
