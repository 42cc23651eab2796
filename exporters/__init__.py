"""Exporters: consume plain stats objects from the bus and export them.

* :mod:`kvmeter.exporters.prometheus` — prometheus-client metrics, ``/metrics`` ASGI app,
  multiprocess mode, alert rules.
* :mod:`kvmeter.exporters.otel` — OTLP export in the OpenTelemetry GenAI semantic conventions.
"""
