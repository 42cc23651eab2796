"""In-process agent-run store: the embedded default, beside the in-memory quota store.

One lock guards every run, approval and idempotency record, so each operation of
:class:`~kvmeter.serving.agents.store.AgentStore` is atomic against every other of the process
(asyncio tasks and OS threads alike). The run's tool-call counter is the quota's own
(:class:`~kvmeter.serving.quota.MemoryQuotaStore`, counted with its ``add_sync`` inside this
store's critical section), so the quota's ``max_tool_calls`` check on the next model call reads
what the permits counted. Semantics are the Redis scripts', operation for operation
(:mod:`.redis_store`); the same tests run on both.

Expiry: a run's state is dropped :data:`~.store.RUN_STATE_TTL_S` after its last write, an
approval :data:`~.store.APPROVAL_RETENTION_S` after its expiry, idempotency records at the end
of their window, by a sweep every ``sweep_interval_s`` seconds of store time.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

from kvmeter.serving.quota.memory import MemoryQuotaStore
from kvmeter.serving.quota.plan import RUN_TTL_S

from .loops import cycle_repeats, signature
from .store import (APPROVAL_RETENTION_S, IDEMPOTENCY_KEY_TTL_S, RUN_STATE_TTL_S, AgentStore, Approval,
                    DecideResult, ModelCallResult, ReportRequest, ReportResult, RunStop)

__all__ = ["MemoryAgentStore"]


@dataclass(slots=True)
class _Run:
    stop: RunStop | None = None
    history: list[str] = field(default_factory=list)          # permitted signatures, newest first
    counts: dict[str, int] = field(default_factory=dict)       # signature → permits
    prompt: tuple[str, int] = ("", 0)                          # last prompt digest, calls in a row
    pending: dict[str, float] = field(default_factory=dict)    # approval id → expiry
    side_effects: dict[str, tuple[str, float]] = field(default_factory=dict)  # signature → (id, until)
    touched: float = 0.0


class MemoryAgentStore(AgentStore):
    """Agent-run state in dicts (see module docstring).

    Args:
        counters: the quota store holding the runs' tool-call counters (default: a private
            :class:`MemoryQuotaStore`, for a store used without a quota).
        sweep_interval_s: seconds of store time between expiry sweeps (> 0).
    """

    name = "memory"

    def __init__(self, counters: MemoryQuotaStore | None = None, *, sweep_interval_s: float = 60.0) -> None:
        if sweep_interval_s <= 0:
            raise ValueError(f"sweep_interval_s must be > 0, got {sweep_interval_s}")
        self.counters = counters if counters is not None else MemoryQuotaStore()
        self.sweep_interval_s = sweep_interval_s
        self._lock = threading.Lock()
        self._runs: dict[tuple[str, str], _Run] = {}
        self._approvals: dict[str, Approval] = {}
        self._bindings: dict[str, str] = {}
        self._keys: dict[tuple[str, str], tuple[str, str, float]] = {}  # (tenant, key) → (sig, id, until)
        self._next_sweep = float("-inf")

    def tracked_runs(self) -> set[tuple[str, str]]:
        """The ``(tenant id, run id)`` of every run whose state the store holds now (a snapshot);
        a run is forgotten :data:`~.store.RUN_STATE_TTL_S` after its last write, at the next sweep."""
        with self._lock:
            return set(self._runs)

    # -- helpers (lock held) ---------------------------------------------------------------------
    def _run(self, tenant_id: str, run_id: str, now: float) -> _Run:
        run = self._runs.get((tenant_id, run_id))
        if run is None:
            run = self._runs[(tenant_id, run_id)] = _Run()
        run.touched = now
        return run

    def _sweep(self, now: float) -> None:
        self._next_sweep = now + self.sweep_interval_s
        for k in [k for k, r in self._runs.items() if now - r.touched > RUN_STATE_TTL_S]:
            del self._runs[k]
        for aid in [a for a, ap in self._approvals.items() if now > ap.expires_ts + APPROVAL_RETENTION_S]:
            del self._approvals[aid]
        for b in [b for b, aid in self._bindings.items() if aid not in self._approvals]:
            del self._bindings[b]
        for k in [k for k, v in self._keys.items() if v[2] <= now]:
            del self._keys[k]

    def _stop(self, run: _Run, stop: RunStop) -> RunStop:
        run.stop = stop
        return stop

    # -- operations ------------------------------------------------------------------------------
    async def report(self, req: ReportRequest) -> ReportResult:
        return self.report_sync(req)

    def report_sync(self, req: ReportRequest) -> ReportResult:
        """Synchronous :meth:`report` (for threads and benchmarks)."""
        now = req.now
        sig = signature(req.tool, req.arguments_sha256)
        with self._lock:
            if now >= self._next_sweep:
                self._sweep(now)
            run = self._run(req.tenant_id, req.run_id, now)
            key = req.idempotency_key if req.risk_class != "read_only" else ""
            # 1. replay of a call already permitted
            if req.decide_only:
                pass
            elif key:
                rec = self._keys.get((req.tenant_id, key))
                if rec is not None and rec[2] > now:
                    if rec[0] != sig:
                        return ReportResult("idempotency_conflict", tool_call_id=rec[1])
                    return ReportResult("replayed", tool_call_id=rec[1])
            elif req.risk_class == "side_effect":
                hit = run.side_effects.get(sig)
                if hit is not None and hit[1] > now:
                    return ReportResult("replayed", tool_call_id=hit[0])
            # 2. a stopped run
            if run.stop is not None:
                return ReportResult("run_stopped", stop=run.stop)
            # 3. approval
            approval: Approval | None = None
            if req.risk_class == "high_risk":
                if req.approval_id:
                    approval = self._approvals.get(req.approval_id)
                    if approval is None:
                        return ReportResult("approval_not_found")
                    field_ = req.mismatch(approval)
                    if field_:
                        return ReportResult("approval_mismatch", approval=approval, mismatch=field_)
                else:
                    aid = self._bindings.get(req.binding)
                    approval = self._approvals.get(aid) if aid is not None else None
                status = approval.status(now) if approval is not None else "none"
                if status == "pending":
                    return ReportResult("pending_approval", approval=approval)
                if approval is not None and status == "rejected" and now < approval.expires_ts:
                    return ReportResult("approval_rejected", approval=approval)
                if approval is not None and req.approval_id and status in ("consumed", "expired", "rejected"):
                    outcome = {"consumed": "approval_used", "expired": "approval_expired",
                               "rejected": "approval_expired"}[status]
                    return ReportResult(outcome, approval=approval, tool_call_id=approval.tool_call_id)
                if status != "approved":
                    new = req.new_approval()
                    self._approvals[new.approval_id] = new
                    self._bindings[req.binding] = new.approval_id
                    run.pending[new.approval_id] = new.expires_ts
                    return ReportResult("pending_approval", approval=new, approval_created=True)
            if req.decide_only:
                return ReportResult("approval_granted" if req.risk_class == "high_risk" else "allowed",
                                    approval=approval)
            # 4. loop stops
            loop = req.loop_stops
            if loop is not None:
                n = run.counts.get(sig, 0) + 1
                if loop.max_identical_tool_calls is not None and n > loop.max_identical_tool_calls:
                    stop = self._stop(run, RunStop("identical_tool_calls", req.tool, 0,
                                                   loop.max_identical_tool_calls, now))
                    return ReportResult("loop_stopped", stop=stop, stopped_now=True)
                if loop.max_cycle_repeats is not None:
                    repeats, period = cycle_repeats([sig, *run.history], loop.max_cycle_length)
                    if repeats > loop.max_cycle_repeats:
                        stop = self._stop(run, RunStop("tool_cycle", req.tool, period, loop.max_cycle_repeats, now))
                        return ReportResult("loop_stopped", stop=stop, stopped_now=True)
            # 5. budget: the quota's counter of the run's tool calls
            total = self.counters.add_sync(req.tool_calls_key, 1, max(RUN_TTL_S, RUN_STATE_TTL_S), now)
            if req.max_tool_calls is not None and total > req.max_tool_calls:
                return ReportResult("budget_exceeded", tool_calls=total)
            # 6. permit
            history_len = loop.history_calls if loop is not None else 0
            if history_len:
                run.history.insert(0, sig)
                del run.history[history_len:]
            run.counts[sig] = run.counts.get(sig, 0) + 1
            run.prompt = ("", 0)
            if approval is not None:
                approval = replace(approval, state="consumed", tool_call_id=req.new_tool_call_id)
                self._approvals[approval.approval_id] = approval
            if key:
                self._keys[(req.tenant_id, key)] = (sig, req.new_tool_call_id, now + IDEMPOTENCY_KEY_TTL_S)
            elif req.risk_class == "side_effect":
                run.side_effects[sig] = (req.new_tool_call_id, now + req.side_effect_window_s)
                if len(run.side_effects) > 4 * 1024:
                    for s in [s for s, v in run.side_effects.items() if v[1] <= now]:
                        del run.side_effects[s]
            return ReportResult("allowed", tool_call_id=req.new_tool_call_id, approval=approval, tool_calls=total)

    async def model_call(self, tenant_id: str, run_id: str, prompt_digest: str, max_repeated_prompts: int | None,
                         now: float) -> ModelCallResult:
        with self._lock:
            if now >= self._next_sweep:
                self._sweep(now)
            if not prompt_digest and (tenant_id, run_id) not in self._runs:
                return ModelCallResult("ok")  # nothing to check, nothing to remember
            run = self._run(tenant_id, run_id, now)
            if run.stop is not None:
                return ModelCallResult("run_stopped", stop=run.stop)
            for aid in [a for a, until in run.pending.items() if until <= now]:
                del run.pending[aid]
            if run.pending:
                oldest = min(run.pending, key=lambda a: (run.pending[a], a))
                return ModelCallResult("approval_pending", approval_id=oldest)
            if not prompt_digest:
                return ModelCallResult("ok")
            last, count = run.prompt
            count = count + 1 if last == prompt_digest else 1
            if max_repeated_prompts is not None and count > max_repeated_prompts:
                stop = self._stop(run, RunStop("repeated_prompt", "", 0, max_repeated_prompts, now))
                return ModelCallResult("loop_stopped", stop=stop, stopped_now=True, repeats=count)
            run.prompt = (prompt_digest, count)
            return ModelCallResult("ok", repeats=count)

    async def decide(self, approval_id: str, approve: bool, actor_key_id: str, reason: str,
                     now: float) -> DecideResult:
        with self._lock:
            a = self._approvals.get(approval_id)
            if a is None:
                return DecideResult("not_found")
            if a.state != "pending":
                return DecideResult("already_decided", a)
            if now >= a.expires_ts:
                return DecideResult("expired", a)
            a = replace(a, state="approved" if approve else "rejected", decided_by=actor_key_id,
                        decided_ts=now, reason=reason)
            self._approvals[approval_id] = a
            run = self._runs.get((a.tenant_id, a.run_id))
            if run is not None:
                run.pending.pop(approval_id, None)
            return DecideResult(a.state, a)

    async def get_approval(self, approval_id: str) -> Approval | None:
        with self._lock:
            return self._approvals.get(approval_id)

    async def list_pending(self, tenant_id: str | None, now: float, limit: int) -> list[Approval]:
        with self._lock:
            found = [a for a in self._approvals.values() if a.state == "pending" and a.expires_ts > now
                     and (tenant_id is None or a.tenant_id == tenant_id)]
        found.sort(key=lambda a: (a.expires_ts, a.approval_id))
        return found[:limit]

    async def run_stop(self, tenant_id: str, run_id: str) -> RunStop | None:
        with self._lock:
            run = self._runs.get((tenant_id, run_id))
            return run.stop if run is not None else None
