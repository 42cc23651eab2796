"""Prometheus exporter: kvmeter's stats as prometheus-client metrics, a ``/metrics`` ASGI app,
multiprocess support for several gateway workers, and alert rules (``rules/*.yml``).

Wiring in the serve process::

    from kvmeter.exporters.prometheus import install_prometheus, metrics_asgi_app
    exporter = install_prometheus(bus)                  # global REGISTRY; tests pass their own
    app.mount("/metrics", metrics_asgi_app())           # or Mount("/metrics", app=...)

Metric names and labels: :mod:`.names` (``METRICS``). Tenant labels are bounded to the top-K
tenants by active work plus ``other`` (:mod:`.tenants`, K from ``KVMETER_PROM_TOP_K_TENANTS``).
"""

from .app import mark_worker_dead, metrics_asgi_app, multiprocess_registry, prepare_multiprocess_dir
from .base import MetricSource, SourceContext, make_metric
from .config import PrometheusConfig
from .install import PrometheusExporter, default_sources, install_prometheus
from .names import METRICS, Metric, emitted_names, metric, reserved_names
from .rules import rule_files
from .tenants import OTHER, TenantLabels

__all__ = [
    "install_prometheus",
    "PrometheusExporter",
    "PrometheusConfig",
    "metrics_asgi_app",
    "multiprocess_registry",
    "prepare_multiprocess_dir",
    "mark_worker_dead",
    "MetricSource",
    "SourceContext",
    "make_metric",
    "default_sources",
    "TenantLabels",
    "OTHER",
    "METRICS",
    "Metric",
    "metric",
    "emitted_names",
    "reserved_names",
    "rule_files",
]
