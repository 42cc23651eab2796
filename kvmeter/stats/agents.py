"""Stats of agent-run policy: every tool-call decision, every approval event, every run stopped as
a loop or a retry storm (published by :mod:`kvmeter.serving.agents`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvmeter.attribution import Attribution

__all__ = ["ToolCallDecided", "ApprovalEvent", "AgentRunStopped", "TOOL_CALL_SOURCES", "TOOL_CALL_DECISIONS",
           "APPROVAL_EVENTS", "RUN_STOP_REASONS", "RISK_CLASSES"]

#: Risk classes of a tool, least risky first (the tenants config's tool policy assigns them:
#: :mod:`kvmeter.serving.tenancy.toolpolicy`).
RISK_CLASSES = ("read_only", "side_effect", "high_risk")

#: Where a tool call crossed the gateway: reported to ``/v1/agent_runs/{id}/tool_calls``, emitted
#: by the model in a response, or declared in a request's ``tools``.
TOOL_CALL_SOURCES = ("reported", "emitted", "declared")
#: What was decided about it. ``allowed``: a permit (reported) or passed through (emitted,
#: declared); ``replayed``: a repeat answered with the first permit; ``blocked`` /
#: ``not_allowed``: the tool policy refused the tool; ``approval_refused``: a named approval that
#: does not fit (mismatch, used, expired, unknown).
TOOL_CALL_DECISIONS = ("allowed", "replayed", "pending_approval", "blocked", "not_allowed", "approval_rejected",
                       "approval_refused", "idempotency_conflict", "budget_exceeded", "loop_stopped", "run_stopped")
#: Events of an approval's life: a high-risk call asked for one, an approver decided it, a permit
#: used it.
APPROVAL_EVENTS = ("requested", "approved", "rejected", "consumed")
#: Why a run was stopped (:mod:`kvmeter.serving.agents.loops`).
RUN_STOP_REASONS = ("identical_tool_calls", "tool_cycle", "repeated_prompt")


@dataclass(slots=True)
class ToolCallDecided:
    """One decision on one tool call of an agent run.

    Attributes:
        attribution: the calling key's, with the run's ``agent_run_id`` (``""`` outside a run).
        tool: the tool name; risk_class: its class under the key's policy.
        source: one of :data:`TOOL_CALL_SOURCES`; decision: one of :data:`TOOL_CALL_DECISIONS`.
        wall_ts: wall-clock epoch seconds.
    """

    attribution: Attribution
    tool: str
    risk_class: str
    source: str
    decision: str
    wall_ts: float = 0.0


@dataclass(slots=True)
class ApprovalEvent:
    """An approval was requested, approved, rejected or consumed.

    Attributes:
        attribution: the requesting key's, with the approval's run; approval_id: the approval.
        event: one of :data:`APPROVAL_EVENTS`.
        wait_s: for a decision, seconds from the request to it (wall clock), else None.
        wall_ts: wall-clock epoch seconds.
    """

    attribution: Attribution
    approval_id: str
    event: str
    wait_s: float | None = None
    wall_ts: float = 0.0


@dataclass(slots=True)
class AgentRunStopped:
    """An agent run was stopped as a loop or a retry storm (once per run).

    Attributes:
        attribution: the key whose call stopped the run, with the run's ``agent_run_id``.
        reason: one of :data:`RUN_STOP_REASONS`.
        wall_ts: wall-clock epoch seconds.
    """

    attribution: Attribution
    reason: str
    wall_ts: float = 0.0
