"""Records the ledger stores besides the :class:`~kvmeter.events.UsageEvent`, and how each
record becomes one spool line.

* :class:`AttemptRecord` — one HTTP attempt as the gateway decided it (admitted, rejected with a
  reason, idempotent replay, ...). Every attempt is recorded; only usage events are billed.
* :class:`Adjustment` — a signed money correction (credit < 0, debit > 0) for one tenant.
* :class:`SignalSample` — one point of a generic time series (the exporters' ClickHouse sink).

A spool line is a JSON array in the stream's column order (ClickHouse ``JSONCompactEachRow``),
so the drain hands the spool bytes to ClickHouse without re-parsing them in Python. Every
encoder validates first: anything that reaches the spool is insertable, so one bad record can
never block the drain (see :class:`~kvmeter.ledger.errors.InvalidRecord`).
"""

from __future__ import annotations

import operator
import re
import uuid
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, Callable, Literal, Mapping

import msgspec
from msgspec import Meta

from kvmeter.events import UsageEvent
from kvmeter.stats import EngineRequestStats

from .errors import InvalidRecord

__all__ = [
    "AttemptRecord",
    "AttemptStatus",
    "Adjustment",
    "SignalSample",
    "StreamSpec",
    "USAGE_STREAM",
    "ATTEMPT_STREAM",
    "ENGINE_STREAM",
    "STREAMS",
    "attempt_id_for",
    "encode_usage",
    "encode_attempt",
    "encode_engine",
    "NIL_UUID",
]

#: Namespace for deterministic attempt ids (never change it).
ATTEMPT_NAMESPACE = uuid.UUID("0c7b5a52-3d8e-5f1a-9e2b-7a4f6c1d8e03")
#: Namespace for deterministic adjustment ids.
ADJUSTMENT_NAMESPACE = uuid.UUID("a2e9f3c4-6b71-5d08-8c5e-1f2a3b4c5d6e")
NIL_UUID = "00000000-0000-0000-0000-000000000000"

AttemptStatus = Literal["admitted", "rejected", "replayed", "invalid", "error"]
_ATTEMPT_STATUSES = ("admitted", "rejected", "replayed", "invalid", "error")

# DateTime64 holds 1900..2299; the ledger accepts 2000-01-01 .. 2200-01-01 as plausible epochs.
_MIN_TS = 946_684_800.0
_MAX_TS = 7_258_118_400.0
_MAX_U32 = 2**32 - 1
_MAX_STR = 4096
_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_encoder = msgspec.json.Encoder()


def attempt_id_for(tenant_id: str, request_id: str) -> str:
    """Deterministic id of one HTTP attempt: UUIDv5 over tenant and request id.

    A re-recorded attempt (crash replay) keeps its id, so the attempts table keeps one row.
    Raises:
        ValueError: if either argument is empty.
    """
    if not tenant_id or not request_id:
        raise ValueError("attempt_id_for needs a non-empty tenant_id and request_id")
    return str(uuid.uuid5(ATTEMPT_NAMESPACE, f"{tenant_id}\x1f{request_id}"))


@dataclass(frozen=True, slots=True)
class AttemptRecord:
    """One HTTP attempt at the gateway, recorded when admission decides it.

    Attributes:
        tenant_id: the tenant (org) the key belongs to.
        request_id: kvmeter's request id of this attempt (the engine sees the same id).
        status: ``admitted`` (sent to the scheduler/engine), ``rejected`` (429/402/400 by quota
            or scheduler: see ``reason``), ``replayed`` (an idempotent replay served from the
            stored result: no engine work), ``invalid`` (bad request before admission), ``error``
            (failed before any engine work).
        ts: wall-clock Unix epoch seconds of the decision.
        event_id: the logical request's event id (:func:`kvmeter.events.event_id_for`), or ``""``.
        reason: ``admitted`` or the rejection/shed reason (``rate_limited``, ``queue_full``...).
        status_code: HTTP status sent (200 when admitted and the response started).
        tier, model, endpoint, org_id, workspace_id, project_id, api_key_id, agent_run_id,
            idempotency_key: attribution, as in :class:`~kvmeter.events.UsageEvent`.
        reserved_prompt_tokens, reserved_completion_tokens: what admission reserved (0 if none).
        attempt: 1 for the logical request's first attempt, counting up on retries.
        level, dimension: for a quota rejection, the principal level and limit dimension that
            refused it (``project`` / ``input_tokens_per_minute``); ``""`` otherwise.
        attempt_id: deterministic id; empty → :func:`attempt_id_for` (tenant, request id).
    Raises:
        InvalidRecord: on an unknown status or empty tenant/request id.
    """

    tenant_id: str
    request_id: str
    status: AttemptStatus
    ts: float
    event_id: str = ""
    reason: str = "admitted"
    status_code: int = 200
    tier: str = ""
    model: str = ""
    endpoint: str = ""
    org_id: str = ""
    workspace_id: str = ""
    project_id: str = ""
    api_key_id: str = ""
    agent_run_id: str = ""
    idempotency_key: str = ""
    reserved_prompt_tokens: int = 0
    reserved_completion_tokens: int = 0
    attempt: int = 1
    attempt_id: str = ""
    level: str = ""
    dimension: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.tenant_id, str) or not self.tenant_id:
            raise InvalidRecord("AttemptRecord.tenant_id must be a non-empty string")
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidRecord("AttemptRecord.request_id must be a non-empty string")
        if self.status not in _ATTEMPT_STATUSES:
            raise InvalidRecord(f"AttemptRecord.status must be one of {_ATTEMPT_STATUSES}, got {self.status!r}")
        if not self.attempt_id:
            object.__setattr__(self, "attempt_id", attempt_id_for(self.tenant_id, self.request_id))


@dataclass(frozen=True, slots=True)
class Adjustment:
    """A signed money correction on a tenant's bill.

    Attributes:
        tenant_id: the tenant (org) billed.
        amount: Decimal in the price list's currency; negative = credit, positive = debit.
            At most 18 decimal places (ClickHouse ``Decimal(38, 18)``).
        ts: wall-clock epoch seconds at which it takes effect (decides the billing period).
        reason: free text shown on the invoice (≤ 4096 characters).
        reference: an external reference (ticket, event id), part of the deterministic id.
        org_id, workspace_id, project_id, api_key_id: optional narrower attribution.
        created_by: who issued it.
        adjustment_id: deterministic id; empty → UUIDv5(tenant, reference, ts, amount), so
            issuing the same correction twice stores it once.
    Raises:
        InvalidRecord: on a non-Decimal amount, too many decimal places or an empty tenant.
    """

    tenant_id: str
    amount: Decimal
    ts: float
    reason: str
    reference: str = ""
    org_id: str = ""
    workspace_id: str = ""
    project_id: str = ""
    api_key_id: str = ""
    created_by: str = ""
    adjustment_id: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.tenant_id, str) or not self.tenant_id:
            raise InvalidRecord("Adjustment.tenant_id must be a non-empty string")
        if isinstance(self.amount, float) or not isinstance(self.amount, (Decimal, int, str)):
            raise InvalidRecord(f"Adjustment.amount must be a Decimal (never a float), got {self.amount!r}")
        try:
            amount = Decimal(self.amount)
        except InvalidOperation:
            raise InvalidRecord(f"Adjustment.amount {self.amount!r} is not a decimal number") from None
        if not amount.is_finite():
            raise InvalidRecord(f"Adjustment.amount must be finite, got {amount!r}")
        exponent = amount.as_tuple().exponent
        if isinstance(exponent, int) and exponent < -18:
            raise InvalidRecord(f"Adjustment.amount {amount} has more than 18 decimal places")
        if abs(amount) >= Decimal(10) ** 20:
            raise InvalidRecord(f"Adjustment.amount {amount} is out of range (|amount| < 1e20)")
        object.__setattr__(self, "amount", amount)
        _check_ts("Adjustment.ts", self.ts)
        if not self.adjustment_id:
            key = f"{self.tenant_id}\x1f{self.reference}\x1f{self.ts!r}\x1f{amount}"
            object.__setattr__(self, "adjustment_id", str(uuid.uuid5(ADJUSTMENT_NAMESPACE, key)))


@dataclass(frozen=True, slots=True)
class SignalSample:
    """One sample of a generic time series stored in ClickHouse's ``signals`` table.

    Attributes:
        ts: wall-clock epoch seconds.
        name: metric name in Prometheus style with its unit (``kvmeter_kv_watermark_ratio``).
        value: the sample value (float; NaN allowed, as in Prometheus).
        labels: label name → value (strings).
    Raises:
        InvalidRecord: on a bad name, non-string labels or a non-numeric value.
    """

    ts: float
    name: str
    value: float
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _METRIC_NAME.match(self.name):
            raise InvalidRecord(f"SignalSample.name {self.name!r} is not a valid metric name")
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)):
            raise InvalidRecord(f"SignalSample.value must be a number, got {self.value!r}")
        _check_ts("SignalSample.ts", self.ts)
        for k, v in self.labels.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise InvalidRecord(f"SignalSample.labels must map str to str, got {k!r}: {v!r}")


# --------------------------------------------------------------------------- validation helpers


def _check_ts(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _MIN_TS <= value < _MAX_TS:
        raise InvalidRecord(f"{name} must be wall-clock epoch seconds in 2000..2200, got {value!r}")


# --------------------------------------------------------------------------- spool streams


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """One spool stream and the ClickHouse table it drains into.

    Attributes:
        name: directory name under the spool dir (``usage``, ``attempts``, ``engine``).
        table: target table.
        schema: version of the column list written in each spool block.
        columns: column order of the JSON arrays, per schema version.
    """

    name: str
    table: str
    schema: int
    columns: Mapping[int, tuple[str, ...]]

    def columns_for(self, schema: int) -> tuple[str, ...]:
        """Column list of a block written with ``schema`` (KeyError if unknown)."""
        return self.columns[schema]


USAGE_COLUMNS: tuple[str, ...] = UsageEvent.field_names()
#: Attempt columns; schema 2 added the refusing limit's ``level`` and ``dimension``.
_ATTEMPT_COLUMNS_V1: tuple[str, ...] = (
    "attempt_id", "event_id", "tenant_id", "request_id", "status", "reason", "status_code", "ts",
    "tier", "model", "endpoint", "org_id", "workspace_id", "project_id", "api_key_id", "agent_run_id",
    "idempotency_key", "reserved_prompt_tokens", "reserved_completion_tokens", "attempt",
)
ATTEMPT_COLUMNS: tuple[str, ...] = _ATTEMPT_COLUMNS_V1 + ("level", "dimension")
#: Engine record columns: EngineRequestStats' fields, then the tenant the ledger attributed the
#: request to from its admitted attempt ("" when unknown). Schema 1 lacked the tenant.
_ENGINE_STATS_COLUMNS: tuple[str, ...] = (
    "request_id", "finish_reason", "prompt_tokens", "generation_tokens", "cached_prompt_tokens",
    "queued_s", "prefill_s", "decode_s", "inference_s", "e2e_s", "mean_tpot_s", "preemptions", "wall_ts",
)
ENGINE_COLUMNS: tuple[str, ...] = _ENGINE_STATS_COLUMNS + ("tenant_id",)

USAGE_STREAM = StreamSpec("usage", "usage_events", 1, {1: USAGE_COLUMNS})
ATTEMPT_STREAM = StreamSpec("attempts", "attempts", 2, {1: _ATTEMPT_COLUMNS_V1, 2: ATTEMPT_COLUMNS})
ENGINE_STREAM = StreamSpec("engine", "engine_requests", 2, {1: _ENGINE_STATS_COLUMNS, 2: ENGINE_COLUMNS})
STREAMS: tuple[StreamSpec, ...] = (USAGE_STREAM, ATTEMPT_STREAM, ENGINE_STREAM)

# Row shapes (scalar fields only, so untracked by the cycle collector: gc=False), validated in C by msgspec.convert (about 2 µs per usage event, against ~6 µs for the
# same checks in Python) and encoded as JSON arrays in column order.
_Str = Annotated[str, Meta(max_length=_MAX_STR)]
_U32 = Annotated[int, Meta(ge=0, le=_MAX_U32)]
_U16 = Annotated[int, Meta(ge=0, le=65535)]
_Status = Annotated[int, Meta(ge=0, le=999)]
_Ts = Annotated[float, Meta(ge=_MIN_TS, lt=_MAX_TS)]
_Dur = Annotated[float, Meta(ge=0, lt=1e12)]  # also refuses NaN and infinities


class _UsageRow(msgspec.Struct, array_like=True, gc=False):
    event_id: uuid.UUID
    tenant_id: _Str
    request_id: _Str
    tier: _Str
    model: _Str
    endpoint: _Str
    outcome: _Str
    finish_reason: _Str
    arrival_ts: _Ts
    finish_ts: _Ts
    prompt_tokens: _U32
    completion_tokens: _U32
    cached_prompt_tokens: _U32
    reasoning_tokens: _U32
    reserved_prompt_tokens: _U32
    reserved_completion_tokens: _U32
    idempotency_key: _Str
    org_id: _Str
    workspace_id: _Str
    project_id: _Str
    api_key_id: _Str
    agent_run_id: _Str
    status_code: _Status
    stream: bool
    queue_s: _Dur | None
    ttft_s: _Dur | None
    prefill_s: _Dur | None
    decode_s: _Dur | None
    e2e_s: _Dur | None
    itl_mean_s: _Dur | None
    kv_token_seconds: _Dur
    token_source: _Str
    attempt: _U32
    preemptions: _U32
    schema_version: _U16


class _AttemptRow(msgspec.Struct, array_like=True, gc=False):
    attempt_id: uuid.UUID
    event_id: uuid.UUID
    tenant_id: _Str
    request_id: _Str
    status: _Str
    reason: _Str
    status_code: _Status
    ts: _Ts
    tier: _Str
    model: _Str
    endpoint: _Str
    org_id: _Str
    workspace_id: _Str
    project_id: _Str
    api_key_id: _Str
    agent_run_id: _Str
    idempotency_key: _Str
    reserved_prompt_tokens: _U32
    reserved_completion_tokens: _U32
    attempt: _U32
    level: _Str
    dimension: _Str


class _EngineRow(msgspec.Struct, array_like=True, gc=False):
    request_id: Annotated[str, Meta(min_length=1, max_length=_MAX_STR)]
    finish_reason: _Str
    prompt_tokens: _U32
    generation_tokens: _U32
    cached_prompt_tokens: _U32
    queued_s: _Dur
    prefill_s: _Dur
    decode_s: _Dur
    inference_s: _Dur
    e2e_s: _Dur
    mean_tpot_s: _Dur
    preemptions: _U32
    wall_ts: _Ts
    tenant_id: _Str


for _row, _cols in ((_UsageRow, USAGE_COLUMNS), (_AttemptRow, ATTEMPT_COLUMNS), (_EngineRow, ENGINE_COLUMNS)):
    assert tuple(_row.__struct_fields__) == _cols, f"{_row.__name__} out of step with its column list"

_INDEX = re.compile(r"\$\[(\d+)\]")


def _convert(values: tuple[Any, ...], row: type, columns: tuple[str, ...], what: str) -> Any:
    try:
        return msgspec.convert(values, row)
    except msgspec.ValidationError as exc:
        text = str(exc)
        m = _INDEX.search(text)
        name = columns[int(m.group(1))] if m else "?"
        value = values[int(m.group(1))] if m else None
        raise InvalidRecord(f"{what}.{name} = {value!r}: {text.split(' - at ')[0]}") from None


_usage_values: Callable[[UsageEvent], tuple[Any, ...]] = operator.attrgetter(*USAGE_COLUMNS)


def encode_usage(event: UsageEvent) -> bytes:
    """Validate a usage event for storage and encode it as one JSON array (no newline).

    Checks beyond :class:`UsageEvent`'s own: ``event_id`` is a UUID, strings ≤ 4096 chars,
    counts fit UInt32, timestamps are epoch seconds in 2000..2200 with finish ≥ arrival,
    durations and ``kv_token_seconds`` finite and ≥ 0, ``status_code`` in 0..999.
    Raises:
        InvalidRecord: naming the field and value.
    """
    if type(event) is not UsageEvent:
        raise InvalidRecord(f"record() takes a kvmeter.events.UsageEvent, got {type(event).__name__}")
    row = _convert(_usage_values(event), _UsageRow, USAGE_COLUMNS, "UsageEvent")
    if row.finish_ts < row.arrival_ts:
        raise InvalidRecord(f"UsageEvent.finish_ts ({event.finish_ts}) is before arrival_ts ({event.arrival_ts})")
    return _encoder.encode(row)


_attempt_values: Callable[[AttemptRecord], tuple[Any, ...]] = operator.attrgetter(*ATTEMPT_COLUMNS)


def encode_attempt(attempt: AttemptRecord) -> bytes:
    """Validate an :class:`AttemptRecord` and encode it as one JSON array (``""`` event id →
    the nil UUID).

    Raises:
        InvalidRecord: naming the field and value.
    """
    if type(attempt) is not AttemptRecord:
        raise InvalidRecord(f"record_attempt() takes an AttemptRecord, got {type(attempt).__name__}")
    values = _attempt_values(attempt)
    if not attempt.event_id:
        values = (values[0], NIL_UUID) + values[2:]
    return _encoder.encode(_convert(values, _AttemptRow, ATTEMPT_COLUMNS, "AttemptRecord"))


_engine_values: Callable[[EngineRequestStats], tuple[Any, ...]] = operator.attrgetter(*_ENGINE_STATS_COLUMNS)


def encode_engine(stats: EngineRequestStats, now_wall: float, tenant_id: str = "") -> bytes:
    """Validate the engine's account of one finished request and encode it as a JSON array.

    Args:
        stats: from the engine hooks (published on the bus).
        now_wall: wall-clock epoch seconds used when ``stats.wall_ts`` is 0 (unset).
        tenant_id: the tenant whose admitted attempt carried this request id, or ``""``.
    Raises:
        InvalidRecord: naming the field and value.
    """
    if type(stats) is not EngineRequestStats:
        raise InvalidRecord(f"expected EngineRequestStats, got {type(stats).__name__}")
    values = _engine_values(stats)
    if not stats.wall_ts:
        values = values[:-1] + (now_wall,)
    values = values + (tenant_id,)
    return _encoder.encode(_convert(values, _EngineRow, ENGINE_COLUMNS, "EngineRequestStats"))
