"""Agent-run metrics: tool-call decisions, approval events and their wait, runs stopped as loops.

Inputs (plain dataclasses on the bus, from :mod:`kvmeter.serving.agents`):
:class:`~kvmeter.stats.ToolCallDecided`, :class:`~kvmeter.stats.ApprovalEvent`,
:class:`~kvmeter.stats.AgentRunStopped`.

Every label comes from a fixed set (:data:`~kvmeter.stats.TOOL_CALL_SOURCES`,
:data:`~kvmeter.stats.RISK_CLASSES`, :data:`~kvmeter.stats.TOOL_CALL_DECISIONS`,
:data:`~kvmeter.stats.APPROVAL_EVENTS`, :data:`~kvmeter.stats.RUN_STOP_REASONS`); a value outside
it is labelled ``other``. Tool names and run ids are never labels (they are in the ledger); the
tenant of a run stop is bounded to the top-K tenants plus ``other``.

Calls per run (the noisy-neighbour agent-loop detector, :mod:`.rules.noisy`): every
:class:`~kvmeter.stats.RequestCompletion` whose attribution carries an ``agent_run_id`` counts one
model call (``kvmeter_agent_run_model_calls_total``); the first one of a run this process has not
seen counts a run (``kvmeter_agent_runs_seen_total``). The memory of runs is bounded
(:data:`RUNS_REMEMBERED` most recently seen, least recent forgotten first); a forgotten run seen
again, or a run whose calls several worker processes serve, counts again, so calls per run errs
low (the detector errs quiet), never high.
"""

from __future__ import annotations

from collections import OrderedDict

from kvmeter.bus import StatsBus
from kvmeter.stats import (APPROVAL_EVENTS, RISK_CLASSES, RUN_STOP_REASONS, TOOL_CALL_DECISIONS, TOOL_CALL_SOURCES,
                           AgentRunStopped, ApprovalEvent, RequestCompletion, ToolCallDecided)

from .base import MetricSource, SourceContext

__all__ = ["AgentMetrics", "RUNS_REMEMBERED"]

#: How many (tenant, run id) pairs the run counter remembers (about 100 bytes each).
RUNS_REMEMBERED = 65_536


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
        self.run_calls = self.metric("kvmeter_agent_run_model_calls_total")
        self.runs_seen = self.metric("kvmeter_agent_runs_seen_total")
        self._runs: OrderedDict[tuple[str, str], None] = OrderedDict()
        for event in APPROVAL_EVENTS:  # at 0 from the start: the first event is an increase()
            self.approvals.labels(event)

    def attach(self, bus: StatsBus):
        return [bus.subscribe(ToolCallDecided, self.on_tool_call),
                bus.subscribe(ApprovalEvent, self.on_approval),
                bus.subscribe(AgentRunStopped, self.on_stop),
                bus.subscribe(RequestCompletion, self.on_completion)]

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

    def on_completion(self, c: RequestCompletion) -> None:
        """Count a model call of an agent run, and the run at its first call seen."""
        who = c.attribution
        if not who.agent_run_id:
            return
        values = (who.tier or "unknown", who.tenant_id)
        self.tenant_child(self.run_calls, 1, values).inc()
        key = (who.tenant_id, who.agent_run_id)
        if key in self._runs:
            self._runs.move_to_end(key)
            return
        self._runs[key] = None
        if len(self._runs) > RUNS_REMEMBERED:
            self._runs.popitem(last=False)
        self.tenant_child(self.runs_seen, 1, values).inc()
