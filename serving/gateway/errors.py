"""OpenAI-style error responses, and the one place a refusal becomes one.

Every error leaves the gateway as ``{"error": {"message", "type", "param", "code"}}`` with the
matching HTTP status, as OpenAI's API does, so existing clients surface the message. The refusals
other packages raise — :class:`~kvmeter.serving.tenancy.AuthError`,
:class:`~kvmeter.serving.quota.QuotaRejected`, the :class:`~kvmeter.serving.quota.IdempotencyError`
family, :class:`~kvmeter.serving.scheduler.SchedulerRejected` — share the base
:class:`~kvmeter.errors.Refusal` with :class:`ApiError`, and :func:`api_error` alone translates
them (status, code, message, ``Retry-After``, headers, a quota refusal's level and dimension).

A refusal that brings its whole body (``error_body()``: vLLM's error answers,
:class:`~kvmeter.serving.openai_api.errors.OpenAIError`) is answered with that body unchanged.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from kvmeter.errors import Refusal, merge_headers, retry_after_headers

__all__ = ["ApiError", "api_error", "error_response", "merge_headers", "retry_after_headers"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "insufficient_quota",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class ApiError(Refusal):
    """An error to return to the client: a :class:`~kvmeter.errors.Refusal` in the OpenAI shape.

    Args:
        status: HTTP status (4xx for the client's fault, 5xx for ours); also ``status_code``.
        message: human-readable; never contains secrets.
        code: machine-readable code (``context_length_exceeded``, ``invalid_api_key``, ...).
        param: the offending request field, if any.
        headers: extra headers (``Retry-After``, ``x-ratelimit-*``).
        type: OpenAI error type; derived from ``status`` when omitted.
        extra: more fields of the error body (a quota refusal's ``level`` and ``dimension``).
        body: the whole error body, sent instead of the OpenAI-shaped one built from the fields
            above (which still name the refusal for metrics and attempt records).
    """

    code = None

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None, type: str | None = None,
                 extra: dict | None = None, body: dict | None = None) -> None:
        super().__init__(message, status_code=status, code=code, headers=headers, param=param)
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.extra = dict(extra or {})
        self._body = body

    @property
    def status(self) -> int:
        """The HTTP status (= ``status_code``)."""
        return self.status_code

    def body_fields(self) -> dict[str, Any]:
        return dict(self.extra)

    def body(self) -> dict:
        if self._body is not None:
            return self._body
        err = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        err.update(self.extra)
        return {"error": err}


def api_error(refusal: Refusal, *, param: str | None = None) -> ApiError:
    """The client's answer to ``refusal``: the one translation of every refusal (tenancy, quota,
    idempotency, scheduler, gateway) into an HTTP error.

    Status, code, message and ``param`` are the refusal's; the headers are its
    :meth:`~kvmeter.errors.Refusal.response_headers` (``retry-after`` from ``retry_after_s``, then
    its own); the body carries its :meth:`~kvmeter.errors.Refusal.body_fields` beside OpenAI's
    four fields. ``param`` names the request field when the caller knows it better than the
    refusal does (a tool-call report's ``count``). An :class:`ApiError` is returned as it is.
    """
    if isinstance(refusal, ApiError) and param is None:
        return refusal
    whole = getattr(refusal, "error_body", None)
    return ApiError(refusal.status_code, refusal.message, code=refusal.code,
                    param=param if param is not None else refusal.param,
                    headers=refusal.response_headers(), extra=refusal.body_fields(),
                    body=whole() if callable(whole) else None)


def error_response(err: Refusal, headers: dict[str, str] | None = None) -> JSONResponse:
    """The JSON response for ``err`` (any refusal, through :func:`api_error`; plus ``headers``;
    each header name appears once)."""
    err = api_error(err)
    return JSONResponse(err.body(), status_code=err.status, headers=merge_headers(err.headers, headers))
