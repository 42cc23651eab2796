"""The usage event: one billable record per logical request.

This is the contract between the serving tier (which produces it when a request finishes, is
aborted or fails after admission) and the ledger (which makes it durable, deduplicates it and bills
it). It is a plain, frozen dataclass with no behaviour beyond validation and (de)serialisation.

Metering rules it encodes (see docs/ARCHITECTURE.md, "Metering rules"):

* Token counts are engine-true: ``prompt_tokens`` is what the engine prefilled or took from its
  prefix cache, ``completion_tokens`` what the engine generated — for an aborted stream, what the
  engine had generated when it was aborted, not what reached the client.
* ``cached_prompt_tokens`` is a *part of* ``prompt_tokens`` (0 ≤ cached ≤ prompt), never an addition;
  ``reasoning_tokens`` is a part of ``completion_tokens``.
* ``event_id`` is deterministic: derived from the tenant and the logical request key (the client's
  ``Idempotency-Key`` when given, else the gateway's request id), so a replay of the same logical
  request yields the same id and the ledger keeps one billable record.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "UsageEvent",
    "Outcome",
    "event_id_for",
    "EVENT_NAMESPACE",
    "SCHEMA_VERSION",
]

#: Namespace for the UUIDv5 event ids; never change it (ids in existing ledgers depend on it).
EVENT_NAMESPACE = uuid.UUID("6f1d3c2e-9b7a-5e44-8a61-2b0c4d9e7f10")

#: Version of the event's field set, carried in each serialised event.
SCHEMA_VERSION = 1

Outcome = Literal["ok", "aborted", "error"]
_OUTCOMES = ("ok", "aborted", "error")


def event_id_for(tenant_id: str, logical_key: str) -> str:
    """Deterministic event id of one logical request.

    Args:
        tenant_id: the billed tenant (dedup is scoped by tenant: two tenants that happen to send
            the same idempotency key get different ids).
        logical_key: the client's ``Idempotency-Key`` if it sent one, else the gateway request id.
    Returns:
        A UUIDv5 string (36 characters) over ``tenant_id`` and ``logical_key``.
    Raises:
        ValueError: if either argument is empty.
    """
    if not tenant_id or not logical_key:
        raise ValueError("event_id_for needs a non-empty tenant_id and logical_key")
    return str(uuid.uuid5(EVENT_NAMESPACE, f"{tenant_id}\x1f{logical_key}"))


@dataclass(frozen=True, slots=True)
class UsageEvent:
    """One logical request's usage, as billed.

    Identity and attribution:
        event_id: deterministic UUIDv5 (see :func:`event_id_for`).
        tenant_id: the billed tenant (the organisation).
        request_id: kvmeter's engine request id of the attempt that did the work.
        idempotency_key: the client's ``Idempotency-Key`` header, or ``""``.
        org_id, workspace_id, project_id, api_key_id: the principal path; ``api_key_id`` is the key's
            public id (never the secret).
        agent_run_id: the agent run this call belongs to, or ``""``.
        tier: the tenant's tier (``enterprise``, ``paid_interactive``, ``batch``, ``free``, ...).
        model: the served model name the client asked for.
        endpoint: ``chat.completions`` or ``completions``.
    Outcome:
        outcome: ``ok`` (finished: stop or length), ``aborted`` (client went away or cancelled),
            ``error`` (failed after admission).
        finish_reason: ``stop``, ``length``, ``abort`` or ``error``.
        status_code: the HTTP status the client got (200 for a stream that started).
        stream: whether the response was streamed.
    Tokens (engine-true, counts ≥ 0):
        prompt_tokens, cached_prompt_tokens (⊆ prompt), completion_tokens,
        reasoning_tokens (⊆ completion).
        reserved_prompt_tokens, reserved_completion_tokens: what admission reserved, for
            reservation-vs-actual drift.
    Times (seconds; ``arrival_ts``/``finish_ts`` are wall-clock Unix epoch, the rest durations
    measured on a monotonic clock; ``None`` when the request never reached that phase):
        queue_s: gateway arrival → engine dispatch (kvmeter's queue) plus the engine's own queue.
        ttft_s: gateway arrival → first output token leaving the engine.
        prefill_s, decode_s: engine-reported phase times.
        e2e_s: gateway arrival → last token / abort / error.
        itl_mean_s: mean inter-token latency over the stream (``None`` with < 2 tokens).
        kv_token_seconds: ∫ tokens held in KV cache dt over the request's life in the engine
            (prompt tokens from dispatch, plus each output token from when it was generated).
    Provenance:
        token_source: ``engine_hooks`` (the engine's own account: vLLM's FinishedRequestStats,
            or for a request that ended early the scheduler hook's computed-token account) or
            ``frontend`` (counted from the outputs the gateway received, where the engine gave
            no account: the remote engine).
        attempt: 1 for the first attempt of this logical request; retries that did work count up.
        preemptions: times the engine preempted this request.
    """

    event_id: str
    tenant_id: str
    request_id: str
    tier: str
    model: str
    endpoint: str
    outcome: Outcome
    finish_reason: str
    arrival_ts: float
    finish_ts: float
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0
    reasoning_tokens: int = 0
    reserved_prompt_tokens: int = 0
    reserved_completion_tokens: int = 0
    idempotency_key: str = ""
    org_id: str = ""
    workspace_id: str = ""
    project_id: str = ""
    api_key_id: str = ""
    agent_run_id: str = ""
    status_code: int = 200
    stream: bool = False
    queue_s: float | None = None
    ttft_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    e2e_s: float | None = None
    itl_mean_s: float | None = None
    kv_token_seconds: float = 0.0
    token_source: str = "engine_hooks"
    attempt: int = 1
    preemptions: int = 0
    schema_version: int = field(default=SCHEMA_VERSION)

    def __post_init__(self) -> None:
        if not self.event_id or not self.tenant_id:
            raise ValueError("UsageEvent needs event_id and tenant_id")
        if self.outcome not in _OUTCOMES:
            raise ValueError(f"UsageEvent.outcome must be one of {_OUTCOMES}, got {self.outcome!r}")
        for name in ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "reasoning_tokens",
                     "reserved_prompt_tokens", "reserved_completion_tokens", "attempt", "preemptions"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"UsageEvent.{name} must be an int >= 0, got {value!r}")
        if self.cached_prompt_tokens > self.prompt_tokens:
            raise ValueError(
                f"cached_prompt_tokens ({self.cached_prompt_tokens}) is part of prompt_tokens "
                f"({self.prompt_tokens}) and cannot exceed it")
        if self.reasoning_tokens > self.completion_tokens:
            raise ValueError(
                f"reasoning_tokens ({self.reasoning_tokens}) is part of completion_tokens "
                f"({self.completion_tokens}) and cannot exceed it")

    @property
    def total_tokens(self) -> int:
        """prompt + completion (cached and reasoning tokens are already inside those)."""
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (JSON-serialisable)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "UsageEvent":
        """Inverse of :meth:`to_dict`; unknown keys are ignored (forward compatibility).

        Raises:
            TypeError / ValueError: on missing required fields or invalid values.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @staticmethod
    def field_names() -> tuple[str, ...]:
        """Field names in declaration order (the ledger's column order)."""
        return tuple(f.name for f in dataclasses.fields(UsageEvent))
