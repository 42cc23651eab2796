"""Approvals of high-risk tool calls: list, read, approve, reject — who may do what.

An approval request is created by the run store when a ``high_risk`` call is reported (or
emitted) and is bound to {run, requesting key, tool, argument digest, policy version, expiry}
(:class:`~.store.Approval`). :class:`ApprovalDesk` is what the approvals API calls.

Who may see and decide an approval:

* **decide** (approve, or reject with a reason): an admin key, or a key listed in ``approvers``
  on a node of the requesting key's chain (org, workspace, project or the key itself; the tenants
  config checks that approvers belong to the same org). Never the requesting key itself: an agent
  cannot approve its own calls.
* **read** (list, get): the deciders above, and the requesting key (an agent polls its approval).
  A key of another tenant gets 404 (an approval id reveals nothing across tenants); a key of the
  same tenant without either right gets 403 ``approval_forbidden``.

Every decision is an append-only ledger record (:class:`~kvmeter.ledger.agent_records.ApprovalRecord`)
and an :class:`~kvmeter.stats.ApprovalEvent` on the bus.
"""

from __future__ import annotations

from typing import Any

from kvmeter.serving.tenancy import Principal

from .errors import AgentRefusal
from .service import AgentService, check_id, store_down
from .store import AgentStoreUnavailable, Approval

__all__ = ["ApprovalDesk", "MAX_LIST", "MAX_REASON_CHARS"]

#: Most approvals one list returns.
MAX_LIST = 1_000
#: Longest reason an approver may give (characters).
MAX_REASON_CHARS = 2_000


class ApprovalDesk(AgentService):
    """The approvals API's operations (see module docstring); built like :class:`~.runs.AgentRuns`."""

    def _may_decide(self, principal: Principal, a: Approval) -> bool:
        if principal.api_key_id == a.api_key_id:
            return False
        if principal.admin:
            return True
        entry = self.directory.snapshot.keys.get(a.api_key_id)
        return (entry is not None and principal.tenant_id == a.tenant_id
                and entry.tool_policy.can_approve(principal.api_key_id, False))

    def _may_read(self, principal: Principal, a: Approval) -> bool:
        return principal.admin or principal.api_key_id == a.api_key_id or self._may_decide(principal, a)

    async def _find(self, principal: Principal, approval_id: str) -> Approval:
        approval_id = check_id(approval_id, "approval_id")
        try:
            a = await self.store.get_approval(approval_id) if approval_id else None
        except AgentStoreUnavailable as exc:
            raise store_down(exc) from None
        if a is None or (not principal.admin and a.tenant_id != principal.tenant_id):
            raise AgentRefusal("no such approval", status_code=404, code="approval_not_found", param="approval_id")
        if not self._may_read(principal, a):
            raise AgentRefusal("this API key may not read this approval", status_code=403, code="approval_forbidden")
        return a

    async def get(self, principal: Principal, approval_id: str) -> dict[str, Any]:
        """One approval as JSON (``status`` at now: ``pending``, ``approved``, ``rejected``,
        ``consumed`` or ``expired``).

        Raises:
            AgentRefusal: 404 ``approval_not_found``, 403 ``approval_forbidden``, 503.
        """
        self.entry(principal)
        a = await self._find(principal, approval_id)
        return a.to_dict(self.clock.wall())

    async def list_pending(self, principal: Principal, *, tenant_id: str | None = None, run_id: str | None = None,
                           limit: int = 100) -> list[dict[str, Any]]:
        """Pending, unexpired approvals this key may read, the soonest to expire first.

        Args:
            tenant_id: an admin key's filter (another key's own tenant only).
            run_id: only this run's.
            limit: 1..:data:`MAX_LIST`.
        Raises:
            AgentRefusal: 403 for another tenant, 400 for a bad limit, 503.
        """
        self.entry(principal)
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_LIST:
            raise AgentRefusal(f"limit must be an integer in 1..{MAX_LIST}", status_code=400, code="invalid_value",
                               param="limit")
        if not principal.admin:
            if tenant_id is not None and tenant_id != principal.tenant_id:
                raise AgentRefusal("this API key can read only its own tenant's approvals", status_code=403,
                                   code="approval_forbidden", param="tenant_id")
            tenant_id = principal.tenant_id
        now = self.clock.wall()
        try:
            found = await self.store.list_pending(tenant_id, now, MAX_LIST)
        except AgentStoreUnavailable as exc:
            raise store_down(exc) from None
        out = [a.to_dict(now) for a in found
               if self._may_read(principal, a) and (run_id is None or a.run_id == run_id)]
        return out[:limit]

    async def decide(self, principal: Principal, approval_id: str, *, approve: bool,
                     reason: str = "") -> dict[str, Any]:
        """Approve or reject a pending approval.

        Args:
            approve: True to approve, False to reject.
            reason: the approver's reason (required to reject; at most :data:`MAX_REASON_CHARS`).
        Returns:
            The approval after the decision (JSON).
        Raises:
            AgentRefusal: 404 ``approval_not_found``; 403 ``approval_forbidden`` (not an approver of
                its scope, or the requesting key itself); 409 ``approval_already_decided`` /
                ``approval_expired``; 400 for a missing or over-long reason; 503.
        """
        self.entry(principal)
        if not isinstance(reason, str) or len(reason) > MAX_REASON_CHARS:
            raise AgentRefusal(f"reason must be a string of at most {MAX_REASON_CHARS} characters", status_code=400,
                               code="invalid_value", param="reason")
        if not approve and not reason.strip():
            raise AgentRefusal("a rejection needs a reason", status_code=400, code="invalid_value", param="reason")
        a = await self._find(principal, approval_id)
        if not self._may_decide(principal, a):
            why = ("a key cannot decide its own tool calls" if principal.api_key_id == a.api_key_id
                   else "this API key is not an approver of this approval's scope")
            raise AgentRefusal(why, status_code=403, code="approval_forbidden")
        now = self.clock.wall()
        try:
            res = await self.store.decide(a.approval_id, approve, principal.api_key_id, reason.strip(), now)
        except AgentStoreUnavailable as exc:
            raise store_down(exc) from None
        if res.outcome == "not_found" or res.approval is None:
            raise AgentRefusal("no such approval", status_code=404, code="approval_not_found", param="approval_id")
        if res.outcome == "already_decided":
            raise AgentRefusal(f"approval {a.approval_id} was already decided ({res.approval.status(now)})",
                               status_code=409, code="approval_already_decided",
                               fields={"approval_id": a.approval_id, "status": res.approval.status(now)})
        if res.outcome == "expired":
            raise AgentRefusal(f"approval {a.approval_id} expired before it was decided", status_code=409,
                               code="approval_expired", fields={"approval_id": a.approval_id})
        entry = self.directory.snapshot.keys.get(a.api_key_id)
        tier = entry.principal.tier if entry is not None else ""
        await self.approval_event(res.approval, res.outcome, tier, actor=principal.api_key_id, now=now)
        return res.approval.to_dict(now)
