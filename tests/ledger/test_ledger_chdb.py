"""The Ledger facade on a real embedded ClickHouse (chDB): durability, idempotent drain, schema."""

from __future__ import annotations

import asyncio
import json
from decimal import Decimal
from pathlib import Path

import pytest
from ledgerkit import PERIOD, T0, make_attempt, make_attribution, make_event, scalar

from kvmeter.attribution import Attribution
from kvmeter.bus import StatsBus
from kvmeter.ledger import Adjustment, InvalidRecord, MigrationError, SignalSample
from kvmeter.ledger.records import USAGE_STREAM, encode_usage
from kvmeter.ledger.schema import load_migrations, migrate, render
from kvmeter.stats import EngineRequestStats, LedgerStats
from kvmeter.tokens import TokenCounts


async def test_record_is_durable_then_drains_and_reads_back(open_ledger) -> None:
    ledger = open_ledger()
    events = [make_event(i) for i in range(300)]
    await asyncio.gather(*(ledger.record(e) for e in events))
    stats = ledger.stats()
    assert stats.spool_depth_events == 300 and stats.spool_pending_events == 0
    assert stats.events_ingested_total["new"] == 300
    assert ledger.flush()
    assert ledger.stats().spool_depth_events == 0
    (row,) = ledger.queries.usage_summary(PERIOD)
    assert row["tenant_id"] == "acme" and row["requests"] == 300
    assert row["input_tokens"] == 300 * 25 and row["output_tokens"] == 300 * 10
    assert row["kv_token_seconds"] == pytest.approx(300 * 12.5)
    assert row["ttft_p50_s"] == pytest.approx(0.05) and row["itl_p95_s"] == pytest.approx(0.01)
    # 7,500 input at 0.30/M + 3,000 output at 0.60/M, exact
    assert row["cost"] == Decimal("0.00225") + Decimal("0.0018")


async def test_same_event_in_two_batches_is_billed_once(open_ledger) -> None:
    ledger = open_ledger()
    await ledger.record(make_event(1))
    assert ledger.flush()
    await ledger.record(make_event(1))  # a retry after a crash re-records the same logical request
    assert ledger.flush()
    assert ledger.stats().events_ingested_total["duplicate"] == 1
    assert scalar(ledger, "SELECT count() FROM usage_events") == 2  # two batches, two tokens: stored twice
    assert ledger.queries.usage_summary(PERIOD)[0]["requests"] == 1  # ...billed once (FINAL)
    assert ledger.queries.invoice_usage(PERIOD)[0]["input_tokens"] == 25


async def test_same_batch_ingested_twice_is_stored_once(open_ledger) -> None:
    ledger = open_ledger()
    await asyncio.gather(*(ledger.record(make_event(i)) for i in range(50)))
    stream = ledger.spool.streams[USAGE_STREAM.name]
    batch = stream.next_batch(1000)
    payload = stream.read_batch(batch)
    client = ledger.query_client()
    for _ in range(2):  # a writer that lost the acknowledgement sends the same batch again
        client.raw_insert("usage_events", column_names=list(USAGE_STREAM.columns_for(USAGE_STREAM.schema)),
                          insert_block=payload,
                          fmt="JSONCompactEachRow", settings={"insert_deduplication_token": batch.token})
    assert ledger.flush()  # the writer itself now inserts the batch a third time, same token
    assert scalar(ledger, "SELECT count() FROM usage_events") == 50  # the token dropped the repeats
    assert scalar(ledger, "SELECT count() FROM usage_events FINAL") == 50


async def test_same_event_id_from_two_tenants_is_two_records(open_ledger) -> None:
    ledger = open_ledger()
    shared_id = make_event(1, "acme").event_id
    await ledger.record(make_event(1, "acme"))
    await ledger.record(make_event(1, "globex", event_id=shared_id))
    assert ledger.flush()
    rows = {r["tenant_id"]: r["requests"] for r in ledger.queries.usage_summary(PERIOD)}
    assert rows == {"acme": 1, "globex": 1}


async def test_a_later_successful_attempt_is_the_bill_and_the_earlier_one_is_kept_absorbed(open_ledger) -> None:
    ledger = open_ledger()
    await ledger.record(make_event(1, output_tokens=3, outcome="aborted", finish_reason="abort"))
    await ledger.record(make_event(1, request_id="acme-r1-retry", output_tokens=10, attempt=2))
    assert ledger.flush()
    rows = {r["line_type"]: r for r in ledger.queries.invoice_usage(PERIOD)}
    assert (rows["usage"]["requests"], rows["usage"]["output_tokens"], rows["usage"]["aborted_requests"]) == (1, 10, 0)
    absorbed = rows["undelivered_absorbed"]  # the abandoned attempt's work: recorded, not billed
    assert (absorbed["requests"], absorbed["output_tokens"], absorbed["aborted_requests"]) == (1, 3, 1)
    assert set(rows) == {"usage", "undelivered_absorbed"}


async def test_invalid_event_is_refused_counted_and_never_spooled(open_ledger) -> None:
    ledger = open_ledger()
    bad = make_event(1)
    object.__setattr__(bad, "ttft_s", float("nan"))
    with pytest.raises(InvalidRecord, match="ttft_s"):
        await ledger.record(bad)
    with pytest.raises(InvalidRecord):
        await ledger.record({"event_id": "x"})  # type: ignore[arg-type]
    stats = ledger.stats()
    assert stats.events_ingested_total["invalid"] == 2 and stats.spool_depth_events == 0


async def test_late_events_are_counted(open_ledger, clock) -> None:
    ledger = open_ledger()
    clock.advance(2 * 86400)
    await ledger.record(make_event(1))
    assert ledger.stats().events_ingested_total["late"] == 1


async def test_spool_depth_and_age_are_published_on_the_bus(open_ledger, clock) -> None:
    bus = StatsBus()
    seen: list[LedgerStats] = []
    bus.subscribe(LedgerStats, seen.append)
    ledger = open_ledger(bus=bus)
    await ledger.record(make_event(1))
    clock.advance(42)
    stats = ledger.stats()
    assert stats.spool_depth_events == 1 and stats.spool_oldest_age_seconds == pytest.approx(42)
    assert ledger.flush()
    assert seen and seen[-1].spool_depth_events == 0 and seen[-1].clickhouse_up
    assert seen[-1].drained_records_total["usage"] == 1


async def test_engine_stats_from_the_bus_land_in_engine_requests_under_the_stamped_tenant(open_ledger) -> None:
    bus = StatsBus()
    ledger = open_ledger(bus=bus)
    # no attempt of these requests was ever recorded: the tenant comes from the stats themselves
    bus.publish(EngineRequestStats(request_id="acme-r1", finish_reason="stop",
                                   tokens=TokenCounts(input_tokens=25, output_tokens=10), wall_ts=T0 + 1.5,
                                   attribution=make_attribution("acme")))
    bus.publish(EngineRequestStats(request_id="bench-r1", finish_reason="stop",
                                   tokens=TokenCounts(input_tokens=3, output_tokens=2), wall_ts=T0 + 2))
    bus.publish(EngineRequestStats(request_id="", finish_reason="stop", tokens=TokenCounts(1, 0, 1, 0)))
    assert ledger.flush()
    assert bus.errors_total == 0  # the invalid one is logged and dropped, never raised into the engine
    rows = ledger.query_client().query("SELECT request_id, tenant_id, output_tokens FROM engine_requests FINAL "
                                       "ORDER BY request_id").result_rows
    assert rows == [("acme-r1", "acme", 10), ("bench-r1", "", 2)]  # unattributed: tenant ""


async def test_attempts_are_recorded(open_ledger) -> None:
    ledger = open_ledger()
    event = make_event(1)
    await ledger.record_attempt(make_attempt(event))
    await ledger.record_attempt(make_attempt(make_event(2), status="rejected", reason="rate_limited",
                                             status_code=429))
    await ledger.record_attempt(make_attempt(event))  # re-recorded: same deterministic attempt id
    for i, (status, code) in enumerate((("invalid", 400), ("error", 499)), start=3):  # never admitted
        await ledger.record_attempt(make_attempt(make_event(i), status=status, reason="bad", status_code=code,
                                                 event_id=""))
    assert ledger.flush()
    (row,) = ledger.queries.invoice_attempts(PERIOD)
    assert (row["attempts"], row["rejected_attempts"], row["replayed_attempts"], row["invalid_attempts"]) == \
        (4, 1, 0, 2)  # attempts = 1 admitted + 1 rejected + 0 replayed + 2 invalid


def test_signals_and_adjustments_are_stored(open_ledger) -> None:
    ledger = open_ledger()
    ledger.write_signals([SignalSample(T0, "kvmeter_kv_watermark_ratio", 0.5, {"engine": "0"}),
                          SignalSample(T0 + 1, "kvmeter_kv_watermark_ratio", 0.75, {"engine": "0"})])
    with pytest.raises(InvalidRecord):
        SignalSample(T0, "bad name!", 1.0)
    assert ledger.flush()
    assert scalar(ledger, "SELECT max(value) FROM signals WHERE labels['engine'] = '0'") == 0.75
    credit = Adjustment(Attribution("acme", project_id="proj1"), amount=Decimal("-1.50"), ts=T0,
                        reason="SLO credit", reference="T-1")
    ledger.adjust(credit)
    ledger.adjust(credit)  # idempotent
    (adj,) = ledger.queries.adjustments(PERIOD)
    assert adj["amount"] == Decimal("-1.5") and adj["reason"] == "SLO credit"
    assert (adj["tenant_id"], adj["project_id"], adj["workspace_id"]) == ("acme", "proj1", "")
    with pytest.raises(InvalidRecord, match="float"):
        Adjustment(Attribution("acme"), amount=0.1, ts=T0, reason="x")  # type: ignore[arg-type]
    with pytest.raises(InvalidRecord, match="tenant_id"):
        Adjustment(Attribution(""), amount=Decimal(1), ts=T0, reason="x")


async def test_hourly_rollups_are_recomputed_from_deduplicated_events(open_ledger) -> None:
    ledger = open_ledger()
    await asyncio.gather(*(ledger.record(make_event(i)) for i in range(10)))
    assert ledger.flush()
    assert ledger.refresh_rollups() >= 1
    await ledger.record(make_event(3))  # a duplicate arrives later
    await ledger.record(make_event(4000))  # and a new event in the next hour
    assert ledger.flush()
    ledger.refresh_rollups()
    series = ledger.queries.usage_timeseries(PERIOD)
    assert [(r["requests"], r["input_tokens"]) for r in series] == [(10, 250), (1, 25)]
    assert ledger.queries.usage_timeseries(PERIOD, step="day")[0]["requests"] == 11


async def test_a_record_clickhouse_refuses_is_dead_lettered_and_the_rest_drains(open_ledger, config) -> None:
    ledger = open_ledger()
    await asyncio.gather(*(ledger.record(make_event(i)) for i in range(20)))
    # a line that passed an older validator but that ClickHouse cannot parse (bad UUID)
    bad = json.loads(encode_usage(make_event(99)))
    bad[0] = "not-a-uuid"
    ledger.spool.streams["usage"].submit(json.dumps(bad).encode()).wait(10)
    await asyncio.gather(*(ledger.record(make_event(i)) for i in range(20, 40)))
    assert ledger.flush()
    assert ledger.queries.usage_summary(PERIOD)[0]["requests"] == 40
    rejected = (Path(config.spool_dir) / "usage" / "rejected.ndjson").read_text().splitlines()
    assert len(rejected) == 1 and "not-a-uuid" in json.loads(rejected[0])["record"]
    assert ledger.stats().rejected_records_total == 1


def test_migrations_are_versioned_and_rerunnable(open_ledger) -> None:
    ledger = open_ledger()
    client = ledger.query_client()
    assert migrate(client) == []  # already current: nothing applied twice
    assert scalar(ledger, "SELECT count() FROM schema_migrations FINAL") == len(load_migrations())
    client.command("ALTER TABLE schema_migrations UPDATE checksum = 'edited' WHERE version = 1 "
                   "SETTINGS mutations_sync = 1")
    with pytest.raises(MigrationError, match="changed after it was applied"):
        migrate(client)


def test_cluster_mode_renders_replicated_and_distributed_ddl() -> None:
    single = [s for m in load_migrations() for s in m.statements]
    cluster = [s for m in load_migrations("main") for s in m.statements]
    assert not any("$" in s or "ON CLUSTER" in s or "Replicated" in s for s in single)
    assert all("ON CLUSTER main" in s for s in cluster)
    assert any("ReplicatedReplacingMergeTree(attempt)" in s and "usage_events_local" in s for s in cluster)
    assert any("ENGINE = Distributed(main, currentDatabase(), usage_events_local, cityHash64(tenant_id))" in s
               for s in cluster)
    assert render("SELECT 1;\n-- comment\nSELECT 2;") == ["SELECT 1", "SELECT 2"]
    with pytest.raises(MigrationError):
        render("CREATE TABLE $nope")


class _ArrivalsDuringInserts:
    """A real chDB client that logs each insert's table; while a ``usage_events`` insert runs,
    one more usage event becomes durable (traffic that never pauses), up to ``arrivals`` times."""

    def __init__(self, client, arrive) -> None:  # noqa: ANN001
        self._client = client
        self._arrive = arrive
        self.tables: list[str] = []

    def raw_insert(self, table, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        result = self._client.raw_insert(table, *args, **kwargs)
        self.tables.append(table)
        if table == "usage_events":
            self._arrive()
        return result

    def __getattr__(self, name: str):
        return getattr(self._client, name)


async def test_a_round_under_steady_traffic_ends_and_drains_every_stream(open_ledger, config) -> None:
    # Draining each stream until it was empty never ended a round while usage events kept
    # arriving: usage_events was inserted one record at a time (an insert's CPU is mostly fixed)
    # and attempts waited for the traffic to stop. A round drains what was durable when it began.
    from kvmeter.ledger.connection import connect

    clients: list[_ArrivalsDuringInserts] = []
    arrived = iter(range(100, 130))

    def arrive() -> None:
        i = next(arrived, None)
        if i is not None:
            ledger.record_sync(make_event(i))

    ledger = open_ledger(client_factory=lambda: clients.append(_ArrivalsDuringInserts(connect(config), arrive))
                         or clients[-1])
    event = make_event(1)
    await ledger.record(event)
    await ledger.record_attempt(make_attempt(event))
    assert ledger.flush()  # one forced round
    tables = [t for c in clients for t in c.tables]
    assert tables == ["usage_events", "attempts"]  # one insert per stream, nothing starved
    assert scalar(ledger, "SELECT count() FROM attempts") == 1
    assert scalar(ledger, "SELECT count() FROM usage_events") == 1  # the arrival waits for the next round
    assert ledger.flush()  # the next round takes the arrival (and its insert brings one more)
    assert [t for c in clients for t in c.tables] == ["usage_events", "attempts", "usage_events"]
    assert scalar(ledger, "SELECT count() FROM usage_events") == 2
