"""Reconciliation signals from :class:`~kvmeter.stats.ReconciliationStats`, published after
every periodic three-way reconciliation that ``kvmeter serve`` runs
(:class:`~kvmeter.ledger.reconciler.Reconciler`): the unexplained drift of each view against the
ledger, when the last successful run finished, and how many runs succeeded or failed.

A failed run (the ledger could not be read) leaves the drift and last-run gauges as they were —
the ``KvmeterReconciliationStale`` alert notices the last-run time ageing — and counts one
``result="error"`` run. Before the first successful run the last-run gauge reads 0 (the epoch), so
a serve whose runs never succeed is stale too (10 minutes after start, the rule's ``for``; the
first run comes ``reconciliation.first_run_delay_s`` after start, one minute by default).
"""

from __future__ import annotations

from kvmeter.bus import StatsBus
from kvmeter.stats import RUN_RESULTS, ReconciliationStats

from ._series import CumulativeMirror
from .base import MetricSource, SourceContext

__all__ = ["ReconciliationMetrics"]


class ReconciliationMetrics(MetricSource):
    """Maps :class:`ReconciliationStats` to ``kvmeter_reconciliation_*`` metrics."""

    def __init__(self, ctx: SourceContext) -> None:
        super().__init__(ctx)
        m = self.metric
        self.drift = m("kvmeter_reconciliation_drift_ratio")
        self.last_run = m("kvmeter_reconciliation_last_run_timestamp_seconds")
        self.runs = m("kvmeter_reconciliation_runs_total")
        for result in RUN_RESULTS:  # both series exist from the start (0 until a run ends so)
            self.runs.labels(result)
        self._cumulative = CumulativeMirror()

    def attach(self, bus: StatsBus):
        return [bus.subscribe(ReconciliationStats, self.on_stats)]

    def on_stats(self, s: ReconciliationStats) -> None:
        if s.ok:
            for view, ratio in s.drift_ratio.items():
                self.drift.labels(view).set(ratio)
            self.last_run.set(s.wall_ts)
        for result, total in s.runs_total.items():
            self._cumulative.update(self.runs, (result,), total)
