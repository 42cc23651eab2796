"""Self-check signals: :class:`~kvmeter.stats.SelfCheckViolation` (published by ``kvmeter
serve``'s :class:`~kvmeter.serving.selfcheck.monitor.SelfCheckMonitor`) counted per check, and the
successful streams (:class:`~kvmeter.stats.RequestCompletion`) that each owe one TTFT sample.

Every violation counter is created at 0 for each of its label values, so ``increase()`` in the
rules (``rules/selfcheck.yml``) sees the first violation.
"""

from __future__ import annotations

from kvmeter.bus import StatsBus
from kvmeter.stats import RequestCompletion, SelfCheckViolation

from .base import MetricSource, SourceContext

__all__ = ["SelfCheckMetrics", "VIOLATION_METRICS"]

#: check → (metric, the label values it is created with)
VIOLATION_METRICS: dict[str, tuple[str, tuple[tuple[str, ...], ...]]] = {
    "ttft_below_floor": ("kvmeter_selfcheck_ttft_below_floor_requests_total", ((),)),
    "output_above_roofline": ("kvmeter_selfcheck_output_above_roofline_requests_total", ((),)),
    "cached_over_input": ("kvmeter_selfcheck_cached_over_input_requests_total", (("gateway",), ("engine",))),
    "reservation_exceeded": ("kvmeter_selfcheck_reservation_exceeded_requests_total", (("input",), ("output",))),
}


class SelfCheckMetrics(MetricSource):
    """Maps self-check violations and successful streams to ``kvmeter_selfcheck_*`` counters."""

    def __init__(self, ctx: SourceContext) -> None:
        super().__init__(ctx)
        self.violations = {}
        for check, (name, label_sets) in VIOLATION_METRICS.items():
            counter = self.metric(name)
            for labels in label_sets:
                if labels:
                    counter.labels(*labels)
            self.violations[check] = counter
        self.streamed_ok = self.metric("kvmeter_selfcheck_streamed_ok_requests_total")

    def attach(self, bus: StatsBus):
        return [bus.subscribe(SelfCheckViolation, self.on_violation),
                bus.subscribe(RequestCompletion, self.on_completion)]

    def on_violation(self, v: SelfCheckViolation) -> None:
        counter = self.violations.get(v.check)
        if counter is None:
            return
        name, label_sets = VIOLATION_METRICS[v.check]
        if label_sets == ((),):
            counter.inc()
        elif (v.view,) in label_sets:
            counter.labels(v.view).inc()

    def on_completion(self, c: RequestCompletion) -> None:
        if c.stream and c.outcome == "ok" and c.tokens.output_tokens > 0:
            self.streamed_ok.labels(c.attribution.tier or "unknown").inc()
