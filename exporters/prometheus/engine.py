"""Engine metrics: KV watermark and blocks, batch, queue, preemptions, prefix cache, engine-side
TTFT/ITL (from :class:`~kvmeter.stats.EngineStepStats`) and per-request phases and engine-true
tokens, aborted requests included (from :class:`~kvmeter.stats.EngineRequestStats`; the phase
histograms only where the engine measured the phases, not for an abort's scheduler account), and
per tenant (bounded label) the engine's scheduled prefill and decode tokens and KV token-seconds
(from :class:`~kvmeter.stats.EngineStepShares`)."""

from __future__ import annotations

from kvmeter.bus import StatsBus
from kvmeter.stats import EngineRequestStats, EngineStepShares, EngineStepStats

from .base import MetricSource, SourceContext

__all__ = ["EngineMetrics"]


class EngineMetrics(MetricSource):
    """Maps the locally hosted engine's stats (label ``engine`` = its index, ``model`` = config)."""

    def __init__(self, ctx: SourceContext) -> None:
        super().__init__(ctx)
        m = self.metric
        self.kv_watermark = m("kvmeter_engine_kv_watermark_ratio")
        self.kv_used = m("kvmeter_engine_kv_used_blocks")
        self.kv_capacity = m("kvmeter_engine_kv_capacity_blocks")
        self.kv_block_size = m("kvmeter_engine_kv_block_size_tokens")
        self.running = m("kvmeter_engine_running_requests")
        self.waiting = m("kvmeter_engine_waiting_requests")
        self.preemptions = m("kvmeter_engine_preemptions_total")
        self.prefix_queries = m("kvmeter_engine_prefix_cache_queries_tokens_total")
        self.prefix_hits = m("kvmeter_engine_prefix_cache_hits_tokens_total")
        self.input_tokens = m("kvmeter_engine_input_tokens_total")
        self.output_tokens = m("kvmeter_engine_output_tokens_total")
        self.batch_size = m("kvmeter_engine_step_batch_size_requests")
        self.step_tokens = m("kvmeter_engine_step_scheduled_tokens")
        self.ttft = m("kvmeter_engine_ttft_seconds")
        self.itl = m("kvmeter_engine_itl_seconds")
        self.req_queue = m("kvmeter_engine_request_queue_seconds")
        self.req_prefill = m("kvmeter_engine_request_prefill_seconds")
        self.req_decode = m("kvmeter_engine_request_decode_seconds")
        self.req_e2e = m("kvmeter_engine_request_e2e_seconds")
        self.req_tokens = m("kvmeter_engine_request_tokens_total")
        self.tenant_prefill = m("kvmeter_engine_tenant_scheduled_prefill_tokens_total")
        self.tenant_decode = m("kvmeter_engine_tenant_scheduled_decode_tokens_total")
        self.tenant_kv_seconds = m("kvmeter_engine_tenant_kv_token_seconds_total")

    def attach(self, bus: StatsBus):
        return [bus.subscribe(EngineStepStats, self.on_step),
                bus.subscribe(EngineRequestStats, self.on_request),
                bus.subscribe(EngineStepShares, self.on_shares)]

    def on_step(self, s: EngineStepStats) -> None:
        labels = (str(s.engine_idx), self.ctx.config.model)
        self.kv_watermark.labels(*labels).set(s.kv_watermark_ratio)
        if s.kv_blocks_total > 0:  # 0 means unknown
            self.kv_capacity.labels(*labels).set(s.kv_blocks_total)
            self.kv_used.labels(*labels).set(s.kv_blocks_used)
        if s.kv_block_size_tokens > 0:
            self.kv_block_size.labels(*labels).set(s.kv_block_size_tokens)
        self.running.labels(*labels).set(s.num_running)
        self.waiting.labels(*labels).set(s.num_waiting)
        for counter, delta in ((self.preemptions, s.num_preempted),
                               (self.prefix_queries, s.prefix_cache_queries_tokens),
                               (self.prefix_hits, s.prefix_cache_hits_tokens),
                               (self.input_tokens, s.input_tokens),
                               (self.output_tokens, s.output_tokens)):
            if delta > 0:
                counter.labels(*labels).inc(delta)
        if s.batch_size > 0:
            self.batch_size.labels(*labels).observe(s.batch_size)
        if s.scheduled_tokens > 0:
            self.step_tokens.labels(*labels).observe(s.scheduled_tokens)
        if s.ttfts_s:
            ttft = self.ttft.labels(*labels)
            for value in s.ttfts_s:
                ttft.observe(value)
        if s.itls_s:
            itl = self.itl.labels(*labels)
            for value in s.itls_s:
                itl.observe(value)

    def on_request(self, r: EngineRequestStats) -> None:
        reason = r.finish_reason or "unknown"
        if r.phase_times_measured:  # an abort's account from the scheduler hook has no phase times
            self.req_queue.labels(reason).observe(r.queued_s)
            self.req_prefill.labels(reason).observe(r.prefill_s)
            self.req_decode.labels(reason).observe(r.decode_s)
            self.req_e2e.labels(reason).observe(r.e2e_s)
        for kind, count in (("input", r.tokens.input_tokens), ("cached_input", r.tokens.cached_input_tokens),
                            ("output", r.tokens.output_tokens)):
            if count > 0:
                self.req_tokens.labels(kind, reason).inc(count)

    def on_shares(self, s: EngineStepShares) -> None:
        """Per-tenant counters; KV token-seconds = kv_tokens × duration_s of the step."""
        engine, model = str(s.engine_idx), self.ctx.config.model
        tenants = self.ctx.tenants
        for share in s.tenants:
            tenants.observe(share.tenant_id, share.prefill_tokens + share.decode_tokens)
            values = (engine, model, share.tier or "unknown", share.tenant_id)
            for counter, delta in ((self.tenant_prefill, share.prefill_tokens),
                                   (self.tenant_decode, share.decode_tokens),
                                   (self.tenant_kv_seconds, share.kv_tokens * s.duration_s)):
                if delta > 0:
                    self.tenant_child(counter, 3, values).inc(delta)
