"""The ledger's records of agent runs: every tool-call decision, every approval event and every
run stopped as a loop — append-only, durable in the spool before the gateway answers, drained into
ClickHouse (``tool_calls``, ``approval_events``, ``agent_run_stops``; migration 0004, ``org_id``
dropped by 0005).

* :class:`ToolCallRecord` — one decision on one tool call (reported, emitted by the model, or
  declared in a request): permitted, replayed, pending approval, refused and why.
* :class:`ApprovalRecord` — one event of an approval: ``requested``, ``approved``, ``rejected``,
  ``consumed``. The approval's state at any time is its events in order; nothing is updated.
* :class:`RunStopRecord` — a run stopped by a loop stop, with the reason (once per run).

Each record carries the calling key's :class:`~kvmeter.attribution.Attribution` (its tenant,
workspace, project, key, tier and the run id; flattened into columns by
:func:`~kvmeter.ledger.records.column_getter`), has a deterministic or unique ``record_id`` (the
tables deduplicate re-drained blocks on it) and is validated before it reaches the spool (see
:mod:`kvmeter.ledger.records`). Spool blocks of stream schema 1 carry ``org_id``, which
:meth:`~kvmeter.ledger.records.StreamSpec.decode` drops.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable

import msgspec
from msgspec import Meta

from kvmeter.attribution import Attribution
from kvmeter.stats import APPROVAL_EVENTS, RUN_STOP_REASONS, TOOL_CALL_DECISIONS, TOOL_CALL_SOURCES

from .errors import InvalidRecord
from .records import StreamSpec, _convert, _encoder, column_getter

__all__ = ["ToolCallRecord", "ApprovalRecord", "RunStopRecord", "AgentRecord", "TOOL_CALL_STREAM",
           "APPROVAL_STREAM", "RUN_STOP_STREAM", "AGENT_STREAMS", "encode_agent_record"]

#: Namespace of deterministic approval-event and run-stop ids (never change it).
AGENT_NAMESPACE = uuid.UUID("6d1f0b7e-2c4a-5e93-8a61-3b9c7d2e4f10")

_MIN_TS = 946_684_800.0
_MAX_TS = 7_258_118_400.0
_Str = Annotated[str, Meta(max_length=4096)]
_Ts = Annotated[float, Meta(ge=_MIN_TS, lt=_MAX_TS)]
_Status = Annotated[int, Meta(ge=0, le=999)]


def _new_id() -> str:
    return str(uuid.uuid4())


def _check(what: str, name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise InvalidRecord(f"{what}.{name} must be one of {allowed}, got {value!r}")


class _Attributed:
    """The attribution's part of an agent record: who (``tenant_id``) and which run
    (``agent_run_id``), read from the one :class:`~kvmeter.attribution.Attribution` it carries."""

    __slots__ = ()
    attribution: Attribution

    @property
    def tenant_id(self) -> str:
        return self.attribution.tenant_id

    @property
    def agent_run_id(self) -> str:
        return self.attribution.agent_run_id

    def _check_attribution(self, what: str) -> None:
        if not isinstance(self.attribution, Attribution):
            raise InvalidRecord(f"{what}.attribution must be an Attribution, got {self.attribution!r}")


@dataclass(frozen=True, slots=True)
class ToolCallRecord(_Attributed):
    """One decision on one tool call of an agent run.

    Attributes:
        attribution: the calling key's (tenant, workspace, project, key, tier) and the run
            (``agent_run_id``: ``""`` for a call emitted or declared outside one);
            :attr:`tenant_id` and :attr:`agent_run_id` are its.
        source: ``reported``, ``emitted`` or ``declared`` (:data:`~kvmeter.stats.TOOL_CALL_SOURCES`).
        tool, risk_class: the tool and its class under the key's policy.
        decision: one of :data:`~kvmeter.stats.TOOL_CALL_DECISIONS`.
        ts: wall-clock epoch seconds of the decision.
        tool_call_id: the permit's id (``allowed``; the first permit's for ``replayed``), else "".
        call_id: the client's or model's id of the call (OpenAI ``call_...``), if given.
        arguments_sha256: the canonical-JSON SHA-256 of the arguments (never the arguments).
        reason: the refusal's code (``tool_blocked``, ``approval_used``...) or "".
        rule: the policy rule that refused it, or the stop's detail.
        approval_id, idempotency_key, policy_version: what the decision was bound to.
        status_code: the HTTP status answered (200 permit, 202 pending, 4xx refused).
        record_id: unique id (default: a new UUID).
    Raises:
        InvalidRecord: an unknown source or decision, an empty tenant id, or a reported call
            without a run id.
    """

    attribution: Attribution
    source: str
    tool: str
    risk_class: str
    decision: str
    ts: float
    tool_call_id: str = ""
    call_id: str = ""
    arguments_sha256: str = ""
    reason: str = ""
    rule: str = ""
    approval_id: str = ""
    idempotency_key: str = ""
    policy_version: str = ""
    status_code: int = 200
    record_id: str = field(default_factory=_new_id)

    def __post_init__(self) -> None:
        self._check_attribution("ToolCallRecord")
        if not self.tenant_id or (self.source == "reported" and not self.agent_run_id):
            raise InvalidRecord("ToolCallRecord needs a tenant_id (and an agent_run_id when reported)")
        _check("ToolCallRecord", "source", self.source, TOOL_CALL_SOURCES)
        _check("ToolCallRecord", "decision", self.decision, TOOL_CALL_DECISIONS)


@dataclass(frozen=True, slots=True)
class ApprovalRecord(_Attributed):
    """One event of an approval (append-only: an approval's history is its events).

    Attributes:
        approval_id: the approval; event: ``requested``, ``approved``, ``rejected`` or ``consumed``.
        attribution: the requesting key's (tenant, workspace, project, key, tier) and the run it
            is bound to; :attr:`tenant_id` and :attr:`agent_run_id` are its.
        tool, risk_class, arguments_sha256, policy_version: what else it is bound to.
        expires_ts: when it expires (wall-clock epoch seconds).
        ts: when the event happened.
        actor_key_id: the deciding key (``approved`` / ``rejected``), else "".
        reason: the approver's reason.
        tool_call_id: the permit that consumed it (``consumed``).
        record_id: UUIDv5 of (approval id, event): each event is stored once.
    Raises:
        InvalidRecord: an unknown event, or an empty approval / tenant / run id.
    """

    approval_id: str
    event: str
    attribution: Attribution
    tool: str
    ts: float
    expires_ts: float
    risk_class: str = "high_risk"
    arguments_sha256: str = ""
    policy_version: str = ""
    actor_key_id: str = ""
    reason: str = ""
    tool_call_id: str = ""
    record_id: str = ""

    def __post_init__(self) -> None:
        self._check_attribution("ApprovalRecord")
        if not self.approval_id or not self.tenant_id or not self.agent_run_id:
            raise InvalidRecord("ApprovalRecord needs an approval_id, a tenant_id and an agent_run_id")
        _check("ApprovalRecord", "event", self.event, APPROVAL_EVENTS)
        if not self.record_id:
            object.__setattr__(self, "record_id",
                               str(uuid.uuid5(AGENT_NAMESPACE, f"approval\x1f{self.approval_id}\x1f{self.event}")))


@dataclass(frozen=True, slots=True)
class RunStopRecord(_Attributed):
    """An agent run stopped by a loop stop.

    Attributes:
        attribution: the key whose call stopped it and the run (:attr:`tenant_id`,
            :attr:`agent_run_id`); reason: one of :data:`~kvmeter.stats.RUN_STOP_REASONS`.
        detail: one sentence (which tool, which threshold); tool: the tool of the last call ("" for
            a repeated prompt).
        ts: wall-clock epoch seconds.
        record_id: UUIDv5 of (tenant, run): a run is stopped once.
    Raises:
        InvalidRecord: an unknown reason, or an empty tenant / run id.
    """

    attribution: Attribution
    reason: str
    detail: str
    ts: float
    tool: str = ""
    record_id: str = ""

    def __post_init__(self) -> None:
        self._check_attribution("RunStopRecord")
        if not self.tenant_id or not self.agent_run_id:
            raise InvalidRecord("RunStopRecord needs a tenant_id and an agent_run_id")
        _check("RunStopRecord", "reason", self.reason, RUN_STOP_REASONS)
        if not self.record_id:
            object.__setattr__(self, "record_id",
                               str(uuid.uuid5(AGENT_NAMESPACE, f"stop\x1f{self.tenant_id}\x1f{self.agent_run_id}")))


AgentRecord = ToolCallRecord | ApprovalRecord | RunStopRecord


class _ToolCallRow(msgspec.Struct, array_like=True, gc=False):
    record_id: uuid.UUID
    tenant_id: _Str
    workspace_id: _Str
    project_id: _Str
    api_key_id: _Str
    tier: _Str
    agent_run_id: _Str
    source: _Str
    tool: _Str
    risk_class: _Str
    decision: _Str
    reason: _Str
    rule: _Str
    tool_call_id: _Str
    call_id: _Str
    arguments_sha256: _Str
    approval_id: _Str
    idempotency_key: _Str
    policy_version: _Str
    status_code: _Status
    ts: _Ts


class _ApprovalRow(msgspec.Struct, array_like=True, gc=False):
    record_id: uuid.UUID
    approval_id: _Str
    event: _Str
    tenant_id: _Str
    workspace_id: _Str
    project_id: _Str
    api_key_id: _Str
    tier: _Str
    agent_run_id: _Str
    tool: _Str
    risk_class: _Str
    arguments_sha256: _Str
    policy_version: _Str
    actor_key_id: _Str
    reason: _Str
    tool_call_id: _Str
    expires_ts: _Ts
    ts: _Ts


class _RunStopRow(msgspec.Struct, array_like=True, gc=False):
    record_id: uuid.UUID
    tenant_id: _Str
    workspace_id: _Str
    project_id: _Str
    api_key_id: _Str
    tier: _Str
    agent_run_id: _Str
    reason: _Str
    detail: _Str
    tool: _Str
    ts: _Ts


TOOL_CALL_COLUMNS = tuple(_ToolCallRow.__struct_fields__)
APPROVAL_COLUMNS = tuple(_ApprovalRow.__struct_fields__)
RUN_STOP_COLUMNS = tuple(_RunStopRow.__struct_fields__)

# Schema 1 (before the one tenant id) carried ``org_id`` after ``tenant_id``; decode drops it.
def _with_org_id(columns: tuple[str, ...]) -> tuple[str, ...]:
    i = columns.index("tenant_id") + 1
    return columns[:i] + ("org_id",) + columns[i:]


TOOL_CALL_STREAM = StreamSpec("tool_calls", "tool_calls", 2, {1: _with_org_id(TOOL_CALL_COLUMNS), 2: TOOL_CALL_COLUMNS})
APPROVAL_STREAM = StreamSpec("approvals", "approval_events", 2,
                             {1: _with_org_id(APPROVAL_COLUMNS), 2: APPROVAL_COLUMNS})
RUN_STOP_STREAM = StreamSpec("run_stops", "agent_run_stops", 2,
                             {1: _with_org_id(RUN_STOP_COLUMNS), 2: RUN_STOP_COLUMNS})
#: The agent streams (the ledger's spool opens them beside the usage, attempt and engine streams).
AGENT_STREAMS = (TOOL_CALL_STREAM, APPROVAL_STREAM, RUN_STOP_STREAM)

_ENCODERS: dict[type, tuple[StreamSpec, type, Callable[[Any], tuple[Any, ...]], str]] = {
    ToolCallRecord: (TOOL_CALL_STREAM, _ToolCallRow, column_getter(TOOL_CALL_COLUMNS), "ToolCallRecord"),
    ApprovalRecord: (APPROVAL_STREAM, _ApprovalRow, column_getter(APPROVAL_COLUMNS), "ApprovalRecord"),
    RunStopRecord: (RUN_STOP_STREAM, _RunStopRow, column_getter(RUN_STOP_COLUMNS), "RunStopRecord"),
}


def encode_agent_record(record: AgentRecord) -> tuple[str, bytes]:
    """Validate an agent record and encode it as one JSON array in its stream's column order.

    Returns:
        ``(stream name, line)``.
    Raises:
        InvalidRecord: not an agent record, or a field out of range (named with its value).
    """
    found = _ENCODERS.get(type(record))
    if found is None:
        raise InvalidRecord(f"record_agent() takes a ToolCallRecord, ApprovalRecord or RunStopRecord, "
                            f"got {type(record).__name__}")
    spec, row, values, what = found
    return spec.name, _encoder.encode(_convert(values(record), row, spec.columns_for(spec.schema), what))
