"""Self-checks: numbers that check themselves.

* :mod:`.bounds` — the physical bounds a request's numbers must respect (the TTFT floor from the
  prefill's FLOPs, the output roofline), from the model's parameter count and the device's peak;
* :mod:`.monitor` — :class:`~.monitor.SelfCheckMonitor`, run continuously by ``kvmeter serve``:
  every finished request, engine record and reservation is checked as it is published, and each
  violation is published as a :class:`~kvmeter.stats.SelfCheckViolation` (the exporter turns it
  into ``kvmeter_selfcheck_*`` counters the alert rules ``rules/selfcheck.yml`` read);
* :mod:`.checks` — the table of checks ``kvmeter check`` evaluates on a running serve's
  ``/metrics`` page, one line each, and :mod:`.cli` (``kvmeter check``).
"""
