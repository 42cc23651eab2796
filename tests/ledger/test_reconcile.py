"""Three-way reconciliation on real data in chDB: each kind of difference lands in its class."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from ledgerkit import PERIOD, T0, engine_stats, make_attempt, make_event, scalar

from kvmeter.bus import StatsBus
from kvmeter.ledger import parse_period
from kvmeter.ledger.billing import build_invoice
from kvmeter.ledger.reconcile import UNATTRIBUTED, reconcile
from kvmeter.stats import EngineRequestStats
from kvmeter.tokens import TokenCounts


def scalar_rows(ledger, sql: str) -> list[tuple]:  # noqa: ANN001
    return ledger.query_client().query(sql).result_rows


def _engine(bus: StatsBus, event, *, output_tokens: int | None = None, **overrides) -> None:  # noqa: ANN001
    """The engine's stats of ``event``'s request, stamped with its attribution as the engines do."""
    extra = 0 if output_tokens is None else output_tokens - event.tokens.output_tokens
    bus.publish(engine_stats(event, extra_output=extra, **{"wall_ts": event.finish_ts + 0.01, **overrides}))


@pytest.fixture
def scenario(open_ledger):
    bus = StatsBus()
    ledger = open_ledger(bus=bus)
    ledger.query_client().command("SYSTEM STOP MERGES usage_events")  # keep stored duplicates countable

    # clean: engine, gateway and ledger agree
    for i in range(5):
        e = make_event(i, "clean")
        ledger.record_attempt_sync(make_attempt(e))
        _engine(bus, e)
        ledger.record_sync(e)
    ledger.record_sync(make_event(0, "clean"))  # a retried record: a stored duplicate, billed once

    # aborts: billed from the frontend's counts; vLLM never reports them
    for i in range(3):
        e = make_event(i, "aborts", outcome="aborted", finish_reason="abort", output_tokens=4,
                       token_source="frontend")
        ledger.record_attempt_sync(make_attempt(e))
        ledger.record_sync(e)

    # drifty: every unexplained kind, plus one superseded retry (explained)
    for i in range(2):  # the engine generated 12 tokens, the ledger billed 10
        e = make_event(i, "drifty")
        ledger.record_attempt_sync(make_attempt(e))
        _engine(bus, e, output_tokens=12)
        ledger.record_sync(e)
    lost = make_event(2, "drifty")  # the engine finished, the usage event never arrived
    ledger.record_attempt_sync(make_attempt(lost))
    _engine(bus, lost)
    never = make_event(3, "drifty")  # admitted, then nothing at all
    ledger.record_attempt_sync(make_attempt(never))
    first = make_event(4, "drifty", key="logical-4", request_id="drifty-r4-a1")  # attempt 1 did work...
    ledger.record_attempt_sync(make_attempt(first))
    _engine(bus, first)
    retry = make_event(4, "drifty", key="logical-4", request_id="drifty-r4-a2", attempt=2)  # ...attempt 2 is billed
    ledger.record_attempt_sync(make_attempt(retry))
    _engine(bus, retry)
    ledger.record_sync(retry)
    ledger.record_attempt_sync(make_attempt(make_event(9, "drifty"), status="rejected", reason="rate_limited",
                                            status_code=429))

    # an idempotent request run twice: the server restarted between, forgot the replay, and the
    # re-run (attempt 1 again, a new request id) is a row of its own beside the first (migration
    # 0006): delivered again, billed once (superseded) — explained, not drift
    once = make_event(0, "rerun", key="idem-1", request_id="rerun-a")
    ledger.record_attempt_sync(make_attempt(once))
    _engine(bus, once)
    ledger.record_sync(once)
    again = make_event(0, "rerun", key="idem-1", request_id="rerun-b", arrival_ts=T0 + 100, finish_ts=T0 + 100.5)
    ledger.record_attempt_sync(make_attempt(again))
    _engine(bus, again)
    ledger.record_sync(again)

    # engine work nobody can attribute
    bus.publish(EngineRequestStats("ghost-1", "stop", TokenCounts(input_tokens=7, output_tokens=3), wall_ts=T0 + 5))
    assert ledger.flush()
    return ledger


def test_each_difference_is_classified(scenario) -> None:
    views = {r["tenant_id"]: r for r in scenario.queries.reconcile_views(PERIOD)}
    report = reconcile(views.values())
    rows = {r["tenant_id"]: r for r in report.frame.to_dicts()}

    clean = rows["clean"]
    assert clean["status"] == "ok" and clean["matched_requests"] == 5 and clean["unexplained_drift_tokens"] == 0
    assert clean["ledger_requests"] == 5 and clean["duplicate_rows"] == 1
    assert clean["engine_tokens"] == clean["ledger_tokens"] == 5 * 35

    aborts = rows["aborts"]
    assert aborts["status"] == "ok" and aborts["aborted_requests"] == 3 and aborts["aborted_tokens"] == 3 * 29
    assert aborts["engine_requests"] == 0 and aborts["ledger_only_requests"] == 0

    d = rows["drifty"]
    assert d["status"] == "drift"
    assert (d["mismatched_requests"], d["matched_token_drift"]) == (2, 4)
    assert (d["engine_unbilled_requests"], d["engine_unbilled_tokens"]) == (1, 35)
    assert (d["superseded_requests"], d["superseded_tokens"]) == (1, 35)
    assert (d["missing_finishes"], d["missing_finish_reserved_tokens"]) == (1, 25 + 64)
    assert d["unexplained_requests"] == 2 + 1 + 1
    assert d["unexplained_drift_tokens"] == 4 + 35
    assert (d["gateway_attempts"], d["gateway_admitted"], d["rejected_attempts"]) == (7, 6, 1)
    assert d["reserved_tokens"] == 3 * (25 + 64) and d["actual_tokens"] == 3 * 35

    rerun = rows["rerun"]
    assert rerun["status"] == "ok" and rerun["unexplained_drift_tokens"] == 0, rerun
    assert (rerun["ledger_requests"], rerun["engine_requests"], rerun["superseded_requests"]) == (2, 2, 0)
    assert rerun["engine_unbilled_requests"] == 0 and rerun["duplicate_rows"] == 0
    assert (rerun["delivered_engine_tokens"], rerun["superseded_engine_tokens"]) == (35, 35)
    assert rerun["engine_tokens_explained_ratio"] == 1.0
    [line] = build_invoice(scenario.queries, PERIOD, scenario.prices, "rerun").rows()  # billed once
    assert (line["line_type"], line["requests"], line["input_tokens"] + line["output_tokens"]) == ("usage", 1, 35)

    ghost = rows[UNATTRIBUTED]
    assert ghost["engine_unbilled_requests"] == 1 and ghost["engine_unbilled_tokens"] == 10
    assert set(report.failed_tenants) == {"drifty", UNATTRIBUTED}


def test_the_fast_set_check_agrees_with_the_per_request_pass(scenario) -> None:
    fast = {r["tenant_id"]: r for r in scenario.queries.reconcile_views(PERIOD)}
    slow = {r["tenant_id"]: r for r in scenario.queries.reconcile_views(PERIOD, detailed=True)}
    assert fast.keys() == slow.keys()
    assert fast["clean"]["checked"] == fast["aborts"]["checked"] == "sets"  # consistent: no join needed
    assert fast["drifty"]["checked"] == "per_request"
    assert all(r["checked"] == "per_request" for r in slow.values())
    for tenant in fast:
        assert {k: v for k, v in fast[tenant].items() if k != "checked"} == \
            {k: v for k, v in slow[tenant].items() if k != "checked"}, tenant


def test_engine_records_carry_the_tenant_the_engine_stamped(scenario) -> None:
    tenants = dict(scalar_rows(scenario, "SELECT request_id, tenant_id FROM engine_requests"))
    assert tenants["clean-r0"] == "clean" and tenants["drifty-r2"] == "drifty" and tenants["ghost-1"] == ""


def test_threshold_and_tenant_filter(scenario) -> None:
    views = scenario.queries.reconcile_views(PERIOD, "drifty")
    assert [v["tenant_id"] for v in views] == ["drifty"]
    assert reconcile(views, threshold_ratio=0.5).failed is False  # 39 unexplained of 140 tokens < 0.5
    assert reconcile(views, threshold_ratio=0.5, max_missing_finishes=0).failed is True
    assert reconcile(scenario.queries.reconcile_views(PERIOD, "clean")).failed is False
    with pytest.raises(ValueError):
        reconcile(views, threshold_ratio=-1)


def test_requests_at_a_period_boundary_match_their_engine_record(open_ledger) -> None:
    bus = StatsBus()
    ledger = open_ledger(bus=bus)
    day_end = datetime(2026, 11, 16, tzinfo=timezone.utc).timestamp()
    e = make_event(1, arrival_ts=day_end - 2, finish_ts=day_end - 0.1)
    ledger.record_attempt_sync(make_attempt(e))
    _engine(bus, e, wall_ts=day_end + 0.1)  # the engine's clock stamped it in the next day
    ledger.record_sync(e)
    assert ledger.flush()
    (day,) = reconcile(ledger.queries.reconcile_views(parse_period("2026-11-15"))).frame.to_dicts()
    assert day["matched_requests"] == 1 and day["status"] == "ok"
    assert ledger.queries.reconcile_views(parse_period("2026-11-16")) == []
    assert scalar(ledger, "SELECT count() FROM engine_requests") == 1
