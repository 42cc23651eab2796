"""Every refusal shares one base, and one function turns each into the client's HTTP answer with the
status, code, message, param, headers and body fields the gateway has always sent for it."""

from __future__ import annotations

import orjson
import pytest

from kvmeter.errors import Refusal
from kvmeter.serving.gateway.errors import ApiError, api_error, error_response
from kvmeter.serving.quota import (IdempotencyConflict, IdempotencyInProgress, IdempotencyUnavailable,
                                   InvalidIdempotencyKey, QuotaRejected)
from kvmeter.serving.quota.headers import retry_after_headers
from kvmeter.serving.scheduler import SchedulerRejected
from kvmeter.serving.tenancy import AuthError


def _answer(refusal: Refusal) -> tuple[int, dict, dict]:
    response = error_response(refusal, {"x-request-id": "kvm-1"})
    headers = {k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")}
    return response.status_code, orjson.loads(response.body)["error"], headers


def test_every_refusal_type_is_a_refusal():
    for cls in (AuthError, QuotaRejected, SchedulerRejected, ApiError, InvalidIdempotencyKey,
                IdempotencyConflict, IdempotencyInProgress, IdempotencyUnavailable):
        assert issubclass(cls, Refusal), cls


def test_a_quota_refusal_carries_retry_after_its_headers_and_its_level_and_dimension():
    rej = QuotaRejected("Rate limit reached", reason="rate_limited", level="api_key",
                        dimension="requests_per_minute", retry_after_s=1.2,
                        headers={"Retry-After": "5", "x-ratelimit-limit-requests": "10"})
    assert rej.reason == rej.code == "rate_limited"
    status, body, headers = _answer(rej)
    assert status == 429
    assert body == {"message": "Rate limit reached", "type": "rate_limit_error", "param": None,
                    "code": "rate_limited", "level": "api_key", "dimension": "requests_per_minute"}
    # retry-after-ms from retry_after_s; the refusal's own Retry-After wins, one header per name
    assert headers == {"retry-after": "5", "retry-after-ms": "1200", "x-ratelimit-limit-requests": "10",
                       "x-request-id": "kvm-1"}


def test_spend_exhausted_is_402_insufficient_quota():
    status, body, _ = _answer(QuotaRejected("budget", status_code=402, reason="spend_exhausted", level="org",
                                            dimension="spend_per_day"))
    assert (status, body["type"], body["code"], body["level"]) == (402, "insufficient_quota", "spend_exhausted",
                                                                   "org")


def test_a_scheduler_refusal_sends_retry_after_and_no_quota_fields():
    rej = SchedulerRejected("queue_full", "12 requests queued (limit 12)", retry_after_s=0.25)
    assert (rej.reason, rej.level, rej.dimension) == ("queue_full", "global", "scheduler")
    status, body, headers = _answer(rej)
    assert status == 429
    assert body == {"message": "12 requests queued (limit 12)", "type": "rate_limit_error", "param": None,
                    "code": "queue_full"}
    assert headers == {**retry_after_headers(0.25), "x-request-id": "kvm-1"} == {
        "retry-after": "1", "retry-after-ms": "250", "x-request-id": "kvm-1"}


@pytest.mark.parametrize("refusal,status,code,kind", [
    (InvalidIdempotencyKey("Idempotency-Key must be 1-255 printable characters"), 400, "invalid_idempotency_key",
     "invalid_request_error"),
    (IdempotencyConflict("reused with another body"), 422, "idempotency_key_reused", "invalid_request_error"),
    (IdempotencyInProgress("still running"), 409, "idempotency_in_progress", "conflict_error"),
    (IdempotencyUnavailable("unreachable"), 503, "idempotency_store_unavailable", "server_error"),
])
def test_idempotency_refusals_name_the_header(refusal, status, code, kind):
    got_status, body, headers = _answer(refusal)
    assert (got_status, body["code"], body["type"], body["param"]) == (status, code, kind, "Idempotency-Key")
    assert body["message"] == refusal.message and headers == {"x-request-id": "kvm-1"}


def test_an_auth_refusal_is_a_401_without_the_key():
    status, body, _ = _answer(AuthError("missing API key", code="missing_api_key"))
    assert (status, body["type"], body["code"], body["message"]) == (401, "authentication_error",
                                                                     "missing_api_key", "missing API key")


def test_an_api_error_is_its_own_answer_and_a_param_override_keeps_the_rest():
    err = ApiError(413, "too big", code="request_too_large", headers={"X-A": "1"})
    assert api_error(err) is err and err.status == err.status_code == 413
    rej = QuotaRejected("count out of range", status_code=400, reason="invalid_request", level="agent_run",
                        dimension="tool_calls")
    named = api_error(rej, param="count")
    assert (named.status, named.code, named.param, named.extra) == (
        400, "invalid_request", "count", {"level": "agent_run", "dimension": "tool_calls"})
