"""The usage event: the record of one attempt's engine work, of one logical request.

This is the contract between the serving tier (which produces it when a request finishes, is
aborted or fails after admission) and the ledger (which makes it durable, deduplicates it and bills
it). It is a plain, frozen dataclass with no behaviour beyond validation and (de)serialisation.

Metering rules it encodes (see docs/ARCHITECTURE.md, "Metering rules"):

* Token counts (:class:`~kvmeter.tokens.TokenCounts`, which checks them) are engine-true:
  ``input_tokens`` is what the engine prefilled or took from its prefix cache, ``output_tokens``
  what the engine generated — for an aborted stream, what the engine had generated when it was
  aborted, not what reached the client. ``cached_input_tokens`` is a *part of* ``input_tokens``,
  never an addition; ``reasoning_tokens`` is a part of ``output_tokens``.
* The attribution (:class:`~kvmeter.attribution.Attribution`) is the request's, built once at
  admission and carried here by reference.
* ``event_id`` is deterministic: derived from the tenant and the logical request key (the client's
  ``Idempotency-Key`` with the request's fingerprint when given, else the gateway's request id), so
  every attempt of the same logical request carries the same id, and a key reused with another
  body is another logical request.
* Every attempt that reached the engine is its own usage row (``attempt_id``, from the tenant and
  the attempt's request id); one that did not complete carries its :data:`UNDELIVERED_CAUSES` cause
  and whether its tier bills that work or the platform absorbs it (``undelivered_billing``). Which
  rows make the logical request's bill is decided by the ledger's reads (docs/ARCHITECTURE.md,
  "Metering rules"): the successful attempt's, or with none the undelivered work its tier bills.
"""

from __future__ import annotations

import dataclasses
import hashlib
import uuid
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, Mapping

from kvmeter.attribution import Attribution
from kvmeter.tokens import NO_TOKENS, TokenCounts

__all__ = [
    "UsageEvent",
    "Outcome",
    "event_id_for",
    "attempt_id_for",
    "EVENT_NAMESPACE",
    "ATTEMPT_NAMESPACE",
    "SCHEMA_VERSION",
    "UNDELIVERED_CAUSES",
    "UndeliveredCause",
    "UNDELIVERED_BILLING",
    "UndeliveredBilling",
    "DEFAULT_UNDELIVERED_BILLING",
]

#: Namespace for the UUIDv5 event ids; never change it (ids in existing ledgers depend on it).
EVENT_NAMESPACE = uuid.UUID("6f1d3c2e-9b7a-5e44-8a61-2b0c4d9e7f10")

#: Namespace for deterministic attempt ids (never change it): the attempts table's and each usage
#: row's ``attempt_id``.
ATTEMPT_NAMESPACE = uuid.UUID("0c7b5a52-3d8e-5f1a-9e2b-7a4f6c1d8e03")

#: Version of the event's field set, carried in each serialised event: 1 spelled the tokens
#: prompt/completion and carried ``org_id``; 2 is the input/output vocabulary with one tenant id;
#: 3 adds each attempt's id and its undelivered cause and billing (one usage row per attempt).
SCHEMA_VERSION = 3

Outcome = Literal["ok", "aborted", "error"]
_OUTCOMES = ("ok", "aborted", "error")

#: Why an attempt's engine work reached no client (the one list; the tier policy, the gateway,
#: the ledger and the invoice use it): the client left (``client_abandoned``: disconnected or gave
#: up, before or after its first token, or stopped reading its stream and was cut after
#: ``stream_stall_timeout_s``), the server failed it (``server_failure``: an engine or
#: upstream error, an internal error), the server stopped under it (``shutdown``), or it was
#: dropped at its deadline after it had been dispatched (``deadline``: reserved, no attempt carries
#: it yet — the scheduler drops only requests still queued, which did no engine work and get no
#: usage row; their attempt record is ``rejected`` with reason ``deadline``).
UNDELIVERED_CAUSES = ("client_abandoned", "server_failure", "shutdown", "deadline")
UndeliveredCause = Literal["client_abandoned", "server_failure", "shutdown", "deadline"]
#: What becomes of undelivered work: ``billed`` to the tenant, or ``absorbed`` by the platform.
UNDELIVERED_BILLING = ("billed", "absorbed")
UndeliveredBilling = Literal["billed", "absorbed"]
#: The default policy: work the client abandoned is billed (it asked for it and left); work lost
#: to the server — a failure, a shutdown, a deadline drop — is the platform's cost.
DEFAULT_UNDELIVERED_BILLING: Mapping[str, str] = MappingProxyType({
    "client_abandoned": "billed", "server_failure": "absorbed", "shutdown": "absorbed", "deadline": "absorbed"})
assert tuple(DEFAULT_UNDELIVERED_BILLING) == UNDELIVERED_CAUSES


_EVENT_NS_BYTES = EVENT_NAMESPACE.bytes
_ATTEMPT_NS_BYTES = ATTEMPT_NAMESPACE.bytes


#: The RFC 4122 variant digit for a SHA-1 hex digit (its top two bits forced to ``10``).
_VARIANT_DIGIT = {c: "89ab"[int(c, 16) & 3] for c in "0123456789abcdef"}


def _uuid5(namespace: bytes, name: str) -> str:
    """``str(uuid.uuid5(namespace, name))`` without building a ``UUID`` object (RFC 4122 §4.3:
    the first 16 bytes of SHA-1 over namespace + name, version digit 5, variant bits ``10``),
    written straight from the hex digest. The ledger computes one per usage and attempt row it
    encodes: 1.0 µs against 6.5 µs through ``uuid.uuid5`` (bench/ledger/RESULTS.md, "record()
    after migration 0006"); tests/core/test_event_ids.py checks it equals ``uuid.uuid5``."""
    x = hashlib.sha1(namespace + name.encode("utf-8")).hexdigest()
    return f"{x[:8]}-{x[8:12]}-5{x[13:16]}-{_VARIANT_DIGIT[x[16]]}{x[17:20]}-{x[20:32]}"


def event_id_for(tenant_id: str, logical_key: str, fingerprint: str = "") -> str:
    """Deterministic event id of one logical request.

    Args:
        tenant_id: the billed tenant (dedup is scoped by tenant: two tenants that happen to send
            the same idempotency key get different ids).
        logical_key: the client's ``Idempotency-Key`` if it sent one, else the gateway request id.
        fingerprint: with an ``Idempotency-Key``, the request's fingerprint (a digest of its
            canonical body, :func:`kvmeter.serving.gateway.replays.fingerprint`): the same key sent
            with another body is another logical request, so it can never rewrite the first one's
            bill, even after the idempotency store forgot the key (a restart of the in-memory store).
            ``""``: the id of the key alone (requests without a key; records before schema 3).
    Returns:
        A UUIDv5 string (36 characters) over ``tenant_id``, ``logical_key`` and ``fingerprint``.
    Raises:
        ValueError: if ``tenant_id`` or ``logical_key`` is empty.
    """
    if not tenant_id or not logical_key:
        raise ValueError("event_id_for needs a non-empty tenant_id and logical_key")
    name = f"{tenant_id}\x1f{logical_key}" + (f"\x1f{fingerprint}" if fingerprint else "")
    return _uuid5(_EVENT_NS_BYTES, name)


def attempt_id_for(tenant_id: str, request_id: str) -> str:
    """Deterministic id of one HTTP attempt: UUIDv5 over tenant and request id.

    A re-recorded attempt (crash replay) keeps its id, so the attempts table keeps one row, and
    its usage row one row.
    Raises:
        ValueError: if either argument is empty.
    """
    if not tenant_id or not request_id:
        raise ValueError("attempt_id_for needs a non-empty tenant_id and request_id")
    return _uuid5(_ATTEMPT_NS_BYTES, f"{tenant_id}\x1f{request_id}")


@dataclass(frozen=True, slots=True)
class UsageEvent:
    """One attempt's usage (the usage row of one attempt of a logical request).

    Identity and attribution:
        event_id: deterministic UUIDv5 of the logical request (see :func:`event_id_for`): every
            attempt of it carries the same one.
        request_id: kvmeter's engine request id of the attempt that did the work (its row's key,
            with the tenant: :attr:`attempt_id`).
        attribution: the request's :class:`~kvmeter.attribution.Attribution` (tenant, key path,
            tier, agent run, model, endpoint); :attr:`tenant_id` is its tenant.
        idempotency_key: the client's ``Idempotency-Key`` header, or ``""``.
    Outcome:
        outcome: ``ok`` (finished: stop or length), ``aborted`` (client went away or cancelled),
            ``error`` (failed after admission).
        finish_reason: ``stop``, ``length``, ``abort`` or ``error``.
        status_code: the HTTP status the client got (200 for a stream that started).
        stream: whether the response was streamed.
    Tokens:
        tokens: engine-true :class:`~kvmeter.tokens.TokenCounts`.
        reserved: what admission reserved (``input_tokens`` and ``output_tokens``; the parts are
            0), for reservation-vs-actual drift.
    Times (seconds; ``arrival_ts``/``finish_ts`` are wall-clock Unix epoch, the rest durations
    measured on a monotonic clock; ``None`` when the request never reached that phase):
        queue_s: gateway arrival → engine dispatch (kvmeter's queue) plus the engine's own queue.
        ttft_s: gateway arrival → first output token leaving the engine.
        prefill_s, decode_s: engine-reported phase times.
        e2e_s: gateway arrival → last token / abort / error.
        itl_mean_s: mean inter-token latency over the stream (``None`` with < 2 tokens).
        kv_token_seconds: ∫ tokens held in KV cache dt over the request's life in the engine
            (input tokens from dispatch, plus each output token from when it was generated).
    Provenance:
        undelivered_cause: for an attempt that did not complete (``aborted``, ``error``), why its
            work reached no client (one of :data:`UNDELIVERED_CAUSES`); ``""`` for ``ok`` and for
            records that name no cause (written before schema 3: billed as they were).
        undelivered_billing: with a cause, ``billed`` or ``absorbed``, as the request's tier
            decided it when the attempt was recorded
            (:attr:`~kvmeter.serving.tenancy.TierPolicy.undelivered_billing`); ``""`` without one.
        token_source: ``engine_hooks`` (the engine's own account: vLLM's FinishedRequestStats,
            or for a request that ended early the scheduler hook's computed-token account),
            ``frontend`` (counted from the outputs the gateway received, where the engine gave
            no account: the remote engine's upstream usage) or ``estimate`` (the remote engine
            when no upstream usage covers the counts: kvmeter's count of the prompt and of the
            streamed text, :mod:`kvmeter.serving.gateway.upstream`).
        attempt: 1 for the first attempt of this logical request; retries that did work count up.
        preemptions: times the engine preempted this request.
    Raises:
        ValueError: an empty event id or tenant, an unknown outcome, a bad attempt or preemption
            count (token counts are checked by :class:`~kvmeter.tokens.TokenCounts`).
        TypeError: ``attribution``, ``tokens`` or ``reserved`` of the wrong type.
    """

    event_id: str
    request_id: str
    attribution: Attribution
    outcome: Outcome
    finish_reason: str
    arrival_ts: float
    finish_ts: float
    tokens: TokenCounts
    reserved: TokenCounts = NO_TOKENS
    idempotency_key: str = ""
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
    undelivered_cause: str = ""
    undelivered_billing: str = ""
    schema_version: int = field(default=SCHEMA_VERSION)

    def __post_init__(self) -> None:
        if type(self.attribution) is not Attribution:
            raise TypeError(f"UsageEvent.attribution must be an Attribution, got {self.attribution!r}")
        if type(self.tokens) is not TokenCounts or type(self.reserved) is not TokenCounts:
            raise TypeError("UsageEvent.tokens and UsageEvent.reserved must be TokenCounts")
        if not self.event_id or not self.attribution.tenant_id:
            raise ValueError("UsageEvent needs event_id and tenant_id")
        if self.outcome not in _OUTCOMES:
            raise ValueError(f"UsageEvent.outcome must be one of {_OUTCOMES}, got {self.outcome!r}")
        for name in ("attempt", "preemptions"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"UsageEvent.{name} must be an int >= 0, got {value!r}")
        cause, billing = self.undelivered_cause, self.undelivered_billing
        if cause:
            if cause not in UNDELIVERED_CAUSES:
                raise ValueError(f"UsageEvent.undelivered_cause must be one of {UNDELIVERED_CAUSES}, got {cause!r}")
            if self.outcome == "ok":
                raise ValueError("UsageEvent.undelivered_cause must be empty for an ok outcome")
            if billing not in UNDELIVERED_BILLING:
                raise ValueError(f"UsageEvent.undelivered_billing must be one of {UNDELIVERED_BILLING} "
                                 f"with a cause, got {billing!r}")
        elif billing:
            raise ValueError("UsageEvent.undelivered_billing needs an undelivered_cause")

    @property
    def tenant_id(self) -> str:
        """The billed tenant (``attribution.tenant_id``)."""
        return self.attribution.tenant_id

    @property
    def attempt_id(self) -> str:
        """The attempt's deterministic id (:func:`attempt_id_for` of tenant and request id): the
        key of its usage row and of its attempt record; the nil UUID without a request id)."""
        if not self.request_id:
            return "00000000-0000-0000-0000-000000000000"
        return attempt_id_for(self.attribution.tenant_id, self.request_id)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field, ``attribution``, ``tokens`` and ``reserved`` as nested
        dicts (JSON-serialisable)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "UsageEvent":
        """Inverse of :meth:`to_dict`; unknown keys are ignored (forward compatibility).

        Raises:
            TypeError / ValueError: on missing required fields or invalid values.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        if isinstance(values.get("attribution"), dict):
            values["attribution"] = Attribution(**values["attribution"])
        for name in ("tokens", "reserved"):
            if isinstance(values.get(name), dict):
                values[name] = TokenCounts(**values[name])
        return cls(**values)
