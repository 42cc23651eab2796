"""Stats of the fair scheduler: one snapshot of the whole, its tiers and its tenants.

Built by :meth:`kvmeter.serving.scheduler.core.SchedulerCore.snapshot` and published by the asyncio
adapter (:class:`kvmeter.serving.scheduler.fair.FairScheduler`) every ``stats_interval_s``.

Units: *service* is weighted token work — ``input_weight × input tokens + output_weight × output
tokens`` (VTC's cost function, Sheng et al., OSDI 2024, §3); *normalised service* divides it by the
tenant's weight (the VTC counter's unit). Durations are seconds; ``wall_ts`` is wall-clock epoch
seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["TenantSchedulerStats", "TierSchedulerStats", "SchedulerStats"]


@dataclass(slots=True)
class TenantSchedulerStats:
    """One tenant's state at snapshot time.

    Attributes:
        tenant_id, tier: attribution.
        weight: the tenant's weight inside its tier.
        queue_depth: requests queued.
        queued_input_tokens: input tokens of the queued requests.
        queue_wait_oldest_s: age of the oldest queued request (0 when none).
        queue_wait_mean_s: mean queue wait of the requests dispatched so far (0 when none).
        projected_wait_s: the scheduler's projection of how long a new request would wait.
        running: dispatched, unreleased requests.
        active_kv_tokens: input + output tokens of the running requests (the tenant's KV load).
        kv_budget_tokens: its active-KV budget (0 = none).
        service_total: weighted service received since start.
        input_tokens_total, output_tokens_total: tokens charged since start.
        vtc_counter: the VTC virtual counter (normalised service, lifted on re-activation).
        dispatched_total, completed_total: requests dispatched / released.
    """

    tenant_id: str
    tier: str
    weight: float
    queue_depth: int
    queued_input_tokens: int
    queue_wait_oldest_s: float
    queue_wait_mean_s: float
    projected_wait_s: float
    running: int
    active_kv_tokens: int
    kv_budget_tokens: int
    service_total: float
    input_tokens_total: int
    output_tokens_total: int
    vtc_counter: float
    dispatched_total: int
    completed_total: int


@dataclass(slots=True)
class TierSchedulerStats:
    """One tier's aggregates.

    Attributes:
        tier: tier name.
        queue_depth, running: summed over the tier's tenants.
        paused: True while the tier is paused by overload control.
        completed_total: requests released.
        slo_met_total: of those, requests that met the tier's TTFT and ITL objectives.
        output_tokens_total: output tokens of released requests.
        goodput_output_tokens_total: output tokens of the requests that met the objectives.
        goodput_ratio: goodput tokens / output tokens (1.0 when nothing completed).
    """

    tier: str
    queue_depth: int
    running: int
    paused: bool
    completed_total: int
    slo_met_total: int
    output_tokens_total: int
    goodput_output_tokens_total: int
    goodput_ratio: float


@dataclass(slots=True)
class SchedulerStats:
    """The scheduler as a whole at snapshot time.

    Attributes:
        wall_ts: wall-clock epoch seconds of the snapshot.
        policy: ``vtc``, ``fcfs`` or ``rpm``.
        pressure_level: 0 normal, 1 elevated (batch paused, new free refused), 2 overload.
        queued_total, running_total: requests queued / dispatched-unreleased.
        service_rate_per_s: weighted service per second measured while requests were queued (the
            engines' drain rate that projected waits use), over the rate window; 0 when unknown.
        jain_index: Jain's fairness index (0–1] of the weight-normalised service rate tenants
            received while backlogged, over the last stats window (1.0 when < 2 tenants qualify).
        max_service_gap: the largest difference of VTC counters between two backlogged tenants of
            the same tier seen since start (normalised service units; VTC bounds it, see core).
        service_gap: the same difference now.
        rejected_total: admission refusals by reason (``queue_full``, ``projected_wait``,
            ``shed``, ``rate_limited``, ``deadline``, ``kv_capacity_exceeded``, ``invalid``).
        dropped_total: queued requests dropped by reason (``deadline``, ``shed``, ``cancelled``,
            ``kv_capacity_exceeded``).
        engines_kv_watermark: last reported KV watermark per engine (0–1).
        engines_running_limit: per engine, the most requests kvmeter lets it hold now — the
            adaptive limit driven by its step latencies, or the static ``max_engine_running``.
        tiers: per-tier aggregates.
        tenants: per-tenant detail (every tenant seen; exporters cap the label set).
        shared_service_failures_total: failed syncs of the VTC counters shared through Redis
            since start (``serving/scheduler/shared_service.py``); None without sharing.
    """

    wall_ts: float
    policy: str
    pressure_level: int
    queued_total: int
    running_total: int
    service_rate_per_s: float
    jain_index: float
    max_service_gap: float
    service_gap: float
    rejected_total: dict[str, int] = field(default_factory=dict)
    dropped_total: dict[str, int] = field(default_factory=dict)
    engines_kv_watermark: list[float] = field(default_factory=list)
    engines_running_limit: list[int] = field(default_factory=list)
    tiers: list[TierSchedulerStats] = field(default_factory=list)
    tenants: list[TenantSchedulerStats] = field(default_factory=list)
    shared_service_failures_total: int | None = None
