"""Metrics of vLLM servers kvmeter scrapes but does not host, from
:class:`~kvmeter.stats.RemoteEngineStats`.

They land in the same ``kvmeter_engine_*`` families as the local engine (so the KV-watermark and
preemption alerts cover both), with ``engine`` = ``<url>#<engine index>`` and ``model`` = the
server's ``model_name``. Counters advance by the scraper's reset-aware deltas. Latency histograms
cannot be re-observed from bucket counts, so their window quantiles are exported as gauges
(``kvmeter_engine_latency_window_seconds{metric, quantile}``); NaN means no observation in the
window.
"""

from __future__ import annotations

import math

from kvmeter.bus import StatsBus
from kvmeter.stats import RemoteEngineStats

from ._series import set_or_clear
from .base import MetricSource, SourceContext

__all__ = ["RemoteEngineMetrics"]

_LATENCIES = ("ttft", "itl", "e2e", "queue", "prefill", "decode")


class RemoteEngineMetrics(MetricSource):
    """Maps :class:`RemoteEngineStats`; shares the engine metric families with
    :class:`.engine.EngineMetrics` (pass that source's metrics in, so each family is created once)."""

    def __init__(self, ctx: SourceContext, engine_metrics) -> None:
        super().__init__(ctx)
        e = engine_metrics
        self.kv_watermark, self.kv_used, self.kv_capacity = e.kv_watermark, e.kv_used, e.kv_capacity
        self.kv_block_size, self.running, self.waiting = e.kv_block_size, e.running, e.waiting
        self.counters = {key: getattr(e, attr) for key, attr in (
            ("preemptions", "preemptions"), ("prefix_cache_queries_tokens", "prefix_queries"),
            ("prefix_cache_hits_tokens", "prefix_hits"), ("input_tokens", "input_tokens"),
            ("output_tokens", "output_tokens"))}
        self.window = self.metric("kvmeter_engine_latency_window_seconds")
        self.anomalies = self.metric("kvmeter_engine_scrape_anomalies_total")

    def attach(self, bus: StatsBus):
        return [bus.subscribe(RemoteEngineStats, self.on_stats)]

    def on_stats(self, st: RemoteEngineStats) -> None:
        labels = (st.engine_id, st.model_name)
        set_or_clear(self.kv_watermark, labels, st.kv_cache_usage_ratio)
        set_or_clear(self.kv_capacity, labels, st.kv_blocks_total)
        used = (None if st.kv_cache_usage_ratio is None or st.kv_blocks_total is None
                else round(st.kv_cache_usage_ratio * st.kv_blocks_total))
        set_or_clear(self.kv_used, labels, used)
        set_or_clear(self.kv_block_size, labels, st.kv_block_size_tokens)
        set_or_clear(self.running, labels, st.num_running)
        set_or_clear(self.waiting, labels, st.num_waiting)
        for key, counter in self.counters.items():
            delta = st.deltas.get(key)
            if delta is not None and delta > 0:
                counter.labels(*labels).inc(delta)
        for metric in _LATENCIES:
            for q, value in st.quantiles.get(metric, {}).items():
                self.window.labels(*labels, metric, str(q)).set(math.nan if value is None else value)
        for anomaly in st.anomalies:
            self.anomalies.labels(*labels, anomaly.kind).inc()
