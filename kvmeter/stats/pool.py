"""Stats of an engine pool (several replicas of one model behind one scheduler): the router's
decisions (:mod:`kvmeter.serving.scheduler.router`) and each replica's health
(:mod:`kvmeter.serving.engines.pool`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RoutingDecision", "ReplicaHealth", "ROUTING_OUTCOMES"]

#: every :attr:`RoutingDecision.outcome` (see :mod:`kvmeter.serving.scheduler.router`)
ROUTING_OUTCOMES = ("prefix_hit", "prefix_miss", "no_prefix", "failover")


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """One request routed to a replica.

    Attributes:
        model: the pool's model; policy: the routing policy (``prefix_aware``, ``least_kv``,
            ``round_robin``); outcome: one of :data:`ROUTING_OUTCOMES`; replica: the chosen
            replica's name (its URL).
    """

    model: str
    policy: str
    outcome: str
    replica: str


@dataclass(frozen=True, slots=True)
class ReplicaHealth:
    """A replica's state after a change (or a scrape).

    Attributes:
        model: the pool's model; replica: its name (URL); index: its position in the pool.
        healthy: does it answer (its ``/metrics`` scrape, its connections)?
        draining: taken out of routing by an operator (what it runs goes on).
        reason: why it is unhealthy ("" when healthy).
    """

    model: str
    replica: str
    index: int
    healthy: bool
    draining: bool = False
    reason: str = ""

    @property
    def available(self) -> bool:
        """May it take new requests (healthy and not draining)?"""
        return self.healthy and not self.draining
