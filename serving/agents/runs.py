"""Agent runs under the platform's rules: the tool policy, approvals, side-effect idempotency and
loop stops, applied wherever a tool crosses the gateway.

:class:`AgentRuns` is what the gateway calls. Four entry points:

``report_tool_call(principal, run_id, tool, arguments, ...)``
    The tool-call report endpoint (``POST /v1/agent_runs/{id}/tool_calls``): the **permit** to
    execute one tool call. Policy first (blocked → 403), then the run store's atomic decision
    (:mod:`.store`: replay, stopped run, approval, loop stops, budget, permit). Returns a
    :class:`ToolCallDecision` (``allowed`` 200, ``replayed`` 200, ``pending_approval`` 202) or
    raises an :class:`~.errors.AgentRefusal`.
``check_declared_tools(principal, run_id, tool_names)``
    Gateway hook (a): after parsing a request that declares ``tools``. Raises a 403
    :class:`~.errors.AgentRefusal` (``param="tools"``) naming the first tool the key may not use
    and the rule.
``on_emitted_tool_call(principal, run_id, tool, arguments, call_id=...)``
    Gateway hook (b): for each tool call the model emits. Returns an :class:`EmittedDecision`:
    ``allow``, ``refuse`` (the response carries :attr:`EmittedDecision.message` in place of the
    call) or ``pending_approval`` (a high-risk call: an approval request exists or was created).
    Emitted calls are decided without a permit: the report is the permit, so a call the model
    emitted and the client reports counts once.
``on_model_call(principal, run_id, prompt_digest)``
    Gateway hook (c): before each model call that carries a run id. Raises
    :class:`~.errors.ModelCallRefused` (409) for a stopped run, a run with a pending approval, or
    the repeated-prompt stop.

Every decision is a ledger record (:mod:`kvmeter.ledger.agent_records`), durable before the call
returns, and a stats object on the bus (:mod:`kvmeter.stats.agents`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from kvmeter.bus import StatsBus
from kvmeter.clock import SYSTEM_CLOCK, Clock
from kvmeter.ledger.agent_records import RunStopRecord, ToolCallRecord
from kvmeter.serving.quota.gate import HierarchicalQuota
from kvmeter.serving.tenancy import Principal, TenantDirectory, ToolVerdict, valid_tool_name
from kvmeter.serving.tenancy.directory import KeyEntry
from kvmeter.serving.tenancy.limits import LoopStops
from kvmeter.stats import AgentRunStopped, ToolCallDecided, ToolCallReported

from .digest import ArgumentsError, arguments_digest
from .errors import AgentRefusal, ModelCallRefused
from .service import AgentRecorder, AgentService, check_id, store_down, valid_run_id
from .store import AgentStore, AgentStoreUnavailable, Approval, ReportRequest, ReportResult, RunStop

__all__ = ["AgentRuns", "ToolCallDecision", "EmittedDecision"]

#: store outcome → (decision recorded and published, HTTP status)
_OUTCOMES = {
    "allowed": ("allowed", 200), "replayed": ("replayed", 200), "approval_granted": ("allowed", 200),
    "pending_approval": ("pending_approval", 202), "approval_rejected": ("approval_rejected", 403),
    "approval_not_found": ("approval_refused", 404), "approval_mismatch": ("approval_refused", 409),
    "approval_used": ("approval_refused", 409), "approval_expired": ("approval_refused", 409),
    "idempotency_conflict": ("idempotency_conflict", 422), "budget_exceeded": ("budget_exceeded", 429),
    "loop_stopped": ("loop_stopped", 409), "run_stopped": ("run_stopped", 409),
}


@dataclass(frozen=True, slots=True)
class ToolCallDecision:
    """A tool-call report that was not refused.

    Attributes:
        decision: ``allowed`` (a permit: execute the call), ``replayed`` (the same call was
            permitted before: this is that permit, do not execute it again) or
            ``pending_approval`` (wait for the approval, then report again).
        agent_run_id, tool, risk_class, arguments_sha256, policy_version: the call as decided.
        tool_call_id: the permit's id (``allowed``, ``replayed``).
        approval: the approval (``pending_approval``; the consumed one for a high-risk permit).
        tool_calls, max_tool_calls: the run's tool calls counted so far and its budget.
    """

    decision: str
    agent_run_id: str
    tool: str
    risk_class: str
    arguments_sha256: str
    policy_version: str
    tool_call_id: str = ""
    approval: Approval | None = None
    tool_calls: int | None = None
    max_tool_calls: int | None = None

    @property
    def status_code(self) -> int:
        """200 for a permit or a replay, 202 while an approval is pending."""
        return 202 if self.decision == "pending_approval" else 200

    def to_dict(self, now: float) -> dict[str, Any]:
        """The report endpoint's JSON answer."""
        out: dict[str, Any] = {
            "decision": self.decision, "agent_run_id": self.agent_run_id, "tool": self.tool,
            "risk_class": self.risk_class, "arguments_sha256": self.arguments_sha256,
            "policy_version": self.policy_version, "tool_call_id": self.tool_call_id or None,
            "replayed": self.decision == "replayed", "tool_calls": self.tool_calls,
            "max_tool_calls": self.max_tool_calls, "approval_id": None}
        if self.approval is not None:
            out["approval_id"] = self.approval.approval_id
            out["approval"] = self.approval.to_dict(now)
        return out


@dataclass(frozen=True, slots=True)
class EmittedDecision:
    """What the gateway does with one tool call the model emitted.

    Attributes:
        action: ``allow`` (hand the call to the client), ``refuse`` (do not: put :attr:`message`
            in its place) or ``pending_approval`` (a high-risk call awaiting an approver:
            :attr:`approval_id`; see the hook's docstring).
        tool, risk_class: the call and its class.
        code: the refusal's code (``tool_blocked``, ``tool_not_allowed``, ``approval_rejected``,
            ``agent_run_stopped``, ``approval_requires_run``) or ``""``.
        rule: the policy rule that refused it, when the policy did.
        message: one sentence for the response in place of the call (refusals and pending).
        approval_id: the approval (``pending_approval``; an approved one for ``allow``).
    """

    action: str
    tool: str
    risk_class: str
    code: str = ""
    rule: str = ""
    message: str = ""
    approval_id: str = ""


class AgentRuns(AgentService):
    """Tool policy, approvals, idempotency and loop stops for agent runs (see module docstring).

    Args:
        directory: the live tenants config.
        quota: the quota gate (the run's tool-call counter key and budget live there).
        store: the run store (:class:`~.memory.MemoryAgentStore` or
            :class:`~.redis_store.RedisAgentStore`, on the quota's backend).
        recorder: the ledger (``record_agent``); None keeps no records.
        bus: where :class:`~kvmeter.stats.ToolCallDecided`, :class:`~kvmeter.stats.ApprovalEvent`,
            :class:`~kvmeter.stats.AgentRunStopped` and :class:`~kvmeter.stats.ToolCallReported` go.
        clock: injected clock.
        new_id: id factory for permits and approvals (default: UUID4 strings).
    """

    def __init__(self, directory: TenantDirectory, quota: HierarchicalQuota, store: AgentStore, *,
                 recorder: AgentRecorder | None = None, bus: StatsBus | None = None, clock: Clock = SYSTEM_CLOCK,
                 new_id: Callable[[], str] = lambda: str(uuid.uuid4())) -> None:
        super().__init__(directory, store, recorder=recorder, bus=bus, clock=clock)
        self.quota = quota
        self._new_id = new_id

    # -- shared ---------------------------------------------------------------------------------
    def _loops(self, entry: KeyEntry) -> LoopStops | None:
        tier = self.directory.snapshot.tiers.get(entry.principal.tier)
        return tier.loop_stops if tier is not None else None

    def can_withhold(self, principal: Principal) -> bool:
        """Whether the key's tool policy could refuse or hold a tool call the model emits
        (:attr:`~kvmeter.serving.tenancy.toolpolicy.ToolPolicy.can_withhold`).

        Raises:
            AuthError: 401 for a removed key.
        """
        return self.entry(principal).tool_policy.can_withhold

    def verdict(self, principal: Principal, tool: str) -> ToolVerdict:
        """The key's tool policy on ``tool`` (no side effect).

        Raises:
            AuthError: 401 for a removed key. AgentRefusal: 400 for a malformed tool name.
        """
        entry = self.entry(principal)
        _check_tool(tool, "tool")
        return entry.tool_policy.evaluate(tool)

    def _decided(self, p: Principal, run_id: str, tool: str, risk: str, source: str, decision: str,
                 now: float) -> None:
        self.publish(ToolCallDecided(attribution=p.attribution(agent_run_id=run_id), tool=tool, risk_class=risk,
                                     source=source, decision=decision, wall_ts=now))

    async def _tool_record(self, p: Principal, run_id: str, source: str, tool: str, risk: str, decision: str,
                           now: float, *, status: int, **fields: Any) -> None:
        await self.record(ToolCallRecord(
            attribution=p.attribution(agent_run_id=run_id), source=source, tool=tool,
            risk_class=risk, decision=decision, ts=now, status_code=status, **fields))
        self._decided(p, run_id, tool, risk, source, decision, now)

    async def _stopped(self, p: Principal, run_id: str, stop: RunStop) -> None:
        attribution = p.attribution(agent_run_id=run_id)
        await self.record(RunStopRecord(attribution=attribution, reason=stop.reason, detail=stop.detail, ts=stop.ts,
                                        tool=stop.tool))
        self.publish(AgentRunStopped(attribution=attribution, reason=stop.reason, wall_ts=stop.ts))

    def _request(self, entry: KeyEntry, p: Principal, run_id: str, tool: str, risk: str, digest: str, now: float,
                 *, idempotency_key: str = "", approval_id: str = "", decide_only: bool = False) -> ReportRequest:
        policy = entry.tool_policy
        return ReportRequest(
            tenant_id=p.tenant_id, workspace_id=p.workspace_id, project_id=p.project_id,
            api_key_id=p.api_key_id, run_id=run_id, tool=tool, risk_class=risk, arguments_sha256=digest,
            policy_version=policy.version, new_tool_call_id=self._new_id(), new_approval_id=self._new_id(),
            tool_calls_key=self.quota.tool_calls_key(p, run_id), now=now, idempotency_key=idempotency_key,
            approval_id=approval_id, approval_ttl_s=policy.approval_ttl_s,
            side_effect_window_s=policy.side_effect_window_s, max_tool_calls=entry.run_budget.max_tool_calls,
            loop_stops=self._loops(entry), decide_only=decide_only)

    # -- the report endpoint ----------------------------------------------------------------------
    async def report_tool_call(self, principal: Principal, run_id: str, tool: str, arguments: Any = None, *,
                               idempotency_key: str = "", approval_id: str = "",
                               call_id: str = "") -> ToolCallDecision:
        """Decide one reported tool call: the permit to execute it (module docstring).

        Args:
            principal: the run's key.
            run_id: the run (the quota's rule: 1–256 printable characters, no spaces).
            tool: the tool name (:data:`~kvmeter.serving.tenancy.toolpolicy.TOOL_NAME_PATTERN`).
            arguments: a JSON value or JSON text (``None`` = ``{}``); only its canonical digest is kept.
            idempotency_key: the client's key for this call (``side_effect`` / ``high_risk``).
            approval_id: the approval this report uses (default: the one bound to the call).
            call_id: the client's or model's id of the call (kept in the ledger record).
        Returns:
            The :class:`ToolCallDecision` (200 / 202).
        Raises:
            AgentRefusal: see :mod:`.errors` (403 policy or rejection, 404/409 approval, 409 stopped
                run, 422 idempotency key reused, 429 budget, 400 bad input, 503 store down).
            AuthError: 401 for a key removed by a reload.
        """
        entry = self.entry(principal)
        p = entry.principal
        if not valid_run_id(run_id):
            raise AgentRefusal("agent run id must be 1-256 printable characters without spaces", status_code=400,
                               code="invalid_request", param="run_id")
        _check_tool(tool, "tool")
        idempotency_key = check_id(idempotency_key, "idempotency_key")
        approval_id = check_id(approval_id, "approval_id")
        call_id = check_id(call_id, "call_id")
        digest = _digest(arguments)
        now = self.clock.wall()
        verdict = entry.tool_policy.evaluate(tool)
        policy_version = entry.tool_policy.version
        common = dict(arguments_sha256=digest, call_id=call_id, idempotency_key=idempotency_key,
                      policy_version=policy_version)
        if not verdict.allowed:
            decision = "blocked" if verdict.code == "tool_blocked" else "not_allowed"
            await self._tool_record(p, run_id, "reported", tool, verdict.risk_class, decision, now, status=403,
                                    reason=verdict.code, rule=verdict.rule, approval_id=approval_id, **common)
            raise AgentRefusal(verdict.message, status_code=403, code=verdict.code, param="tool",
                               fields={"tool": tool, "rule": verdict.rule})
        req = self._request(entry, p, run_id, tool, verdict.risk_class, digest, now,
                            idempotency_key=idempotency_key, approval_id=approval_id)
        try:
            res = await self.store.report(req)
        except AgentStoreUnavailable as exc:
            raise store_down(exc) from None
        return await self._answer_report(p, req, res, verdict, call_id, entry.run_budget.max_tool_calls)

    async def _answer_report(self, p: Principal, req: ReportRequest, res: ReportResult, verdict: ToolVerdict,
                             call_id: str, max_tool_calls: int | None) -> ToolCallDecision:
        now, run_id, tool, risk = req.now, req.run_id, req.tool, req.risk_class
        decision, status = _OUTCOMES[res.outcome]
        a = res.approval
        rule = res.stop.detail if res.stop is not None else ""
        await self._tool_record(p, run_id, "reported", tool, risk, decision, now, status=status,
                                tool_call_id=res.tool_call_id if res.outcome in ("allowed", "replayed") else "",
                                call_id=call_id, arguments_sha256=req.arguments_sha256,
                                reason="" if status < 300 else res.outcome, rule=rule,
                                approval_id=a.approval_id if a is not None else req.approval_id,
                                idempotency_key=req.idempotency_key, policy_version=req.policy_version)
        if res.approval_created and a is not None:
            await self.approval_event(a, "requested", p.tier, now=now)
        if res.outcome == "allowed" and a is not None and a.state == "consumed":
            await self.approval_event(a, "consumed", p.tier, now=now)
        if res.outcome in ("allowed", "budget_exceeded"):
            total = res.tool_calls or 0
            self.publish(ToolCallReported(p.attribution(endpoint="agent_runs.tool_calls", agent_run_id=run_id), total,
                                          max_tool_calls, max_tool_calls is not None and total > max_tool_calls, now))
        if res.stopped_now and res.stop is not None:
            await self._stopped(p, run_id, res.stop)
        if status < 300:
            return ToolCallDecision(decision if res.outcome != "replayed" else "replayed", run_id, tool, risk,
                                    req.arguments_sha256, req.policy_version, res.tool_call_id, a, res.tool_calls,
                                    max_tool_calls)
        raise _refusal(res, tool, max_tool_calls)

    # -- gateway hook (a): tools declared in a request --------------------------------------------
    async def check_declared_tools(self, principal: Principal, run_id: str, tool_names: Iterable[str]) -> None:
        """Refuse a request whose ``tools`` name a tool the key may not use.

        Args:
            principal: the request's key.
            run_id: its ``X-Agent-Run-Id`` (``""`` when none).
            tool_names: the names of the declared tools (``tools[].function.name``).
        Raises:
            AgentRefusal: 403 ``tool_blocked`` / ``tool_not_allowed`` (``param`` ``tools``; body
                ``tool`` and ``rule``) for the first refused tool, recorded in the ledger and
                counted; 400 ``invalid_value`` for a malformed name.
            AuthError: 401 for a key removed by a reload.
        """
        entry = self.entry(principal)
        p = entry.principal
        for name in tool_names:
            _check_tool(name, "tools")
            verdict = entry.tool_policy.evaluate(name)
            if verdict.allowed:
                continue
            now = self.clock.wall()
            decision = "blocked" if verdict.code == "tool_blocked" else "not_allowed"
            await self._tool_record(p, run_id if valid_run_id(run_id) else "", "declared", name, verdict.risk_class,
                                    decision, now, status=403, reason=verdict.code, rule=verdict.rule,
                                    policy_version=entry.tool_policy.version)
            raise AgentRefusal(verdict.message, status_code=403, code=verdict.code, param="tools",
                               fields={"tool": name, "rule": verdict.rule})

    # -- gateway hook (b): a tool call the model emitted --------------------------------------------
    async def on_emitted_tool_call(self, principal: Principal, run_id: str, tool: str, arguments: Any = None, *,
                                   call_id: str = "") -> EmittedDecision:
        """Decide what the response does with one tool call the model emitted.

        Never raises for the call's content (a malformed name or arguments is refused in the
        decision); raises only :class:`~kvmeter.serving.tenancy.AuthError` for a removed key.

        Args:
            principal: the request's key.
            run_id: its ``X-Agent-Run-Id`` (``""`` when none).
            tool: ``tool_calls[].function.name``.
            arguments: ``tool_calls[].function.arguments`` (JSON text) or a parsed value.
            call_id: ``tool_calls[].id``.
        Returns:
            The :class:`EmittedDecision`. Every refusal and every pending approval is recorded in
            the ledger (``source`` ``emitted``) and counted in ``kvmeter_agent_tool_calls_total``.
        """
        entry = self.entry(principal)
        p = entry.principal
        policy = entry.tool_policy
        now = self.clock.wall()
        run = run_id if valid_run_id(run_id) else ""
        call_id = call_id if isinstance(call_id, str) and len(call_id) <= 255 else ""
        if not valid_tool_name(tool):
            return await self._emitted_refusal(p, run, str(tool)[:128], "side_effect", now, "invalid_value",
                                               "", "the model emitted a tool call with an invalid tool name", call_id)
        verdict = policy.evaluate(tool)
        try:
            digest = arguments_digest(arguments)
        except ArgumentsError as exc:
            return await self._emitted_refusal(p, run, tool, verdict.risk_class, now, "invalid_value", "",
                                               f"the model emitted invalid arguments for {tool!r}: {exc}", call_id)
        if not verdict.allowed:
            return await self._emitted_refusal(p, run, tool, verdict.risk_class, now, verdict.code, verdict.rule,
                                               f"kvmeter refused this tool call: {verdict.message}", call_id,
                                               decision="blocked" if verdict.code == "tool_blocked" else "not_allowed",
                                               digest=digest)
        if not run:
            if verdict.risk_class == "high_risk":
                return await self._emitted_refusal(
                    p, run, tool, verdict.risk_class, now, "approval_requires_run", "",
                    f"kvmeter refused this tool call: {tool!r} is high-risk and needs an approval, which is bound "
                    "to an agent run: send X-Agent-Run-Id", call_id, decision="approval_refused", digest=digest)
            self._decided(p, run, tool, verdict.risk_class, "emitted", "allowed", now)
            return EmittedDecision("allow", tool, verdict.risk_class)
        req = self._request(entry, p, run, tool, verdict.risk_class, digest, now, decide_only=True)
        try:
            res = await self.store.report(req)
        except AgentStoreUnavailable as exc:
            return await self._emitted_refusal(p, run, tool, verdict.risk_class, now, "agent_store_unavailable", "",
                                               f"kvmeter could not check this tool call ({exc})", call_id,
                                               decision="approval_refused", digest=digest)
        a = res.approval
        if res.outcome in ("allowed", "approval_granted"):
            self._decided(p, run, tool, verdict.risk_class, "emitted", "allowed", now)
            return EmittedDecision("allow", tool, verdict.risk_class, approval_id=a.approval_id if a else "")
        decision, status = _OUTCOMES[res.outcome]
        await self._tool_record(p, run, "emitted", tool, verdict.risk_class, decision, now, status=status,
                                call_id=call_id, arguments_sha256=digest, reason="" if status < 300 else res.outcome,
                                rule=res.stop.detail if res.stop else "",
                                approval_id=a.approval_id if a is not None else "", policy_version=policy.version)
        if res.outcome == "pending_approval" and a is not None:
            if res.approval_created:
                await self.approval_event(a, "requested", p.tier, now=now)
            return EmittedDecision(
                "pending_approval", tool, verdict.risk_class, code="approval_pending", approval_id=a.approval_id,
                message=(f"kvmeter holds this tool call: {tool!r} is high-risk and waits for approval "
                         f"{a.approval_id} (expires at {a.expires_ts:.0f}); once approved, report the call to "
                         f"POST /v1/agent_runs/{run}/tool_calls with approval_id to get its permit"))
        refusal = _refusal(res, tool, None)
        return EmittedDecision("refuse", tool, verdict.risk_class, code=refusal.code or "",
                               message=f"kvmeter refused this tool call: {refusal.message}",
                               approval_id=a.approval_id if a is not None else "")

    async def _emitted_refusal(self, p: Principal, run: str, tool: str, risk: str, now: float, code: str, rule: str,
                               message: str, call_id: str, *, decision: str = "approval_refused",
                               digest: str = "") -> EmittedDecision:
        await self._tool_record(p, run, "emitted", tool, risk, decision, now, status=403, reason=code, rule=rule,
                                call_id=call_id, arguments_sha256=digest)
        return EmittedDecision("refuse", tool, risk, code=code, rule=rule, message=message)

    # -- gateway hook (c): each model call of a run --------------------------------------------------
    async def on_model_call(self, principal: Principal, run_id: str, prompt_digest: str = "") -> None:
        """Check a model call of an agent run before quota admission.

        Args:
            principal: the request's key.
            run_id: its ``X-Agent-Run-Id``; ``""`` or a malformed one is not checked here (the
                quota refuses a malformed one).
            prompt_digest: :func:`~.digest.prompt_digest` of the call's prompt token ids, for the
                repeated-prompt stop; ``""`` skips that stop.
        Raises:
            ModelCallRefused: 409 ``agent_run_stopped`` (the run was stopped; body ``reason``,
                ``detail``), 409 ``approval_pending`` (body ``approval_id``), 503
                ``agent_store_unavailable``.
        """
        if not valid_run_id(run_id):
            return
        entry = self.directory.snapshot.keys.get(principal.api_key_id)
        if entry is None:
            return  # removed by a reload: the quota answers 401
        loops = self._loops(entry)
        now = self.clock.wall()
        try:
            res = await self.store.model_call(principal.tenant_id, run_id, prompt_digest,
                                              loops.max_repeated_prompts if loops else None, now)
        except AgentStoreUnavailable as exc:
            raise ModelCallRefused(f"the agent-run store is unavailable ({exc})", status_code=503,
                                   reason="agent_store_unavailable", dimension="agent_store",
                                   retry_after_s=1.0) from None
        if res.outcome == "ok":
            return
        if res.outcome == "approval_pending":
            raise ModelCallRefused(
                f"agent run {run_id!r} waits for approval {res.approval_id} of a high-risk tool call; the run's "
                "model calls resume once an approver decides it", status_code=409, reason="approval_pending",
                dimension="approval", fields={"approval_id": res.approval_id})
        assert res.stop is not None
        if res.stopped_now:
            await self._stopped(entry.principal, run_id, res.stop)
        raise ModelCallRefused(f"agent run {run_id!r} was stopped: {res.stop.detail}", status_code=409,
                               reason="agent_run_stopped", dimension=res.stop.reason,
                               fields={"reason": res.stop.reason, "detail": res.stop.detail})

    async def run_stop(self, principal: Principal, run_id: str) -> RunStop | None:
        """The run's stop, or None while it may run.

        Raises:
            AgentRefusal: 503 while the store is down.
        """
        try:
            return await self.store.run_stop(principal.tenant_id, run_id)
        except AgentStoreUnavailable as exc:
            raise store_down(exc) from None


def _check_tool(tool: object, param: str) -> None:
    if not valid_tool_name(tool):
        raise AgentRefusal(f"{param}: a tool name must be 1-128 characters of letters, digits and _ . : / -",
                           status_code=400, code="invalid_value", param=param)


def _digest(arguments: Any) -> str:
    try:
        return arguments_digest(arguments)
    except ArgumentsError as exc:
        raise AgentRefusal(f"arguments: {exc}", status_code=400, code="invalid_value", param="arguments") from None


def _refusal(res: ReportResult, tool: str, max_tool_calls: int | None) -> AgentRefusal:
    """The refusal of a store outcome that is not a permit (see :mod:`.errors`)."""
    a = res.approval
    aid = a.approval_id if a is not None else ""
    o = res.outcome
    if o == "approval_rejected":
        return AgentRefusal(f"approval {aid} of this call of {tool!r} was rejected: {a.reason if a else ''}",
                            status_code=403, code="approval_rejected", fields={"approval_id": aid,
                                                                               "reason": a.reason if a else ""})
    if o == "approval_not_found":
        return AgentRefusal("no such approval", status_code=404, code="approval_not_found", param="approval_id")
    if o == "approval_mismatch":
        return AgentRefusal(f"approval {aid} is bound to another {res.mismatch.replace('_', ' ')}: it cannot permit "
                            "this call", status_code=409, code="approval_mismatch", param="approval_id",
                            fields={"approval_id": aid, "mismatch": res.mismatch})
    if o == "approval_used":
        return AgentRefusal(f"approval {aid} already permitted its one call ({res.tool_call_id})", status_code=409,
                            code="approval_used", param="approval_id",
                            fields={"approval_id": aid, "tool_call_id": res.tool_call_id})
    if o == "approval_expired":
        return AgentRefusal(f"approval {aid} expired", status_code=409, code="approval_expired", param="approval_id",
                            fields={"approval_id": aid})
    if o == "idempotency_conflict":
        return AgentRefusal("this idempotency key was already used for another tool call", status_code=422,
                            code="idempotency_key_reused", param="Idempotency-Key")
    if o == "budget_exceeded":
        return AgentRefusal(f"agent run budget exceeded: tool_calls is at {res.tool_calls} of {max_tool_calls}",
                            status_code=429, code="run_budget_exceeded",
                            fields={"level": "agent_run", "dimension": "tool_calls"})
    stop = res.stop
    assert stop is not None, o
    return AgentRefusal(f"the agent run was stopped: {stop.detail}", status_code=409, code="agent_run_stopped",
                        fields={"reason": stop.reason, "detail": stop.detail})
