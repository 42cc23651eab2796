"""What the scheduler's :class:`~kvmeter.stats.SchedulerStats` snapshot is built from: periodic
fairness sampling and the per-tenant and per-tier rows.

* :class:`FairnessSampler` — every second (``SAMPLE_INTERVAL_S``) it records each backlogged
  tenant's service and entitled share into a :class:`~.fairness.BackloggedServiceMeter` (Jain's
  index over a ``stats_window_s`` window) and the *service gap*: the largest spread of VTC
  counters between two backlogged tenants of a tier (VTC bounds it by ``2U``, Sheng et al., OSDI
  2024, §4 — see :mod:`.core`).
* :func:`tenant_stats` / :func:`tier_stats` — one tenant's or tier's row of a snapshot.

Cost: a sample is O(backlogged tenants); it runs from the core's ``tick`` at most once a second.
"""

from __future__ import annotations

from typing import Iterable

from kvmeter.stats import TenantSchedulerStats, TierSchedulerStats

from .fairness import BackloggedServiceMeter
from .state import TenantState, TierState

__all__ = ["SAMPLE_INTERVAL_S", "FairnessSampler", "tenant_stats", "tier_stats"]

#: Seconds between fairness samples (Jain's index, service gap).
SAMPLE_INTERVAL_S = 1.0
_INF = float("inf")


class FairnessSampler:
    """Jain's index and service gap from periodic samples of the backlogged tenants.

    Args:
        stats_window_s: window of the published Jain's index (seconds, > 0).
    Attributes:
        meter: the :class:`BackloggedServiceMeter` (window and whole run).
        service_gap: the counter spread at the last sample; ``max_service_gap`` the largest seen.
        next_sample_s: clock time of the next sample.
    """

    def __init__(self, stats_window_s: float) -> None:
        self.meter = BackloggedServiceMeter()
        self._window_s = stats_window_s
        self._window_start: float | None = None
        self._jain_last = 1.0
        self._prev_backlogged: set[TenantState] = set()
        self.next_sample_s = -_INF
        self.service_gap = 0.0
        self.max_service_gap = 0.0

    def due(self, now: float) -> bool:
        return now >= self.next_sample_s

    def sample(self, now: float, tiers: Iterable[TierState], backlogged_tier_weight: float) -> None:
        """Record a sample at ``now`` (monotonic seconds) and schedule the next."""
        self.next_sample_s = now + SAMPLE_INTERVAL_S
        gap = 0.0
        states = []
        backlogged_now: set[TenantState] = set()
        for tier in tiers:
            if not tier.backlogged:
                continue
            lo, hi = _INF, -_INF
            tw = tier.weight / backlogged_tier_weight if backlogged_tier_weight > 0 else 0.0
            bw = tier.backlogged_weight
            for t in tier.backlogged:
                backlogged_now.add(t)
                c = t.counter
                if c < lo:
                    lo = c
                if c > hi:
                    hi = c
                states.append((t.id, t.service, True, tw * t.weight / bw if bw > 0 else 0.0))
            if len(tier.backlogged) > 1 and hi - lo > gap:
                gap = hi - lo
        for t in self._prev_backlogged:
            if t not in backlogged_now:
                states.append((t.id, t.service, False, 0.0))
        self._prev_backlogged = backlogged_now
        self.meter.sample(now, states)
        self.service_gap = gap
        self.max_service_gap = max(self.max_service_gap, gap)
        if self._window_start is None:
            self._window_start = now
        elif now - self._window_start >= self._window_s:
            self._jain_last = self.meter.index()
            self.meter.reset()
            self._window_start = now

    def jain_index(self) -> float:
        """Jain's index of the current window, or of the last full window when the current one
        has no qualifying tenant yet."""
        return self.meter.index() if self.meter.rates() else self._jain_last


def tenant_stats(t: TenantState, now: float, *, projected_wait_s: float, kv_budget_tokens: int) -> TenantSchedulerStats:
    """One tenant's row of a snapshot at ``now``."""
    h = t.head()
    return TenantSchedulerStats(
        tenant_id=t.id, tier=t.tier.name, weight=t.weight, queue_depth=t.n_queued,
        queued_input_tokens=t.queued_input,
        queue_wait_oldest_s=(now - h.job.arrival_s) if h else 0.0,
        queue_wait_mean_s=(t.wait_sum / t.dispatched) if t.dispatched else 0.0,
        projected_wait_s=projected_wait_s, running=t.running, active_kv_tokens=t.active_kv,
        kv_budget_tokens=kv_budget_tokens, service_total=t.service, input_tokens_total=t.in_tokens,
        output_tokens_total=t.out_tokens, vtc_counter=t.counter, dispatched_total=t.dispatched,
        completed_total=t.completed)


def tier_stats(tier: TierState) -> TierSchedulerStats:
    """One tier's row of a snapshot."""
    members = tier.tenants.values()
    return TierSchedulerStats(
        tier=tier.name, queue_depth=sum(t.n_queued for t in tier.backlogged),
        running=sum(t.running for t in members), paused=tier.paused,
        completed_total=tier.completed, slo_met_total=tier.slo_met,
        output_tokens_total=tier.out_tokens, goodput_output_tokens_total=tier.good_tokens,
        goodput_ratio=(tier.good_tokens / tier.out_tokens) if tier.out_tokens else 1.0)
