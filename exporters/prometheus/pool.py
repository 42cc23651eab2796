"""Engine-pool metrics: the router's decisions (:class:`~kvmeter.stats.RoutingDecision`) and each
replica's health (:class:`~kvmeter.stats.ReplicaHealth`), labelled with the pool's ``model`` and
the ``replica`` (its URL). The routing outcomes are defined in
:mod:`kvmeter.serving.scheduler.router`; health in :mod:`kvmeter.serving.engines.pool`.
"""

from __future__ import annotations

from kvmeter.bus import StatsBus
from kvmeter.stats import ReplicaHealth, RoutingDecision

from .base import MetricSource, SourceContext

__all__ = ["PoolMetrics"]


class PoolMetrics(MetricSource):
    """Maps :class:`RoutingDecision` and :class:`ReplicaHealth` to the ``kvmeter_router_*`` and
    ``kvmeter_replica_*`` metrics."""

    def __init__(self, ctx: SourceContext) -> None:
        super().__init__(ctx)
        m = self.metric
        self.decisions = m("kvmeter_router_decisions_requests_total")
        self.routed = m("kvmeter_replica_routed_requests_total")
        self.up = m("kvmeter_replica_up")
        self.available = m("kvmeter_replica_available")

    def attach(self, bus: StatsBus):
        return [bus.subscribe(RoutingDecision, self.on_decision), bus.subscribe(ReplicaHealth, self.on_health)]

    def on_decision(self, d: RoutingDecision) -> None:
        self.decisions.labels(d.model, d.policy, d.outcome).inc()
        self.routed.labels(d.model, d.replica).inc()

    def on_health(self, h: ReplicaHealth) -> None:
        self.up.labels(h.model, h.replica).set(1 if h.healthy else 0)
        self.available.labels(h.model, h.replica).set(1 if h.available else 0)
