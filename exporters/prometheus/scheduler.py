"""Fair-scheduler metrics from :class:`~kvmeter.stats.SchedulerStats` (published by
``FairScheduler`` about once a second): per-tenant queue depth (requests, prompt tokens) and
oldest wait, per-tenant active KV tokens, per-tenant service, Jain's index, the service gap,
dropped requests by reason, the overload level and failed syncs of the shared VTC counters.

Bounded tenants. A snapshot lists every tenant the scheduler has seen; the ``tenant`` label keeps
the top-K (:mod:`.tenants`) and folds the rest into ``other``:

* each tenant's *active work* — active KV tokens plus queued prompt tokens — is handed to
  :meth:`TenantLabels.set_active`, so a tenant that holds the KV cache, or floods its queue while
  its KV budget holds it back, earns a label of its own;
* gauges are **aggregated per label value** before being set: ``other`` carries the sum of its
  tenants' queue depth, queued tokens and active KV, and the maximum of their oldest waits (so
  ``sum by (tier)`` over the series equals the scheduler's totals);
* service is a counter: each tenant's running total is turned into increments (a total that goes
  down means the scheduler restarted: the new total is counted from 0), added to its label.

Scheduler refusals at admission are not exported here: the gateway publishes them as
:class:`~kvmeter.stats.AdmissionDecision` (``kvmeter_admission_rejected_requests_total`` with
``level="global", dimension="scheduler"``); exporting ``SchedulerStats.rejected_total`` too would
count them twice. Goodput by tier is the gateway's ``kvmeter_goodput_tokens_total`` (the same SLO
check, per request), not repeated from ``TierSchedulerStats``.
"""

from __future__ import annotations

import os

from kvmeter.bus import StatsBus
from kvmeter.stats import SchedulerStats

from ._series import CumulativeMirror
from .base import MetricSource, SourceContext

__all__ = ["SchedulerMetrics"]


class SchedulerMetrics(MetricSource):
    """Maps :class:`SchedulerStats` to ``kvmeter_scheduler_*`` and ``kvmeter_tenant_active_kv_tokens``."""

    def __init__(self, ctx: SourceContext) -> None:
        super().__init__(ctx)
        m = self.metric
        self.depth = m("kvmeter_scheduler_queue_depth_requests")
        self.depth_tokens = m("kvmeter_scheduler_queue_depth_tokens")
        self.oldest = m("kvmeter_scheduler_queue_oldest_wait_seconds")
        self.active_kv = m("kvmeter_tenant_active_kv_tokens")
        self.service = m("kvmeter_scheduler_service_tokens_total")
        self.jain = m("kvmeter_scheduler_jain_index_ratio")
        self.gap = m("kvmeter_scheduler_max_service_gap_tokens")
        self.dropped = m("kvmeter_scheduler_dropped_requests_total")
        self.pressure = m("kvmeter_scheduler_pressure_level")
        self.shared_failures = m("kvmeter_scheduler_shared_service_sync_errors_total")
        self._gauges = (self.depth, self.depth_tokens, self.oldest, self.active_kv)
        self._service_last: dict[str, float] = {}
        self._working: set[str] = set()  # tenants with active work in the last snapshot
        self._groups: set[tuple[str, str]] = set()  # (tier, label) gauge series set last time
        self._cumulative = CumulativeMirror()
        self._multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))

    def attach(self, bus: StatsBus):
        return [bus.subscribe(SchedulerStats, self.on_stats)]

    def on_stats(self, s: SchedulerStats) -> None:
        labels = self.ctx.tenants
        with labels.lock:
            working = set()
            for t in s.tenants:
                work = t.active_kv_tokens + t.queued_input_tokens
                if work > 0:
                    labels.set_active(t.tenant_id, work)
                    working.add(t.tenant_id)
            for tenant in self._working - working:
                labels.set_active(tenant, 0)
            self._working = working
            labels.refresh_if_due()  # one top-K set for the whole snapshot
            # (tier, label) → [depth, queued tokens, oldest wait, active KV, a tenant of the group]
            groups: dict[tuple[str, str], list] = {}
            for t in s.tenants:
                key = (t.tier, labels.label(t.tenant_id))
                g = groups.get(key)
                if g is None:
                    groups[key] = [t.queue_depth, t.queued_input_tokens, t.queue_wait_oldest_s,
                                   t.active_kv_tokens, t.tenant_id]
                else:
                    g[0] += t.queue_depth
                    g[1] += t.queued_input_tokens
                    g[2] = max(g[2], t.queue_wait_oldest_s)
                    g[3] += t.active_kv_tokens
                self._count_service(t.tier, t.tenant_id, t.service_total)
            for (tier, _), (depth, tokens, oldest, kv, tenant) in groups.items():
                for metric, value in zip(self._gauges, (depth, tokens, oldest, kv), strict=True):
                    # child() maps the group's tenant to its label and records a labelled
                    # tenant's series so that a demotion prunes it
                    labels.child(metric, 1, (tier, tenant)).set(value)
            for key in self._groups - groups.keys():
                self._retire(key)
            self._groups = set(groups)
        self.jain.set(s.jain_index)
        self.gap.set(s.service_gap)
        self.pressure.set(s.pressure_level)
        for reason, total in s.dropped_total.items():
            self._cumulative.update(self.dropped, (reason,), total)
        if s.shared_service_failures_total is not None:
            self._cumulative.update(self.shared_failures, (), s.shared_service_failures_total)

    def _count_service(self, tier: str, tenant: str, total: float) -> None:
        last = self._service_last.get(tenant)
        delta = total if last is None or total < last else total - last
        self._service_last[tenant] = total
        if delta > 0:
            self.ctx.tenants.child(self.service, 1, (tier, tenant)).inc(delta)

    def _retire(self, key: tuple[str, str]) -> None:
        """A (tier, label) group no snapshot tenant maps to any more (a demoted tenant, an empty
        ``other``): its gauges go. In multiprocess mode a series cannot be removed, so it is set
        to 0 — a demoted tenant's last value must not stay beside ``other``, which now holds it."""
        for metric in self._gauges:
            if self._multiprocess:
                metric.labels(*key).set(0)
                continue
            try:
                metric.remove(*key)
            except KeyError:  # already pruned with a demoted tenant
                pass
