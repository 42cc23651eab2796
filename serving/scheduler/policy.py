"""Dispatch-order policies behind one interface: VTC (kvmeter's), FCFS and RPM-limit (baselines).

A policy answers two questions for :class:`~kvmeter.serving.scheduler.core.SchedulerCore`:

* **order** — the key a backlogged tenant (and a tier) is ranked by; the core dispatches from the
  least key (lazy heaps, so a decision is O(log n));
* **admission** — whether the policy itself refuses a request before queueing (only RPM does).

Everything else (queues, KV budgets, engine gating, bounds, deadlines, shedding, stats) is the
core's and is shared by every policy, so a benchmark compares orderings, not plumbing.

* :class:`VTCPolicy` — Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language
  Models", OSDI 2024, Algorithm 1 / weighted variant §4.3): the least weight-normalised service
  first, hierarchically (tier counters first, then tenant counters inside the tier).
* :class:`FCFSPolicy` — global arrival order, what a shared engine queue does.
* :class:`RPMLimitPolicy` — FCFS plus a per-tenant requests-per-minute limit at admission, the
  common gateway practice the VTC paper compares against (§5 "RPM").
"""

from __future__ import annotations

import abc
from collections import deque
from typing import TYPE_CHECKING, Mapping

from .base import SchedulerRejected

if TYPE_CHECKING:  # pragma: no cover
    from .state import TenantState, TierState

__all__ = ["OrderingPolicy", "VTCPolicy", "FCFSPolicy", "RPMLimitPolicy", "make_policy", "POLICIES"]


class OrderingPolicy(abc.ABC):
    """Ranks tenants and tiers for dispatch; may refuse at admission.

    Attributes:
        name: ``vtc``, ``fcfs`` or ``rpm``.
        counter_ordered: True when the tenant key is the VTC counter itself (the core then uses
            the order heap for the counter-lift minimum too).
        engine_priorities: True when grants carry the tier's engine priority (kvmeter's
            scheduler); False for the baselines, which submit every request at priority 0 as a
            plain deployment does (the engine then runs FCFS).
    """

    name: str = ""
    counter_ordered: bool = False
    engine_priorities: bool = False

    @abc.abstractmethod
    def tenant_key(self, tenant: "TenantState") -> float:
        """Rank of a backlogged tenant inside its tier (least dispatches first); must only grow
        while the tenant stays backlogged and eligible."""

    @abc.abstractmethod
    def tier_key(self, tier: "TierState") -> float:
        """Rank of a tier that has a dispatchable tenant (least dispatches first)."""

    def admission(self, tenant: "TenantState", now: float) -> SchedulerRejected | None:
        """A refusal of the policy's own, or ``None``. Must not record anything."""
        return None

    def on_submitted(self, tenant: "TenantState", now: float) -> None:  # noqa: B027 — optional hook, no-op by default
        """A request of ``tenant`` was queued at ``now`` (record it for rate limits)."""


class VTCPolicy(OrderingPolicy):
    """Least weight-normalised service first, tiers then tenants (hierarchical VTC)."""

    name = "vtc"
    counter_ordered = True
    engine_priorities = True

    def tenant_key(self, tenant: "TenantState") -> float:
        return tenant.counter

    def tier_key(self, tier: "TierState") -> float:
        return tier.counter


class FCFSPolicy(OrderingPolicy):
    """Global first-come first-served: the oldest queued request of any tenant goes first."""

    name = "fcfs"

    def tenant_key(self, tenant: "TenantState") -> float:
        return tenant.head_seq()

    def tier_key(self, tier: "TierState") -> float:
        best = tier.order.top()
        return float("inf") if best is None else best.head_seq()


class RPMLimitPolicy(FCFSPolicy):
    """FCFS plus a per-tenant requests-per-minute cap (sliding 60 s window) at admission.

    Args:
        rpm_limit: requests per minute each tenant may submit (> 0).
        tenant_limits: per-tenant overrides (requests per minute, > 0).
    """

    name = "rpm"

    def __init__(self, rpm_limit: float, tenant_limits: Mapping[str, float] | None = None) -> None:
        if not rpm_limit > 0:
            raise ValueError(f"rpm_limit must be > 0, got {rpm_limit!r}")
        self.rpm_limit = float(rpm_limit)
        self.tenant_limits = dict(tenant_limits or {})
        for tenant, lim in self.tenant_limits.items():
            if not lim > 0:
                raise ValueError(f"rpm limit of tenant {tenant!r} must be > 0, got {lim!r}")
        self._window: dict[str, deque[float]] = {}

    def _trim(self, tenant_id: str, now: float) -> deque[float]:
        times = self._window.setdefault(tenant_id, deque())
        while times and times[0] <= now - 60.0:
            times.popleft()
        return times

    def admission(self, tenant: "TenantState", now: float) -> SchedulerRejected | None:
        times = self._trim(tenant.id, now)
        limit = self.tenant_limits.get(tenant.id, self.rpm_limit)
        if len(times) + 1 > limit:
            retry = max(0.0, times[0] + 60.0 - now) if times else 60.0
            return SchedulerRejected(
                "rate_limited",
                f"tenant {tenant.id!r} is over its limit of {limit:g} requests per minute",
                retry_after_s=retry)
        return None

    def on_submitted(self, tenant: "TenantState", now: float) -> None:
        self._trim(tenant.id, now).append(now)


#: Policy names accepted by :func:`make_policy` (and ``kvmeter simulate --policy``).
POLICIES = ("vtc", "fcfs", "rpm")


def make_policy(name: str, *, rpm_limit: float = 60.0,
                tenant_rpm_limits: Mapping[str, float] | None = None) -> OrderingPolicy:
    """Build the policy called ``name`` (one of :data:`POLICIES`).

    Raises:
        ValueError: for an unknown name.
    """
    if name == "vtc":
        return VTCPolicy()
    if name == "fcfs":
        return FCFSPolicy()
    if name == "rpm":
        return RPMLimitPolicy(rpm_limit, tenant_rpm_limits)
    raise ValueError(f"unknown scheduling policy {name!r}; choose one of {', '.join(POLICIES)}")
