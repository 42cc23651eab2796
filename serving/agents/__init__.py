"""Agent runs under the platform's rules: tool policy, approvals, side-effect idempotency and loop
stops.

Public surface (the modules are internals):

* :class:`AgentRuns` — the tool-call report (the permit to execute a call) and the gateway's
  three hooks: :meth:`~AgentRuns.check_declared_tools` (a request's ``tools``),
  :meth:`~AgentRuns.on_emitted_tool_call` (a call the model emits),
  :meth:`~AgentRuns.on_model_call` (each model call of a run) (:mod:`.runs`), called by the
  gateway (:mod:`kvmeter.serving.gateway.handler` at admission,
  :mod:`kvmeter.serving.gateway.emitted` on vLLM's layer's answer);
  :class:`ToolCallDecision`, :class:`EmittedDecision` — their answers.
* :class:`ApprovalDesk` — list, read, approve, reject approvals (:mod:`.approvals`).
* The run store: :class:`AgentStore`, :class:`MemoryAgentStore`, :class:`RedisAgentStore`,
  :func:`open_agent_store`; :class:`Approval`, :class:`RunStop` (:mod:`.store`, :mod:`.memory`,
  :mod:`.redis_store`, :mod:`.backends`).
* :class:`AgentRefusal`, :class:`ModelCallRefused` — the refusals and their codes (:mod:`.errors`).
* :func:`arguments_digest`, :func:`prompt_digest`, :func:`canonical_json` (RFC 8785) (:mod:`.digest`).

The policy itself — allowed / blocked tools, risk classes, approvers, the policy version — is part
of the tenants config: :mod:`kvmeter.serving.tenancy.toolpolicy`; the loop thresholds are the
tier's :class:`~kvmeter.serving.tenancy.LoopStops`.
"""

from kvmeter.serving.agents.approvals import ApprovalDesk
from kvmeter.serving.agents.backends import open_agent_store
from kvmeter.serving.agents.digest import ArgumentsError, arguments_digest, canonical_json, prompt_digest
from kvmeter.serving.agents.errors import AgentRefusal, ModelCallRefused
from kvmeter.serving.agents.memory import MemoryAgentStore
from kvmeter.serving.agents.redis_store import RedisAgentStore
from kvmeter.serving.agents.runs import AgentRuns, EmittedDecision, ToolCallDecision
from kvmeter.serving.agents.store import (AgentStore, AgentStoreUnavailable, Approval, ReportRequest, ReportResult,
                                          RunStop)

__all__ = [
    "AgentRuns", "ToolCallDecision", "EmittedDecision", "ApprovalDesk",
    "AgentStore", "MemoryAgentStore", "RedisAgentStore", "open_agent_store", "AgentStoreUnavailable",
    "Approval", "RunStop", "ReportRequest", "ReportResult",
    "AgentRefusal", "ModelCallRefused",
    "arguments_digest", "prompt_digest", "canonical_json", "ArgumentsError",
]
