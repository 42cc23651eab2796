"""Stats of the gateway: every admitted request when it ends, every admission decision (the
quota's and the scheduler's, at the front door), every refusal before admission, and the sends of
every streamed answer once it has ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmeter.attribution import Attribution
from kvmeter.tokens import TokenCounts

__all__ = ["RequestCompletion", "RequestPhase", "TRACE_CONTEXT_HEADERS", "AdmissionDecision", "RequestRefused",
           "REFUSAL_CODES", "REFUSAL_ENDPOINTS", "StreamSendStats"]

#: Every error code the gateway answers a refusal with (its own, and the tenancy, idempotency and
#: quota codes it passes on from the tool-call route). A fixed set, so an exporter can use it as a
#: label's allowed values; a code not listed here should be labelled ``other``.
REFUSAL_CODES = frozenset({
    # authentication (serving/tenancy)
    "missing_api_key", "invalid_api_key",
    # the body (body.py)
    "invalid_content_length", "request_too_large", "unsupported_media_type", "request_timeout",
    "invalid_json", "invalid_encoding",
    # the request's fields (serving/openai_api/errors.py, remote_path.py, handler.py, tools.py)
    "invalid_value", "unsupported_parameter", "unknown_parameter", "model_not_found",
    "context_length_exceeded", "invalid_request",
    # Idempotency-Key (serving/quota/idempotency.py, replays.py)
    "invalid_idempotency_key", "idempotency_key_reused", "idempotency_in_progress",
    "idempotency_store_unavailable", "idempotent_response_unavailable",
    # quota errors on the tool-call route (serving/quota/gate.py)
    "quota_store_unavailable",
    # the tool-call report and the approvals API (serving/agents/errors.py), and a request's
    # declared tools refused by the tool policy (AgentRuns.check_declared_tools)
    "agent_store_unavailable", "approval_forbidden", "approval_not_found", "approval_already_decided",
    "approval_expired", "tool_blocked", "tool_not_allowed",
    # routing (app.py)
    "not_found", "method_not_allowed",
    # the engine pool's replicas API, a key that is not an admin's (serving/gateway/replicas.py)
    "permission_denied",
})

#: The ``endpoint`` values of :class:`RequestRefused`.
REFUSAL_ENDPOINTS = ("chat.completions", "completions", "models", "agent_runs.tool_calls", "approvals", "other")


#: The W3C Trace Context headers (https://www.w3.org/TR/trace-context/) a request's completion
#: carries as received, for the trace exporters to join the caller's trace.
TRACE_CONTEXT_HEADERS = ("traceparent", "tracestate")


@dataclass(frozen=True, slots=True)
class RequestPhase:
    """One phase of an admitted request, in seconds from its gateway arrival (the gateway's clock).

    Attributes:
        name: ``queue`` (arrival → the engine starts it: the gateway's scheduler queue, then the
            engine's waiting queue as the engine measured it), ``prefill`` (→ the first output
            token reaches the gateway) or ``decode`` (first → last output token).
        start_s, end_s: offsets from arrival, ``0 ≤ start_s ≤ end_s ≤ e2e_s``.
    """

    name: str
    start_s: float
    end_s: float


@dataclass(slots=True)
class RequestCompletion:
    """Gateway-side view of one request when it ends, for latency, token and goodput metrics.

    Published for every admitted request (ok, aborted or error) right after its usage event.

    Attributes:
        attribution: the request's (tenant, tier, model, ...).
        outcome: ``ok``, ``aborted`` or ``error``.
        tokens: engine-true counts (the usage event's).
        ttft_s: gateway arrival → first token sent (``None`` if none was sent).
        itls_s: the stream's inter-token latencies in seconds (gaps between successive output
            chunks, divided evenly over the tokens in each chunk).
        e2e_s: gateway arrival → end.
        queue_s: gateway arrival → engine dispatch.
        stream: the client asked for a stream (SSE).
        slo_met: whether the request met its tier's TTFT and ITL SLO (``None`` when no SLO is set);
            goodput counts the tokens of requests with ``slo_met`` true.
        wall_ts: wall-clock epoch seconds at the end.
        phases: the request's :class:`RequestPhase` s in order (``queue``; ``prefill`` once a
            first token came; ``decode`` with two output tokens or more).
        response_id: the ``id`` of the answer (``chatcmpl-...`` / ``cmpl-...``), ``""`` when unknown.
        finish_reasons: one finish reason per choice, in the answer's choice order, as the answer
            sent it (``stop``, ``length``, ``tool_calls``...; ``abort`` / ``error`` for a choice that
            did not finish).
        trace_headers: the request's :data:`TRACE_CONTEXT_HEADERS` as received, ``(name, value)``
            pairs in order (lower-case names; a header sent twice appears twice); unvalidated.
        reprefill_input_tokens: input tokens the engine prefilled again although the gateway saw
            the same prefix computed within its window and the prefix cache did not serve them
            (prompt-cache thrash, ≥ 0; part of ``tokens.input_tokens`` − cached; 0 where the
            engine reports no prefix-cache hits): :mod:`kvmeter.serving.gateway.reprefill`.
    """

    attribution: Attribution
    outcome: str
    tokens: TokenCounts
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    queue_s: float = 0.0
    slo_met: bool | None = None
    wall_ts: float = 0.0
    stream: bool = False
    phases: tuple[RequestPhase, ...] = ()
    response_id: str = ""
    finish_reasons: tuple[str, ...] = ()
    trace_headers: tuple[tuple[str, str], ...] = ()
    reprefill_input_tokens: int = 0


@dataclass(frozen=True, slots=True)
class StreamSendStats:
    """How one streamed (SSE) answer of an admitted request went out to its client, published once
    the stream has ended (completed, left by the client, or cut) — after its
    :class:`RequestCompletion`, which the usage event's durability precedes
    (``kvmeter.serving.gateway.stall`` defines each quantity).

    Attributes:
        attribution: the request's.
        duration_s: the stream's first send (its headers) → the end of its last send or its cut,
            seconds (the gateway's monotonic clock).
        sent_bytes: body bytes the client's connection accepted.
        send_blocked_s: seconds sends waited for the client to read (back-pressure).
        blocked_bytes: body bytes of the sends that waited.
        blocked_kv_token_s: KV tokens the request held × seconds its sends waited (token-seconds; a
            lower bound: the engine may generate while a send waits).
        longest_block_s: the longest single wait, seconds.
        stall_cut: the stream was cut because one send waited ``stream_stall_timeout_s`` (the
            request was aborted in the engine and billed as a client disconnect).
        wall_ts: wall-clock epoch seconds at the end.
    """

    attribution: Attribution
    duration_s: float = 0.0
    sent_bytes: int = 0
    send_blocked_s: float = 0.0
    blocked_bytes: int = 0
    blocked_kv_token_s: float = 0.0
    longest_block_s: float = 0.0
    stall_cut: bool = False
    wall_ts: float = 0.0


@dataclass(slots=True)
class AdmissionDecision:
    """One admission decision at the gateway (quota and scheduler front door).

    Attributes:
        attribution: the request's (tenant, tier, key path, model, ...).
        admitted: True if admitted.
        reason: ``admitted`` or the rejection reason (``rate_limited``, ``quota_exceeded``,
            ``context_length_exceeded``, ``queue_full``, ``deadline``, ``shed``, ...).
        level: principal level that bound (``org``, ``workspace``, ``project``, ``api_key``,
            ``agent_run``, ``global``) or ``""``.
        dimension: limit dimension that bound (``requests_per_minute``, ``input_tokens_per_minute``,
            ... ) or ``""``.
        status_code: HTTP status returned (200 when admitted).
        wall_ts: wall-clock epoch seconds.
    """

    attribution: Attribution
    admitted: bool
    reason: str = "admitted"
    level: str = ""
    dimension: str = ""
    status_code: int = 200
    wall_ts: float = 0.0


@dataclass(slots=True)
class RequestRefused:
    """A request answered with an error before any admission decision: authentication, a bad
    body or field, an unknown model or route, an Idempotency-Key refusal, a body that did not
    arrive in time. Refusals by the quota or the scheduler are
    :class:`AdmissionDecision` (``admitted=False``) instead, never both; a client
    that left before its answer (499) is neither. Nothing refused is billed.

    Attributes:
        status_code: the HTTP status answered (4xx; 503 for an unreachable idempotency store).
        code: the error code of the body (``invalid_value``, ``request_timeout``...; "" if none).
            Set by the code, never from request text; see :data:`REFUSAL_CODES`.
        endpoint: one of :data:`REFUSAL_ENDPOINTS` (``other``: an unknown route).
        attribution: the caller's (its principal, with this endpoint; no model: the request may
            have been refused for naming an unknown one), ``None`` when it was not authenticated.
        wall_ts: wall-clock epoch seconds.
    """

    status_code: int
    code: str
    endpoint: str
    attribution: Attribution | None = None
    wall_ts: float = 0.0
