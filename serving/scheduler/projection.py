"""Wait projection: how long a new request of a tenant would queue, from the measured drain rate.

The gateway refuses early (429 + ``Retry-After``) a request whose projected wait exceeds its
deadline instead of letting it time out late; ``Retry-After`` of ``queue_full`` refusals is the
same projection. Two parts:

* :class:`DrainRateMeter` — weighted service per second charged *while requests were queued*
  (the engines' drain rate of a backlog, in VTC service units per second);
* :func:`projected_wait` — the GPS-like drain time of the tenant's queued work under VTC (or of
  everything queued under FCFS/RPM) at that rate.

Under VTC the backlogged tenants' counters advance together, a generalised-processor-sharing
virtual time (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024, §4: VTC
tracks GPS within ``2U``; Parekh & Gallager, "A Generalized Processor Sharing Approach to Flow
Control", IEEE/ACM ToN 1993, for the GPS drain time of a flow's backlog at its share).
"""

from __future__ import annotations

import math
from collections import deque

from .base import Job
from .config import SchedulerConfig
from .state import TenantState

__all__ = ["DrainRateMeter", "projected_wait", "job_cost", "expected_output_tokens", "lift_floor"]


class DrainRateMeter:
    """Weighted service per second of *backlogged* time, over a sliding window (1-s buckets).

    Only service charged while requests were queued counts, divided by the time they were queued:
    that is the rate at which the engines drain a backlog (their capacity in service units), not the
    offered load of a quiet period. Returns 0 (unknown) until ``min_busy_s`` of backlog was seen.

    Args:
        window_s: how far back the rate looks (seconds, > 0).
        min_busy_s: backlogged seconds needed before a rate is reported.
    """

    __slots__ = ("_window", "_buckets", "_last_t", "_busy", "_min_busy")

    def __init__(self, window_s: float, min_busy_s: float = 1.0) -> None:
        self._window = window_s
        self._buckets: deque[list[float]] = deque()  # [start, service, busy seconds]
        self._last_t: float | None = None
        self._busy = False
        self._min_busy = min_busy_s

    def _bucket(self, now: float) -> list[float]:
        b = self._buckets
        if not b or now >= b[-1][0] + 1.0:
            b.append([math.floor(now), 0.0, 0.0])
        return b[-1]

    def mark(self, now: float, backlogged: bool) -> None:
        """Account the time since the last mark; ``backlogged`` is the state from now on."""
        if self._last_t is not None and self._busy and now > self._last_t:
            self._bucket(now)[2] += now - self._last_t
        self._last_t = now
        self._busy = backlogged

    def add(self, now: float, amount: float) -> None:
        """Service ``amount`` was charged at ``now`` (counted only while backlogged)."""
        if self._busy:
            self._bucket(now)[1] += amount

    def rate(self, now: float) -> float:
        """Service units per backlogged second over the window (0.0 while unknown)."""
        self.mark(now, self._busy)
        b = self._buckets
        while b and b[0][0] < now - self._window:
            b.popleft()
        busy = sum(x[2] for x in b)
        if busy < self._min_busy:
            return 0.0
        return sum(x[1] for x in b) / busy


def expected_output_tokens(config: SchedulerConfig, tenant: TenantState | None, job: Job) -> float:
    """Expected output tokens of ``job``: the tenant's recent mean output
    (``config.default_output_tokens`` before it has history), capped by ``max_tokens`` (tokens ≥ 0)."""
    est = config.default_output_tokens if (tenant is None or tenant.ewma_out is None) else tenant.ewma_out
    if job.max_tokens > 0:
        est = min(est, job.max_tokens)
    return float(est)


def job_cost(config: SchedulerConfig, tenant: TenantState | None, job: Job) -> float:
    """Expected service of ``job``: its prompt plus its expected output
    (:func:`expected_output_tokens`), in service units."""
    return job.input_tokens * config.input_weight + expected_output_tokens(config, tenant, job) * config.output_weight


def lift_floor(tenant: TenantState, low: TenantState, output_weight: float) -> float:
    """The counter ``tenant`` is lifted to (at least) when its queue turns non-empty while ``low``
    holds the tier's least backlogged counter: ``low``'s counter less the committed output
    ``tenant`` has beyond ``low`` — each one's :attr:`~.state.TenantState.pending_output` ×
    ``output_weight`` ÷ its weight — so output still streaming is not charged twice (once by the
    lift, once as it streams). Never above ``low.counter`` (Sheng et al., OSDI 2024, Algorithm 1's
    lift); weight-normalised service units."""
    mine = tenant.pending_output * output_weight / tenant.weight
    theirs = low.pending_output * output_weight / low.weight
    return low.counter - max(0.0, mine - theirs)


def projected_wait(tenant: TenantState | None, *, rate: float, queued_cost_total: float,
                   backlogged_tier_weight: float, counter_ordered: bool, output_weight: float) -> float:
    """Projected queue wait (seconds) of a new request of ``tenant``: the service VTC gives out
    before that request is dispatched, at the drain rate.

    **Fairness-aware** (issue 17): under VTC (Sheng et al., "Fairness in Serving Large Language
    Models", OSDI 2024, Algorithm 1) the head of the backlogged tenant with the least counter goes
    next, so a tenant below its fair share is served *alone* until its counter catches up with the
    others', and a tenant above it waits while they catch up. The projection follows that fluid
    (GPS) order within the tier: the new request starts when the tenant's counter reaches
    ``L = c + W/w`` (its counter ``c`` — lifted to the backlog's least counter if it has nothing
    queued, as on arrival — plus its queued work ``W`` over its weight ``w``); before that the
    tier's other backlogged tenants (summed weight ``W_o``, weighted mean counter ``c̄_o`` — the
    tier's fair-share point —, queued work ``Q_o``) receive ``min(Q_o, W_o·max(0, L − c̄_o))``.
    So an early ``projected_wait`` refusal falls on the tenant whose counter is above the fair
    share, not on the one below it (whose wait is its own queue at the tier's whole rate).

    Across tiers the tier gets its weighted share ``s = w_tier / Σ backlogged unpaused tier
    weights`` of the drain rate ``R``, and nobody waits longer than the whole backlog ``Q`` takes::

        wait = min(Q, (W + min(Q_o, W_o·max(0, L − c̄_o))) / s) / R

    Exact for two backlogged tenants in a tier (``c̄_o`` is then the other's counter); with more,
    the tenants below ``L`` but above their mean are under-counted by at most ``W_o`` × the
    counters' spread, which VTC bounds by ``2U`` (Sheng et al., §4). Under FCFS/RPM
    (``counter_ordered`` False) or for an unknown tenant it is ``Q / R``. O(1): the tier keeps the
    sums (``backlogged_wc``, ``queued_cost``) up to date.

    Args:
        tenant: the tenant (its tier and queue as they are now), or None.
        rate: the drain rate ``R`` (service units per second); ≤ 0 means unknown.
        queued_cost_total: ``Q`` (service units).
        backlogged_tier_weight: summed weights of the tiers with queued work that are not paused
            (a paused tier is served nothing while it is paused).
        counter_ordered: whether dispatch follows VTC counters.
        output_weight: service units per output token, the scheduler config's (the lift's
            committed-output credit, :func:`lift_floor`).
    Returns:
        Seconds ≥ 0; 0.0 when no rate has been measured yet (the caller answers 0.0 when nothing
        is queued).
    """
    if rate <= 0:
        return 0.0
    if tenant is None or not counter_ordered:
        return queued_cost_total / rate
    tier = tenant.tier
    tiers_w = backlogged_tier_weight + (0.0 if tier.backlogged and not tier.paused else tier.weight)
    queued = tenant.n_queued > 0
    own = tenant.queued_cost if queued else 0.0
    others_w = tier.backlogged_weight - (tenant.weight if queued else 0.0)
    before = own
    if others_w > 1e-12:
        counter = tenant.counter
        if not queued:  # the lift a new arrival gets (core: _on_backlogged)
            low = tier.counters.top()
            if low is not None:
                counter = max(counter, lift_floor(tenant, low, output_weight))
        others_mean = (tier.backlogged_wc - (tenant.weight * tenant.counter if queued else 0.0)) / others_w
        level = counter + own / tenant.weight
        before += min(max(0.0, tier.queued_cost - own), others_w * max(0.0, level - others_mean))
    return min(queued_cost_total, before * tiers_w / tier.weight) / rate
