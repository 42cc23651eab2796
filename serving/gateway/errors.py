"""OpenAI-style error responses.

Every error leaves the gateway as ``{"error": {"message", "type", "param", "code"}}`` with the
matching HTTP status, as OpenAI's API does, so existing clients surface the message.
"""

from __future__ import annotations

import math

from starlette.responses import JSONResponse

__all__ = ["ApiError", "error_response", "retry_after_header", "merge_headers"]

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


class ApiError(Exception):
    """An error to return to the client.

    Args:
        status: HTTP status (4xx for the client's fault, 5xx for ours).
        message: human-readable; never contains secrets.
        code: machine-readable code (``context_length_exceeded``, ``invalid_api_key``, ...).
        param: the offending request field, if any.
        headers: extra headers (``Retry-After``, ``x-ratelimit-*``).
        type: OpenAI error type; derived from ``status`` when omitted.
    """

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None, type: str | None = None,
                 extra: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = dict(headers or {})
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.extra = dict(extra or {})

    def body(self) -> dict:
        err = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        err.update(self.extra)
        return {"error": err}


def merge_headers(*parts: dict[str, str] | None) -> dict[str, str]:
    """Merge header dicts by lower-cased name, later parts winning, so a name is never sent
    twice (``Retry-After`` and ``retry-after`` are one header)."""
    out: dict[str, str] = {}
    for part in parts:
        for name, value in (part or {}).items():
            out[name.lower()] = value
    return out


def error_response(err: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    """The JSON response for ``err`` (plus ``headers``; each header name appears once)."""
    return JSONResponse(err.body(), status_code=err.status, headers=merge_headers(err.headers, headers))


def retry_after_header(seconds: float | None) -> dict[str, str]:
    """``retry-after`` in whole seconds, rounded up (RFC 9110 §10.2.3 delay-seconds), and
    ``retry-after-ms`` unrounded in milliseconds (as OpenAI sends it); {} for None."""
    if seconds is None:
        return {}
    s = max(0.0, seconds)
    return {"retry-after": str(math.ceil(s)), "retry-after-ms": str(math.ceil(s * 1000))}
