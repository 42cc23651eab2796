"""Tenants billed in their own time zones, on a real chDB ledger: invoice periods, daily buckets
and the read API follow each tenant's zone; DST days bill exactly their hours."""

from __future__ import annotations

from datetime import datetime, timezone

import httpx
from ledgerkit import make_attempt, make_event, read_api_in_thread

from kvmeter.ledger import parse_period
from kvmeter.ledger.billing import build_invoice
from kvmeter.ledger.http_client import LedgerHttpClient
from kvmeter.serving.tenancy import Principal

ZONES = {"acme": "America/New_York", "nepal": "Asia/Kathmandu"}
ADMIN = Principal("ops", "enterprise", "w", "p", "admin", admin=True)
ACME = Principal("acme", "paid_interactive", "ws1", "proj1", "acme-key1")


def ts(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


#: (tenant, finish instant): where each lands is the point of the tests.
EVENTS = [
    ("acme", "2026-11-01T03:30:00+00:00"),    # 23:30 EDT on Oct 31: October in New York
    ("acme", "2026-11-01T04:30:00+00:00"),    # 00:30 EDT on Nov 1: the first hour of its 25-hour day
    ("acme", "2026-11-02T04:30:00+00:00"),    # 23:30 EST on Nov 1: the 25th hour of that day
    ("acme", "2026-12-01T04:30:00+00:00"),    # 23:30 EST on Nov 30: November in New York
    ("globex", "2026-11-01T03:30:00+00:00"),  # UTC tenant: November
    ("globex", "2026-12-01T04:30:00+00:00"),  # UTC tenant: December
    ("nepal", "2026-10-31T18:10:00+00:00"),   # 23:55 on Oct 31 (+05:45)
    ("nepal", "2026-10-31T18:20:00+00:00"),   # 00:05 on Nov 1 (+05:45)
]


async def _filled(open_ledger):
    ledger = open_ledger()
    for i, (tenant, iso) in enumerate(EVENTS):
        e = make_event(i, tenant, arrival_ts=ts(iso) - 1, finish_ts=ts(iso), api_key_id=f"{tenant}-key1")
        await ledger.record_attempt(make_attempt(e))
        await ledger.record(e)
    assert ledger.flush()
    return ledger


def _requests(invoice) -> dict[str, int]:
    return {r["tenant_id"]: r["requests"] for r in invoice.rows()}


async def test_each_tenant_is_invoiced_for_its_own_local_month(open_ledger):
    ledger = await _filled(open_ledger)
    invoice = build_invoice(ledger.queries, parse_period("2026-11"), ledger.prices, zones=ZONES)
    assert _requests(invoice) == {"acme": 3, "globex": 1, "nepal": 1}
    by_tenant = {r["tenant_id"]: r for r in invoice.rows()}
    assert by_tenant["acme"]["timezone"] == "America/New_York"
    assert by_tenant["acme"]["period_start"] == datetime(2026, 11, 1, 4, tzinfo=timezone.utc)
    assert by_tenant["acme"]["period_end"] == datetime(2026, 12, 1, 5, tzinfo=timezone.utc)  # 721 hours
    assert by_tenant["nepal"]["period_start"] == datetime(2026, 10, 31, 18, 15, tzinfo=timezone.utc)
    assert by_tenant["globex"]["timezone"] == "UTC"
    # without zones the same label is UTC for everyone: acme's October-evening request counts,
    # its last one is December, and nepal's two are October
    assert _requests(build_invoice(ledger.queries, parse_period("2026-11"), ledger.prices)) == \
        {"acme": 3, "globex": 1}
    utc = {r["tenant_id"]: r for r in build_invoice(ledger.queries, parse_period("2026-11"), ledger.prices).rows()}
    assert utc["acme"]["period_start"] == datetime(2026, 11, 1, tzinfo=timezone.utc)


async def test_a_fall_back_day_bills_its_25_hours_and_daily_buckets_are_local(open_ledger):
    ledger = await _filled(open_ledger)
    day = parse_period("2026-11-01", "America/New_York")
    assert day.hours == 25
    assert _requests(build_invoice(ledger.queries, day, ledger.prices, "acme")) == {"acme": 2}
    rows = ledger.queries.usage_summary(parse_period("2026-10-31/2026-11-03", "America/New_York"), "acme",
                                        group_by=["day"])
    starts = {r["day"]: r["requests"] for r in rows}
    assert starts == {datetime(2026, 10, 31, 4, tzinfo=timezone.utc): 1,
                      datetime(2026, 11, 1, 4, tzinfo=timezone.utc): 2}


async def test_kathmandu_days_come_from_the_events_and_turn_at_18_15_utc(open_ledger):
    ledger = await _filled(open_ledger)
    rows = ledger.queries.usage_timeseries(parse_period("2026-10-31/2026-11-02", "Asia/Kathmandu"), "nepal",
                                           step="day")
    assert [(r["ts"], r["requests"]) for r in rows] == [
        (datetime(2026, 10, 30, 18, 15, tzinfo=timezone.utc), 1),
        (datetime(2026, 10, 31, 18, 15, tzinfo=timezone.utc), 1)]


async def test_the_read_api_reads_a_tenants_period_in_its_zone(open_ledger):
    ledger = await _filled(open_ledger)
    keys = {"sk-admin-0000": ADMIN, "sk-acme-00000": ACME}
    with read_api_in_thread(ledger, keys, timezones=ZONES) as url:
        own = httpx.get(f"{url}/v1/usage/invoice", params={"period": "2026-11"},
                        headers={"Authorization": "Bearer sk-acme-00000"}).json()
        assert [(r["tenant_id"], r["requests"], r["timezone"]) for r in own] == [("acme", 3, "America/New_York")]
        every = httpx.get(f"{url}/v1/usage/invoice", params={"period": "2026-11"},
                          headers={"Authorization": "Bearer sk-admin-0000"}).json()
        assert {r["tenant_id"]: r["requests"] for r in every} == {"acme": 3, "globex": 1, "nepal": 1}
        bad = httpx.get(f"{url}/v1/usage/summary", params={"period": "2026-11", "timezone": "Mars/Base"},
                        headers={"Authorization": "Bearer sk-admin-0000"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "timezone"
        with LedgerHttpClient(url, "sk-acme-00000") as client:
            prices, zones = client.billing_config()
            assert zones == {"acme": "America/New_York"}          # a tenant key sees its own zone only
            assert prices.to_mapping() == ledger.prices.to_mapping()
            invoice = build_invoice(client, parse_period("2026-11"), prices, zones=zones)
            assert _requests(invoice) == {"acme": 3}
