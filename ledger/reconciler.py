"""Periodic three-way reconciliation inside the process that holds the ledger (``kvmeter serve``).

Every ``interval_s`` (the first time ``first_run_delay_s`` after start) the :class:`Reconciler`
reads the engine, gateway and ledger views of a trailing window with the ledger's own read
(:meth:`~kvmeter.ledger.queries.LedgerQueries.reconcile_views`), classifies them with
:func:`~kvmeter.ledger.reconcile.reconcile` — the same code as ``kvmeter billing reconcile`` —
and publishes a :class:`~kvmeter.stats.ReconciliationStats` on the bus. The Prometheus
exporter turns it into ``kvmeter_reconciliation_*``, which the alert rules
``KvmeterReconciliationDrift`` and ``KvmeterReconciliationStale`` read.

Off the hot path: a run happens on a worker thread (``asyncio.to_thread``), never on the event
loop. Its queries go through the ledger's query client, the one the read API uses; calls on it
are serialised per client (clickhouse-connect; chDB holds a lock per handle), so a
reconciliation never runs two queries at once on the embedded engine, and the ledger's writer
(its own client) keeps draining the spool meanwhile. The embedded chDB ledger is single-process:
this is why the reconciliation runs inside serve rather than as a separate job.

The window is ``[now − settle_s − lookback_s, now − settle_s)``: it ends ``settle_s`` (default
:data:`~kvmeter.ledger.queries.RECONCILE_SLACK_S`, 10 minutes) in the past, so requests still
running and records still on their way through the spool are not counted as drift.

Timing is the injected clock's: whether a run is due is decided by ``clock.monotonic()``; the
loop wakes at least once a second (through the injected ``sleep``) to ask.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from datetime import datetime, timezone
from typing import Any, Awaitable, Callable, Protocol

from kvmeter.aio import PeriodicTask
from kvmeter.bus import StatsBus
from kvmeter.clock import SYSTEM_CLOCK, Clock

from .errors import LedgerError
from .period import Period
from .queries import RECONCILE_SLACK_S
from .reconcile import reconcile, view_drift
from kvmeter.stats import RUN_RESULTS, ReconciliationStats

__all__ = ["Reconciler", "ViewsReader"]

log = logging.getLogger(__name__)

#: The loop asks the clock at least this often (seconds of real time).
WAKE_S = 1.0


class ViewsReader(Protocol):
    """What the reconciler reads: :meth:`LedgerQueries.reconcile_views
    <kvmeter.ledger.queries.LedgerQueries.reconcile_views>` (all tenants)."""

    def reconcile_views(self, period: Period, tenant_id: str | None = None) -> list[dict[str, Any]]: ...


class Reconciler:
    """Runs the three-way reconciliation every ``interval_s`` and publishes the outcome.

    Args:
        reader: the ledger's reads (``ledger.queries`` in serve).
        bus: where :class:`~kvmeter.stats.ReconciliationStats` is published (``None``:
            only kept as :attr:`last`).
        clock: decides when a run is due (``monotonic()``) and stamps the window (``wall()``).
        interval_s: seconds between runs (> 0; default hourly).
        first_run_delay_s: seconds from construction to the first run (≥ 0).
        lookback_s: length of the reconciled window, seconds (> 0; default one day).
        settle_s: how long before now the window ends, seconds (≥ 0).
        sleep: how the loop waits (default ``asyncio.sleep``; tests pass one that advances a
            manual clock).
    Raises:
        ValueError: on a non-positive interval or lookback, or a negative delay or settle time.

    Attributes:
        last: the newest run's stats (``None`` before the first run).
    """

    def __init__(self, reader: ViewsReader, bus: StatsBus | None, *,
                 clock: Clock = SYSTEM_CLOCK, interval_s: float = 3600.0, first_run_delay_s: float = 60.0,
                 lookback_s: float = 86400.0, settle_s: float = float(RECONCILE_SLACK_S),
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep) -> None:
        for name, value, low in (("interval_s", interval_s, 0.0), ("lookback_s", lookback_s, 0.0)):
            if not (math.isfinite(value) and value > low):
                raise ValueError(f"{name} must be a number > 0 (seconds), got {value!r}")
        for name, value in (("first_run_delay_s", first_run_delay_s), ("settle_s", settle_s)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a number ≥ 0 (seconds), got {value!r}")
        self._reader = reader
        self._bus = bus
        self._clock = clock
        self.interval_s = float(interval_s)
        self.lookback_s = float(lookback_s)
        self.settle_s = float(settle_s)
        self._next_due = clock.monotonic() + first_run_delay_s
        self._runs = dict.fromkeys(RUN_RESULTS, 0)
        self._last_ok: float | None = None
        self._tick_lock = threading.Lock()
        self._task = PeriodicTask(self._wake, min(self.interval_s, WAKE_S), name="kvmeter-reconciler",
                                  sleep=sleep)
        self.last: ReconciliationStats | None = None

    # ------------------------------------------------------------------ one run

    def due(self) -> bool:
        """Whether the next run is due (by the injected clock)."""
        return self._clock.monotonic() >= self._next_due

    def tick(self, *, force: bool = False) -> ReconciliationStats | None:
        """Run once if due (or ``force``); returns the run's stats, or ``None`` when not due.

        The next run is due one interval after this one was due (a late tick does not drift the
        schedule; after a pause longer than an interval it restarts from now). Blocking: call it
        from a worker thread (the loop does).
        """
        with self._tick_lock:
            now = self._clock.monotonic()
            if not force and now < self._next_due:
                return None
            self._next_due += self.interval_s
            if self._next_due <= now:
                self._next_due = now + self.interval_s
            return self._run()

    def window(self) -> Period:
        """The window a run now reconciles: ``[now − settle − lookback, now − settle)``."""
        end = datetime.fromtimestamp(self._clock.wall() - self.settle_s, tz=timezone.utc)
        start = datetime.fromtimestamp(end.timestamp() - self.lookback_s, tz=timezone.utc)
        label = f"{start.isoformat().replace('+00:00', 'Z')}/{end.isoformat().replace('+00:00', 'Z')}"
        return Period(start, end, label)

    def _run(self) -> ReconciliationStats:
        try:
            period = self.window()
        except LedgerError as exc:  # a clock outside what the ledger holds (PeriodError)
            return self._failed(None, exc)
        try:
            report = reconcile(self._reader.reconcile_views(period))
        except LedgerError as exc:  # unavailable (an outage) or refused: counted, retried next interval
            return self._failed(period, exc)
        except Exception as exc:  # noqa: BLE001 — a background job never takes serve down
            log.exception("reconciliation failed")
            return self._failed(period, exc)
        drift = view_drift(report)
        self._runs["ok"] += 1
        wall = self._clock.wall()
        self._last_ok = wall
        stats = ReconciliationStats(
            wall_ts=wall, ok=True, period_start_ts=period.start_ts, period_end_ts=period.end_ts,
            tenants=report.frame.height,
            drift_ratio={view: units / max(base, 1) for view, (units, base) in drift.items()},
            drift_units={view: units for view, (units, _) in drift.items()},
            drift_tenants=tuple(sorted(report.failed_tenants)), runs_total=dict(self._runs), last_ok_ts=wall)
        if report.failed_tenants:
            log.warning("reconciliation %s: unexplained drift for %s (engine %d tokens, gateway %d requests)",
                        period.label, ", ".join(stats.drift_tenants), stats.drift_units["engine"],
                        stats.drift_units["gateway"])
        return self._publish(stats)

    def _failed(self, period: Period | None, exc: BaseException) -> ReconciliationStats:
        self._runs["error"] += 1
        log.warning("reconciliation not run: %s", exc)
        return self._publish(ReconciliationStats(
            wall_ts=self._clock.wall(), ok=False, period_start_ts=period.start_ts if period else math.nan,
            period_end_ts=period.end_ts if period else math.nan, runs_total=dict(self._runs),
            last_ok_ts=self._last_ok, error=f"{type(exc).__name__}: {exc}"[:300]))

    def _publish(self, stats: ReconciliationStats) -> ReconciliationStats:
        self.last = stats
        if self._bus is not None:
            self._bus.publish(stats)
        return stats

    # ------------------------------------------------------------------ the loop

    @property
    def running(self) -> bool:
        """True while the loop task runs."""
        return self._task.running

    def start(self) -> asyncio.Task:
        """Run :meth:`tick` from a task of the running event loop (idempotent); a due run goes to
        a worker thread, so the loop keeps serving meanwhile."""
        return self._task.start()

    async def _wake(self) -> None:
        if self.due():
            await asyncio.to_thread(self.tick)

    async def stop(self) -> None:
        """Stop the loop, then wait for a run still in progress on its worker thread (so the
        ledger it reads can close after this returns)."""
        await self._task.stop()
        await asyncio.to_thread(self._wait_idle)

    def _wait_idle(self) -> None:
        with self._tick_lock:
            pass
