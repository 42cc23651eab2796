"""Admission metrics from :class:`~kvmeter.stats.AdmissionDecision`: admitted, and rejected or shed
by reason, the principal level that bound and the limit dimension, by tier and bounded tenant."""

from __future__ import annotations

from kvmeter.bus import StatsBus
from kvmeter.stats import AdmissionDecision

from .base import MetricSource, SourceContext

__all__ = ["AdmissionMetrics"]


class AdmissionMetrics(MetricSource):
    """Maps :class:`AdmissionDecision` to admitted / rejected counters."""

    def __init__(self, ctx: SourceContext) -> None:
        super().__init__(ctx)
        self.admitted = self.metric("kvmeter_admission_admitted_requests_total")
        self.rejected = self.metric("kvmeter_admission_rejected_requests_total")

    def attach(self, bus: StatsBus):
        return [bus.subscribe(AdmissionDecision, self.on_decision)]

    def on_decision(self, d: AdmissionDecision) -> None:
        tenant = d.attribution.tenant_id
        tier = d.attribution.tier or "unknown"
        if d.admitted:
            self.tenant_child(self.admitted, 1, (tier, tenant)).inc()
        else:
            self.tenant_child(self.rejected, 1, (tier, tenant, d.reason or "unknown",
                                                 d.level, d.dimension)).inc()
