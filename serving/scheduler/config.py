"""Typed configuration of the fair scheduler: its limits, and the tier policies it runs with.

Everything here is plain, validated data passed in by the caller (``kvmeter serve`` builds it from
the tenancy configuration; ``kvmeter simulate`` and the benchmarks build it from flags). The tier
policy — weight, priority, SLOs, the deadline rule, overload behaviour — is not defined here: it is
:class:`~kvmeter.serving.tenancy.tiers.TierPolicy`, the one definition tenancy, gateway, scheduler
and simulator share (the scheduler imports it from tenancy; tenancy imports nothing from the
scheduler). The defaults below are kvmeter's own and are documented where they are chosen; none of
them is read from the environment.

Units: seconds for times (monotonic-clock durations), tokens for token counts, dimensionless
ratios in ``[0, 1]`` for watermarks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping

from kvmeter.serving.tenancy.tiers import (DEFAULT_TIERS, PRESSURE_ELEVATED, PRESSURE_NORMAL,
                                           PRESSURE_OVERLOAD, TierPolicy)

__all__ = [
    "SchedulerConfig",
    "PLAIN_BASELINE",
    "PRESSURE_NORMAL",
    "PRESSURE_ELEVATED",
    "PRESSURE_OVERLOAD",
]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Everything the scheduler core needs besides its clock.

    Fairness (VTC cost function, Sheng et al., OSDI 2024, §3):
        input_weight: service charged per input (prompt) token, at dispatch (paper's w_p; 1).
        output_weight: service charged per output token, as it streams (paper's w_q; 2).
        tiers: tier name → :class:`~kvmeter.serving.tenancy.tiers.TierPolicy` (default: the built-in
            :data:`~kvmeter.serving.tenancy.tiers.DEFAULT_TIERS`); a job of an unknown tier uses
            ``default_tier``.
        default_tier: tier policy used for unknown tier names (must be a key of ``tiers``).
        tenant_weights: tenant id → weight inside its tier (default 1.0).

    Engine gating (per engine replica):
        kv_watermark_high: dispatch only while the engine's KV watermark (used/total blocks,
            projected with the prompts dispatched since its last report) stays below this (0–1].
        max_engine_running: most requests kvmeter keeps dispatched on one engine (running +
            the engine's own waiting queue); vLLM's ``max_num_seqs`` is the natural value.
        max_engine_waiting: most requests allowed in the engine's own waiting queue; kept small
            so kvmeter, not the engine's FCFS queue, decides the order.

    Adaptive running limit (per engine; the control law and its sources are in
    :mod:`kvmeter.serving.scheduler.gating`):
        adaptive_engine_limit: below ``max_engine_running``, limit the requests an engine holds
            by AIMD on its reported step latencies (active from its first latency report).
        engine_itl_target_ratio: target mean ITL as a fraction of the tightest protected tier's
            ITL SLO (0–1]; above it the limit decreases.
        engine_ttft_target_ratio: target median engine-side TTFT as a fraction of the tightest
            protected tier's TTFT SLO (0–1); the rest of the TTFT budget is kvmeter's queue wait
            (the limit grows rather than shrinks while protected requests wait longer, relative to
            that rest, than the engine's latency exceeds its targets).
        engine_limit_initial: the limit at the engine's first latency report (≥ 1).
        engine_limit_min: the floor (≥ 1): the engine always may hold this many.
        engine_limit_increase: additive increase per interval (requests, > 0) once past slow start.
        engine_limit_decrease: multiplicative decrease factor (0–1).
        engine_limit_interval_s: seconds between control decisions (> 0).
        engine_limit_window_s: the latency signal covers the intervals of the last this many
            seconds (≥ the interval): a request's TPOT averages its ITLs over its life, so one slow
            step (a long prefill chunk) should not cut the limit the way sustained slowness does.

    KV budgets:
        tenant_kv_budget_ratio: a request is dispatched only while its tenant's active KV tokens
            (input + output so far of its running requests) plus the new prompt stay within this
            fraction of the total KV capacity of all engines; ``None`` disables the budget. It is
            a dispatch rule, not a ceiling: running requests keep growing by their outputs, so a
            tenant of long outputs can hold more (measured in the simulator: 4,000-token prompts
            with 3,000-token outputs held ≈ 0.75 of the cache under 0.5; bench/noisy/RESULTS.md).
            A tenant with nothing running may always dispatch one request (so a request larger
            than the budget is not starved).
        tenant_kv_budget_tokens: per-tenant absolute overrides (tokens).
        tenant_prefill_budget_tokens: most prompt tokens one tenant may have dispatched and not yet
            prefilled (no first token yet); a tenant with nothing in prefill may always dispatch
            one request. It bounds how much of every engine step one tenant's long prompts take
            (with chunked prefill, concurrent long prefills fill the step token budget and
            stretch everyone's TTFT and ITL). ``None`` disables it.

    Bounded queues and overload:
        max_queued_per_tenant: most queued requests per tenant (reason ``queue_full``).
        max_queued_total: most queued requests over all tenants (reason ``queue_full``). With
            overload control, once the queue is ``overload_queue_fill`` full a tenant with queued
            work may hold only its weighted share of that fill (reason ``queue_full``), so the
            last slots go to tenants under their share, not to the one that filled the queue.
        reject_on_projected_wait: refuse at admission a request whose projected wait exceeds its
            deadline (reason ``projected_wait``). A job's deadline is its own ``deadline_s``,
            else its tier's :meth:`~kvmeter.serving.tenancy.tiers.TierPolicy.deadline_s`. The
            projection follows VTC's order (:func:`~.projection.projected_wait`): a tenant below
            its fair share waits for its own queue only, so the refusals fall on the tenant above.
        overload_control: enable pressure levels (pause/shed by tier) and deadline drops. The
            FCFS/RPM baselines run with it off to show what a plain engine queue does.
        elevated_queue_fill, overload_queue_fill: queue fill ratios (queued / max_queued_total)
            that enter pressure levels 1 and 2.
        elevated_wait_ratio, overload_wait_ratio: thresholds on the protected tiers' (tiers
            never paused nor shed) SLO ratio — the larger of the oldest queued request's age ÷ the
            tier's TTFT SLO and the completed requests' TPOT ÷ the tier's ITL SLO, each smoothed over
            ``pressure_smoothing_s`` — that enter pressure levels 1 and 2.
        pressure_smoothing_s: time constant of that smoothing (exponential moving average).
        pressure_min_dwell_s: a level is held at least this long before it may fall (shedding
            improves the very signals that set it; without a dwell the level oscillates).
        pressure_exit_factor: a level is left when every signal is below factor × its entry
            threshold (hysteresis, 0–1).
        pressure_eval_interval_s: how often the pressure level is re-evaluated.

    Projected wait:
        rate_window_s: window of the measured service rate (weighted tokens per second).
        default_output_tokens: expected output of a request before a tenant has history.

    RPM-limit baseline:
        rpm_limit: requests per minute per tenant for the ``rpm`` policy (sliding 60 s window).
        tenant_rpm_limits: per-tenant overrides of ``rpm_limit``.

    Stats:
        stats_window_s: window of the Jain's index in :class:`~kvmeter.stats.SchedulerStats`.
    Raises:
        ValueError: on out-of-range values (checked at construction).
    """

    input_weight: float = 1.0
    output_weight: float = 2.0
    tiers: Mapping[str, TierPolicy] = field(default_factory=lambda: dict(DEFAULT_TIERS))
    default_tier: str = "paid_interactive"
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    kv_watermark_high: float = 0.90
    max_engine_running: int = 256
    max_engine_waiting: int = 8
    adaptive_engine_limit: bool = True
    engine_itl_target_ratio: float = 0.8
    engine_ttft_target_ratio: float = 0.5
    engine_limit_initial: int = 8
    engine_limit_min: int = 2
    engine_limit_increase: float = 1.0
    engine_limit_decrease: float = 0.85
    engine_limit_interval_s: float = 1.0
    engine_limit_window_s: float = 5.0
    tenant_kv_budget_ratio: float | None = 0.5
    tenant_kv_budget_tokens: Mapping[str, int] = field(default_factory=dict)
    tenant_prefill_budget_tokens: int | None = 32_768
    max_queued_per_tenant: int = 1_000
    max_queued_total: int = 100_000
    reject_on_projected_wait: bool = True
    overload_control: bool = True
    elevated_queue_fill: float = 0.5
    overload_queue_fill: float = 0.8
    elevated_wait_ratio: float = 1.0
    overload_wait_ratio: float = 2.0
    pressure_exit_factor: float = 0.6
    pressure_eval_interval_s: float = 0.5
    pressure_smoothing_s: float = 5.0
    pressure_min_dwell_s: float = 30.0
    rate_window_s: float = 30.0
    default_output_tokens: int = 256
    rpm_limit: float = 60.0
    tenant_rpm_limits: Mapping[str, float] = field(default_factory=dict)
    stats_window_s: float = 60.0

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"SchedulerConfig.{name} must be > 0, got {v!r}")

        for name in ("input_weight", "output_weight", "max_engine_running", "max_queued_per_tenant",
                     "max_queued_total", "rate_window_s", "default_output_tokens", "rpm_limit",
                     "stats_window_s", "pressure_eval_interval_s", "pressure_smoothing_s"):
            positive(name)
        for name in ("engine_limit_initial", "engine_limit_min", "engine_limit_increase",
                     "engine_limit_interval_s", "engine_limit_window_s"):
            positive(name)
        for name in ("engine_itl_target_ratio", "engine_ttft_target_ratio", "engine_limit_decrease"):
            v = getattr(self, name)
            if not 0 < v <= 1 or (name != "engine_itl_target_ratio" and v == 1):
                close = "]" if name == "engine_itl_target_ratio" else ")"
                raise ValueError(f"SchedulerConfig.{name} must be in (0, 1{close}, got {v!r}")
        for name in ("pressure_min_dwell_s",):
            if getattr(self, name) < 0:
                raise ValueError(f"SchedulerConfig.{name} must be ≥ 0")
        if self.max_engine_waiting < 1:
            raise ValueError(f"SchedulerConfig.max_engine_waiting must be ≥ 1, got {self.max_engine_waiting}")
        if not 0 < self.kv_watermark_high <= 1:
            raise ValueError(f"kv_watermark_high must be in (0, 1], got {self.kv_watermark_high}")
        if self.tenant_kv_budget_ratio is not None and not 0 < self.tenant_kv_budget_ratio <= 1:
            raise ValueError(f"tenant_kv_budget_ratio must be in (0, 1] or None, got {self.tenant_kv_budget_ratio}")
        if self.tenant_prefill_budget_tokens is not None and self.tenant_prefill_budget_tokens < 1:
            raise ValueError("tenant_prefill_budget_tokens must be ≥ 1 or None")
        if not 0 < self.pressure_exit_factor <= 1:
            raise ValueError(f"pressure_exit_factor must be in (0, 1], got {self.pressure_exit_factor}")
        if not 0 < self.elevated_queue_fill <= self.overload_queue_fill <= 1:
            raise ValueError("need 0 < elevated_queue_fill ≤ overload_queue_fill ≤ 1")
        if not 0 < self.elevated_wait_ratio <= self.overload_wait_ratio:
            raise ValueError("need 0 < elevated_wait_ratio ≤ overload_wait_ratio")
        if not self.tiers:
            raise ValueError("SchedulerConfig.tiers must name at least one tier")
        for key, tier in self.tiers.items():
            if not isinstance(tier, TierPolicy) or tier.name != key:
                raise ValueError(f"tiers[{key!r}] must be a TierPolicy named {key!r}")
        if self.default_tier not in self.tiers:
            raise ValueError(f"default_tier {self.default_tier!r} is not one of {sorted(self.tiers)}")
        for tenant, w in self.tenant_weights.items():
            if not (w > 0 and math.isfinite(w)):
                raise ValueError(f"tenant_weights[{tenant!r}] must be > 0, got {w!r}")
        for tenant, b in self.tenant_kv_budget_tokens.items():
            if b < 1:
                raise ValueError(f"tenant_kv_budget_tokens[{tenant!r}] must be ≥ 1, got {b!r}")

    def tier(self, name: str) -> TierPolicy:
        """The policy of tier ``name`` (the default tier's policy when unknown)."""
        return self.tiers.get(name) or self.tiers[self.default_tier]

    @classmethod
    def plain_baseline(cls, **changes: object) -> "SchedulerConfig":
        """The configuration of a plain deployment, what the FCFS and RPM baselines run with
        (``kvmeter simulate --policy fcfs|rpm``, ``bench/fairness``, ``kvmeter demo --scheduler
        fcfs``): :data:`PLAIN_BASELINE` — no overload control (no deadlines, pressure levels or
        shedding), no adaptive engine limit, no per-tenant KV or prefill budget, queues as deep as
        the load — then ``changes`` (``SchedulerConfig`` fields; a caller that adds a kvmeter
        mechanism back says so in the baseline's name, e.g. ``fcfs+kv-budget``).

        Raises:
            TypeError: an unknown field; ValueError: as the constructor.
        """
        return cls(**{**PLAIN_BASELINE, **changes})  # type: ignore[arg-type]

    def with_tiers(self, **changes: TierPolicy) -> "SchedulerConfig":
        """A copy with some tier policies replaced or added (keyword = tier name)."""
        tiers = dict(self.tiers)
        tiers.update(changes)
        return replace(self, tiers=tiers)


#: The fields :meth:`SchedulerConfig.plain_baseline` sets: kvmeter's own mechanisms off, so a
#: baseline is the engine's queue in arrival order (FCFS) or that plus a rate limit (RPM), and the
#: engine's static caps (``max_engine_running``, ``max_engine_waiting``, the KV watermark) decide
#: how much it holds — as a plain vLLM deployment's ``max_num_seqs`` and KV cache do.
PLAIN_BASELINE: Mapping[str, object] = MappingProxyType({
    "overload_control": False, "adaptive_engine_limit": False, "tenant_kv_budget_ratio": None,
    "tenant_prefill_budget_tokens": None, "max_queued_per_tenant": 10 ** 9, "max_queued_total": 10 ** 9})
