"""Wire the Prometheus exporter to a stats bus: ``install_prometheus(bus, registry)``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from prometheus_client import REGISTRY, CollectorRegistry

from kvmeter.bus import StatsBus
from kvmeter.clock import SYSTEM_CLOCK, Clock

from .admission import AdmissionMetrics
from .agents import AgentMetrics
from .base import MetricSource, SourceContext
from .config import PrometheusConfig
from .engine import EngineMetrics
from .gpu import GpuMetrics
from .ledger import LedgerMetrics
from .pool import PoolMetrics
from .quota import QuotaMetrics
from .reconciliation import ReconciliationMetrics
from .refusals import RefusalMetrics
from .remote import RemoteEngineMetrics
from .requests import RequestMetrics
from .scheduler import SchedulerMetrics
from .selfcheck import SelfCheckMetrics
from .streams import StreamMetrics
from .tenants import TenantLabels

__all__ = ["PrometheusExporter", "install_prometheus", "default_sources"]

SourceFactory = Callable[[SourceContext], MetricSource]


def default_sources(ctx: SourceContext) -> list[MetricSource]:
    """Every source: engine (local + scraped), requests, admission, refusals before admission,
    GPU, scheduler, engine pool (router decisions, replica health), quota (with retries and tenancy
    reloads), agent runs, ledger, reconciliation, self-checks."""
    engine = EngineMetrics(ctx)
    return [engine, RemoteEngineMetrics(ctx, engine), RequestMetrics(ctx), StreamMetrics(ctx), AdmissionMetrics(ctx),
            RefusalMetrics(ctx), GpuMetrics(ctx), SchedulerMetrics(ctx), PoolMetrics(ctx), QuotaMetrics(ctx),
            AgentMetrics(ctx), LedgerMetrics(ctx), ReconciliationMetrics(ctx), SelfCheckMetrics(ctx)]


@dataclass
class PrometheusExporter:
    """The installed exporter: its registry, tenant labeler and sources."""

    registry: CollectorRegistry | None
    config: PrometheusConfig
    tenants: TenantLabels
    sources: list[MetricSource]
    _unsubscribe: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        """Unsubscribe from the bus (metrics stay registered)."""
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe.clear()


def install_prometheus(bus: StatsBus, registry: CollectorRegistry | None = REGISTRY, *,
                       config: PrometheusConfig | None = None, clock: Clock = SYSTEM_CLOCK,
                       extra_sources: Sequence[SourceFactory] = ()) -> PrometheusExporter:
    """Create kvmeter's metrics in ``registry`` and subscribe them to ``bus``.

    Call once per process (each gateway worker in multiprocess mode). The serve app then mounts
    :func:`~kvmeter.exporters.prometheus.app.metrics_asgi_app` at ``/metrics``.

    Args:
        bus: where the engine, gateway, scheduler and collectors publish stats.
        registry: where metrics are registered (default the global ``REGISTRY``; tests pass a
            fresh ``CollectorRegistry()``).
        config: labels and bounds (default: ``PrometheusConfig.from_env()``).
        clock: for the tenant top-K decay and refresh.
        extra_sources: factories of more sources (a producer outside kvmeter's own).
    Raises:
        ValueError: if the metrics are already registered in ``registry``.
    """
    config = config or PrometheusConfig.from_env()
    tenants = TenantLabels(config.top_k_tenants, clock=clock, half_life_s=config.tenant_half_life_s,
                           refresh_s=config.tenant_refresh_s, hysteresis=config.tenant_hysteresis)
    ctx = SourceContext(registry=registry, tenants=tenants, config=config, clock=clock)
    sources = default_sources(ctx) + [factory(ctx) for factory in extra_sources]
    exporter = PrometheusExporter(registry, config, tenants, sources)
    for source in sources:
        exporter._unsubscribe.extend(source.attach(bus))
    return exporter
