"""Quota, idempotency and tenancy metrics: reservation vs actual drift, client retries and
idempotent replays, the shared quota store's degraded state, agent tool-call budget reports and
tenancy config reloads.

Inputs (plain dataclasses on the bus): :class:`~kvmeter.stats.ReservationDrift`,
:class:`~kvmeter.stats.IdempotencyAttempt`,
:class:`~kvmeter.stats.QuotaStoreState`,
:class:`~kvmeter.stats.ToolCallReported`,
:class:`~kvmeter.stats.ConfigReloaded`, and :class:`~kvmeter.stats.AdmissionDecision`
(for the tier of a retrying tenant, below).

Definitions:

* **reserved / drift** — for ``input_tokens`` and ``output_tokens`` drifts: ``reserved`` adds to
  ``kvmeter_quota_reserved_tokens_total{type}``; ``actual − reserved`` adds to the drift counter
  with ``direction="under"`` when positive (the request used more than was reserved) and
  ``"over"`` when negative. A reservation released unused (``outcome="released"``) is all "over".
  ``cost`` drifts (money, Decimal) are not exported: money lives in the ledger.
* **keyed logical request** — the first attempt (``first``, ``attempt`` 1) of a request with an
  ``Idempotency-Key``: the denominator of a tenant's retries per logical request (a request
  without a key is a new logical request every time, never a retry).
* **retry** — an attempt of a logical request already seen under the same idempotency key: any
  outcome but ``first``, or ``first`` with ``attempt > 1`` (the retry after an abandoned attempt,
  which runs again). **Idempotent replay** — a retry answered from the stored result (``joined``
  or ``replayed``: no engine work, never billed again).
* **tier of a retry** — :class:`IdempotencyAttempt` carries the tenant but not the tier, so the
  tier is that of the tenant's latest :class:`AdmissionDecision` seen by this process (the first
  attempt of the key was admitted before any retry can replay it); ``unknown`` if none was seen
  (e.g. the first attempt went through another gateway worker).
"""

from __future__ import annotations

from kvmeter.bus import StatsBus
from kvmeter.stats import (AdmissionDecision, ConfigReloaded, IdempotencyAttempt, QuotaStoreState,
                           ReservationDrift, ToolCallReported)

from .base import MetricSource, SourceContext

__all__ = ["QuotaMetrics", "MAX_REMEMBERED_TENANTS"]

#: tenants whose tier is remembered for retries (the map is cleared when it grows past this)
MAX_REMEMBERED_TENANTS = 100_000

_TOKEN_DIMENSIONS = {"input_tokens": "input", "output_tokens": "output"}


class QuotaMetrics(MetricSource):
    """Maps quota, idempotency and tenancy stats to ``kvmeter_quota_*``, ``kvmeter_gateway_*``,
    ``kvmeter_agent_*`` and ``kvmeter_tenancy_*`` metrics."""

    def __init__(self, ctx: SourceContext) -> None:
        super().__init__(ctx)
        m = self.metric
        self.reserved = m("kvmeter_quota_reserved_tokens_total")
        self.drift = m("kvmeter_quota_reservation_drift_tokens_total")
        self.retries = m("kvmeter_gateway_retries_total")
        self.keyed = m("kvmeter_gateway_idempotent_requests_total")
        self.replays = m("kvmeter_gateway_idempotent_replays_total")
        self.degraded = m("kvmeter_quota_store_degraded")
        self.pending = m("kvmeter_quota_store_pending_settles_requests")
        self.tool_reports = m("kvmeter_agent_tool_call_reports_total")
        self.reloads = m("kvmeter_tenancy_config_reloads_total")
        for result in ("within_budget", "exceeded"):  # at 0 from the start, so that the first
            self.tool_reports.labels(result)            # event is an increase() Prometheus sees
        for result in ("ok", "error"):
            self.reloads.labels(result)
        self._tier_of: dict[str, str] = {}

    def attach(self, bus: StatsBus):
        return [bus.subscribe(ReservationDrift, self.on_drift),
                bus.subscribe(IdempotencyAttempt, self.on_attempt),
                bus.subscribe(AdmissionDecision, self.on_decision),
                bus.subscribe(QuotaStoreState, self.on_store),
                bus.subscribe(ToolCallReported, self.on_tool_calls),
                bus.subscribe(ConfigReloaded, self.on_reload)]

    def on_drift(self, d: ReservationDrift) -> None:
        kind = _TOKEN_DIMENSIONS.get(d.dimension)
        if kind is None:
            return
        tier = d.attribution.tier or "unknown"
        reserved, actual = int(d.reserved), int(d.actual)
        if reserved > 0:
            self.reserved.labels(tier, kind).inc(reserved)
        if actual > reserved:
            self.drift.labels(tier, kind, "under").inc(actual - reserved)
        elif actual < reserved:
            self.drift.labels(tier, kind, "over").inc(reserved - actual)

    def on_decision(self, d: AdmissionDecision) -> None:
        tenant, tier = d.attribution.tenant_id, d.attribution.tier
        if tier and self._tier_of.get(tenant) != tier:
            if len(self._tier_of) >= MAX_REMEMBERED_TENANTS:
                self._tier_of.clear()
            self._tier_of[tenant] = tier

    def on_attempt(self, a: IdempotencyAttempt) -> None:
        tier = self._tier_of.get(a.tenant_id, "unknown")
        if a.outcome == "first" and a.attempt <= 1:
            self.tenant_child(self.keyed, 1, (tier, a.tenant_id)).inc()
            return
        self.tenant_child(self.retries, 1, (tier, a.tenant_id)).inc()
        if a.replayed:
            self.replays.labels(tier).inc()

    def on_store(self, st: QuotaStoreState) -> None:
        self.degraded.labels(st.store).set(1 if st.degraded else 0)
        self.pending.labels(st.store).set(st.pending_settles)

    def on_tool_calls(self, r: ToolCallReported) -> None:
        self.tool_reports.labels("exceeded" if r.exceeded else "within_budget").inc()

    def on_reload(self, r: ConfigReloaded) -> None:
        self.reloads.labels("ok" if r.ok else "error").inc()
