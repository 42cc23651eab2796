"""Ledger metrics from :class:`~kvmeter.stats.LedgerStats` (published by the ledger after every
writer round, on the writer's thread): spool depth and age of the oldest undrained record, usage
events ingested by status, ClickHouse insert retries, records refused as data, spool write errors
and whether ClickHouse answered last time.

``LedgerStats`` counts since the ledger was opened; the counters here take its increments (a total
below the last one means the ledger was reopened and is counted again from 0).
"""

from __future__ import annotations

from kvmeter.bus import StatsBus
from kvmeter.stats import LedgerStats

from ._series import CumulativeMirror
from .base import MetricSource, SourceContext

__all__ = ["LedgerMetrics"]


class LedgerMetrics(MetricSource):
    """Maps :class:`LedgerStats` to ``kvmeter_ledger_*`` metrics."""

    def __init__(self, ctx: SourceContext) -> None:
        super().__init__(ctx)
        m = self.metric
        self.ingested = m("kvmeter_ledger_events_ingested_total")
        self.depth = m("kvmeter_ledger_spool_depth_events")
        self.age = m("kvmeter_ledger_spool_oldest_age_seconds")
        self.retries = m("kvmeter_ledger_insert_retries_total")
        self.rejected = m("kvmeter_ledger_rejected_records_total")
        self.write_errors = m("kvmeter_ledger_spool_write_errors_total")
        self.up = m("kvmeter_ledger_clickhouse_up")
        self._cumulative = CumulativeMirror()

    def attach(self, bus: StatsBus):
        return [bus.subscribe(LedgerStats, self.on_stats)]

    def on_stats(self, s: LedgerStats) -> None:
        self.depth.set(s.spool_depth_events)
        self.age.set(s.spool_oldest_age_seconds)
        self.up.set(1 if s.clickhouse_up else 0)
        for status, total in s.events_ingested_total.items():
            self._cumulative.update(self.ingested, (status,), total)
        self._cumulative.update(self.retries, (), s.insert_retries_total)
        self._cumulative.update(self.rejected, (), s.rejected_records_total)
        self._cumulative.update(self.write_errors, (), s.spool_write_errors_total)
