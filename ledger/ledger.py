"""The :class:`Ledger` facade the gateway holds: durable record, background drain, queries.

Lifecycle::

    ledger = Ledger.open(config, bus=bus)          # recovers the spool, connects, migrates
    await ledger.record(usage_event)               # returns once the event is fsynced
    await ledger.record_attempt(attempt)           # every HTTP attempt, same durability
    await ledger.record_agent(tool_call_record)    # agent-run records (kvmeter.ledger.agent_records)
    ledger.record_step_shares(shares, model=m, replica=r)  # per-step engine work (never blocks)
    ledger.queries.usage_summary(period, tenant)   # reads (also served by read_api)
    ledger.agent_runs.runs(period, tenants)        # the per-run rollup (kvmeter.ledger.agent_runs)
    ledger.flush()                                 # drain everything spooled so far
    ledger.close()

In embedded mode (``chdb://``) the opening process owns the chDB path and the spool; other
processes read through its read API (:mod:`kvmeter.ledger.read_api`). With a server DSN the
ledger opens even while ClickHouse is down: records stay durable in the spool and drain when it
comes back.
"""

from __future__ import annotations

import hashlib
import logging
from datetime import datetime, timezone
from typing import Callable, Iterable

from clickhouse_connect.driver.client import Client

from kvmeter.bus import StatsBus
from kvmeter.clock import SYSTEM_CLOCK, Clock
from kvmeter.events import UsageEvent
from kvmeter.stats import INGEST_STATUSES, EngineRequestStats, EngineStepShares, LedgerStats

from .agent_records import AGENT_STREAMS, AgentRecord, encode_agent_record
from .agent_runs import AgentRunQueries
from .config import LedgerConfig
from .connection import ClientFactory, ClientHolder, connect, describe_error
from .drain import Writer
from .errors import InvalidRecord, LedgerError, LedgerUnavailable
from .interference import InterferenceQueries
from .prices import PriceList, load_price_list
from .queries import LedgerQueries
from .records import (ATTEMPT_STREAM, ENGINE_STREAM, STREAMS, USAGE_STREAM, Adjustment, AttemptRecord,
                      SignalSample, column_getter, encode_attempt, encode_engine, encode_usage)
from .rollups import refresh_rollups
from .retention import apply_engine_steps_retention
from .schema import migrate
from .spool import CommitTicket, Spool
from .step_records import STEP_STREAM, encode_step_shares

__all__ = ["Ledger", "sync_prices"]

log = logging.getLogger(__name__)

#: Usage rows (tenant, event id, attempt request id) remembered to classify a re-recorded one as ``duplicate``.
RECENT_EVENT_IDS = 100_000
#: Columns of the ``adjustments`` table an :class:`Adjustment` holds (then ``ts`` and ``currency``).
_ADJUSTMENT_COLUMNS = ("adjustment_id", "tenant_id", "workspace_id", "project_id", "api_key_id", "amount",
                       "reason", "reference", "created_by")
_adjustment_values = column_getter(_ADJUSTMENT_COLUMNS)


def sync_prices(client: Client, prices: PriceList) -> None:
    """Store the price list in the ``prices`` / ``price_tier_discounts`` tables (idempotent:
    the insert is deduplicated by a token over the list's content)."""
    rows = [[prices.version, prices.currency, r["model"], r["token_type"], r["price_per_million"]]
            for r in prices.rows()]
    digest = hashlib.sha256(repr((rows, sorted(prices.tier_discounts.items()))).encode()).hexdigest()[:16]
    token = f"kvmeter:prices:{prices.version}:{digest}"
    client.insert("prices", rows, column_names=["version", "currency", "model", "token_type", "price_per_million"],
                  settings={"insert_deduplication_token": token})
    if prices.tier_discounts:
        client.insert("price_tier_discounts",
                      [[prices.version, t, d] for t, d in sorted(prices.tier_discounts.items())],
                      column_names=["version", "tier", "discount_ratio"],
                      settings={"insert_deduplication_token": token + ":tiers"})


class Ledger:
    """Exact, idempotent usage metering into ClickHouse through a durable spool.

    Build with :meth:`open`. Thread-safe; ``record*`` may be awaited from any event loop.

    Attributes:
        queries: :class:`~kvmeter.ledger.queries.LedgerQueries` over this ledger's database.
        agent_runs: :class:`~kvmeter.ledger.agent_runs.AgentRunQueries` (the per-run rollup).
        interference: :class:`~kvmeter.ledger.interference.InterferenceQueries` (who hurt whom).
        config: the effective :class:`LedgerConfig`.
        prices: the price list in use.
    """

    def __init__(self, *, config: LedgerConfig, spool: Spool, writer: Writer, query_holder: ClientHolder,
                 prices: PriceList, bus: StatsBus | None, clock: Clock) -> None:
        self.config = config
        self.prices = prices
        self.queries = LedgerQueries(query_holder, prices)
        self.agent_runs = AgentRunQueries(query_holder, prices)
        self.interference = InterferenceQueries(query_holder, cluster=config.cluster is not None)
        self._spool = spool
        self._writer = writer
        self._query_holder = query_holder
        self._bus = bus
        self._clock = clock
        self._usage = spool.streams[USAGE_STREAM.name]
        self._attempts = spool.streams[ATTEMPT_STREAM.name]
        self._engine = spool.streams[ENGINE_STREAM.name]
        self._steps = spool.streams[STEP_STREAM.name]
        self._steps_invalid = 0
        self._ingested = dict.fromkeys(INGEST_STATUSES, 0)
        self._recent: set[tuple[str, str, str]] = set()
        self._recent_old: set[tuple[str, str, str]] = set()
        self._late_after_s = config.late_after_s
        self._engine_invalid = 0
        self._unsubscribe: Callable[[], None] | None = None
        self._closed = False

    @property
    def spool(self) -> Spool:
        """The durable spool under the ledger (its streams' depth, batches and segment files), for
        inspection and recovery tools; records enter it through the ``record*`` methods."""
        return self._spool

    def query_client(self) -> Client:
        """The read-side ClickHouse client (connected and migrated on first use), shared with
        :attr:`queries`: for SQL the query classes do not offer (diagnostics, benches, tests).
        :meth:`close` closes it; callers must not.

        Raises:
            LedgerUnavailable: ClickHouse cannot be reached.
        """
        return self._query_holder.get()

    # ------------------------------------------------------------------ construction

    @classmethod
    def open(cls, config: LedgerConfig | None = None, *, bus: StatsBus | None = None,
             clock: Clock = SYSTEM_CLOCK, client_factory: ClientFactory | None = None,
             prices: PriceList | None = None) -> "Ledger":
        """Open the spool (recovering it), start the writer and connect.

        Args:
            config: defaults to :meth:`LedgerConfig.from_env`.
            bus: subscribe to :class:`~kvmeter.stats.EngineRequestStats` on it (the engine view
                for reconciliation) and publish :class:`~kvmeter.stats.LedgerStats` there
                after every writer round. ``None``: neither.
            clock: wall clock for record ages and lateness; monotonic for back-off.
            client_factory: opens a ClickHouse client (default :func:`connect` on the config's
                DSN); tests inject one that fails for a while.
            prices: price list (default: ``config.prices_path`` or the packaged list).
        Raises:
            LedgerLocked: the spool or the embedded chDB path is held by another process.
            MigrationError: the schema could not be brought up to date (embedded mode).
            LedgerUnavailable: the embedded chDB path cannot be opened.
            PriceListError, ConfigError: invalid configuration.
        """
        config = config or LedgerConfig.from_env()
        prices = prices or load_price_list(config.prices_path)
        factory = client_factory or (lambda: connect(config))

        def prepare(client: Client) -> None:
            migrate(client, config.cluster)
            apply_engine_steps_retention(client, config.engine_steps_retention_days, config.cluster)
            sync_prices(client, prices)

        spool = Spool(config.spool_dir, STREAMS + AGENT_STREAMS + (STEP_STREAM,), clock=clock,
                      segment_bytes=config.segment_bytes, fsync=config.fsync)
        try:
            writer_holder = ClientHolder(factory, prepare)
            query_holder = ClientHolder(factory, lambda client: migrate(client, config.cluster))
            if config.embedded and client_factory is None:
                writer_holder.get()  # fail loudly at construction: locked path, failed migration
            ledger_box: list[Ledger] = []

            def on_round() -> None:
                if ledger_box:
                    ledger_box[0]._publish()

            writer = Writer(spool, writer_holder, config, clock, on_round=on_round, refresh_rollups=refresh_rollups)
            ledger = cls(config=config, spool=spool, writer=writer, query_holder=query_holder,
                         prices=prices, bus=bus, clock=clock)
            ledger_box.append(ledger)
        except BaseException:
            spool.close()
            raise
        writer.start()
        if bus is not None:
            ledger._unsubscribe = bus.subscribe(EngineRequestStats, ledger.record_engine)
        log.info("ledger open: %r", config)
        return ledger

    # ------------------------------------------------------------------ writes

    def _submit_usage(self, event: UsageEvent) -> CommitTicket:
        try:
            line = encode_usage(event)
        except InvalidRecord:
            self._ingested["invalid"] += 1
            raise
        key = (event.tenant_id, event.event_id, event.request_id)  # one row per attempt (migration 0006)
        # stats only (a race between threads can at worst misclassify one event): two
        # generations of recent ids, the older dropped when the newer fills up
        if key in self._recent or key in self._recent_old:
            status = "duplicate"
        else:
            if len(self._recent) >= RECENT_EVENT_IDS:
                self._recent_old, self._recent = self._recent, set()
            self._recent.add(key)
            status = "late" if event.finish_ts < self._clock.wall() - self._late_after_s else "new"
        self._ingested[status] += 1
        return self._usage.submit(line)

    async def record(self, event: UsageEvent) -> None:
        """Make one usage event durable; returns once it is fsynced in the spool.

        Concurrent calls share one fsync (group commit). The event reaches ClickHouse later
        (background writer); recording the same event again is harmless (deduplicated).
        Raises:
            InvalidRecord: the event cannot be stored (nothing was written).
            SpoolWriteError: the spool could not write it (disk full, I/O error).
        """
        ticket = self._submit_usage(event)
        if not ticket.done:  # the inlined CommitTicket.wait_async: one coroutine frame less per event
            fut = ticket.shared_future()
            if fut is not None:
                await fut
        ticket.raise_if_failed()

    def record_sync(self, event: UsageEvent, timeout_s: float | None = 10.0) -> None:
        """Blocking :meth:`record` for code without an event loop.

        Raises:
            InvalidRecord, SpoolWriteError: as :meth:`record`; TimeoutError after ``timeout_s``.
        """
        self._submit_usage(event).wait(timeout_s)

    def _submit_attempt(self, attempt: AttemptRecord) -> CommitTicket:
        return self._attempts.submit(encode_attempt(attempt))

    async def record_attempt(self, attempt: AttemptRecord) -> None:
        """Make one HTTP attempt record durable (same contract as :meth:`record`)."""
        await self._submit_attempt(attempt).wait_async()

    def record_attempt_sync(self, attempt: AttemptRecord, timeout_s: float | None = 10.0) -> None:
        """Blocking :meth:`record_attempt`."""
        self._submit_attempt(attempt).wait(timeout_s)

    async def record_agent(self, record: AgentRecord) -> None:
        """Make one agent-run record (a tool-call decision, an approval event, a run stop) durable;
        same contract as :meth:`record`.

        Raises:
            InvalidRecord: the record cannot be stored (nothing was written).
            SpoolWriteError: the spool could not write it.
        """
        stream, line = encode_agent_record(record)
        await self._spool.streams[stream].submit(line).wait_async()

    def record_engine(self, stats: EngineRequestStats) -> None:
        """Spool the engine's account of a request (cheap, never blocks), under the tenant the
        engine stamped on it (``""`` when unattributed) — the engine view of reconciliation.
        :meth:`open` subscribes it to the bus; a record that cannot be encoded is counted and
        logged, not raised."""
        try:
            line = encode_engine(stats, self._clock.wall())
        except InvalidRecord as exc:
            self._engine_invalid += 1
            log.warning("ledger: engine stats not stored: %s", exc)
            return
        self._engine.submit(line)

    def record_step_shares(self, shares: EngineStepShares, *, model: str, replica: str) -> None:
        """Spool one engine step's per-tenant work for the ``engine_steps`` table
        (:mod:`kvmeter.ledger.step_records`). Called on the engine's output loop for every step, so
        it only encodes and queues (the spool's committer fsyncs in groups, the drain inserts in
        batches) and never raises: a step that cannot be encoded, or a closed spool, is counted
        and logged.

        Args:
            shares: one step (:class:`~kvmeter.stats.EngineStepShares`).
            model: the served model's name; replica: the serve process's name.
        """
        try:
            lines = encode_step_shares(shares, model=model, replica=replica)
            if lines:
                self._steps.submit_many(lines)
        except LedgerError as exc:  # InvalidRecord, SpoolWriteError
            self._steps_invalid += 1
            if self._steps_invalid in (1, 10, 100) or self._steps_invalid % 1000 == 0:
                log.warning("ledger: engine step not stored (%d so far): %s", self._steps_invalid, exc)

    def write_signals(self, samples: Iterable[SignalSample]) -> None:
        """Queue signal samples for the ``signals`` table (best effort, not spooled: the
        newest ``signal_buffer`` samples are kept while ClickHouse is away).

        Raises:
            InvalidRecord: if an item is not a :class:`SignalSample`.
        """
        batch = list(samples)
        for s in batch:
            if type(s) is not SignalSample:
                raise InvalidRecord(f"write_signals() takes SignalSample items, got {type(s).__name__}")
        self._writer.add_signals(batch)

    def adjust(self, adjustment: Adjustment) -> None:
        """Store a signed money correction now (synchronous; idempotent by ``adjustment_id``).

        Raises:
            InvalidRecord: not an :class:`Adjustment`.
            LedgerUnavailable: ClickHouse cannot be reached (nothing stored; retry).
        """
        if type(adjustment) is not Adjustment:
            raise InvalidRecord(f"adjust() takes an Adjustment, got {type(adjustment).__name__}")
        row = [*_adjustment_values(adjustment), datetime.fromtimestamp(adjustment.ts, tz=timezone.utc),
               self.prices.currency]
        client = self._query_holder.get()
        try:
            client.insert("adjustments", [row], column_names=[*_ADJUSTMENT_COLUMNS, "ts", "currency"],
                          settings={"insert_deduplication_token": f"kvmeter:adjustment:{adjustment.adjustment_id}"})
        except Exception as exc:  # noqa: BLE001
            self._query_holder.reset()
            raise LedgerUnavailable(f"adjustment not stored: {describe_error(exc)}") from None

    # ------------------------------------------------------------------ drain & maintenance

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Drain everything spooled so far into ClickHouse.

        Returns:
            True when every record recorded before the call is in ClickHouse; False if
            ClickHouse is unreachable now or ``timeout_s`` passed (records stay in the spool).
        """
        return self._writer.flush(timeout_s)

    def refresh_rollups(self, *, full: bool = False) -> int:
        """Recompute the hourly rollups now (the writer also does it every ``rollup_interval_s``).

        Returns:
            Hours recomputed.
        Raises:
            LedgerUnavailable: ClickHouse cannot be reached.
        """
        client = self._query_holder.get()
        try:
            return refresh_rollups(client, full=full)
        except Exception as exc:  # noqa: BLE001
            raise LedgerUnavailable(f"rollup refresh failed: {describe_error(exc)}") from None

    def stats(self) -> LedgerStats:
        """A snapshot of spool depth/age and writer counters (see :class:`LedgerStats`)."""
        now = self._clock.wall()
        depth_events = depth_bytes = pending = 0
        oldest: float | None = None
        by_stream: dict[str, int] = {}
        fsyncs = errors = 0
        for name, stream in self._spool.streams.items():
            n, b, first = stream.depth()
            depth_events += n
            depth_bytes += b
            by_stream[name] = n
            pending += stream.pending
            fsyncs += stream.fsyncs_total
            errors += stream.write_errors_total
            if first is not None and (oldest is None or first < oldest):
                oldest = first
        w = self._writer
        return LedgerStats(
            wall_ts=now,
            spool_depth_events=depth_events,
            spool_depth_bytes=depth_bytes,
            spool_oldest_age_seconds=max(0.0, now - oldest) if oldest is not None else 0.0,
            spool_depth_by_stream=by_stream,
            spool_pending_events=pending,
            events_ingested_total=dict(self._ingested),
            drained_records_total=dict(w.drained_total),
            insert_batches_total=w.insert_batches_total,
            insert_retries_total=w.insert_retries_total,
            rejected_records_total=w.rejected_total,
            spool_write_errors_total=errors,
            fsyncs_total=fsyncs,
            signals_dropped_total=w.signals_dropped_total,
            clickhouse_up=w.clickhouse_up,
            last_error=w.last_error,
        )

    def _publish(self) -> None:
        if self._bus is not None and not self._closed:
            self._bus.publish(self.stats())

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Stop taking records, try to drain for ``close_timeout_s``, release the spool.

        What is not drained stays durable in the spool for the next :meth:`open`. Idempotent.
        """
        if self._closed:
            return
        if self._unsubscribe is not None:
            self._unsubscribe()
        try:
            for stream in self._spool.streams.values():
                stream.sync(self.config.close_timeout_s)
        except (TimeoutError, LedgerError) as exc:
            log.warning("ledger close: spool commit incomplete: %s", exc)
        if not self._writer.stop(self.config.close_timeout_s):
            log.warning("ledger close: writer still busy after %.1f s; undrained records stay in the spool",
                        self.config.close_timeout_s)
        self._closed = True
        self._spool.close()
        self._writer_holder_close()
        self._query_holder.close()

    def _writer_holder_close(self) -> None:
        self._writer._holder.close()

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
