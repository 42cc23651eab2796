"""Request metrics from the gateway's :class:`~kvmeter.stats.RequestCompletion`: TTFT / ITL / E2E /
queue histograms by tier, requests and tokens by tier, tenant (bounded), type and outcome,
throughput and goodput tokens by tier.

Definitions:

* token types: ``input``, ``cached_input`` (the part of the input served from the prefix
  cache — *part of* ``input``, never add the two), ``output`` (completion);
* throughput counts the tokens of every request that ended, whatever the outcome;
* goodput counts the tokens of requests that finished ``ok`` *and* met their tier's SLO
  (``slo_met`` true, or no SLO set for the tier: ``slo_met`` None);
* re-prefilled input tokens (``kvmeter_prompt_reprefill_tokens_total``, by tenant and model): the
  prompt-cache thrash the gateway measured (:mod:`kvmeter.serving.gateway.reprefill`).
"""

from __future__ import annotations

from kvmeter.bus import StatsBus
from kvmeter.stats import RequestCompletion

from .base import MetricSource, SourceContext

__all__ = ["RequestMetrics", "OUTCOMES"]

OUTCOMES = ("ok", "aborted", "error")


class RequestMetrics(MetricSource):
    """Maps :class:`RequestCompletion` to request, token, latency and goodput metrics."""

    def __init__(self, ctx: SourceContext) -> None:
        super().__init__(ctx)
        m = self.metric
        self.requests = m("kvmeter_requests_total")
        self.tokens = m("kvmeter_tokens_total")
        self.ttft = m("kvmeter_request_ttft_seconds")
        self.itl = m("kvmeter_request_itl_seconds")
        self.e2e = m("kvmeter_request_e2e_seconds")
        self.queue = m("kvmeter_request_queue_seconds")
        self.throughput = m("kvmeter_throughput_tokens_total")
        self.goodput = m("kvmeter_goodput_tokens_total")
        self.slo = m("kvmeter_slo_requests_total")
        self.reprefill = m("kvmeter_prompt_reprefill_tokens_total")

    def attach(self, bus: StatsBus):
        return [bus.subscribe(RequestCompletion, self.on_completion)]

    def on_completion(self, c: RequestCompletion) -> None:
        tenant, tokens = c.attribution.tenant_id, c.tokens
        tier = c.attribution.tier or "unknown"
        outcome = c.outcome if c.outcome in OUTCOMES else "error"
        self.ctx.tenants.observe(tenant, tokens.total_tokens)
        self.tenant_child(self.requests, 1, (tier, tenant, outcome)).inc()
        for kind, count in (("input", tokens.input_tokens), ("cached_input", tokens.cached_input_tokens),
                            ("output", tokens.output_tokens)):
            if count > 0:
                self.tenant_child(self.tokens, 1, (tier, tenant, kind, outcome)).inc(count)
        if c.ttft_s is not None:
            self.ttft.labels(tier).observe(c.ttft_s)
        if c.itls_s:
            itl = self.itl.labels(tier)
            for gap in c.itls_s:
                itl.observe(gap)
        self.e2e.labels(tier, outcome).observe(c.e2e_s)
        self.queue.labels(tier).observe(c.queue_s)
        good = outcome == "ok" and c.slo_met is not False
        for kind, count in (("input", tokens.input_tokens), ("output", tokens.output_tokens)):
            if count > 0:
                self.throughput.labels(tier, kind).inc(count)
                if good:
                    self.goodput.labels(tier, kind).inc(count)
        result = "unset" if c.slo_met is None else ("met" if c.slo_met else "missed")
        self.slo.labels(tier, result).inc()
        if c.reprefill_input_tokens > 0:
            model = c.attribution.model or "unknown"
            self.tenant_child(self.reprefill, 0, (tenant, model)).inc(c.reprefill_input_tokens)
