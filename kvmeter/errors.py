"""Refusals: the one base of every error that answers a request with an HTTP refusal.

Tenancy (:class:`~kvmeter.serving.tenancy.AuthError`), quota
(:class:`~kvmeter.serving.quota.QuotaRejected`, the
:class:`~kvmeter.serving.quota.IdempotencyError` family), scheduler
(:class:`~kvmeter.serving.scheduler.SchedulerRejected`) and gateway
(:class:`~kvmeter.serving.gateway.errors.ApiError`) raise subclasses of :class:`Refusal`; the
gateway turns any of them into the client's answer in one place
(:func:`kvmeter.serving.gateway.errors.api_error`). This module is a core type: it imports nothing
from kvmeter, so every package can raise a refusal without an import cycle.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["Refusal", "retry_after_headers", "merge_headers", "NO_RETRY_HEADERS"]

#: The header that tells OpenAI's SDKs not to retry a refusal. They retry 408, 409, 429 and every
#: 5xx on their own (openai-python ``BaseClient._should_retry``; the default is 2 retries) unless
#: the answer says ``x-should-retry: false``; sent on refusals that retrying the same request
#: cannot fix (a spent agent-run budget, a stopped run, an approval that waits for a person), with
#: the status OpenAI clients expect kept.
NO_RETRY_HEADERS: dict[str, str] = {"x-should-retry": "false"}


def retry_after_headers(retry_after_s: float | None) -> dict[str, str]:
    """``retry-after`` in whole seconds, rounded up (RFC 9110 §10.2.3 delay-seconds), and
    ``retry-after-ms`` unrounded in milliseconds (as OpenAI sends it); ``{}`` for None. A negative
    delay counts as 0."""
    if retry_after_s is None:
        return {}
    s = max(0.0, retry_after_s)
    return {"retry-after": str(math.ceil(s)), "retry-after-ms": str(math.ceil(s * 1000))}


def merge_headers(*parts: dict[str, str] | None) -> dict[str, str]:
    """Merge header dicts by lower-cased name, later parts winning, so a name is never sent
    twice (``Retry-After`` and ``retry-after`` are one header)."""
    out: dict[str, str] = {}
    for part in parts:
        for name, value in (part or {}).items():
            out[name.lower()] = value
    return out


class Refusal(Exception):
    """A request refused, with what its HTTP answer needs.

    Attributes:
        message: human-readable; never contains secrets.
        status_code: HTTP status (4xx: the client's request or limits; 5xx: ours).
        code: machine-readable reason (``rate_limited``, ``queue_full``, ``invalid_api_key``, ...);
            the OpenAI error body's ``code`` (``None`` only for a gateway error that has none).
        retry_after_s: seconds the client should wait before retrying (≥ 0), or ``None``; sent
            as ``retry-after`` / ``retry-after-ms``.
        level: the principal level that refused (``org``, ..., ``agent_run``, ``global``), or ``""``.
        dimension: the limit that refused (``requests_per_minute``, ``scheduler``, ...), or ``""``.
        headers: extra response headers (``x-ratelimit-*``, ...).
        param: the request field the refusal is about, or ``None``.
    A subclass sets ``status_code`` and ``code`` as class defaults where they are fixed, and says
    in :meth:`body_fields` which of its attributes the error body carries beyond OpenAI's four.
    """

    status_code: int = 400
    code: str | None = "invalid_request"

    def __init__(self, message: str, *, status_code: int | None = None, code: str | None = None,
                 retry_after_s: float | None = None, level: str = "", dimension: str = "",
                 headers: dict[str, str] | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status_code is not None:
            self.status_code = status_code
        if code is not None:
            self.code = code
        self.retry_after_s = retry_after_s
        self.level = level
        self.dimension = dimension
        self.headers = dict(headers or {})
        self.param = param

    def response_headers(self) -> dict[str, str]:
        """The answer's headers: ``retry-after``/``retry-after-ms`` from ``retry_after_s``, then
        :attr:`headers` (by lower-cased name; :attr:`headers` win)."""
        return merge_headers(retry_after_headers(self.retry_after_s), self.headers)

    def body_fields(self) -> dict[str, Any]:
        """Fields the error body carries besides ``message``/``type``/``param``/``code`` (none)."""
        return {}
