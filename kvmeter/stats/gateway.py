"""Plain stats objects the gateway publishes on a :class:`kvmeter.bus.StatsBus` (besides
:class:`kvmeter.stats.AdmissionDecision` and :class:`kvmeter.stats.RequestCompletion`).

Nothing here imports an exporter; exporters subscribe to these types.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RequestRefused", "REFUSAL_CODES", "REFUSAL_ENDPOINTS"]

#: Every error code the gateway answers a refusal with (its own, and the tenancy, idempotency and
#: quota codes it passes on from the tool-call route). A fixed set, so an exporter can use it as a
#: label's allowed values; a code not listed here should be labelled ``other``.
REFUSAL_CODES = frozenset({
    # authentication (serving/tenancy)
    "missing_api_key", "invalid_api_key",
    # the body (body.py)
    "invalid_content_length", "request_too_large", "unsupported_media_type", "request_timeout",
    "invalid_json", "invalid_encoding",
    # the request's fields (protocol.py, handler.py, tools.py)
    "invalid_value", "unsupported_parameter", "unknown_parameter", "model_not_found",
    "context_length_exceeded", "invalid_request",
    # Idempotency-Key (serving/quota/idempotency.py, replays.py)
    "invalid_idempotency_key", "idempotency_key_reused", "idempotency_in_progress",
    "idempotency_store_unavailable", "idempotent_response_unavailable",
    # quota errors on the tool-call route (serving/quota/gate.py)
    "quota_store_unavailable",
    # routing (app.py)
    "not_found", "method_not_allowed",
})

#: The ``endpoint`` values of :class:`RequestRefused`.
REFUSAL_ENDPOINTS = ("chat.completions", "completions", "models", "agent_runs.tool_calls", "other")


@dataclass(slots=True)
class RequestRefused:
    """A request answered with an error before any admission decision: authentication, a bad
    body or field, an unknown model or route, an Idempotency-Key refusal, a body that did not
    arrive in time. Refusals by the quota or the scheduler are
    :class:`~kvmeter.stats.AdmissionDecision` (``admitted=False``) instead, never both; a client
    that left before its answer (499) is neither. Nothing refused is billed.

    Attributes:
        status_code: the HTTP status answered (4xx; 503 for an unreachable idempotency store).
        code: the error code of the body (``invalid_value``, ``request_timeout``...; "" if none).
            Set by the code, never from request text; see :data:`REFUSAL_CODES`.
        endpoint: one of :data:`REFUSAL_ENDPOINTS` (``other``: an unknown route).
        tenant_id, tier: the caller's, "" when it was not authenticated.
        wall_ts: wall-clock epoch seconds.
    """

    status_code: int
    code: str
    endpoint: str
    tenant_id: str = ""
    tier: str = ""
    wall_ts: float = 0.0
