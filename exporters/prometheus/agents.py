"""Agent-run metrics: tool-call decisions, approval events and their wait, runs stopped as loops.

Inputs (plain dataclasses on the bus, from :mod:`kvmeter.serving.agents`):
:class:`~kvmeter.stats.ToolCallDecided`, :class:`~kvmeter.stats.ApprovalEvent`,
:class:`~kvmeter.stats.AgentRunStopped`.

Every label comes from a fixed set (:data:`~kvmeter.stats.TOOL_CALL_SOURCES`,
:data:`~kvmeter.stats.RISK_CLASSES`, :data:`~kvmeter.stats.TOOL_CALL_DECISIONS`,
:data:`~kvmeter.stats.APPROVAL_EVENTS`, :data:`~kvmeter.stats.RUN_STOP_REASONS`); a value outside
it is labelled ``other``. Tool names and run ids are never labels (they are in the ledger); the
tenant of a run stop is bounded to the top-K tenants plus ``other``.
"""

from __future__ import annotations

from kvmeter.bus import StatsBus
from kvmeter.stats import (APPROVAL_EVENTS, RISK_CLASSES, RUN_STOP_REASONS, TOOL_CALL_DECISIONS, TOOL_CALL_SOURCES,
                           AgentRunStopped, ApprovalEvent, ToolCallDecided)

from .base import MetricSource, SourceContext

__all__ = ["AgentMetrics"]


def _bounded(value: str, allowed: tuple[str, ...]) -> str:
    return value if value in allowed else "other"


class AgentMetrics(MetricSource):
    """Maps agent-run stats to ``kvmeter_agent_*`` metrics."""

    def __init__(self, ctx: SourceContext) -> None:
        super().__init__(ctx)
        self.tool_calls = self.metric("kvmeter_agent_tool_calls_total")
        self.approvals = self.metric("kvmeter_agent_approval_events_total")
        self.wait = self.metric("kvmeter_agent_approval_wait_seconds")
        self.stops = self.metric("kvmeter_agent_stopped_runs_total")
        for event in APPROVAL_EVENTS:  # at 0 from the start: the first event is an increase()
            self.approvals.labels(event)

    def attach(self, bus: StatsBus):
        return [bus.subscribe(ToolCallDecided, self.on_tool_call),
                bus.subscribe(ApprovalEvent, self.on_approval),
                bus.subscribe(AgentRunStopped, self.on_stop)]

    def on_tool_call(self, d: ToolCallDecided) -> None:
        self.tool_calls.labels(_bounded(d.source, TOOL_CALL_SOURCES), _bounded(d.risk_class, RISK_CLASSES),
                               _bounded(d.decision, TOOL_CALL_DECISIONS)).inc()

    def on_approval(self, e: ApprovalEvent) -> None:
        event = _bounded(e.event, APPROVAL_EVENTS)
        self.approvals.labels(event).inc()
        if e.wait_s is not None and e.wait_s >= 0:
            self.wait.labels(event).observe(e.wait_s)

    def on_stop(self, s: AgentRunStopped) -> None:
        who = s.attribution
        reason = _bounded(s.reason, RUN_STOP_REASONS)
        self.tenant_child(self.stops, 1, (who.tier or "unknown", who.tenant_id, reason)).inc()
