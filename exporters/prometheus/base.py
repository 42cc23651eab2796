"""What every metric source of the Prometheus exporter shares.

A *source* is one small module that turns one producer's plain stats into metrics: it creates its
metrics from the :mod:`.names` table and subscribes to the bus (see :mod:`.ledger` for a short
one)::

    class LedgerMetrics(MetricSource):
        def __init__(self, ctx: SourceContext) -> None:
            super().__init__(ctx)
            self.depth = self.metric("kvmeter_ledger_spool_depth_events")
        def attach(self, bus):
            return [bus.subscribe(LedgerStats, self.on_stats)]
        def on_stats(self, s):
            self.depth.set(s.spool_depth_events)

and is listed in :func:`kvmeter.exporters.prometheus.install.default_sources` (or passed to
``install_prometheus(extra_sources=...)``). The module never computes anything the producer should
have: it maps fields to metrics (summing tenants folded into ``other`` is labelling, not
computing). Tenant-labelled series go through :meth:`MetricSource.tenant_child`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvmeter.bus import StatsBus
from kvmeter.clock import Clock

from .config import PrometheusConfig
from .names import Metric, metric
from .tenants import TenantLabels

__all__ = ["SourceContext", "MetricSource", "make_metric"]


def make_metric(m: Metric, registry: CollectorRegistry | None) -> Any:
    """Create the prometheus-client metric for ``m`` in ``registry``.

    Raises:
        ValueError: from prometheus-client on an invalid or already registered name.
    """
    if m.kind == "counter":
        return Counter(m.name.removesuffix("_total"), m.help, m.labels, registry=registry)
    if m.kind == "gauge":
        return Gauge(m.name, m.help, m.labels, registry=registry, multiprocess_mode=m.multiprocess_mode)
    if m.kind == "histogram":
        return Histogram(m.name, m.help, m.labels, registry=registry, buckets=m.buckets)
    raise ValueError(f"unknown metric kind {m.kind!r} for {m.name}")


@dataclass(slots=True)
class SourceContext:
    """What a source needs: where to register, how to label tenants, settings, clock."""

    registry: CollectorRegistry | None
    tenants: TenantLabels
    config: PrometheusConfig
    clock: Clock


class MetricSource:
    """Base class of a metric source (see the module docstring)."""

    def __init__(self, ctx: SourceContext) -> None:
        self.ctx = ctx

    def metric(self, name: str) -> Any:
        """Create the declared metric ``name`` (see :mod:`.names`) in the context's registry."""
        return make_metric(metric(name), self.ctx.registry)

    def tenant_child(self, metric: Any, tenant_index: int, values: tuple[str, ...]) -> Any:
        """The metric's child with the tenant label bounded to top-K + ``other``."""
        return self.ctx.tenants.child(metric, tenant_index, values)

    def attach(self, bus: StatsBus) -> list[Callable[[], None]]:
        """Subscribe to the bus; return the unsubscribe functions."""
        raise NotImplementedError
