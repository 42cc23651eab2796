"""Agent-run records in the real embedded ClickHouse: durable, validated, drained once; the per-run
rollup (model calls, tokens per model, tool calls by tool and risk class, refusals, approvals, loop
stops) recomputed from deduplicated rows and priced exactly at read time."""

from __future__ import annotations

from decimal import Decimal

import pytest
from ledgerkit import MODEL, PERIOD, T0, make_attempt, make_event, scalar

from kvmeter.attribution import Attribution
from kvmeter.ledger import ApprovalRecord, InvalidRecord, RunStopRecord, ToolCallRecord
from kvmeter.tokens import TokenCounts


def run_of(run: str, tenant: str = "acme") -> Attribution:
    """The calling key's attribution for a record of ``run``."""
    return Attribution(tenant, tier="paid_interactive", api_key_id=f"{tenant}-key1", agent_run_id=run)


def tool(run: str, decision: str, name: str = "search", risk: str = "read_only", i: int = 0, **kw) -> ToolCallRecord:
    return ToolCallRecord(attribution=run_of(run), source=kw.pop("source", "reported"), tool=name,
                          risk_class=risk, decision=decision, ts=T0 + i, **kw)


async def test_records_roundtrip_and_the_rollup_counts_a_run(open_ledger):
    ledger = open_ledger()
    for i in range(3):  # three model calls of run r1 (25 input, 10 output tokens each)
        e = make_event(i, agent_run_id="r1")
        await ledger.record_attempt(make_attempt(e))
        await ledger.record(e)
    refused = make_event(9, agent_run_id="r1")
    await ledger.record_attempt(make_attempt(refused, status="rejected", reason="agent_run_stopped"))
    await ledger.record(make_event(20, agent_run_id="r2", input_tokens=1000, output_tokens=500))
    records = [tool("r1", "allowed", i=1, tool_call_id="t1"), tool("r1", "allowed", "send", "side_effect", 2),
               tool("r1", "replayed", "send", "side_effect", 3), tool("r1", "blocked", "rm", "side_effect", 4),
               tool("r1", "allowed", source="emitted"),  # emitted calls are not permits
               ApprovalRecord(approval_id="a1", event="requested", attribution=run_of("r1"),
                              tool="deploy", ts=T0 + 5, expires_ts=T0 + 600),
               ApprovalRecord(approval_id="a1", event="approved", attribution=run_of("r1"),
                              tool="deploy", ts=T0 + 6, expires_ts=T0 + 600, actor_key_id="ops", reason="ok"),
               ApprovalRecord(approval_id="a2", event="requested", attribution=run_of("r1"),
                              tool="deploy", ts=T0 + 7, expires_ts=T0 + 9000),
               RunStopRecord(attribution=run_of("r1"), reason="tool_cycle", detail="a cycle", ts=T0 + 8)]
    for r in records:
        await ledger.record_agent(r)
    await ledger.record_agent(records[5])  # re-recorded: stored once (deterministic record id)
    assert ledger.flush()
    ledger.refresh_rollups()
    runs = {r["agent_run_id"]: r for r in ledger.agent_runs.runs(PERIOD, ["acme"])}
    r1 = runs["r1"]
    assert (r1["model_calls"], r1["ok_model_calls"], r1["refused_model_calls"]) == (3, 3, 1)
    assert (r1["input_tokens"], r1["output_tokens"], r1["models"]) == (75, 30, [MODEL])
    assert (r1["tool_calls"], r1["tool_calls_by_tool"], r1["tool_calls_by_risk_class"]) == (
        2, {"search": 1, "send": 1}, {"read_only": 1, "side_effect": 1})
    assert (r1["refused_tool_calls"], r1["replayed_tool_calls"], r1["refusals"]) == (1, 1, 2)
    assert (r1["approvals_requested"], r1["approvals_approved"], r1["loop_stops"], r1["stop_reason"]) == (
        2, 1, 1, "tool_cycle")
    assert r1["duration_s"] == pytest.approx(9 - 0.0)  # first arrival T0 + 0 … the refused attempt at T0 + 9
    # cost: the one price function, rounded once per run
    prices = ledger.prices
    exact = prices.cost(MODEL, "paid_interactive", TokenCounts(input_tokens=75, output_tokens=30))
    assert exact == Decimal("0.0000405")  # 75 × 0.30 / 1e6 + 30 × 0.60 / 1e6
    assert (Decimal(r1["subtotal"]), Decimal(r1["cost"]), r1["priced"]) == (exact, prices.round(exact), True)
    # the most expensive run first
    assert [r["agent_run_id"] for r in ledger.agent_runs.runs(PERIOD, ["acme"])] == ["r2", "r1"]
    assert [r["agent_run_id"] for r in ledger.agent_runs.runs(PERIOD, ["acme"], order="last_ts")] == ["r2", "r1"]
    assert ledger.agent_runs.runs(PERIOD, ["globex"]) == []
    # approvals pending: a2 (a1 was approved); run stops
    from datetime import datetime, timezone
    pending = ledger.agent_runs.pending_approvals(datetime.fromtimestamp(T0 + 10, tz=timezone.utc), ["acme"])
    assert [p["approval_id"] for p in pending] == ["a2"]
    assert [s["reason"] for s in ledger.agent_runs.run_stops(PERIOD, ["acme"])] == ["tool_cycle"]
    assert scalar(ledger, "SELECT count() FROM approval_events FINAL") == 3


async def test_a_new_record_recomputes_its_run_and_never_double_counts(open_ledger):
    ledger = open_ledger()
    await ledger.record_agent(tool("r1", "allowed", i=1))
    assert ledger.flush()
    ledger.refresh_rollups()
    await ledger.record_agent(tool("r1", "allowed", i=2))
    assert ledger.flush()
    ledger.refresh_rollups()
    ledger.refresh_rollups()
    (r1,) = ledger.agent_runs.runs(PERIOD, ["acme"])
    assert r1["tool_calls"] == 2


def test_invalid_agent_records_are_refused_before_the_spool():
    with pytest.raises(InvalidRecord):
        tool("r1", "maybe")
    with pytest.raises(InvalidRecord):
        ToolCallRecord(attribution=run_of(""), source="reported", tool="x", risk_class="read_only",
                       decision="allowed", ts=T0)
    with pytest.raises(InvalidRecord):
        RunStopRecord(attribution=run_of("r"), reason="bored", detail="", ts=T0)
    with pytest.raises(InvalidRecord):
        ApprovalRecord(approval_id="a", event="maybe", attribution=run_of("r"), tool="t", ts=T0,
                       expires_ts=T0)
    with pytest.raises(InvalidRecord):  # the attribution is the one type, never its fields one by one
        RunStopRecord(attribution="acme", reason="tool_cycle", detail="", ts=T0)  # type: ignore[arg-type]


async def test_an_out_of_range_field_is_refused_naming_it(open_ledger):
    ledger = open_ledger()
    with pytest.raises(InvalidRecord, match="ts"):
        await ledger.record_agent(tool("r1", "allowed", i=-10**10))
