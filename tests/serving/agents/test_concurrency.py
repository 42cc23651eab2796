"""Atomic under concurrency, on the memory store and on a real Redis: 50 parallel branches of one
run against a budget of 10 model calls admit exactly 10; 50 concurrent tool-call reports against a
budget of 10 get exactly 10 permits; one approval, 50 concurrent reports: exactly one permit."""

from __future__ import annotations

import asyncio
import threading

from tests.serving.agents.conftest import config

from kvmeter.serving.agents import AgentRefusal, MemoryAgentStore, ReportRequest
from kvmeter.serving.quota import QuotaRejected, Reservation
from tests.serving.quota.quota_testlib import estimate

N = 50


async def test_50_parallel_branches_against_10_model_calls_admit_exactly_10(make_kit):
    kit = make_kit(config().replace("run_budget: {max_tool_calls: 100}",
                                    "run_budget: {max_model_calls: 10, max_parallel_branches: 64}"))
    p = kit.principal("agent")
    guarded = kit.quota  # HierarchicalQuota on the parametrized store's counters

    async def branch(i: int):
        return await guarded.reserve(p, estimate("m", 10, 10, agent_run_id="run-par", request_id=f"b{i}", principal=p))

    results = await asyncio.gather(*(branch(i) for i in range(N)), return_exceptions=True)
    admitted = [r for r in results if isinstance(r, Reservation)]
    refused = [r for r in results if isinstance(r, QuotaRejected)]
    assert len(admitted) == 10 and len(refused) == N - 10
    assert {(e.reason, e.level, e.dimension) for e in refused} == {("run_budget_exceeded", "agent_run", "model_calls")}
    usage = await guarded.run_usage(p, "run-par")
    assert usage.model_calls == 10  # the counter holds exactly the admitted calls: no overshoot


async def test_50_concurrent_reports_against_10_tool_calls_get_exactly_10_permits(make_kit):
    kit = make_kit(config(max_tool_calls=10))

    async def one(i: int):
        try:
            return await kit.agents.report_tool_call(kit.principal("agent"), "run-tc", "search_web", {"q": i})
        except AgentRefusal as refusal:
            return refusal

    results = await asyncio.gather(*(one(i) for i in range(N)))
    permits = [r for r in results if not isinstance(r, AgentRefusal)]
    refused = [r for r in results if isinstance(r, AgentRefusal)]
    assert len(permits) == 10 and len({r.tool_call_id for r in permits}) == 10
    assert {r.code for r in refused} == {"run_budget_exceeded"} and len(refused) == N - 10
    assert sorted(r.tool_calls for r in permits) == list(range(1, 11))


async def test_one_approval_50_concurrent_reports_exactly_one_permit(make_kit):
    kit = make_kit()
    args = {"service": "api", "version": "2"}
    first = await kit.agents.report_tool_call(kit.principal("agent"), "run-ap", "deploy_service", args)
    await kit.desk.decide(kit.principal("ops"), first.approval.approval_id, approve=True)

    async def one(named: bool):
        return await kit.agents.report_tool_call(kit.principal("agent"), "run-ap", "deploy_service", args,
                                                 approval_id=first.approval.approval_id if named else "")

    results = await asyncio.gather(*(one(i % 2 == 0) for i in range(N)), return_exceptions=True)
    permits = [r for r in results if not isinstance(r, BaseException) and r.decision == "allowed"]
    assert len(permits) == 1 and permits[0].approval.approval_id == first.approval.approval_id
    rest = [r for r in results if r is not permits[0]]
    used = [r for r in rest if isinstance(r, AgentRefusal)]
    pending = [r for r in rest if not isinstance(r, AgentRefusal)]
    assert {r.code for r in used} <= {"approval_used"}
    assert {r.decision for r in pending} <= {"pending_approval"}
    # every unnamed report after the permit shares one new approval request
    assert len({r.approval.approval_id for r in pending}) <= 1
    assert len(used) + len(pending) == N - 1


def test_memory_store_is_atomic_across_os_threads(clock):
    """8 threads × 25 reports of one run against a budget of 10: exactly 10 permits."""
    store = MemoryAgentStore()
    permits: list[str] = []
    start = threading.Barrier(8)

    def worker(w: int) -> None:
        start.wait()
        for i in range(25):
            res = store.report_sync(ReportRequest(
                tenant_id="t", workspace_id="w", project_id="p", api_key_id="k", run_id="r",
                tool="search", risk_class="read_only", arguments_sha256=f"{w:02d}{i:02d}" + "0" * 60,
                policy_version="v", new_tool_call_id=f"id-{w}-{i}", new_approval_id=f"ap-{w}-{i}",
                tool_calls_key=b"kvq:r:t/r:tc", now=clock.wall(), max_tool_calls=10))
            if res.outcome == "allowed":
                permits.append(res.tool_call_id)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(permits) == 10
