"""Agent run budgets: each budget stops the run's next call with a clear reason (memory and Redis)."""

from __future__ import annotations

from decimal import Decimal

import pytest

from kvmeter.bus import StatsBus
from kvmeter.serving.quota import QuotaRejected, UsageEstimate
from kvmeter.stats import ToolCallReported
from quota_testlib import estimate, tree, used

K1 = "sk-test-key-one"


def call(run: str = "run-1", p: int = 100, m: int = 100, attempt: int = 1) -> UsageEstimate:
    return estimate("m", p, m, agent_run_id=run, attempt=attempt)


async def refused(gate, e: UsageEstimate) -> QuotaRejected:
    with pytest.raises(QuotaRejected) as info:
        await gate.reserve(gate.directory.authenticate(K1), e)
    return info.value


async def test_max_model_calls(make_gate):
    gate = make_gate(tree(run_budget="{max_model_calls: 3}"))
    pr = gate.directory.authenticate(K1)
    for _ in range(3):
        r = await gate.reserve(pr, call())
        await gate.reconcile(r, used(100, 0, 10))
    e = await refused(gate, call())
    assert (e.status_code, e.reason, e.level, e.dimension, e.retry_after_s) == (
        429, "run_budget_exceeded", "agent_run", "model_calls", None)
    assert "model_calls is at 3 of 3" in e.message
    await gate.reserve(pr, call(run="run-2"))          # another run has its own budget
    await gate.reserve(pr, estimate("m", 10, 10, principal=pr))  # calls outside any run are not counted
    usage = await gate.run_usage(pr, "run-1")
    assert usage.model_calls == 3 and usage.retries is not None


async def test_tool_calls_reported_then_the_next_model_call_is_refused(make_gate):
    bus = StatsBus()
    reports: list[ToolCallReported] = []
    bus.subscribe(ToolCallReported, reports.append)
    gate = make_gate(tree(run_budget="{max_tool_calls: 2}"), bus=bus)
    pr = gate.directory.authenticate(K1)
    await gate.reserve(pr, call())
    r = await gate.report_tool_call(pr, "run-1", 2)
    assert (r.tool_calls, r.max_tool_calls, r.exceeded) == (2, 2, False)
    await gate.reserve(pr, call())
    r = await gate.report_tool_call(pr, "run-1")
    assert (r.tool_calls, r.exceeded) == (3, True)
    e = await refused(gate, call())
    assert (e.reason, e.dimension) == ("run_budget_exceeded", "tool_calls")
    assert [x.tool_calls for x in reports] == [2, 3] and reports[-1].exceeded
    assert (await gate.run_usage(pr, "run-1")).tool_calls == 3


async def test_bad_tool_call_reports_are_400(make_gate):
    gate = make_gate(tree())
    pr = gate.directory.authenticate(K1)
    for run, count in (("", 1), ("a b", 1), ("x" * 300, 1), ("run", 0), ("run", -2), ("run", 10_001)):
        with pytest.raises(QuotaRejected) as info:
            await gate.report_tool_call(pr, run, count)
        assert (info.value.status_code, info.value.reason) == (400, "invalid_request")


async def test_max_runtime_counts_from_the_first_call(make_gate, clock):
    gate = make_gate(tree(run_budget="{max_runtime_s: 30}"))
    pr = gate.directory.authenticate(K1)
    await gate.reserve(pr, call())
    clock.advance(30)
    await gate.reserve(pr, call())
    clock.advance(0.5)
    e = await refused(gate, call())
    assert (e.reason, e.dimension) == ("run_budget_exceeded", "runtime_seconds")
    await gate.reserve(pr, call(run="fresh-run"))
    assert (await gate.run_usage(pr, "run-1")).started_wall == pytest.approx(clock.wall() - 30.5)


async def test_max_cost_reserves_then_reconciles_to_actual(make_gate):
    gate = make_gate(tree(run_budget="{max_cost: '0.0005'}"))  # one call reserves 0.0002
    pr = gate.directory.authenticate(K1)
    a = await gate.reserve(pr, call())
    await gate.reserve(pr, call())
    e = await refused(gate, call())
    assert (e.reason, e.dimension) == ("run_budget_exceeded", "cost")
    await gate.reconcile(a, used(100, 0, 0))  # actual 0.00005
    await gate.reserve(pr, call())
    assert (await gate.run_usage(pr, "run-1")).cost == Decimal("0.00045")


async def test_max_retries_counts_attempts_after_the_first(make_gate):
    gate = make_gate(tree(run_budget="{max_retries: 1}"))
    pr = gate.directory.authenticate(K1)
    await gate.reserve(pr, call(attempt=1))
    await gate.reserve(pr, call(attempt=2))
    e = await refused(gate, call(attempt=2))
    assert (e.reason, e.dimension) == ("run_budget_exceeded", "retries")
    await gate.reserve(pr, call(attempt=1))


async def test_max_parallel_branches_is_released_at_reconcile(make_gate):
    gate = make_gate(tree(run_budget="{max_parallel_branches: 2}"), default_hold_s=2.0)
    pr = gate.directory.authenticate(K1)
    a = await gate.reserve(pr, call())
    await gate.reserve(pr, call())
    e = await refused(gate, call())
    assert (e.reason, e.dimension) == ("run_budget_exceeded", "parallel_branches")
    assert e.retry_after_s == pytest.approx(1.0)  # 2 s mean hold / 2 in flight
    await gate.reconcile(a, used())
    await gate.reserve(pr, call())


async def test_per_run_rate_limits_and_context(make_gate):
    gate = make_gate(tree(agent_run_limits="{output_tokens_per_minute: 300, max_context_tokens: 500}"))
    pr = gate.directory.authenticate(K1)
    await gate.reserve(pr, call(m=200))
    e = await refused(gate, call(m=200))
    assert (e.reason, e.level, e.dimension) == ("rate_limited", "agent_run", "output_tokens_per_minute")
    assert e.retry_after_s == pytest.approx(20.0)
    e = await refused(gate, call(run="r2", p=400, m=200))
    assert (e.status_code, e.reason, e.level) == (400, "context_length_exceeded", "agent_run")
    await gate.reserve(pr, estimate("m", 400, 200, principal=pr))  # the run's limit binds only calls of runs
    assert gate.context_limit(pr, "r2") == 500


async def test_malformed_run_ids_are_400(make_gate):
    gate = make_gate(tree())
    for run in ("has space", "tab\there", "x" * 257):
        e = await refused(gate, call(run=run))
        assert (e.status_code, e.reason, e.level) == (400, "invalid_request", "agent_run")
