"""What the agent-run services share: the live tenant directory, the run store, the ledger, the
bus and the clock, and the checks of a request's identifiers."""

from __future__ import annotations

import logging
from typing import Protocol

from kvmeter.bus import StatsBus
from kvmeter.clock import SYSTEM_CLOCK, Clock
from kvmeter.ledger.agent_records import AgentRecord, ApprovalRecord
from kvmeter.serving.quota.gate import MAX_RUN_ID_CHARS
from kvmeter.serving.tenancy import AuthError, Principal, TenantDirectory
from kvmeter.serving.tenancy.directory import KeyEntry
from kvmeter.stats import ApprovalEvent

from .errors import AgentRefusal
from .store import AgentStore, AgentStoreUnavailable, Approval

__all__ = ["AgentRecorder", "AgentService", "valid_run_id", "MAX_ID_CHARS"]

log = logging.getLogger(__name__)

#: Longest idempotency key, approval id or call id accepted (characters).
MAX_ID_CHARS = 255


class AgentRecorder(Protocol):
    """Where agent-run records go (the ledger); returns once the record is durable."""

    async def record_agent(self, record: AgentRecord) -> None: ...


def valid_run_id(run_id: object) -> bool:
    """The quota's rule for an agent run id: 1–256 printable characters, no whitespace."""
    return (isinstance(run_id, str) and 0 < len(run_id) <= MAX_RUN_ID_CHARS and run_id.isprintable()
            and not any(c.isspace() for c in run_id))


def check_id(value: object, param: str) -> str:
    """``value`` if it is ``""`` or 1–:data:`MAX_ID_CHARS` printable characters without spaces.

    Raises:
        AgentRefusal: 400 ``invalid_value`` naming ``param``.
    """
    if value == "" or value is None:
        return ""
    if (not isinstance(value, str) or len(value) > MAX_ID_CHARS or not value.isprintable()
            or any(c.isspace() for c in value)):
        raise AgentRefusal(f"{param} must be 1-{MAX_ID_CHARS} printable characters without spaces",
                           status_code=400, code="invalid_value", param=param)
    return value


def store_down(exc: AgentStoreUnavailable) -> AgentRefusal:
    """The answer while the shared run store is down: 503, retry after 1 s (fail closed)."""
    return AgentRefusal(f"the agent-run store is unavailable ({exc}); nothing was permitted", status_code=503,
                        code="agent_store_unavailable", retry_after_s=1.0)


class AgentService:
    """Base of :class:`~.runs.AgentRuns` and :class:`~.approvals.ApprovalDesk`.

    Args:
        directory: the live tenants config (policies, approvers, tiers).
        store: the run store.
        recorder: the ledger (None: records are not kept — tests of the policy alone).
        bus: where the stats go (None: nowhere).
        clock: injected clock (wall seconds for the store and the records).
    """

    def __init__(self, directory: TenantDirectory, store: AgentStore, *, recorder: AgentRecorder | None = None,
                 bus: StatsBus | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        self.directory = directory
        self.store = store
        self.recorder = recorder
        self.bus = bus
        self.clock = clock

    def entry(self, principal: Principal) -> KeyEntry:
        """The live directory entry of the principal's key.

        Raises:
            AuthError: 401, the key was removed by a config reload.
        """
        entry = self.directory.snapshot.keys.get(principal.api_key_id)
        if entry is None or entry.principal.tenant_id != principal.tenant_id:
            raise AuthError("API key is no longer configured")
        return entry

    async def record(self, record: AgentRecord) -> None:
        """Make ``record`` durable in the ledger; a failure is logged at CRITICAL with the record,
        never raised into the request."""
        if self.recorder is None:
            return
        try:
            await self.recorder.record_agent(record)
        except Exception:  # noqa: BLE001 — the spool is local disk; this is an operator alarm
            log.critical("agent-run record could NOT be made durable: %r", record, exc_info=True)

    def publish(self, obj: object) -> None:
        if self.bus is not None:
            self.bus.publish(obj)

    async def approval_event(self, a: Approval, event: str, tier: str, *, actor: str = "", now: float) -> None:
        """Record one event of an approval in the ledger and publish it on the bus."""
        attribution = a.attribution(tier)
        await self.record(ApprovalRecord(
            approval_id=a.approval_id, event=event, attribution=attribution, tool=a.tool,
            ts=now, expires_ts=a.expires_ts, risk_class=a.risk_class,
            arguments_sha256=a.arguments_sha256, policy_version=a.policy_version, actor_key_id=actor,
            reason=a.reason if event in ("approved", "rejected") else "", tool_call_id=a.tool_call_id))
        wait = now - a.created_ts if event in ("approved", "rejected") else None
        self.publish(ApprovalEvent(attribution=attribution, approval_id=a.approval_id, event=event,
                                   wait_s=wait, wall_ts=now))
