"""Stats of the ledger: its spool and writer, published after every writer round.

The Prometheus/OTLP exporters subscribe to :class:`LedgerStats` and turn it into, e.g.,
``kvmeter_ledger_spool_depth_events``, ``kvmeter_ledger_spool_oldest_age_seconds``,
``kvmeter_ledger_events_ingested_total{status}`` and ``kvmeter_ledger_insert_retries_total``; and
:class:`ReconciliationStats` (after every periodic reconciliation, :mod:`kvmeter.ledger.reconciler`)
into ``kvmeter_reconciliation_*``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["LedgerStats", "INGEST_STATUSES", "ReconciliationStats", "RECONCILIATION_VIEWS", "RUN_RESULTS"]

#: Statuses of :attr:`LedgerStats.events_ingested_total` (docs/ARCHITECTURE.md, "Signals").
INGEST_STATUSES = ("new", "duplicate", "invalid", "late")


@dataclass(slots=True)
class LedgerStats:
    """A snapshot of the ledger's spool and writer.

    Counters (``*_total``) count since this process opened the ledger; gauges are current.

    Attributes:
        wall_ts: wall-clock epoch seconds of the snapshot (the injected clock).
        spool_depth_events: records durable in the spool and not yet in ClickHouse (all streams).
        spool_depth_bytes: their size on disk, block headers included.
        spool_oldest_age_seconds: age of the oldest such record (0.0 when the spool is drained).
        spool_depth_by_stream: ``{"usage": n, "attempts": n, "engine": n}``.
        spool_pending_events: records accepted but not yet fsynced (the current commit group).
        events_ingested_total: usage events accepted by ``record()``, by status: ``new``,
            ``duplicate`` (event id already recorded by this process: stored again, deduplicated
            by ClickHouse), ``invalid`` (refused with :class:`InvalidRecord`), ``late``
            (``finish_ts`` older than ``late_after_s``).
        drained_records_total: records inserted into ClickHouse, by stream.
        insert_batches_total: successful insert statements.
        insert_retries_total: failed insert attempts that will be retried (outages).
        rejected_records_total: records ClickHouse refused as data (moved to ``rejected.ndjson``).
        spool_write_errors_total: group commits that failed (disk full, I/O error).
        fsyncs_total: spool group commits (one fsync each); appends / fsyncs = group size.
        signals_dropped_total: signal samples dropped because the buffer was full.
        clickhouse_up: True after the last insert/connect attempt succeeded.
        last_error: the last writer error message ("" if none), password-free.
    """

    wall_ts: float
    spool_depth_events: int = 0
    spool_depth_bytes: int = 0
    spool_oldest_age_seconds: float = 0.0
    spool_depth_by_stream: dict[str, int] = field(default_factory=dict)
    spool_pending_events: int = 0
    events_ingested_total: dict[str, int] = field(default_factory=lambda: dict.fromkeys(INGEST_STATUSES, 0))
    drained_records_total: dict[str, int] = field(default_factory=dict)
    insert_batches_total: int = 0
    insert_retries_total: int = 0
    rejected_records_total: int = 0
    spool_write_errors_total: int = 0
    fsyncs_total: int = 0
    signals_dropped_total: int = 0
    clickhouse_up: bool = False
    last_error: str = ""


#: The views a periodic reconciliation compares with the ledger (:attr:`ReconciliationStats.drift_ratio`).
RECONCILIATION_VIEWS = ("engine", "gateway")
#: Results of a reconciliation run (:attr:`ReconciliationStats.runs_total`).
RUN_RESULTS = ("ok", "error")


@dataclass(slots=True)
class ReconciliationStats:
    """The outcome of one periodic three-way reconciliation (:class:`~kvmeter.ledger.reconciler.Reconciler`).

    Drift is what :func:`~kvmeter.ledger.reconcile.reconcile` classifies as *unexplained*, summed
    over every tenant of the reconciled window, per view compared with the ledger:

    * ``engine`` — tokens: mismatched matched requests + ledger-only + engine-unbilled +
      duplicate-billed tokens (``unexplained_drift_tokens``), over all work seen (ledger tokens +
      engine-unbilled tokens, at least 1): ``billing reconcile``'s ratio, for all tenants.
    * ``gateway`` — requests: admitted attempts that never finished (no engine record, no usage
      event) + requests billed under more than one event id, over admitted attempts (at least 1).

    Attributes:
        wall_ts: wall-clock epoch seconds when the run ended (the injected clock).
        ok: the run read the ledger and reconciled; False when the ledger could not be read
            (then the drift fields are empty and ``error`` says why).
        period_start_ts, period_end_ts: the reconciled window ``[start, end)``, epoch seconds.
        tenants: tenants present in any of the three views.
        drift_ratio: view (:data:`RECONCILIATION_VIEWS`) → unexplained drift ratio, ≥ 0.
        drift_units: view → the unexplained tokens (engine) or requests (gateway) behind the ratio.
        drift_tenants: tenants whose unexplained drift ratio is above 0, sorted.
        runs_total: runs since the reconciler started, by result (:data:`RUN_RESULTS`).
        last_ok_ts: ``wall_ts`` of the last run that succeeded, or ``None`` before the first.
        error: why the run failed ("" when ok), password-free.
    """

    wall_ts: float
    ok: bool
    period_start_ts: float
    period_end_ts: float
    tenants: int = 0
    drift_ratio: dict[str, float] = field(default_factory=dict)
    drift_units: dict[str, int] = field(default_factory=dict)
    drift_tenants: tuple[str, ...] = ()
    runs_total: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RUN_RESULTS, 0))
    last_ok_ts: float | None = None
    error: str = ""
