"""Streamed-answer metrics from the gateway's :class:`~kvmeter.stats.StreamSendStats`, per tier and
tenant (bounded): streams cut for a stalled reader, send back-pressure (seconds blocked, bytes that
waited, KV token-seconds held meanwhile) and stream duration. Each quantity is defined in
:mod:`kvmeter.serving.gateway.stall`.
"""

from __future__ import annotations

from kvmeter.bus import StatsBus
from kvmeter.stats import StreamSendStats

from .base import MetricSource, SourceContext

__all__ = ["StreamMetrics"]


class StreamMetrics(MetricSource):
    """Maps :class:`StreamSendStats` to the ``kvmeter_stream_*`` metrics."""

    def __init__(self, ctx: SourceContext) -> None:
        super().__init__(ctx)
        m = self.metric
        self.cuts = m("kvmeter_stream_stall_cut_requests_total")
        self.blocked_s = m("kvmeter_stream_send_blocked_seconds_total")
        self.blocked_bytes = m("kvmeter_stream_send_blocked_bytes_total")
        self.blocked_kv = m("kvmeter_stream_blocked_kv_token_seconds_total")
        self.duration = m("kvmeter_stream_duration_seconds")

    def attach(self, bus: StatsBus):
        return [bus.subscribe(StreamSendStats, self.on_stream)]

    def on_stream(self, s: StreamSendStats) -> None:
        tier, tenant = s.attribution.tier or "unknown", s.attribution.tenant_id
        labels = (tier, tenant)
        if s.stall_cut:
            self.tenant_child(self.cuts, 1, labels).inc()
        if s.send_blocked_s > 0:
            self.tenant_child(self.blocked_s, 1, labels).inc(s.send_blocked_s)
        if s.blocked_bytes > 0:
            self.tenant_child(self.blocked_bytes, 1, labels).inc(s.blocked_bytes)
        if s.blocked_kv_token_s > 0:
            self.tenant_child(self.blocked_kv, 1, labels).inc(s.blocked_kv_token_s)
        self.tenant_child(self.duration, 1, labels).observe(s.duration_s)
