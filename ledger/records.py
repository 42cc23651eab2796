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

Two boundaries live here, one each:

* **Records → columns.** A record carries its :class:`~kvmeter.attribution.Attribution` and its
  :class:`~kvmeter.tokens.TokenCounts` by reference; :func:`column_getter` is the one function that
  flattens them into the ledger's columns (``tenant_id``, ..., ``input_tokens``, ...), used by every
  row encoder and by :meth:`~kvmeter.ledger.Ledger.adjust`.
* **Old spool lines → columns.** Blocks written by an earlier kvmeter carry an older column list
  (their schema version, kept in :class:`StreamSpec`); :meth:`StreamSpec.decode` is the one place
  that maps them to today's columns: the token columns of the prompt/completion vocabulary are
  renamed by :data:`LEGACY_COLUMN_NAMES`, ``org_id`` (the tenant's second id) is dropped
  (:data:`LEGACY_DROPPED_COLUMNS`) and a column an old block lacks but can be computed from it is
  derived (:attr:`StreamSpec.derived`: a usage row's ``attempt_id`` from its tenant and request
  id), so a spool written before an upgrade still drains after it, each attempt its own row.
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

from kvmeter.attribution import ATTRIBUTION_FIELDS, Attribution
from kvmeter.events import ATTEMPT_NAMESPACE, UsageEvent, attempt_id_for
from kvmeter.stats import EngineRequestStats
from kvmeter.tokens import NO_TOKENS, TOKEN_FIELDS, TokenCounts

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
    "column_getter",
    "LEGACY_COLUMN_NAMES",
    "LEGACY_DROPPED_COLUMNS",
    "encode_usage",
    "encode_attempt",
    "encode_engine",
    "NIL_UUID",
    "ATTEMPT_NAMESPACE",
]

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
_decoder = msgspec.json.Decoder()
#: A block's JSON-array lines: bytes, or a spool view with ``tobytes()``.
_Payload = Any


@dataclass(frozen=True, slots=True)
class AttemptRecord:
    """One HTTP attempt at the gateway, recorded when admission decides it.

    Attributes:
        attribution: the request's :class:`~kvmeter.attribution.Attribution` (for a request
            refused before admission: the caller's principal with the served model and the
            endpoint); :attr:`tenant_id` is its tenant.
        request_id: kvmeter's request id of this attempt (the engine sees the same id).
        status: ``admitted`` (sent to the scheduler/engine), ``rejected`` (429/402/400 by quota
            or scheduler: see ``reason``), ``replayed`` (an idempotent replay served from the
            stored result: no engine work), ``invalid`` (bad request before admission), ``error``
            (failed before any engine work).
        ts: wall-clock Unix epoch seconds of the decision.
        event_id: the logical request's event id (:func:`kvmeter.events.event_id_for`), or ``""``.
        reason: ``admitted`` or the rejection/shed reason (``rate_limited``, ``queue_full``...).
        status_code: HTTP status sent (200 when admitted and the response started).
        idempotency_key: the client's ``Idempotency-Key``, or ``""``.
        reserved: what admission reserved (``input_tokens``, ``output_tokens``; zero if none).
        attempt: 1 for the logical request's first attempt, counting up on retries.
        level, dimension: for a quota rejection, the principal level and limit dimension that
            refused it (``project`` / ``input_tokens_per_minute``); ``""`` otherwise.
        attempt_id: deterministic id; empty → :func:`attempt_id_for` (tenant, request id).
    Raises:
        InvalidRecord: on an unknown status, an empty tenant or request id, or an attribution or
            reservation of the wrong type.
    """

    attribution: Attribution
    request_id: str
    status: AttemptStatus
    ts: float
    event_id: str = ""
    reason: str = "admitted"
    status_code: int = 200
    idempotency_key: str = ""
    reserved: TokenCounts = NO_TOKENS
    attempt: int = 1
    attempt_id: str = ""
    level: str = ""
    dimension: str = ""

    def __post_init__(self) -> None:
        if type(self.attribution) is not Attribution or not self.attribution.tenant_id:
            raise InvalidRecord("AttemptRecord.attribution must be an Attribution with a tenant_id")
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidRecord("AttemptRecord.request_id must be a non-empty string")
        if self.status not in _ATTEMPT_STATUSES:
            raise InvalidRecord(f"AttemptRecord.status must be one of {_ATTEMPT_STATUSES}, got {self.status!r}")
        if type(self.reserved) is not TokenCounts:
            raise InvalidRecord(f"AttemptRecord.reserved must be TokenCounts, got {self.reserved!r}")
        if not self.attempt_id:
            object.__setattr__(self, "attempt_id", attempt_id_for(self.tenant_id, self.request_id))

    @property
    def tenant_id(self) -> str:
        """The tenant (``attribution.tenant_id``)."""
        return self.attribution.tenant_id


@dataclass(frozen=True, slots=True)
class Adjustment:
    """A signed money correction on a tenant's bill.

    Attributes:
        attribution: the tenant billed, optionally narrowed to a workspace, project or API key
            (``Attribution("acme")`` for the whole tenant; the per-request fields stay empty);
            :attr:`tenant_id` is its tenant.
        amount: Decimal in the price list's currency; negative = credit, positive = debit.
            At most 18 decimal places (ClickHouse ``Decimal(38, 18)``).
        ts: wall-clock epoch seconds at which it takes effect (decides the billing period).
        reason: free text shown on the invoice (≤ 4096 characters).
        reference: an external reference (ticket, event id), part of the deterministic id.
        created_by: who issued it.
        adjustment_id: deterministic id; empty → UUIDv5(tenant, reference, ts, amount), so
            issuing the same correction twice stores it once.
    Raises:
        InvalidRecord: on a non-Decimal amount, too many decimal places or an empty tenant.
    """

    attribution: Attribution
    amount: Decimal
    ts: float
    reason: str
    reference: str = ""
    created_by: str = ""
    adjustment_id: str = ""

    def __post_init__(self) -> None:
        if type(self.attribution) is not Attribution or not self.attribution.tenant_id:
            raise InvalidRecord("Adjustment.attribution must be an Attribution with a tenant_id")
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

    @property
    def tenant_id(self) -> str:
        """The tenant billed (``attribution.tenant_id``)."""
        return self.attribution.tenant_id


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


# --------------------------------------------------------------------------- records → columns

#: Column name → attribute path, for the columns a record holds in a nested type: the
#: attribution's fields, the token counts' and the reservation's. Every other column is the
#: record's attribute of the same name.
_NESTED_COLUMNS: dict[str, str] = {
    **{name: f"attribution.{name}" for name in ATTRIBUTION_FIELDS},
    **{name: f"tokens.{name}" for name in TOKEN_FIELDS},
    "reserved_input_tokens": "reserved.input_tokens",
    "reserved_output_tokens": "reserved.output_tokens",
}


def column_getter(columns: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    """The one flattening of a record into ledger columns.

    Args:
        columns: ledger column names; ``tenant_id`` … ``endpoint`` are read from the record's
            ``attribution``, ``input_tokens`` … ``reasoning_tokens`` from its ``tokens``,
            ``reserved_input_tokens`` / ``reserved_output_tokens`` from its ``reserved``, any
            other name from the attribute of that name.
    Returns:
        ``f(record) -> tuple`` of the values in ``columns`` order (an ``operator.attrgetter``:
        one C call per record, so the record path stays at its measured rate).
    """
    return operator.attrgetter(*(_NESTED_COLUMNS.get(c, c) for c in columns))


# --------------------------------------------------------------------------- spool streams

#: Old column name → today's, for spool blocks written before the input/output vocabulary
#: (usage schema 1, attempts 1–2, engine 1–2). The one place the old names survive.
LEGACY_COLUMN_NAMES: Mapping[str, str] = {
    "prompt_tokens": "input_tokens",
    "cached_prompt_tokens": "cached_input_tokens",
    "completion_tokens": "output_tokens",
    "generation_tokens": "output_tokens",
    "reserved_prompt_tokens": "reserved_input_tokens",
    "reserved_completion_tokens": "reserved_output_tokens",
}
#: Columns old blocks carry that no longer exist: ``org_id`` was the tenant's second id (always
#: equal to ``tenant_id``).
LEGACY_DROPPED_COLUMNS: frozenset[str] = frozenset({"org_id"})


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """One spool stream and the ClickHouse table it drains into.

    Attributes:
        name: directory name under the spool dir (``usage``, ``attempts``, ``engine``).
        table: target table.
        schema: version of the column list written in each new spool block.
        columns: column order of the JSON arrays, per schema version, as that version wrote them
            (old versions with their old names; see :meth:`decode`).
        derived: today's columns an older block lacks that are computed from its own columns:
            name → (the source columns, by today's names; the function of their values).
    """

    name: str
    table: str
    schema: int
    columns: Mapping[int, tuple[str, ...]]
    derived: Mapping[str, tuple[tuple[str, ...], Callable[..., Any]]] = field(default_factory=dict)

    def columns_for(self, schema: int) -> tuple[str, ...]:
        """Column list of a block written with ``schema``, as written (KeyError if unknown)."""
        return self.columns[schema]

    def decode(self, schema: int, payload: _Payload) -> tuple[tuple[str, ...], _Payload]:
        """The columns (today's names) and the rows to insert for a block written with ``schema``.

        A block of the current schema passes through untouched (the drain's fast path). An older
        block has its old column names mapped by :data:`LEGACY_COLUMN_NAMES`; if it carries a
        column in :data:`LEGACY_DROPPED_COLUMNS` or lacks one of :attr:`derived`, its rows are
        re-encoded without the first and with the second appended (old blocks are what one
        upgrade left in the spool: a bounded, one-off cost). Columns it lacks that cannot be
        derived take the table's defaults.

        Args:
            schema: the block's schema version.
            payload: its JSON-array lines (bytes, or anything with ``tobytes()``).
        Raises:
            KeyError: an unknown schema version.
        """
        written = self.columns[schema]
        if schema == self.schema:
            return written, payload
        names = tuple(LEGACY_COLUMN_NAMES.get(c, c) for c in written)
        keep = [i for i, c in enumerate(written) if c not in LEGACY_DROPPED_COLUMNS]
        derive = [(column, [names.index(s) for s in sources], fn)
                  for column, (sources, fn) in self.derived.items()
                  if column not in names and all(s in names for s in sources)]
        if len(keep) == len(written) and not derive:
            return names, payload
        data = payload if isinstance(payload, bytes) else payload.tobytes()
        rows = [_decoder.decode(line) for line in data.split(b"\n") if line.strip()]
        out = b"".join(_encoder.encode([row[i] for i in keep] + [fn(*(row[j] for j in at)) for _, at, fn in derive])
                       + b"\n" for row in rows)
        return tuple(names[i] for i in keep) + tuple(column for column, _, _ in derive), out


#: Usage columns: the UsageEvent's fields flattened (see :func:`column_getter`). Schema 1 spelled
#: the tokens prompt/completion and carried ``org_id`` after ``idempotency_key``; schema 3 added the
#: attempt's id and its undelivered cause and billing (one row per attempt, migration 0006).
_USAGE_COLUMNS_V2: tuple[str, ...] = (
    "event_id", "tenant_id", "request_id", "tier", "model", "endpoint", "outcome", "finish_reason",
    "arrival_ts", "finish_ts", "input_tokens", "output_tokens", "cached_input_tokens", "reasoning_tokens",
    "reserved_input_tokens", "reserved_output_tokens", "idempotency_key", "workspace_id", "project_id",
    "api_key_id", "agent_run_id", "status_code", "stream", "queue_s", "ttft_s", "prefill_s", "decode_s",
    "e2e_s", "itl_mean_s", "kv_token_seconds", "token_source", "attempt", "preemptions", "schema_version",
)
USAGE_COLUMNS: tuple[str, ...] = _USAGE_COLUMNS_V2[:-1] + (
    "attempt_id", "undelivered_cause", "undelivered_billing", "schema_version")
_USAGE_COLUMNS_V1: tuple[str, ...] = (
    "event_id", "tenant_id", "request_id", "tier", "model", "endpoint", "outcome", "finish_reason",
    "arrival_ts", "finish_ts", "prompt_tokens", "completion_tokens", "cached_prompt_tokens", "reasoning_tokens",
    "reserved_prompt_tokens", "reserved_completion_tokens", "idempotency_key", "org_id", "workspace_id",
    "project_id", "api_key_id", "agent_run_id", "status_code", "stream", "queue_s", "ttft_s", "prefill_s",
    "decode_s", "e2e_s", "itl_mean_s", "kv_token_seconds", "token_source", "attempt", "preemptions",
    "schema_version",
)
#: Attempt columns; schema 2 added the refusing limit's ``level`` and ``dimension``, schema 3 the
#: input/output names without ``org_id``.
_ATTEMPT_COLUMNS_V1: tuple[str, ...] = (
    "attempt_id", "event_id", "tenant_id", "request_id", "status", "reason", "status_code", "ts",
    "tier", "model", "endpoint", "org_id", "workspace_id", "project_id", "api_key_id", "agent_run_id",
    "idempotency_key", "reserved_prompt_tokens", "reserved_completion_tokens", "attempt",
)
ATTEMPT_COLUMNS: tuple[str, ...] = (
    "attempt_id", "event_id", "tenant_id", "request_id", "status", "reason", "status_code", "ts",
    "tier", "model", "endpoint", "workspace_id", "project_id", "api_key_id", "agent_run_id",
    "idempotency_key", "reserved_input_tokens", "reserved_output_tokens", "attempt", "level", "dimension",
)
#: Engine record columns: EngineRequestStats' fields, then the tenant the engine stamped on it
#: ("" when unattributed). Schema 1 lacked the tenant; 1 and 2 spelled the tokens prompt/generation.
_ENGINE_COLUMNS_V1: tuple[str, ...] = (
    "request_id", "finish_reason", "prompt_tokens", "generation_tokens", "cached_prompt_tokens",
    "queued_s", "prefill_s", "decode_s", "inference_s", "e2e_s", "mean_tpot_s", "preemptions", "wall_ts",
)
ENGINE_COLUMNS: tuple[str, ...] = (
    "request_id", "finish_reason", "input_tokens", "output_tokens", "cached_input_tokens",
    "queued_s", "prefill_s", "decode_s", "inference_s", "e2e_s", "mean_tpot_s", "preemptions", "wall_ts",
    "tenant_id",
)

def _old_attempt_id(tenant_id: str, request_id: str) -> str:
    """A usage row's ``attempt_id`` in a block spooled before schema 3 (the nil UUID without a
    request id, as :attr:`UsageEvent.attempt_id <kvmeter.events.UsageEvent.attempt_id>`)."""
    return attempt_id_for(tenant_id, request_id) if tenant_id and request_id else NIL_UUID


USAGE_STREAM = StreamSpec("usage", "usage_events", 3, {1: _USAGE_COLUMNS_V1, 2: _USAGE_COLUMNS_V2, 3: USAGE_COLUMNS},
                          derived={"attempt_id": (("tenant_id", "request_id"), _old_attempt_id)})
ATTEMPT_STREAM = StreamSpec("attempts", "attempts", 3, {1: _ATTEMPT_COLUMNS_V1,
                                                        2: _ATTEMPT_COLUMNS_V1 + ("level", "dimension"),
                                                        3: ATTEMPT_COLUMNS})
ENGINE_STREAM = StreamSpec("engine", "engine_requests", 3, {1: _ENGINE_COLUMNS_V1,
                                                            2: _ENGINE_COLUMNS_V1 + ("tenant_id",),
                                                            3: ENGINE_COLUMNS})
STREAMS: tuple[StreamSpec, ...] = (USAGE_STREAM, ATTEMPT_STREAM, ENGINE_STREAM)

# Row shapes (scalar fields only, so untracked by the cycle collector: gc=False), validated in C by
# msgspec.convert (about 2 µs per usage event, against ~6 µs for the same checks in Python) and
# encoded as JSON arrays in column order.
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
    input_tokens: _U32
    output_tokens: _U32
    cached_input_tokens: _U32
    reasoning_tokens: _U32
    reserved_input_tokens: _U32
    reserved_output_tokens: _U32
    idempotency_key: _Str
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
    attempt_id: uuid.UUID
    undelivered_cause: _Str
    undelivered_billing: _Str
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
    workspace_id: _Str
    project_id: _Str
    api_key_id: _Str
    agent_run_id: _Str
    idempotency_key: _Str
    reserved_input_tokens: _U32
    reserved_output_tokens: _U32
    attempt: _U32
    level: _Str
    dimension: _Str


class _EngineRow(msgspec.Struct, array_like=True, gc=False):
    request_id: Annotated[str, Meta(min_length=1, max_length=_MAX_STR)]
    finish_reason: _Str
    input_tokens: _U32
    output_tokens: _U32
    cached_input_tokens: _U32
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
for _spec in STREAMS:
    for _old in _spec.columns.values():
        assert ({LEGACY_COLUMN_NAMES.get(c, c) for c in _old} - LEGACY_DROPPED_COLUMNS
                <= set(_spec.columns[_spec.schema]))

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


_usage_values = column_getter(USAGE_COLUMNS)


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


_attempt_values = column_getter(ATTEMPT_COLUMNS)


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


_engine_values = column_getter(ENGINE_COLUMNS)
_ENGINE_WALL_TS = ENGINE_COLUMNS.index("wall_ts")


def encode_engine(stats: EngineRequestStats, now_wall: float) -> bytes:
    """Validate the engine's account of one finished request and encode it as a JSON array.

    Args:
        stats: from the engine (published on the bus), with the attribution the engine adapter
            stamped on it (its tenant is stored; ``""`` when unattributed).
        now_wall: wall-clock epoch seconds used when ``stats.wall_ts`` is 0 (unset).
    Raises:
        InvalidRecord: naming the field and value.
    """
    if type(stats) is not EngineRequestStats:
        raise InvalidRecord(f"expected EngineRequestStats, got {type(stats).__name__}")
    if type(stats.tokens) is not TokenCounts or type(stats.attribution) is not Attribution:
        raise InvalidRecord("EngineRequestStats.tokens must be TokenCounts and .attribution an Attribution")
    values = _engine_values(stats)
    if not stats.wall_ts:
        values = values[:_ENGINE_WALL_TS] + (now_wall,) + values[_ENGINE_WALL_TS + 1:]
    return _encoder.encode(_convert(values, _EngineRow, ENGINE_COLUMNS, "EngineRequestStats"))
