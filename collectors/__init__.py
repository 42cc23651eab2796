"""Collectors: turn what kvmeter observes into plain stats objects on the bus.

* :mod:`kvmeter.collectors.gpu` — NVML (per GPU and MIG instance), XID events, DCGM expositions;
  a capture-backed pynvml stand-in for machines without a GPU.
* :mod:`kvmeter.collectors.remote_vllm` — scrape and parse a vLLM server's ``/metrics``.
* :mod:`kvmeter.collectors.signals` — sample the current signal set (full per-tenant detail) into
  the ledger's ``signals`` table at an interval, for dashboard history.
* :mod:`kvmeter.collectors.gpu_cli` — the ``kvmeter gpu`` command.
* :mod:`kvmeter.collectors.vllm_hooks` — the vLLM stat-logger hook of the hosted engine.

Collectors compute and publish; they never import an exporter.
"""
