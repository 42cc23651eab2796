"""The fair scheduler's synchronous core: per-tenant queues, VTC order, KV budgets, engine gating,
bounded queues, deadlines and overload shedding — one object shared by the real serving path
(through the asyncio adapter :class:`~kvmeter.serving.scheduler.fair.FairScheduler`) and by the
discrete-event simulator (which calls it directly in virtual time). It never sleeps and reads time
only from the injected :class:`~kvmeter.clock.Clock` (monotonic seconds).

Algorithm — Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language Models",
OSDI 2024, Algorithm 1 and its weighted variant, §4.3):

* each tenant *i* has a counter ``cᵢ`` of weight-normalised service; a request's prompt is charged
  at dispatch (``input_weight × prompt tokens / wᵢ``) and its output as it streams
  (``output_weight × tokens / wᵢ``); defaults 1 and 2 as in the paper;
* whenever the engine has room, the head request of the backlogged tenant with the least counter
  is dispatched; if it does not fit the engine's KV room the core stops (head-of-line, as the
  paper's reference implementation does) rather than skip it, so large prompts are not starved;
* a tenant whose queue was empty is lifted on arrival to ``max(cᵢ, min{c_j : j backlogged})`` —
  or, when nobody is backlogged, to the counter of the last tenant that left the backlog — so that
  idle time banks no credit;
* the scheduler is work-conserving: it never leaves the engine idle while a dispatchable request
  waits. The deliberate exceptions are overload actions: a tier paused under pressure (batch) is
  not dispatched until the pressure level falls, so its prefills stop eating the interactive
  tiers' step time; and a tenant at its KV budget (active KV tokens) or prefill budget (prompt
  tokens not yet prefilled) waits for its own requests to progress.

Weights are hierarchical: tiers first (a tier counter charged with ``service / w_tier``, the same
lift rule between tiers), then tenants inside the tier (``service / w_tenant``).

**Bound relied on.** The paper proves (§4, main theorem) that for any two tenants *f*, *g*
continuously backlogged over ``[t₁, t₂]``, ``|W_f(t₁,t₂)/w_f − W_g(t₁,t₂)/w_g| ≤ 2U`` where
``U = max(w_p·L_input, w_q·M)``, ``L_input`` the largest prompt, ``M`` the most tokens the running
batch can hold, and that no work-conserving scheduler does better than ``U``. kvmeter's tests check
this bound (with ``M`` = the engine's KV capacity in tokens) on a :class:`~kvmeter.clock.ManualClock`.
KV budgets and paused tiers make a tenant ineligible for a time; the bound then holds among the
tenants that stay eligible.

Costs: a dispatch decision is two lazy-heap look-ups (tier, then tenant) — O(log n) — plus a few
constant-time updates; see ``bench/fairness/bench_scheduler_cost.py``.

Errors: bad requests are refused with :class:`SchedulerRejected` (status 400 for malformed input,
429 for overload); calls about unknown or finished grants are ignored; nothing here raises into the
serving path for a well-typed call.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Iterable

from kvmeter.clock import SYSTEM_CLOCK, Clock
from kvmeter.serving.engines.base import EngineLoad

from ._heap import LazyMinHeap
from .base import Grant, Job, SchedulerRejected
from .config import (PRESSURE_ELEVATED, PRESSURE_NORMAL, PRESSURE_OVERLOAD, SchedulerConfig,
                     TierPolicy)
from .fairness import BackloggedServiceMeter
from .policy import OrderingPolicy, make_policy
from .stats import SchedulerStats, TenantSchedulerStats, TierSchedulerStats

__all__ = ["SchedulerCore", "CoreGrant"]

log = logging.getLogger(__name__)

_QUEUED, _DISPATCHED, _GONE = 0, 1, 2
_INF = float("inf")
#: Seconds between fairness samples (Jain's index, service gap).
_SAMPLE_INTERVAL_S = 1.0


class _QJob:
    """A queued job and its bookkeeping."""

    __slots__ = ("job", "seq", "tenant", "state", "deadline", "cost")

    def __init__(self, job: Job, seq: int, tenant: "_Tenant", deadline: float | None, cost: float):
        self.job = job
        self.seq = seq
        self.tenant = tenant
        self.state = _QUEUED
        self.deadline = deadline
        self.cost = cost


class _Tenant:
    """Per-tenant state (identity-hashed; lives in the tier's heaps)."""

    __slots__ = ("id", "tier", "weight", "counter", "queue", "n_queued", "queued_prompt",
                 "queued_cost", "running", "active_kv", "kv_blocked", "unstarted", "unstarted_tokens",
                 "service", "in_tokens",
                 "out_tokens", "ewma_out", "dispatched", "completed", "wait_sum")

    def __init__(self, tenant_id: str, tier: "_Tier", weight: float) -> None:
        self.id = tenant_id
        self.tier = tier
        self.weight = weight
        self.counter = 0.0
        self.queue: deque[_QJob] = deque()
        self.n_queued = 0
        self.queued_prompt = 0
        self.queued_cost = 0.0
        self.running = 0
        self.active_kv = 0
        self.kv_blocked = False  # at its KV or prefill budget: out of the order heap
        self.unstarted = 0        # dispatched requests without a first token (in prefill)
        self.unstarted_tokens = 0
        self.service = 0.0
        self.in_tokens = 0
        self.out_tokens = 0
        self.ewma_out: float | None = None
        self.dispatched = 0
        self.completed = 0
        self.wait_sum = 0.0

    def head(self) -> _QJob | None:
        """The oldest live queued job (dead entries are dropped on the way)."""
        q = self.queue
        while q and q[0].state != _QUEUED:
            q.popleft()
        return q[0] if q else None

    def head_seq(self) -> float:
        h = self.head()
        return _INF if h is None else float(h.seq)


class _Tier:
    """Per-tier state: its tenants' order heap, its VTC counter, its goodput counters."""

    __slots__ = ("name", "policy", "weight", "counter", "vtime", "last_leaver", "order", "counters", "backlogged",
                 "n_eligible", "backlogged_weight", "paused", "tenants", "completed", "slo_met", "fifo",
                 "out_tokens", "good_tokens")

    def __init__(self, policy: TierPolicy, ordering: OrderingPolicy) -> None:
        self.name = policy.name
        self.policy = policy
        self.weight = policy.weight
        self.counter = 0.0
        self.vtime = 0.0  # counter of the last tenant that left the backlog, when it left
        self.last_leaver: _Tenant | None = None
        self.order: LazyMinHeap[_Tenant] = LazyMinHeap(ordering.tenant_key)
        # Counter-keyed heap for the lift rule when the order is not by counter (FCFS/RPM).
        self.counters: LazyMinHeap[_Tenant] = (
            self.order if ordering.counter_ordered else LazyMinHeap(lambda t: t.counter))
        self.backlogged: set[_Tenant] = set()
        self.fifo: deque[_QJob] = deque()  # the tier's queued jobs in arrival order (lazy)
        self.n_eligible = 0
        self.backlogged_weight = 0.0
        self.paused = False
        self.tenants: dict[str, _Tenant] = {}
        self.completed = 0
        self.slo_met = 0
        self.out_tokens = 0
        self.good_tokens = 0


class _Engine:
    """kvmeter's view of one engine replica."""

    __slots__ = ("idx", "load", "outstanding", "unstarted", "unstarted_tokens", "reported",
                 "since_report")

    def __init__(self, idx: int) -> None:
        self.idx = idx
        self.load = EngineLoad()
        self.outstanding = 0       # dispatched, not released
        self.unstarted = 0         # dispatched, no output token yet
        self.unstarted_tokens = 0  # their prompt tokens
        self.reported = False      # has the engine ever reported its load?
        self.since_report = 0      # dispatched since its last load report

    def waiting_estimate(self) -> int:
        """Requests in the engine's own waiting queue: its last report plus what was dispatched
        since; without reports, every dispatched request that has not started."""
        if self.reported:
            return self.load.num_waiting + self.since_report
        return self.unstarted

    @property
    def capacity(self) -> int:
        return self.load.kv_capacity_tokens

    def projected_used(self) -> float:
        """KV tokens in use at the last report plus prompts dispatched that have not started."""
        return self.load.kv_watermark_ratio * self.load.kv_capacity_tokens + self.unstarted_tokens


@dataclass(slots=True)
class CoreGrant(Grant):
    """A :class:`Grant` with the core's bookkeeping (the gateway only reads :class:`Grant` fields)."""

    tenant_state: _Tenant | None = None
    started: bool = False
    first_token_s: float = math.nan
    released: bool = False


class _RateMeter:
    """Weighted service per second of *backlogged* time, over a sliding window (1-s buckets).

    Only service charged while requests were queued counts, divided by the time they were queued:
    that is the rate at which the engines drain a backlog (their capacity in service units), not the
    offered load of a quiet period. Returns 0 (unknown) until ``min_busy_s`` of backlog was seen.
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
        if self._busy:
            self._bucket(now)[1] += amount

    def rate(self, now: float) -> float:
        self.mark(now, self._busy)
        b = self._buckets
        while b and b[0][0] < now - self._window:
            b.popleft()
        busy = sum(x[2] for x in b)
        if busy < self._min_busy:
            return 0.0
        return sum(x[1] for x in b) / busy


class SchedulerCore:
    """Synchronous fair scheduler. See the module docstring for the algorithm and bound.

    Args:
        config: limits, weights and tier policies (:class:`SchedulerConfig`; defaults if None).
        policy: ``"vtc"`` (default), ``"fcfs"``, ``"rpm"`` or an :class:`OrderingPolicy`.
        clock: monotonic time source (inject a :class:`~kvmeter.clock.ManualClock` in tests and
            the simulator).
        num_engines: engine replicas this core dispatches to (grants carry ``engine_idx``).
    Raises:
        ValueError: on an unknown policy name or ``num_engines < 1``.
    """

    def __init__(self, config: SchedulerConfig | None = None, *, policy: str | OrderingPolicy = "vtc",
                 clock: Clock = SYSTEM_CLOCK, num_engines: int = 1) -> None:
        self.config = config or SchedulerConfig()
        if isinstance(policy, str):
            policy = make_policy(policy, rpm_limit=self.config.rpm_limit,
                                 tenant_rpm_limits=self.config.tenant_rpm_limits)
        if not isinstance(policy, OrderingPolicy):
            raise ValueError(f"policy must be a name or an OrderingPolicy, got {policy!r}")
        if num_engines < 1:
            raise ValueError(f"num_engines must be ≥ 1, got {num_engines}")
        self.policy = policy
        self._clock = clock
        self._tiers: dict[str, _Tier] = {}
        self._tenants: dict[str, _Tenant] = {}
        self._active_tiers: LazyMinHeap[_Tier] = LazyMinHeap(policy.tier_key)
        self._paused_tiers: LazyMinHeap[_Tier] = LazyMinHeap(policy.tier_key)
        self._backlogged_tiers: set[_Tier] = set()
        self._backlogged_tier_weight = 0.0
        self._tier_vtime = 0.0
        self._engines = [_Engine(i) for i in range(num_engines)]
        self._queued: dict[str, _QJob] = {}
        self._running: dict[str, CoreGrant] = {}
        self._deadlines: list[tuple[float, int, _QJob]] = []
        self._seq = itertools.count(1)
        self._queued_total = 0
        self._queued_cost_total = 0.0
        self._rate = _RateMeter(self.config.rate_window_s)
        self._dropped: list[tuple[Job, SchedulerRejected]] = []
        self.rejected_total: dict[str, int] = {}
        self.dropped_total: dict[str, int] = {}
        self.pressure_level = PRESSURE_NORMAL
        self._next_pressure_eval = -_INF
        self._pressure_last_t: float | None = None
        self._level_since = -_INF
        #: smoothed oldest queue wait of the protected tiers ÷ their TTFT SLO (drives pressure)
        self.protected_wait_ratio = 0.0
        #: smoothed TPOT of completed protected requests ÷ their ITL SLO (drives pressure)
        self.protected_itl_ratio = 0.0
        self._itl_sum = 0.0
        self._itl_n = 0
        self._meter = BackloggedServiceMeter()
        self._n_backlogged = 0
        self._window_start: float | None = None
        self._jain_last = 1.0
        self._prev_backlogged: set[_Tenant] = set()
        self._next_sample = -_INF
        self.service_gap = 0.0
        self.max_service_gap = 0.0
        self.service_total = 0.0

    # ------------------------------------------------------------------ read-only views
    @property
    def policy_name(self) -> str:
        return self.policy.name

    @property
    def queued_total(self) -> int:
        """Requests queued (all tenants)."""
        return self._queued_total

    @property
    def running_total(self) -> int:
        """Requests dispatched and not yet released."""
        return len(self._running)

    @property
    def num_engines(self) -> int:
        return len(self._engines)

    @property
    def backlogged_count(self) -> int:
        """Tenants with at least one queued request."""
        return self._n_backlogged

    @property
    def next_sample_s(self) -> float:
        """Clock time of the next fairness sample (callers sync charges before it)."""
        return self._next_sample

    def queue_depth_by_tier(self) -> dict[str, int]:
        """Queued requests per tier (tiers seen so far)."""
        return {name: sum(t.n_queued for t in tier.backlogged) for name, tier in self._tiers.items()}

    def backlogged_service_rates(self, min_time_s: float = 0.0) -> dict[str, float]:
        """Per tenant, weight-normalised service per second while backlogged, since start
        (the ``xᵢ`` of the run's Jain's index; see :mod:`.fairness`)."""
        return self._meter.rates(min_time_s, whole_run=True)

    def tenant_tier(self, tenant_id: str) -> str | None:
        t = self._tenants.get(tenant_id)
        return t.tier.name if t else None

    def tenant_counter(self, tenant_id: str) -> float:
        """The VTC counter of ``tenant_id`` (0.0 for an unknown tenant)."""
        t = self._tenants.get(tenant_id)
        return t.counter if t else 0.0

    def tenant_service(self, tenant_id: str) -> float:
        """Weighted service charged to ``tenant_id`` since start (0.0 if unknown)."""
        t = self._tenants.get(tenant_id)
        return t.service if t else 0.0

    def tenant_queue_depth(self, tenant_id: str) -> int:
        t = self._tenants.get(tenant_id)
        return t.n_queued if t else 0

    def tenant_active_kv(self, tenant_id: str) -> int:
        """Prompt + output tokens of ``tenant_id``'s running requests."""
        t = self._tenants.get(tenant_id)
        return t.active_kv if t else 0

    def tier_paused(self, tier: str) -> bool:
        t = self._tiers.get(tier)
        return bool(t and t.paused)

    def service_rate(self) -> float:
        """Measured weighted service per second over the rate window."""
        return self._rate.rate(self._clock.monotonic())

    # ------------------------------------------------------------------ tenants and tiers
    def _tier(self, name: str) -> _Tier:
        tier = self._tiers.get(name)
        if tier is None:
            tier = _Tier(self.config.tier(name), self.policy)
            tier.paused = tier.policy.pause_at is not None and self.pressure_level >= tier.policy.pause_at
            self._tiers[name] = tier
        return tier

    def _tenant(self, tenant_id: str, tier_name: str) -> _Tenant:
        t = self._tenants.get(tenant_id)
        if t is None:
            tier = self._tier(tier_name if tier_name in self.config.tiers else self.config.default_tier)
            t = _Tenant(tenant_id, tier, float(self.config.tenant_weights.get(tenant_id, 1.0)))
            tier.tenants[tenant_id] = t
            self._tenants[tenant_id] = t
        return t

    def _make_eligible(self, t: _Tenant) -> None:
        tier = t.tier
        tier.order.push(t)
        if tier.counters is not tier.order:
            tier.counters.push(t)
        tier.n_eligible += 1
        # (re)file the tier: first eligible tenant, or an order key that may have decreased (FCFS)
        if tier.n_eligible == 1 or not self.policy.counter_ordered:
            (self._paused_tiers if tier.paused else self._active_tiers).push(tier)

    def _make_ineligible(self, t: _Tenant) -> None:
        tier = t.tier
        tier.order.remove(t)
        if tier.counters is not tier.order:
            tier.counters.remove(t)
        tier.n_eligible -= 1
        if tier.n_eligible == 0:
            self._active_tiers.remove(tier)
            self._paused_tiers.remove(tier)

    def _on_backlogged(self, t: _Tenant) -> None:
        """``t``'s queue went from empty to non-empty: VTC counter lift, then eligibility."""
        tier = t.tier
        # Lift (Sheng et al., Alg. 1): idle time banks no credit. The floor is the least counter
        # of the backlogged tenants, or — when none is backlogged — the counter of the last tenant
        # that left the backlog (the system's virtual time, as in start-time fair queueing).
        low = tier.counters.top()
        if low is not None and low is not t:
            floor = low.counter
        else:  # the last leaver keeps being charged for the output it streams after leaving
            floor = max(tier.vtime, tier.last_leaver.counter if tier.last_leaver is not None else 0.0)
        t.counter = max(t.counter, floor)
        if not tier.backlogged:
            others = [x.counter for x in self._backlogged_tiers if x is not tier]
            tier.counter = max(tier.counter, min(others) if others else self._tier_vtime)
            self._backlogged_tiers.add(tier)
            self._backlogged_tier_weight += tier.weight
        tier.backlogged.add(t)
        tier.backlogged_weight += t.weight
        self._n_backlogged += 1
        if not t.kv_blocked:
            self._make_eligible(t)

    def _on_idle(self, t: _Tenant) -> None:
        """``t``'s queue became empty."""
        tier = t.tier
        if t.kv_blocked:
            t.kv_blocked = False
        else:
            self._make_ineligible(t)
        tier.backlogged.discard(t)
        tier.backlogged_weight = max(0.0, tier.backlogged_weight - t.weight)
        self._n_backlogged -= 1
        tier.vtime = max(tier.vtime, t.counter)
        tier.last_leaver = t
        if not tier.backlogged:
            self._tier_vtime = max(self._tier_vtime, tier.counter)
            self._backlogged_tiers.discard(tier)
            self._backlogged_tier_weight = max(0.0, self._backlogged_tier_weight - tier.weight)

    def _kv_budget(self, t: _Tenant) -> int:
        override = self.config.tenant_kv_budget_tokens.get(t.id)
        if override is not None:
            return int(override)
        ratio = self.config.tenant_kv_budget_ratio
        if ratio is None:
            return 0
        return int(ratio * sum(e.capacity for e in self._engines))

    # ------------------------------------------------------------------ admission
    def _deadline_of(self, job: Job, tier: TierPolicy) -> float | None:
        if not self.config.overload_control:
            return None
        if job.deadline_s is not None:
            return job.deadline_s
        if tier.max_queue_wait_s is not None:
            return job.arrival_s + tier.max_queue_wait_s
        if tier.ttft_slo_s is not None:
            return job.arrival_s + self.config.deadline_slo_factor * tier.ttft_slo_s
        return None

    def _job_cost(self, t: _Tenant | None, job: Job) -> float:
        est = self.config.default_output_tokens if (t is None or t.ewma_out is None) else t.ewma_out
        if job.max_tokens > 0:
            est = min(est, job.max_tokens)
        return job.prompt_tokens * self.config.input_weight + est * self.config.output_weight

    def _admission_error(self, job: Job, now: float) -> SchedulerRejected | None:
        cfg = self.config
        if not isinstance(job, Job):
            return SchedulerRejected("invalid", f"expected a Job, got {type(job).__name__}",
                                     status_code=400)
        if not job.tenant_id or not job.request_id:
            return SchedulerRejected("invalid", "job needs a tenant_id and a request_id", status_code=400)
        if not isinstance(job.prompt_tokens, int) or job.prompt_tokens < 0 or \
                not isinstance(job.max_tokens, int) or job.max_tokens < 0:
            return SchedulerRejected(
                "invalid", f"prompt_tokens and max_tokens must be integers ≥ 0 "
                f"(got {job.prompt_tokens!r}, {job.max_tokens!r})", status_code=400)
        if job.request_id in self._queued or job.request_id in self._running:
            return SchedulerRejected("invalid", f"request {job.request_id!r} is already scheduled",
                                     status_code=400)
        tier_policy = cfg.tier(job.tier)
        biggest = max(e.capacity for e in self._engines)
        if biggest and job.prompt_tokens > cfg.kv_watermark_high * biggest:
            return SchedulerRejected(
                "kv_capacity_exceeded",
                f"prompt of {job.prompt_tokens} tokens exceeds the engine's KV room "
                f"({int(cfg.kv_watermark_high * biggest)} tokens)", status_code=400)
        t = self._tenants.get(job.tenant_id)
        refusal = self.policy.admission(t or _Tenant(job.tenant_id, self._tier(tier_policy.name), 1.0), now)
        if refusal is not None:
            return refusal
        level = self.pressure_level if cfg.overload_control else PRESSURE_NORMAL
        if tier_policy.shed_new_at is not None and level >= tier_policy.shed_new_at:
            return SchedulerRejected(
                "shed", f"overloaded: {tier_policy.name} requests are refused until load falls",
                retry_after_s=self._shed_retry_after(now))
        if t is not None and t.n_queued >= cfg.max_queued_per_tenant:
            return SchedulerRejected(
                "queue_full", f"tenant {job.tenant_id!r} has {t.n_queued} requests queued "
                f"(limit {cfg.max_queued_per_tenant})", retry_after_s=self._projected_wait(t, now))
        if self._queued_total >= cfg.max_queued_total:
            return SchedulerRejected(
                "queue_full", f"{self._queued_total} requests queued (limit {cfg.max_queued_total})",
                retry_after_s=self._projected_wait(t, now) if t else None)
        deadline = self._deadline_of(job, tier_policy)
        if deadline is not None:
            if now >= deadline:
                return SchedulerRejected("deadline", "the request's deadline has already passed",
                                         retry_after_s=0.0)
            if cfg.reject_on_projected_wait and t is not None:
                wait = self._projected_wait(t, now)
                if wait > deadline - now:
                    return SchedulerRejected(
                        "projected_wait",
                        f"projected queue wait {wait:.1f} s exceeds the {deadline - now:.1f} s left "
                        "before the request's deadline", retry_after_s=wait)
        return None

    def check_admission(self, job: Job) -> None:
        """Refuse early if ``job`` cannot be queued or served in time.

        Raises:
            SchedulerRejected: ``invalid`` (400), ``kv_capacity_exceeded`` (400),
                ``rate_limited`` (rpm policy), ``shed``, ``queue_full``, ``deadline``,
                ``projected_wait`` (429 with ``retry_after_s``).
        """
        err = self._admission_error(job, self._clock.monotonic())
        if err is not None:
            self.rejected_total[err.reason] = self.rejected_total.get(err.reason, 0) + 1
            raise err

    def submit(self, job: Job) -> None:
        """Admission check, then queue ``job`` in its tenant's queue (dispatch with :meth:`dispatch`).

        Raises:
            SchedulerRejected: as :meth:`check_admission`.
        """
        now = self._clock.monotonic()
        self.check_admission(job)
        t = self._tenant(job.tenant_id, job.tier)
        tier_policy = t.tier.policy
        qj = _QJob(job, next(self._seq), t, self._deadline_of(job, tier_policy), self._job_cost(t, job))
        t.queue.append(qj)
        if tier_policy.protected and tier_policy.ttft_slo_s is not None and self.config.overload_control:
            t.tier.fifo.append(qj)  # for the pressure signal's oldest-wait look-up
        t.n_queued += 1
        t.queued_prompt += job.prompt_tokens
        t.queued_cost += qj.cost
        if not self._queued_total:
            self._rate.mark(now, True)
        self._queued_total += 1
        self._queued_cost_total += qj.cost
        self._queued[job.request_id] = qj
        if qj.deadline is not None:
            heapq.heappush(self._deadlines, (qj.deadline, qj.seq, qj))
        self.policy.on_submitted(t, now)
        if t.n_queued == 1:
            self._on_backlogged(t)

    def _unqueue(self, qj: _QJob, state: int) -> None:
        """Take a queued job out (dispatched or gone); keeps every total consistent."""
        t = qj.tenant
        qj.state = state
        self._queued.pop(qj.job.request_id, None)
        t.n_queued -= 1
        t.queued_prompt -= qj.job.prompt_tokens
        t.queued_cost -= qj.cost
        self._queued_total -= 1
        self._queued_cost_total -= qj.cost
        if not self._queued_total:
            self._rate.mark(self._clock.monotonic(), False)
        if t.n_queued == 0:
            t.queued_cost = 0.0
            self._on_idle(t)

    def _drop(self, qj: _QJob, reason: str, message: str, retry_after_s: float | None = None) -> None:
        self._unqueue(qj, _GONE)
        self.dropped_total[reason] = self.dropped_total.get(reason, 0) + 1
        self._dropped.append((qj.job, SchedulerRejected(reason, message, retry_after_s=retry_after_s)))

    def cancel(self, request_id: str) -> bool:
        """Remove a queued job (client gone). Returns True if it was queued."""
        qj = self._queued.get(request_id)
        if qj is None or qj.state != _QUEUED:
            return False
        self._unqueue(qj, _GONE)
        self.dropped_total["cancelled"] = self.dropped_total.get("cancelled", 0) + 1
        return True

    def take_dropped(self) -> list[tuple[Job, SchedulerRejected]]:
        """Jobs dropped from the queues since the last call (deadline, shed, capacity), with why."""
        out, self._dropped = self._dropped, []
        return out

    # ------------------------------------------------------------------ dispatch
    def _engine_with_room(self) -> _Engine | None:
        cfg = self.config
        best: _Engine | None = None
        best_free = -_INF
        for e in self._engines:
            if e.outstanding >= cfg.max_engine_running:
                continue
            if e.waiting_estimate() >= cfg.max_engine_waiting:
                continue
            if e.capacity:
                used = e.projected_used()
                if used >= cfg.kv_watermark_high * e.capacity:
                    continue
                free = e.capacity - used
            else:
                free = -e.outstanding
            if free > best_free:
                best, best_free = e, free
        return best

    def dispatch(self, max_grants: int | None = None) -> list[Grant]:
        """Dispatch queued jobs while an engine has room; returns the new grants (maybe empty).

        Queued jobs whose deadline has passed are dropped on the way (collected for
        :meth:`take_dropped`). Periodic work — pressure level, fairness sampling — is
        :meth:`tick`'s, which the caller runs on a timer (the asyncio adapter) or per event (the
        simulator).
        """
        now = self._clock.monotonic()
        self._expire(now)
        grants: list[Grant] = []
        cfg = self.config
        while self._queued_total and (max_grants is None or len(grants) < max_grants):
            engine = self._engine_with_room()
            if engine is None:
                break
            tier = self._active_tiers.top()
            if tier is None:
                break
            t = tier.order.top()
            if t is None:  # defensive: heaps and counts disagree
                log.error("scheduler: tier %s has no eligible tenant; repairing", tier.name)
                tier.n_eligible = 0
                self._active_tiers.remove(tier)
                self._paused_tiers.remove(tier)
                continue
            qj = t.head()
            if qj is None:
                log.error("scheduler: tenant %s backlogged with an empty queue; repairing", t.id)
                t.n_queued = 1
                self._on_idle(t)
                t.n_queued = 0
                continue
            job = qj.job
            if qj.deadline is not None and now >= qj.deadline:
                self._drop(qj, "deadline", "the request's deadline passed while it was queued", 0.0)
                continue
            need = job.prompt_tokens
            if engine.capacity:
                if need > cfg.kv_watermark_high * max(e.capacity for e in self._engines):
                    self._drop(qj, "kv_capacity_exceeded",
                               f"prompt of {need} tokens can never fit the engine's KV room")
                    continue
                if engine.projected_used() + need > cfg.kv_watermark_high * engine.capacity \
                        and engine.outstanding > 0:
                    break  # head-of-line: wait for room rather than skip (no starvation)
            if self._over_budget(t, need):
                t.kv_blocked = True
                self._make_ineligible(t)
                continue
            grants.append(self._start(qj, engine, now))
        return grants

    def _over_budget(self, t: _Tenant, need: int) -> bool:
        """Would dispatching a ``need``-token prompt put ``t`` over its KV or prefill budget?
        (A tenant with nothing running, or nothing in prefill, may always dispatch one.)"""
        budget = self._kv_budget(t)
        if budget and t.running > 0 and t.active_kv + need > budget:
            return True
        pb = self.config.tenant_prefill_budget_tokens
        return bool(pb and t.unstarted > 0 and t.unstarted_tokens + need > pb)

    def _maybe_unblock(self, t: _Tenant) -> None:
        if not t.kv_blocked:
            return
        nxt = t.head()
        if nxt is None or not self._over_budget(t, nxt.job.prompt_tokens):
            t.kv_blocked = False
            if t.n_queued:
                self._make_eligible(t)

    def _start(self, qj: _QJob, engine: _Engine, now: float) -> CoreGrant:
        job, t = qj.job, qj.tenant
        self._charge(t, job.prompt_tokens * self.config.input_weight, now)
        self._unqueue(qj, _DISPATCHED)
        grant = CoreGrant(job=job, dispatched_s=now, priority=t.tier.policy.priority,
                          engine_idx=engine.idx, tenant_state=t)
        self._running[job.request_id] = grant
        engine.outstanding += 1
        engine.unstarted += 1
        engine.unstarted_tokens += job.prompt_tokens
        engine.since_report += 1
        t.unstarted += 1
        t.unstarted_tokens += job.prompt_tokens
        t.running += 1
        t.active_kv += job.prompt_tokens
        t.dispatched += 1
        t.wait_sum += max(0.0, now - job.arrival_s)
        t.in_tokens += job.prompt_tokens
        return grant

    def _charge(self, t: _Tenant, cost: float, now: float) -> None:
        t.service += cost
        t.counter += cost / t.weight
        t.tier.counter += cost / t.tier.weight
        self.service_total += cost
        self._rate.add(now, cost)

    # ------------------------------------------------------------------ running requests
    def charge_output(self, grant: Grant, tokens: int) -> None:
        """Charge ``tokens`` newly streamed output tokens to the grant's tenant.

        The first call with ``tokens > 0`` marks the request started (its prompt is then in the
        engine's KV report) and records its time to first token.
        Raises:
            ValueError: if ``tokens`` is negative or not an integer.
        """
        if not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"charge_output needs an integer token count ≥ 0, got {tokens!r}")
        g = self._running.get(grant.job.request_id)
        if g is None or tokens == 0:
            return
        now = self._clock.monotonic()
        t = g.tenant_state
        g.output_tokens += tokens
        if g is not grant:
            grant.output_tokens = g.output_tokens
        t.out_tokens += tokens
        t.active_kv += tokens
        self._charge(t, tokens * self.config.output_weight, now)
        if not g.started:
            g.started = True
            g.first_token_s = now
            e = self._engines[g.engine_idx]
            e.unstarted -= 1
            e.unstarted_tokens -= g.job.prompt_tokens
            t.unstarted -= 1
            t.unstarted_tokens -= g.job.prompt_tokens
            self._maybe_unblock(t)

    def release(self, grant: Grant) -> None:
        """The request ended (any outcome): free its slot and KV accounting; idempotent."""
        g = self._running.pop(grant.job.request_id, None)
        if g is None:
            return
        now = self._clock.monotonic()
        g.released = True
        t = g.tenant_state
        e = self._engines[g.engine_idx]
        e.outstanding -= 1
        if not g.started:
            e.unstarted -= 1
            e.unstarted_tokens -= g.job.prompt_tokens
            t.unstarted -= 1
            t.unstarted_tokens -= g.job.prompt_tokens
        t.running -= 1
        t.active_kv -= g.job.prompt_tokens + g.output_tokens
        t.completed += 1
        n = g.output_tokens
        t.ewma_out = n if t.ewma_out is None else 0.8 * t.ewma_out + 0.2 * n
        self._record_slo(t, g, now)
        self._maybe_unblock(t)

    def _record_slo(self, t: _Tenant, g: CoreGrant, now: float) -> None:
        tier = t.tier
        pol = tier.policy
        n = g.output_tokens
        tier.completed += 1
        tier.out_tokens += n
        if not g.started:
            return
        ttft = g.first_token_s - g.job.arrival_s
        tpot = (now - g.first_token_s) / (n - 1) if n > 1 else 0.0
        ok = (pol.ttft_slo_s is None or ttft <= pol.ttft_slo_s) and \
             (pol.itl_slo_s is None or tpot <= pol.itl_slo_s)
        if ok:
            tier.slo_met += 1
            tier.good_tokens += n
        if pol.protected and pol.itl_slo_s is not None and n > 1:
            self._itl_sum += tpot / pol.itl_slo_s
            self._itl_n += 1

    # ------------------------------------------------------------------ engine load
    def on_engine_load(self, load: EngineLoad, engine_idx: int = 0) -> None:
        """Record an engine's latest load (from its step stats); re-evaluates KV budgets.

        Raises:
            ValueError: for an engine index outside ``range(num_engines)`` or a watermark
                outside 0–1.
        """
        if not 0 <= engine_idx < len(self._engines):
            raise ValueError(f"engine_idx {engine_idx} outside 0..{len(self._engines) - 1}")
        if not 0.0 <= load.kv_watermark_ratio <= 1.0 or load.kv_capacity_tokens < 0:
            raise ValueError(f"bad engine load {load!r}")
        e = self._engines[engine_idx]
        capacity_changed = e.load.kv_capacity_tokens != load.kv_capacity_tokens
        e.load = load
        e.reported = True
        e.since_report = 0
        if capacity_changed:
            self._recheck_blocked()

    def _recheck_blocked(self) -> None:
        for tier in self._tiers.values():
            for t in list(tier.backlogged):
                if t.kv_blocked:
                    t.kv_blocked = False
                    self._make_eligible(t)

    # ------------------------------------------------------------------ time-driven work
    def _expire(self, now: float) -> None:
        dl = self._deadlines
        while dl and dl[0][0] <= now:
            _, _, qj = heapq.heappop(dl)
            if qj.state == _QUEUED:
                self._drop(qj, "deadline", "the request's deadline passed while it was queued", 0.0)

    def tick(self, now: float | None = None) -> None:
        """Deadline drops, pressure re-evaluation and fairness sampling due at ``now`` (cheap
        when nothing is due: a few comparisons)."""
        if now is None:
            now = self._clock.monotonic()
        self._expire(now)
        if self.config.overload_control and now >= self._next_pressure_eval:
            self._next_pressure_eval = now + self.config.pressure_eval_interval_s
            self._eval_pressure(now)
        if now >= self._next_sample:
            self._next_sample = now + _SAMPLE_INTERVAL_S
            self._sample(now)

    def _eval_pressure(self, now: float) -> None:
        cfg = self.config
        fill = self._queued_total / cfg.max_queued_total
        wait_ratio = 0.0
        for tier in self._tiers.values():
            pol = tier.policy
            if not pol.protected or pol.ttft_slo_s is None or not tier.backlogged:
                continue
            fifo = tier.fifo
            while fifo and fifo[0].state != _QUEUED:
                fifo.popleft()
            oldest = now - fifo[0].job.arrival_s if fifo else 0.0
            wait_ratio = max(wait_ratio, oldest / pol.ttft_slo_s)
        # smooth the wait signal (EWMA, time constant pressure_smoothing_s) so a momentary burst
        # of queueing does not shed anyone
        # (a gap between evaluations counts as at most 4 intervals, so one look after a quiet
        # spell cannot swing the average; the ITL term needs ~10 completions for a full step)
        last = self._pressure_last_t
        dt = cfg.pressure_eval_interval_s if last is None else max(0.0, now - last)
        alpha = 1.0 - math.exp(-min(dt, 4 * cfg.pressure_eval_interval_s) / cfg.pressure_smoothing_s)
        self._pressure_last_t = now
        self.protected_wait_ratio += alpha * (wait_ratio - self.protected_wait_ratio)
        if self._itl_n:  # mean TPOT/ITL-SLO of protected requests completed since the last look
            a = alpha * min(1.0, self._itl_n / 10.0)
            self.protected_itl_ratio += a * (self._itl_sum / self._itl_n - self.protected_itl_ratio)
            self._itl_sum, self._itl_n = 0.0, 0
        wait_ratio = max(self.protected_wait_ratio, self.protected_itl_ratio)

        def level_for(scale: float) -> int:
            if fill >= scale * cfg.overload_queue_fill or wait_ratio >= scale * cfg.overload_wait_ratio:
                return PRESSURE_OVERLOAD
            if fill >= scale * cfg.elevated_queue_fill or wait_ratio >= scale * cfg.elevated_wait_ratio:
                return PRESSURE_ELEVATED
            return PRESSURE_NORMAL

        # hysteresis: enter a level at its thresholds, leave it only below exit_factor × them and
        # only after it held for pressure_min_dwell_s (shedding changes the signals it reacts to)
        level = max(level_for(1.0), min(self.pressure_level, level_for(cfg.pressure_exit_factor)))
        if level < self.pressure_level and now - self._level_since < cfg.pressure_min_dwell_s:
            level = self.pressure_level
        if level != self.pressure_level:
            log.info("scheduler pressure %d → %d (queue fill %.2f, protected wait/SLO %.2f, "
                     "ITL/SLO %.2f)", self.pressure_level, level, fill, self.protected_wait_ratio,
                     self.protected_itl_ratio)
            self.set_pressure_level(level)

    def set_pressure_level(self, level: int) -> None:
        """Apply pressure ``level`` (0–2): pause / unpause tiers and drop shed-able queued work.

        Normally set by the core itself from queue fill and protected-tier waits; public so an
        operator (or a test) can force it. Raises ValueError outside 0–2.
        """
        if level not in (PRESSURE_NORMAL, PRESSURE_ELEVATED, PRESSURE_OVERLOAD):
            raise ValueError(f"pressure level must be 0, 1 or 2, got {level!r}")
        self.pressure_level = level
        self._level_since = self._clock.monotonic()
        for tier in self._tiers.values():
            pol = tier.policy
            paused = pol.pause_at is not None and level >= pol.pause_at
            if paused != tier.paused:
                tier.paused = paused
                if tier.n_eligible:
                    (self._active_tiers if paused else self._paused_tiers).remove(tier)
                    (self._paused_tiers if paused else self._active_tiers).push(tier)
            if pol.shed_queued_at is not None and level >= pol.shed_queued_at:
                for t in list(tier.backlogged):
                    for qj in list(t.queue):
                        if qj.state == _QUEUED:
                            self._drop(qj, "shed", f"overloaded: queued {pol.name} work is shed",
                                       self._shed_retry_after(self._clock.monotonic()))

    def _shed_retry_after(self, now: float) -> float:
        return max(1.0, 2.0 * self.config.pressure_eval_interval_s)

    def _sample(self, now: float) -> None:
        gap = 0.0
        states = []
        tiers_w = self._backlogged_tier_weight
        backlogged_now: set[_Tenant] = set()
        for tier in self._tiers.values():
            if not tier.backlogged:
                continue
            lo, hi = _INF, -_INF
            tw = tier.weight / tiers_w if tiers_w > 0 else 0.0
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
        self._meter.sample(now, states)
        self.service_gap = gap
        self.max_service_gap = max(self.max_service_gap, gap)
        if self._window_start is None:
            self._window_start = now
        elif now - self._window_start >= self.config.stats_window_s:
            self._jain_last = self._meter.index()
            self._meter.reset()
            self._window_start = now

    # ------------------------------------------------------------------ projections and signals
    def _projected_wait(self, t: _Tenant | None, now: float) -> float:
        if not self._queued_total:
            return 0.0
        rate = self._rate.rate(now)
        if rate <= 0:
            return 0.0
        if t is None or not self.policy.counter_ordered:
            return self._queued_cost_total / rate
        tier = t.tier
        tiers_w = self._backlogged_tier_weight + (0.0 if tier.backlogged else tier.weight)
        tenants_w = tier.backlogged_weight + (0.0 if t.n_queued else t.weight)
        share = (tier.weight / tiers_w) * (t.weight / tenants_w)
        lag = 0.0
        if t.n_queued:
            low = tier.counters.top()
            if low is not None:
                lag = max(0.0, t.counter - low.counter) * t.weight
        # GPS drain time of this tenant, bounded by the time to drain everything queued
        return min(self._queued_cost_total, (t.queued_cost + lag) / share) / rate

    def projected_wait(self, tenant_id: str, tier: str | None = None) -> float:
        """Projected queue wait (seconds) of a new request of ``tenant_id``.

        Under VTC the backlogged tenants' counters advance together (a GPS-like virtual time), so
        a tenant with share ``s = (w_tier/Σ backlogged tier weights)·(w_tenant/Σ backlogged tenant
        weights in the tier)`` of the drain rate ``R`` reaches a new request within
        ``min(Q, (W + lag·w)/s) / R`` seconds: ``W`` its queued work (each request's prompt and
        expected output — the tenant's recent mean, capped by ``max_tokens`` — in service units),
        ``lag`` its counter's lead over the least backlogged counter, and ``Q`` all queued work (no
        tenant waits longer than the whole backlog takes; this bound matters when the other
        backlogged tenants have little queued). Under FCFS/RPM it is ``Q / R``. ``R`` is the
        service rate measured while requests were queued (the engines' drain rate). 0.0 when
        nothing is queued or no rate has been measured yet (nothing to project from).
        """
        now = self._clock.monotonic()
        t = self._tenants.get(tenant_id)
        if t is None and self.policy.counter_ordered:
            name = tier if tier in self.config.tiers else self.config.default_tier
            t = _Tenant(tenant_id, self._tier(name), float(self.config.tenant_weights.get(tenant_id, 1.0)))
        return self._projected_wait(t, now)

    def snapshot(self, include_tenants: bool = True) -> SchedulerStats:
        """The current :class:`SchedulerStats` (O(tenants) when ``include_tenants``)."""
        now = self._clock.monotonic()
        tenants: list[TenantSchedulerStats] = []
        if include_tenants:
            for t in self._tenants.values():
                h = t.head()
                tenants.append(TenantSchedulerStats(
                    tenant_id=t.id, tier=t.tier.name, weight=t.weight, queue_depth=t.n_queued,
                    queued_prompt_tokens=t.queued_prompt,
                    queue_wait_oldest_s=(now - h.job.arrival_s) if h else 0.0,
                    queue_wait_mean_s=(t.wait_sum / t.dispatched) if t.dispatched else 0.0,
                    projected_wait_s=self._projected_wait(t, now), running=t.running,
                    active_kv_tokens=t.active_kv, kv_budget_tokens=self._kv_budget(t),
                    service_total=t.service, input_tokens_total=t.in_tokens,
                    output_tokens_total=t.out_tokens, vtc_counter=t.counter,
                    dispatched_total=t.dispatched, completed_total=t.completed))
        tiers = []
        for tier in self._tiers.values():
            members = tier.tenants.values()
            tiers.append(TierSchedulerStats(
                tier=tier.name, queue_depth=sum(t.n_queued for t in tier.backlogged),
                running=sum(t.running for t in members), paused=tier.paused,
                completed_total=tier.completed, slo_met_total=tier.slo_met,
                output_tokens_total=tier.out_tokens, goodput_output_tokens_total=tier.good_tokens,
                goodput_ratio=(tier.good_tokens / tier.out_tokens) if tier.out_tokens else 1.0))
        live = self._meter.index()
        return SchedulerStats(
            wall_ts=self._clock.wall(), policy=self.policy.name, pressure_level=self.pressure_level,
            queued_total=self._queued_total, running_total=len(self._running),
            service_rate_per_s=self._rate.rate(now),
            jain_index=live if self._meter.rates() else self._jain_last,
            max_service_gap=self.max_service_gap, service_gap=self.service_gap,
            rejected_total=dict(self.rejected_total), dropped_total=dict(self.dropped_total),
            engines_kv_watermark=[e.load.kv_watermark_ratio for e in self._engines],
            tiers=tiers, tenants=tenants)

    def tenants(self) -> Iterable[str]:
        """Ids of every tenant seen."""
        return list(self._tenants)
