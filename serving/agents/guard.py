"""Model calls of a stopped run, or of a run waiting for an approval, refused at admission.

:class:`RunGuardedQuota` wraps the quota gate the gateway holds: before reserving quota for a
model call that carries an agent run id it calls
:meth:`AgentRuns.on_model_call <kvmeter.serving.agents.runs.AgentRuns.on_model_call>` (without a
prompt digest), whose refusals are :class:`~kvmeter.serving.quota.QuotaRejected` — so the
gateway answers them where it answers quota refusals (409 ``agent_run_stopped`` /
``approval_pending``) and records them as rejected attempts, with no change to the request path.

When the gateway calls ``on_model_call`` itself with the prompt digest (hook (c), for the
repeated-prompt stop), it should hold the plain quota gate instead, so the run is checked once.
"""

from __future__ import annotations

from typing import Any

from kvmeter.serving.quota.base import QuotaGate, Reservation, UsageEstimate
from kvmeter.serving.tenancy import Principal
from kvmeter.tokens import TokenCounts

from .runs import AgentRuns

__all__ = ["RunGuardedQuota"]


class RunGuardedQuota(QuotaGate):
    """A :class:`~kvmeter.serving.quota.QuotaGate` that checks the agent run first.

    Args:
        quota: the gate to delegate to (its other attributes are reachable through this one).
        agents: the agent-run service.
    """

    def __init__(self, quota: QuotaGate, agents: AgentRuns) -> None:
        self.inner = quota
        self.agents = agents

    async def reserve(self, principal: object, estimate: UsageEstimate) -> Reservation:
        """Check the run (raises :class:`~kvmeter.serving.agents.ModelCallRefused`), then reserve."""
        run_id = estimate.attribution.agent_run_id
        if run_id and isinstance(principal, Principal):
            await self.agents.on_model_call(principal, run_id)
        return await self.inner.reserve(principal, estimate)

    async def reconcile(self, reservation: Reservation, actual: TokenCounts) -> None:
        await self.inner.reconcile(reservation, actual)

    def context_limit(self, principal: object, agent_run_id: str = "") -> int | None:
        return self.inner.context_limit(principal, agent_run_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
