"""Every attempt's engine work is its own usage row (migration 0006), and the logical request's bill
is its successful attempt's — or, with none, its undelivered work as the tier's policy decided.

The first two tests are issue 15's reproductions at the ledger, written with the record fields an
older kvmeter already had: before 0006 the table kept only the highest attempt of a logical
request, so a failed retry erased the bill (both ended at 0/0 on the previous version).
"""

from __future__ import annotations

import dataclasses
from decimal import Decimal

import msgspec
import pytest
from ledgerkit import MODEL, PERIOD, engine_stats, make_attempt, make_event, scalar

from kvmeter.events import event_id_for
from kvmeter.ledger import Ledger
from kvmeter.ledger.billing import build_invoice
from kvmeter.ledger.connection import connect
from kvmeter.ledger.reconcile import reconcile
from kvmeter.ledger.records import USAGE_STREAM, attempt_id_for, encode_usage
from kvmeter.ledger.schema import applied_versions, load_migrations, migrate
from kvmeter.tokens import TokenCounts

KEY = "order-42"


def _lines(ledger: Ledger, tenant: str = "acme") -> dict[tuple[str, str], dict]:
    """The tenant's invoice lines by (line type, undelivered cause)."""
    invoice = build_invoice(ledger.queries, PERIOD, ledger.prices, tenant)
    return {(r["line_type"], r.get("undelivered_cause", "")): r for r in invoice.rows()}


async def test_a_failed_retry_after_a_restart_never_erases_the_billed_success(open_ledger) -> None:
    ledger = open_ledger()
    success = make_event(1, key=KEY, input_tokens=200, output_tokens=80)
    # the idempotency store was in memory and the server restarted: the retry is attempt 1 again,
    # of the same logical request (same key, same body), and its upstream fails
    failed = make_event(2, key=KEY, request_id="acme-r2-retry", outcome="error", finish_reason="error",
                        status_code=503, input_tokens=0, output_tokens=0)
    assert failed.event_id == success.event_id and failed.attempt == success.attempt == 1
    await ledger.record(success)
    await ledger.record(failed)
    assert ledger.flush()
    lines = _lines(ledger)
    usage = lines[("usage", "")]
    assert (usage["input_tokens"], usage["output_tokens"], usage["requests"]) == (200, 80, 1)
    assert usage["subtotal"] == ledger.prices.cost(
        MODEL, "paid_interactive", TokenCounts(input_tokens=200, output_tokens=80)) > 0
    # both attempts are recorded, each its own row
    assert scalar(ledger, "SELECT count() FROM usage_events FINAL WHERE tenant_id = 'acme'") == 2


async def test_an_aborted_stream_then_a_failed_retry_bills_the_abandoned_work(open_ledger) -> None:
    ledger = open_ledger()
    aborted = make_event(1, key=KEY, outcome="aborted", finish_reason="abort", stream=True,
                         input_tokens=200, output_tokens=3)
    retry = make_event(2, key=KEY, request_id="acme-r2", attempt=2, outcome="error", finish_reason="error",
                       status_code=500, input_tokens=0, output_tokens=0)
    await ledger.record(aborted)
    await ledger.record(retry)
    assert ledger.flush()
    billed = build_invoice(ledger.queries, PERIOD, ledger.prices, "acme").lines
    assert (billed["input_tokens"].sum(), billed["output_tokens"].sum()) == (200, 3)


async def test_undelivered_work_is_billed_or_absorbed_on_lines_of_its_own(open_ledger) -> None:
    ledger = open_ledger()
    prices = ledger.prices
    events = [
        # a logical request the client abandoned twice, then got: the bill is the success's
        make_event(1, key="a", outcome="aborted", finish_reason="abort", input_tokens=300, output_tokens=0,
                   undelivered_cause="client_abandoned", undelivered_billing="billed"),
        make_event(2, key="a", request_id="acme-r2", attempt=2, input_tokens=300, output_tokens=20),
        # abandoned, never retried: billed by the default policy
        make_event(3, key="b", outcome="aborted", finish_reason="abort", input_tokens=200, output_tokens=3,
                   undelivered_cause="client_abandoned", undelivered_billing="billed"),
        # failed by the server: absorbed
        make_event(4, key="c", outcome="error", finish_reason="error", input_tokens=150, output_tokens=7,
                   undelivered_cause="server_failure", undelivered_billing="absorbed"),
        make_event(5, key="d", outcome="aborted", finish_reason="abort", input_tokens=90, output_tokens=1,
                   undelivered_cause="shutdown", undelivered_billing="absorbed"),
    ]
    for e in events:
        await ledger.record_attempt(make_attempt(e))
        ledger.record_engine(engine_stats(e))
        await ledger.record(e)
    assert ledger.flush()
    lines = _lines(ledger)
    assert set(lines) == {("usage", ""), ("undelivered_billed", "client_abandoned"),
                          ("undelivered_absorbed", "client_abandoned"), ("undelivered_absorbed", "server_failure"),
                          ("undelivered_absorbed", "shutdown")}
    tokens = {k: (r["input_tokens"], r["output_tokens"]) for k, r in lines.items()}
    assert tokens == {("usage", ""): (300, 20), ("undelivered_billed", "client_abandoned"): (200, 3),
                      ("undelivered_absorbed", "client_abandoned"): (300, 0),
                      ("undelivered_absorbed", "server_failure"): (150, 7),
                      ("undelivered_absorbed", "shutdown"): (90, 1)}
    subtotal = {k: r["subtotal"] for k, r in lines.items()}
    price = {k: prices.cost(MODEL, "paid_interactive", TokenCounts(input_tokens=i, output_tokens=o))
             for k, (i, o) in tokens.items()}
    assert subtotal[("usage", "")] == price[("usage", "")] > 0
    billed = ("undelivered_billed", "client_abandoned")
    assert subtotal[billed] == price[billed] > 0
    for k in tokens:
        if k[0] == "undelivered_absorbed":
            assert subtotal[k] == lines[k]["cost"] == 0 and str(prices.round(price[k])) in lines[k]["note"]
    invoice = build_invoice(ledger.queries, PERIOD, prices, "acme")
    assert invoice.total == lines[("usage", "")]["cost"] + lines[billed]["cost"]
    assert all(isinstance(v, Decimal) for v in subtotal.values())
    # the usage summary bills what the invoice bills
    [summary] = ledger.queries.usage_summary(PERIOD, "acme")
    assert (summary["input_tokens"], summary["output_tokens"]) == (500, 23)
    # reconciliation explains every engine token
    [row] = reconcile(ledger.queries.reconcile_views(PERIOD, "acme")).frame.to_dicts()
    assert row["engine_tokens"] == sum(i + o for i, o in tokens.values()) == 1071
    assert row["delivered_engine_tokens"] == 320
    assert row["undelivered_billed_engine_tokens"] == 203
    assert row["undelivered_absorbed_engine_tokens"] == 300 + 157 + 91
    assert row["explained_engine_tokens"] == row["engine_tokens"]
    assert row["engine_tokens_explained_ratio"] == 1.0
    assert row["status"] == "ok"


async def test_a_retry_storms_abandoned_attempts_are_one_billed_line_priced_exactly(open_ledger) -> None:
    """The rows the real-engine retry storm writes (tests/serving/engines/test_retry_storm.py): 8
    logical requests of 3 attempts each, every one left before its first token after the engine
    had taken in two 256-token chunks (512 input tokens, 0 output, the engine's own account).
    On 3 Dec that test saw this line's ``cost`` 0 and took it for a billing bug: it is the
    line's rounding. 12,288 input tokens at 0.30 USD per million are 0.0036864 USD exactly (the
    line's ``subtotal``), which the packaged list's rule (ROUND_HALF_EVEN to 0.01 per invoice
    line, the one rounding point) makes 0.00; a list with a finer quantum bills it to the cent
    fraction."""
    ledger = open_ledger()
    prices = ledger.prices
    i = 0
    for client in range(8):
        for attempt in (1, 2, 3):
            i += 1
            e = make_event(i, key=f"storm-{client}", request_id=f"acme-storm-{client}-{attempt}", attempt=attempt,
                           outcome="aborted", finish_reason="abort", stream=True, input_tokens=512,
                           output_tokens=0, token_source="engine_hooks", ttft_s=None, itl_mean_s=None,
                           undelivered_cause="client_abandoned", undelivered_billing="billed")
            await ledger.record_attempt(make_attempt(e))
            ledger.record_engine(engine_stats(e))
            await ledger.record(e)
    assert ledger.flush()
    lines = _lines(ledger)
    assert set(lines) == {("usage", ""), ("undelivered_billed", "client_abandoned")}
    usage = lines[("usage", "")]  # nothing was delivered: the usage line carries the key's 24 attempts
    assert (usage["requests"], usage["attempts"], usage["input_tokens"], usage["cost"]) == (0, 24, 0, 0)
    line = lines[("undelivered_billed", "client_abandoned")]
    assert (line["requests"], line["aborted_requests"], line["input_tokens"], line["output_tokens"]) == \
        (24, 24, 12_288, 0)
    work = TokenCounts(input_tokens=12_288)
    assert line["subtotal"] == prices.cost(MODEL, "paid_interactive", work) == Decimal("0.0036864")
    assert line["cost"] == prices.round(line["subtotal"]) == Decimal("0.00")  # < half a cent: rounds to 0
    assert (prices.quantum, prices.rounding) == (Decimal("0.01"), "ROUND_HALF_EVEN")
    fine = dataclasses.replace(prices, quantum=Decimal("0.000001"))
    [fine_line] = [r for r in build_invoice(ledger.queries, PERIOD, fine, "acme").rows()
                   if r["line_type"] == "undelivered_billed"]
    assert fine_line["subtotal"] == line["subtotal"] and fine_line["cost"] == Decimal("0.003686")
    # every engine token is explained, as undelivered work billed
    [row] = reconcile(ledger.queries.reconcile_views(PERIOD, "acme")).frame.to_dicts()
    assert row["engine_tokens"] == row["undelivered_billed_engine_tokens"] == 12_288
    assert row["engine_tokens_explained_ratio"] == 1.0


async def test_a_key_reused_with_another_body_is_another_logical_request(open_ledger) -> None:
    ledger = open_ledger()
    first = make_event(1, event_id=event_id_for("acme", KEY, "fp-body-a"), input_tokens=200, output_tokens=80)
    # after a restart forgot the key, the same key comes with another body and fails
    other = make_event(2, event_id=event_id_for("acme", KEY, "fp-body-b"), request_id="acme-r2",
                       outcome="error", finish_reason="error", input_tokens=40, output_tokens=0,
                       undelivered_cause="server_failure", undelivered_billing="absorbed")
    assert first.event_id != other.event_id != event_id_for("acme", KEY)
    await ledger.record(first)
    await ledger.record(other)
    assert ledger.flush()
    usage = _lines(ledger)[("usage", "")]
    assert (usage["input_tokens"], usage["output_tokens"]) == (200, 80)


def test_old_usage_blocks_get_their_attempt_ids_so_no_attempt_replaces_another() -> None:
    event = make_event(1, key=KEY)
    current = msgspec.json.decode(encode_usage(event))
    v3 = dict(zip(USAGE_STREAM.columns_for(3), current, strict=True))
    old = USAGE_STREAM.columns_for(2)
    row = [v3[c] if c != "schema_version" else 2 for c in old]
    columns, payload = USAGE_STREAM.decode(2, msgspec.json.encode(row) + b"\n")
    decoded = dict(zip(columns, msgspec.json.decode(payload), strict=True))
    assert decoded["attempt_id"] == attempt_id_for("acme", event.request_id) == event.attempt_id
    assert set(columns) <= set(USAGE_STREAM.columns_for(USAGE_STREAM.schema))
    assert "undelivered_cause" not in columns  # the table's default ('': billed as before)


async def test_a_ledger_at_0005_migrates_and_bills_its_rows_as_before(config, open_ledger) -> None:
    client = connect(config)
    try:
        migrate(client, up_to=5)
        old = [make_event(i, key=f"k{i}", input_tokens=10 * i, output_tokens=i) for i in range(1, 4)]
        rows = [msgspec.json.decode(encode_usage(e)) for e in old]
        names = USAGE_STREAM.columns_for(3)
        v2 = [[dict(zip(names, r, strict=True))[c] for c in USAGE_STREAM.columns_for(2)] for r in rows]
        block = b"".join(msgspec.json.encode(r) + b"\n" for r in v2)  # as version 5's drain inserted them
        client.raw_insert("usage_events", column_names=list(USAGE_STREAM.columns_for(2)), insert_block=block,
                          fmt="JSONCompactEachRow")
    finally:
        client.close()
    ledger = open_ledger()
    assert 6 in applied_versions(ledger.queries._get())
    assert scalar(ledger, "SELECT sorting_key FROM system.tables WHERE name = 'usage_events' "
                          "AND database = currentDatabase()") == "tenant_id, event_id, attempt_id"
    usage = _lines(ledger)[("usage", "")]
    assert (usage["input_tokens"], usage["output_tokens"], usage["requests"]) == (60, 6, 3)
    # run again (an interrupted migration is simply re-run): nothing changes
    [m6] = [m for m in load_migrations() if m.version == 6]
    for stmt in m6.statements:
        ledger.queries._get().command(stmt)
    assert scalar(ledger, "SELECT sorting_key FROM system.tables WHERE name = 'usage_events' "
                          "AND database = currentDatabase()") == "tenant_id, event_id, attempt_id"
    assert _lines(ledger)[("usage", "")]["input_tokens"] == 60


@pytest.mark.parametrize("cause", ["unknown", ""])
def test_a_usage_event_names_a_known_cause_and_its_billing(cause: str) -> None:
    with pytest.raises(ValueError):
        make_event(1, outcome="aborted", undelivered_cause=cause, undelivered_billing="billed" if cause else "absorbed")
    with pytest.raises(ValueError):
        make_event(1, outcome="ok", undelivered_cause="client_abandoned", undelivered_billing="billed")
    with pytest.raises(ValueError):
        make_event(1, outcome="aborted", undelivered_cause="client_abandoned", undelivered_billing="maybe")

