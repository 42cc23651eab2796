"""The reads beyond the invoice count a logical request's bill once (issue 15, follow-up).

A usage row is one attempt (migration 0006): a call aborted and retried has two rows, a call run
again after a restart forgot its key two ``ok`` rows (the second ``superseded``). Every read of
money or of billed tokens reads only the billed rows, through ``classified_usage_sql``; the
dashboards' window reads are engine load and count every attempt, as they say.
"""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

from ledgerkit import MODEL, PERIOD, make_event

from kvmeter.dashboards.window import Window
from kvmeter.ledger import Ledger, parse_period
from kvmeter.ledger.window_queries import WindowQueries
from kvmeter.money import format_money, money_places
from kvmeter.tokens import TokenCounts

TIER = "paid_interactive"
#: What the two logical requests below are billed: call-1's successful retry and call-2's first success.
BILLED = (300 + 100, 40 + 10)


async def record_retried_calls(ledger: Ledger, **attribution: str) -> None:
    """Two logical requests of acme, four attempts, drained:

    * ``call-1``: attempt 1 aborted by the client (undelivered, billed by the tier's default: but
      absorbed, since the retry succeeded), attempt 2 ``ok`` — the bill;
    * ``call-2``: ``ok`` — the bill — then the same key and body run again after a restart:
      ``ok`` again, superseded.
    """
    events = [
        make_event(1, key="call-1", outcome="aborted", finish_reason="abort", input_tokens=300, output_tokens=5,
                   undelivered_cause="client_abandoned", undelivered_billing="billed", **attribution),
        make_event(2, key="call-1", request_id="acme-r2", attempt=2, input_tokens=300, output_tokens=40,
                   **attribution),
        make_event(3, key="call-2", input_tokens=100, output_tokens=10, **attribution),
        make_event(4, key="call-2", request_id="acme-r4-again", input_tokens=100, output_tokens=12, **attribution),
    ]
    for e in events:
        await ledger.record(e)
    assert ledger.flush()


async def test_an_agent_runs_tokens_and_cost_count_a_retried_call_once(open_ledger) -> None:
    ledger = open_ledger()
    await record_retried_calls(ledger, agent_run_id="run-1")
    ledger.refresh_rollups()
    [run] = ledger.agent_runs.runs(PERIOD, ["acme"])
    assert (run["input_tokens"], run["output_tokens"]) == BILLED  # was (800, 67): every attempt
    exact = ledger.prices.cost(MODEL, TIER, TokenCounts(input_tokens=BILLED[0], output_tokens=BILLED[1]))
    # money at the display places, more only where the exact value needs them (README "Billing")
    places = money_places(ledger.prices)
    assert run["subtotal"] == format_money(exact, places) and Decimal(run["subtotal"]) == exact
    assert run["cost"] == format_money(ledger.prices.round(exact), places)
    # the run's bill is the usage summary's for the run
    [summary] = ledger.queries.usage_summary(PERIOD, "acme", group_by=("agent_run_id",))
    assert (summary["input_tokens"], summary["output_tokens"], summary["cost"]) == (*BILLED, exact)
    # model calls count attempts (the run's load, as its model_calls budget counts it)
    assert (run["model_calls"], run["ok_model_calls"]) == (4, 3)


async def test_usage_timeseries_bills_a_retried_request_once_in_every_zone(open_ledger) -> None:
    ledger = open_ledger()
    await record_retried_calls(ledger)
    ledger.refresh_rollups()
    for zone in ("Asia/Kathmandu", "UTC"):  # +05:45 reads usage_events, a whole-hour zone the rollup
        period = parse_period("2026-11", zone)
        for step in ("hour", "day"):
            rows = ledger.queries.usage_timeseries(period, "acme", step=step)
            totals = (sum(r["requests"] for r in rows), sum(r["input_tokens"] for r in rows),
                      sum(r["output_tokens"] for r in rows))
            assert totals == (2, *BILLED), (zone, step)  # Kathmandu was (4, 800, 67)
        [summary] = ledger.queries.usage_summary(period, "acme")
        assert (summary["requests"], summary["input_tokens"], summary["output_tokens"]) == (2, *BILLED)


async def test_the_window_reads_count_every_attempt_as_engine_work(open_ledger) -> None:
    ledger = open_ledger()
    await record_retried_calls(ledger)
    start = PERIOD.start + timedelta(days=14)  # the events finish at T0 + i + 0.5 s, T0 = 15 Nov 00:00 UTC
    window = WindowQueries(ledger.query_client)
    [traffic] = window.traffic(Window(start, start + timedelta(minutes=1), 60))
    assert (traffic["requests"], traffic["input_tokens"], traffic["output_tokens"]) == (4, 800, 67)


async def test_two_tenants_with_one_chosen_event_id_never_decide_each_others_bill(open_ledger) -> None:
    """The classification groups a logical request's rows by ``event_id`` alone (one UUID column:
    2.4× faster than the pair) and matches the tenant inside the group. Ids a caller chose may
    repeat across tenants: globex's earlier success must neither supersede acme's nor absorb
    acme's undelivered attempt."""
    shared = "7d1c1f3e-0000-5000-8000-000000000001"
    ledger = open_ledger()
    for e in [
        make_event(1, "globex", event_id=shared, input_tokens=70, output_tokens=7),
        make_event(2, "acme", event_id=shared, input_tokens=100, output_tokens=10),
        make_event(3, "acme", event_id=shared, request_id="acme-r3", outcome="aborted", finish_reason="abort",
                   input_tokens=300, output_tokens=0, undelivered_cause="client_abandoned",
                   undelivered_billing="billed"),
        make_event(4, "initech", event_id=shared, request_id="initech-r4", outcome="aborted",
                   finish_reason="abort", input_tokens=50, output_tokens=0, undelivered_cause="client_abandoned",
                   undelivered_billing="billed"),
    ]:
        await ledger.record(e)
    assert ledger.flush()
    summary = {r["tenant_id"]: (r["input_tokens"], r["output_tokens"]) for r in ledger.queries.usage_summary(PERIOD)}
    # acme: its own success bills, its aborted attempt is absorbed by that success; globex's
    # success is globex's; initech has no success, so its undelivered work is billed by its tier
    assert summary == {"acme": (100, 10), "globex": (70, 7), "initech": (50, 0)}


async def test_the_usage_summarys_cost_is_priced_from_the_rows_its_totals_count(open_ledger) -> None:
    """A summary read while the writer drains must not pair one set of rows' tokens with another's
    cost (a newcomer read 16 requests' tokens beside 17 requests' cost). A row lands in ClickHouse
    right after the summary's first statement on usage_events; the totals and the cost agree."""
    ledger = open_ledger()
    await ledger.record(make_event(1, input_tokens=100, output_tokens=10))
    assert ledger.flush()
    client = ledger.query_client()
    late = make_event(2, input_tokens=300, output_tokens=30)

    class DrainLandsMidRead:
        """The ledger's own client, with the next event drained after the first usage read."""

        def __init__(self) -> None:
            self.landed = False

        def query(self, sql: str, **kw):  # noqa: ANN003, ANN201
            result = client.query(sql, **kw)
            if not self.landed and "usage_events" in sql:
                self.landed = True
                ledger.record_sync(late)
                assert ledger.flush()
            return result

        def __getattr__(self, name: str):  # noqa: ANN204
            return getattr(client, name)

    proxy = DrainLandsMidRead()
    queries = type(ledger.queries)(lambda: proxy, ledger.prices)
    [row] = queries.usage_summary(PERIOD, "acme")
    assert proxy.landed
    counts = TokenCounts(input_tokens=row["input_tokens"], output_tokens=row["output_tokens"])
    # was the cost of both events beside the first's tokens
    assert row["cost"] == ledger.prices.cost(MODEL, TIER, counts)
