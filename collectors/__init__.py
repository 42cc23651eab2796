"""Collectors: turn what kvmeter observes into plain stats objects on the bus.

* :mod:`kvmeter.collectors.gpu` — NVML (per GPU and MIG instance), XID events, DCGM expositions;
  a capture-backed pynvml stand-in for machines without a GPU.
* :mod:`kvmeter.collectors.remote_vllm` — scrape and parse a vLLM server's ``/metrics`` (the
  remote engine owns one scraper for its upstream).
* :mod:`kvmeter.collectors.gpu_cli` — the ``kvmeter gpu`` command.
* :mod:`kvmeter.collectors.vllm_hooks` — the hosted vLLM engine's hooks: its stat logger, and a
  scheduler subclass in its engine core that accounts for the requests vLLM frees early.

Collectors compute and publish the types of :mod:`kvmeter.stats`; they never import an exporter.
"""
