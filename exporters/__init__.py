"""Exporters: consume plain stats objects from the bus and export them.

* :mod:`kvmeter.exporters.prometheus` — prometheus-client metrics, ``/metrics`` ASGI app,
  multiprocess mode, alert rules.
* :mod:`kvmeter.exporters.otel` — OTLP export in the OpenTelemetry GenAI semantic conventions.
* :mod:`kvmeter.exporters.signals` — the signal history: the current value of every series,
  sampled at an interval into the ledger's ClickHouse ``signals`` table (full per-tenant
  detail) for the dashboards' history; its series names come from
  :mod:`kvmeter.exporters.prometheus.names`.

"Signal" means one thing in kvmeter: a series of that history (a row of the ``signals`` table).
"""
