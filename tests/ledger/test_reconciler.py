"""The periodic reconciliation serve runs (:class:`kvmeter.ledger.reconciler.Reconciler`) on a real
embedded ledger written through the ledger's own API: its schedule (the injected clock decides),
the drift it measures per view, a failed run, and that a run happens off the event loop."""

from __future__ import annotations

import asyncio
import threading

import pytest
from ledgerkit import T0, engine_stats, make_attempt, make_event

from kvmeter.bus import StatsBus
from kvmeter.clock import ManualClock
from kvmeter.ledger.connection import ClientHolder, connect
from kvmeter.ledger.errors import LedgerUnavailable
from kvmeter.ledger.queries import LedgerQueries
from kvmeter.ledger.reconciler import Reconciler
from kvmeter.stats import ReconciliationStats
from kvmeter.stats import EngineRequestStats
from kvmeter.tokens import TokenCounts


async def serve_like(ledger, bus: StatsBus, n: int = 10) -> int:
    """What serve writes for ``n`` requests of acme: admitted attempt, engine record (on the bus),
    usage event; returns their input + output tokens."""
    tokens = 0
    for i in range(n):
        event = make_event(i, "acme", input_tokens=100 + i, output_tokens=20)
        await ledger.record_attempt(make_attempt(event))
        bus.publish(engine_stats(event))
        await ledger.record(event)
        tokens += event.tokens.total_tokens
    return tokens


def published(bus: StatsBus) -> list[ReconciliationStats]:
    seen: list[ReconciliationStats] = []
    bus.subscribe(ReconciliationStats, seen.append)
    return seen


async def test_runs_when_due_by_the_injected_clock_and_finds_a_clean_ledger_clean(open_ledger, clock: ManualClock):
    bus = StatsBus()
    ledger = open_ledger(bus=bus)
    tokens = await serve_like(ledger, bus)
    assert ledger.flush()
    seen = published(bus)
    reconciler = Reconciler(ledger.queries, bus, clock=clock, interval_s=3600, first_run_delay_s=60)
    assert reconciler.tick() is None and not reconciler.due()  # the first run waits 60 s
    clock.advance(60)
    stats = reconciler.tick()
    assert stats is not None and seen == [stats] and reconciler.last is stats
    assert stats.ok and stats.error == "" and stats.runs_total == {"ok": 1, "error": 0}
    assert stats.drift_ratio == {"engine": 0.0, "gateway": 0.0} and stats.drift_tenants == ()
    assert stats.tenants == 1 and stats.last_ok_ts == stats.wall_ts == clock.wall()
    # the window: one day, ending the settle time (10 min) before now; it holds the requests
    assert stats.period_end_ts == clock.wall() - 600 and stats.period_start_ts == stats.period_end_ts - 86400
    assert stats.period_start_ts <= T0 < T0 + 10 < stats.period_end_ts and tokens > 0
    clock.advance(3599)
    assert reconciler.tick() is None  # next one an interval after the first was due
    clock.advance(1)
    assert reconciler.tick().runs_total == {"ok": 2, "error": 0}
    clock.advance(3 * 3600 + 5)  # a long pause: one run, then an interval from now
    assert reconciler.tick() is not None and reconciler.tick() is None
    assert len(seen) == 3


async def test_drift_per_view_against_the_ledger(open_ledger, clock: ManualClock):
    bus = StatsBus()
    ledger = open_ledger(bus=bus)
    tokens = await serve_like(ledger, bus)
    # engine work nobody billed (no attempt, no usage event), and an admitted request that never finished
    bus.publish(
        EngineRequestStats("ghost-1", "stop", TokenCounts(input_tokens=300, output_tokens=50), wall_ts=T0 + 20)
    )
    lost = make_event(99, "acme")
    await ledger.record_attempt(make_attempt(lost))
    assert ledger.flush()
    stats = Reconciler(ledger.queries, bus, clock=clock, first_run_delay_s=0).tick()
    assert stats.ok
    assert stats.drift_units == {"engine": 350, "gateway": 1}
    assert stats.drift_ratio["engine"] == pytest.approx(350 / (tokens + 350))
    assert stats.drift_ratio["gateway"] == pytest.approx(1 / 11)  # 11 admitted attempts, one lost
    assert stats.drift_tenants == ("(unattributed)",)  # the ghost's tenant is unknown


async def test_a_failed_run_is_counted_and_the_next_one_succeeds(open_ledger, clock: ManualClock, config):
    bus = StatsBus()
    ledger = open_ledger(bus=bus)
    assert ledger.flush()
    down = False

    def factory():
        if down:
            raise LedgerUnavailable("ClickHouse is down")
        return connect(config)

    holder = ClientHolder(factory)
    reconciler = Reconciler(LedgerQueries(holder, ledger.prices), bus, clock=clock, first_run_delay_s=0)
    try:
        ok = reconciler.tick()
        assert ok.ok and ok.runs_total == {"ok": 1, "error": 0}
        down = True
        holder.reset()  # the connection dropped; reconnecting fails while ClickHouse is down
        clock.advance(3600)
        failed = reconciler.tick()
        assert not failed.ok and failed.runs_total == {"ok": 1, "error": 1}
        assert failed.error == "LedgerUnavailable: ClickHouse is down" and failed.drift_ratio == {}
        assert failed.last_ok_ts == ok.wall_ts < failed.wall_ts
        down = False
        clock.advance(3600)
        assert reconciler.tick().runs_total == {"ok": 2, "error": 1}
    finally:
        holder.close()


async def test_the_loop_runs_due_reconciliations_off_the_event_loop(open_ledger, clock: ManualClock):
    bus = StatsBus()
    ledger = open_ledger(bus=bus)
    assert ledger.flush()
    loop = asyncio.get_running_loop()
    loop_thread = threading.get_ident()
    done = asyncio.Event()
    threads: list[int] = []

    def on_stats(stats: ReconciliationStats) -> None:
        threads.append(threading.get_ident())
        loop.call_soon_threadsafe(done.set)

    bus.subscribe(ReconciliationStats, on_stats)
    waits: list[float] = []

    async def sleep(seconds: float) -> None:  # the loop's wait: moves the manual clock instead
        waits.append(seconds)
        clock.advance(seconds)
        await asyncio.sleep(0)

    reconciler = Reconciler(ledger.queries, bus, clock=clock, interval_s=600, first_run_delay_s=30, sleep=sleep)
    reconciler.start()
    try:
        await asyncio.wait_for(done.wait(), 60)  # bounds a hang; the schedule is the manual clock's
    finally:
        await reconciler.stop()
    assert not reconciler.running
    assert threads and loop_thread not in threads  # the run was on a worker thread
    assert waits[0] == 1.0 and len(waits) >= 30  # woke once a second (by the clock) until due at 30 s


def test_bad_settings_are_refused(clock: ManualClock):
    for kwargs in ({"interval_s": 0}, {"lookback_s": -1}, {"first_run_delay_s": -1}, {"interval_s": float("inf")}):
        with pytest.raises(ValueError):
            Reconciler(None, None, clock=clock, **kwargs)  # type: ignore[arg-type]
