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
  idle time banks no credit; the floor credits the tenant's committed output (its running
  requests' expected output not yet streamed, beyond what the least tenant's have): without that
  a tenant of many short requests whose queue runs dry while their output streams is charged that
  output twice, once by the lift and once as it streams (issue 17 item 3; measured with B's
  4,000-token prompts against A's 256 in ``bench/fairness/scenario_admission.py --big B``);
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

**Admission is fairness-aware** (issue 17): an early refusal under overload falls on the tenant
above its fair share, not on the one below it. The projected wait that refuses a request
(``projected_wait``) is the service VTC gives out before it — a tenant whose counter is below the
tier's others is served alone until it catches up, one above waits while they do
(:func:`.projection.projected_wait`); and once the global queue is ``overload_queue_fill`` full, a
tenant holding more than its weighted share of it is refused (``queue_full``) while a tenant under
its share still gets the free slots. Tier shedding (``shed``) stays by tier, as the tier policy
says.

**Across gateway processes** (issue 17): with a ``counter_log`` (:mod:`.shared_service`) every
charge and lift is reported, and :meth:`SchedulerCore.raise_counters` takes back the pool's
fleet-wide counters, so the VTC order here follows the service every process gave; without one
(the simulator, a single process) nothing changes.

Engine gating — KV watermark, the engine's waiting queue, a running cap and an adaptive limit on
the running batch driven by the engine's step latencies (AIMD) — is :mod:`.gating`'s; the overload
pressure level is :mod:`.pressure`'s; projected waits are :mod:`.projection`'s; Jain's index, the
service gap and snapshot rows are :mod:`.snapshot`'s. This module owns the queues, the VTC order,
admission, dispatch and the charging of running requests.

Costs: a dispatch decision is two lazy-heap look-ups (tier, then tenant) — O(log n) — plus a few
constant-time updates; see ``bench/fairness/bench_scheduler_cost.py``.

Errors: bad requests are refused with :class:`SchedulerRejected` (status 400 for malformed input,
429 for overload, 503 ``no_replica_available`` while no engine replica is open); calls about
unknown or finished grants are ignored; nothing here raises into the serving path for a
well-typed call.

Why this module is longer than ~600 lines: VTC counters, per-tenant queues, KV and prefill
budgets, deadlines and overload shedding are one state machine mutated under one invariant per
event (arrival, dispatch, progress, finish); the simulator and the asyncio adapter both drive
this one object. The tier policy, configuration and pressure levels live in their own modules.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from typing import Iterable, Mapping, Sequence

from kvmeter.clock import SYSTEM_CLOCK, Clock
from kvmeter.serving.tenancy.tiers import PRESSURE_ELEVATED, PRESSURE_NORMAL, PRESSURE_OVERLOAD, TierPolicy
from kvmeter.stats import EngineLoad, SchedulerStats

from ._heap import LazyMinHeap
from .base import CounterLog, Grant, Job, SchedulerRejected
from .config import SchedulerConfig
from .gating import EngineGate, latency_targets, most_free_kv, open_engines
from .policy import OrderingPolicy, make_policy
from .pressure import PressureController, oldest_protected_wait_ratio
from .projection import DrainRateMeter, expected_output_tokens, job_cost, lift_floor, projected_wait
from .router import Route, Router
from .snapshot import FairnessSampler, tenant_stats, tier_stats
from .state import DISPATCHED, GONE, QUEUED, CoreGrant, QueuedJob, TenantState, TierState

__all__ = ["SchedulerCore", "CoreGrant"]

log = logging.getLogger(__name__)

_INF = float("inf")


class SchedulerCore:
    """Synchronous fair scheduler. See the module docstring for the algorithm and bound.

    Args:
        config: limits, weights and tier policies (:class:`SchedulerConfig`; defaults if None).
        policy: ``"vtc"`` (default), ``"fcfs"``, ``"rpm"`` or an :class:`OrderingPolicy`.
        clock: monotonic time source (inject a :class:`~kvmeter.clock.ManualClock` in tests and
            the simulator).
        num_engines: engine replicas this core dispatches to (grants carry ``engine_idx``).
        counter_log: told of every counter charge and lift (a store that shares the counters
            between gateway processes, :mod:`.shared_service`); None (the default, and the
            simulator's): the counters are this process's alone. Shared counters come back
            through :meth:`raise_counters`.
        router: picks the replica among the open ones (:class:`~.router.Router`); None: the most
            free KV (:func:`~.gating.pick_engine`, the simulator's choice).
        model: the served model these engines run (named by the ``no_replica_available``
            refusal); "" when unnamed.
    Raises:
        ValueError: on an unknown policy name or ``num_engines < 1``.
    """

    def __init__(self, config: SchedulerConfig | None = None, *, policy: str | OrderingPolicy = "vtc",
                 clock: Clock = SYSTEM_CLOCK, num_engines: int = 1,
                 counter_log: CounterLog | None = None, router: Router | None = None,
                 model: str = "") -> None:
        self.config = config or SchedulerConfig()
        self.router = router
        self.model = model
        if isinstance(policy, str):
            policy = make_policy(policy, rpm_limit=self.config.rpm_limit,
                                 tenant_rpm_limits=self.config.tenant_rpm_limits)
        if not isinstance(policy, OrderingPolicy):
            raise ValueError(f"policy must be a name or an OrderingPolicy, got {policy!r}")
        if num_engines < 1:
            raise ValueError(f"num_engines must be ≥ 1, got {num_engines}")
        self.policy = policy
        self._clock = clock
        self._tiers: dict[str, TierState] = {}
        self._tenants: dict[str, TenantState] = {}
        self._active_tiers: LazyMinHeap[TierState] = LazyMinHeap(policy.tier_key)
        self._paused_tiers: LazyMinHeap[TierState] = LazyMinHeap(policy.tier_key)
        self._backlogged_tiers: set[TierState] = set()
        self._backlogged_tier_weight = 0.0
        self._tier_vtime = 0.0
        self._engines = [EngineGate(i, self.config) for i in range(num_engines)]
        self._latency_targets: tuple[float | None, float | None] = (None, None)
        self._queued: dict[str, QueuedJob] = {}
        self._running: dict[str, CoreGrant] = {}
        self._deadlines: list[tuple[float, int, QueuedJob]] = []
        self._seq = itertools.count(1)
        self._queued_total = 0
        self._queued_cost_total = 0.0
        self._rate = DrainRateMeter(self.config.rate_window_s)
        self._dropped: list[tuple[Job, SchedulerRejected]] = []
        self.rejected_total: dict[str, int] = {}
        self.dropped_total: dict[str, int] = {}
        self._pressure = PressureController(self.config)
        self._next_pressure_eval = -_INF
        self._fairness = FairnessSampler(self.config.stats_window_s)
        self._n_backlogged = 0
        self.service_total = 0.0
        self.counter_log = counter_log
        #: shared counters of tenants not seen here yet (their start value when they arrive)
        self._shared_counters: dict[str, float] = {}

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
        return self._fairness.next_sample_s

    @property
    def pressure_level(self) -> int:
        """0 normal, 1 elevated, 2 overload (see :mod:`.pressure`)."""
        return self._pressure.level

    @property
    def protected_wait_ratio(self) -> float:
        """Smoothed oldest queue wait of the protected tiers ÷ their TTFT SLO (drives pressure)."""
        return self._pressure.protected_wait_ratio

    @property
    def protected_itl_ratio(self) -> float:
        """Smoothed TPOT of completed protected requests ÷ their ITL SLO (drives pressure)."""
        return self._pressure.protected_itl_ratio

    @property
    def service_gap(self) -> float:
        """Largest VTC counter spread between backlogged tenants of a tier at the last sample."""
        return self._fairness.service_gap

    @property
    def max_service_gap(self) -> float:
        """The largest :attr:`service_gap` seen since start."""
        return self._fairness.max_service_gap

    @property
    def engine_gates(self) -> tuple[EngineGate, ...]:
        """Per engine replica (by index), its :class:`~.gating.EngineGate`: the last load report,
        outstanding work and the adaptive running limit with its decision counters. For reading;
        the core updates them."""
        return tuple(self._engines)

    def engine_limits(self) -> list[int | None]:
        """Per engine, the adaptive running limit now (None: inactive, the static caps apply)."""
        return [e.adaptive.bound() if e.adaptive is not None else None for e in self._engines]

    def queue_depth_by_tier(self) -> dict[str, int]:
        """Queued requests per tier (tiers seen so far)."""
        return {name: sum(t.n_queued for t in tier.backlogged) for name, tier in self._tiers.items()}

    def backlogged_service_rates(self, min_time_s: float = 0.0) -> dict[str, float]:
        """Per tenant, weight-normalised service per second while backlogged, since start
        (the ``xᵢ`` of the run's Jain's index; see :mod:`.fairness`)."""
        return self._fairness.meter.rates(min_time_s, whole_run=True)

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
    def _tier(self, name: str) -> TierState:
        tier = self._tiers.get(name)
        if tier is None:
            tier = TierState(self.config.tier(name), self.policy)
            tier.paused = tier.policy.pause_at is not None and self.pressure_level >= tier.policy.pause_at
            self._tiers[name] = tier
            self._latency_targets = latency_targets((x.policy for x in self._tiers.values()), self.config)
        return tier

    def _tenant(self, tenant_id: str, tier_name: str) -> TenantState:
        t = self._tenants.get(tenant_id)
        if t is None:
            tier = self._tier(tier_name if tier_name in self.config.tiers else self.config.default_tier)
            t = TenantState(tenant_id, tier, float(self.config.tenant_weights.get(tenant_id, 1.0)))
            t.counter = self._shared_counters.pop(tenant_id, 0.0)
            tier.tenants[tenant_id] = t
            self._tenants[tenant_id] = t
        return t

    def _make_eligible(self, t: TenantState) -> None:
        tier = t.tier
        tier.order.push(t)
        if tier.counters is not tier.order:
            tier.counters.push(t)
        tier.n_eligible += 1
        # (re)file the tier: first eligible tenant, or an order key that may have decreased (FCFS)
        if tier.n_eligible == 1 or not self.policy.counter_ordered:
            (self._paused_tiers if tier.paused else self._active_tiers).push(tier)

    def _make_ineligible(self, t: TenantState) -> None:
        tier = t.tier
        tier.order.remove(t)
        if tier.counters is not tier.order:
            tier.counters.remove(t)
        tier.n_eligible -= 1
        if tier.n_eligible == 0:
            self._active_tiers.remove(tier)
            self._paused_tiers.remove(tier)

    def _on_backlogged(self, t: TenantState) -> None:
        """``t``'s queue went from empty to non-empty: VTC counter lift, then eligibility."""
        tier = t.tier
        # Lift (Sheng et al., Alg. 1): idle time banks no credit. The floor is the least counter
        # of the backlogged tenants, or — when none is backlogged — the counter of the last tenant
        # that left the backlog (the system's virtual time, as in start-time fair queueing).
        # The floor credits output already committed: a tenant whose queue ran dry while its
        # running requests still have more output to stream than the least one's is not idle —
        # that output will be charged as it streams, so lifting it to the least counter as well
        # would charge it twice (issue 17 item 3: many short requests behind few long prompts).
        low = tier.counters.top()
        if low is not None and low is not t:
            floor = lift_floor(t, low, self.config.output_weight)
        else:  # the last leaver keeps being charged for the output it streams after leaving
            floor = max(tier.vtime, tier.last_leaver.counter if tier.last_leaver is not None else 0.0)
        if floor > t.counter:
            t.counter = floor
            if self.counter_log is not None:
                self.counter_log.lifted(t.id, floor)
        if not tier.backlogged:
            others = [x.counter for x in self._backlogged_tiers if x is not tier]
            tier.counter = max(tier.counter, min(others) if others else self._tier_vtime)
            self._backlogged_tiers.add(tier)
            self._backlogged_tier_weight += tier.weight
        tier.backlogged.add(t)
        tier.backlogged_weight += t.weight
        tier.backlogged_wc += t.weight * t.counter
        self._n_backlogged += 1
        if not t.kv_blocked:
            self._make_eligible(t)

    def _on_idle(self, t: TenantState) -> None:
        """``t``'s queue became empty."""
        tier = t.tier
        if t.kv_blocked:
            t.kv_blocked = False
        else:
            self._make_ineligible(t)
        tier.backlogged.discard(t)
        tier.backlogged_weight = max(0.0, tier.backlogged_weight - t.weight)
        tier.backlogged_wc -= t.weight * t.counter
        if not tier.backlogged:  # (no float residue carried into the next backlog)
            tier.backlogged_weight = tier.backlogged_wc = tier.queued_cost = 0.0
        self._n_backlogged -= 1
        tier.vtime = max(tier.vtime, t.counter)
        tier.last_leaver = t
        if not tier.backlogged:
            self._tier_vtime = max(self._tier_vtime, tier.counter)
            self._backlogged_tiers.discard(tier)
            self._backlogged_tier_weight = max(0.0, self._backlogged_tier_weight - tier.weight)

    def _kv_budget(self, t: TenantState) -> int:
        override = self.config.tenant_kv_budget_tokens.get(t.id)
        if override is not None:
            return int(override)
        ratio = self.config.tenant_kv_budget_ratio
        if ratio is None:
            return 0
        return int(ratio * sum(e.capacity for e in self._engines))

    # ------------------------------------------------------------------ admission
    def _deadline_of(self, job: Job, tier: TierPolicy) -> float | None:
        """The job's own deadline, else its tier's rule (:meth:`TierPolicy.deadline_s`); none
        without overload control."""
        if not self.config.overload_control:
            return None
        if job.deadline_s is not None:
            return job.deadline_s
        return tier.deadline_s(job.arrival_s)

    def _admission_error(self, job: Job, now: float) -> SchedulerRejected | None:
        cfg = self.config
        if not isinstance(job, Job):
            return SchedulerRejected("invalid", f"expected a Job, got {type(job).__name__}",
                                     status_code=400)
        if not job.tenant_id or not job.request_id:
            return SchedulerRejected("invalid", "job needs a tenant_id and a request_id", status_code=400)
        if not isinstance(job.input_tokens, int) or job.input_tokens < 0 or \
                not isinstance(job.max_tokens, int) or job.max_tokens < 0:
            return SchedulerRejected(
                "invalid", f"input_tokens and max_tokens must be integers ≥ 0 "
                f"(got {job.input_tokens!r}, {job.max_tokens!r})", status_code=400)
        if job.request_id in self._queued or job.request_id in self._running:
            return SchedulerRejected("invalid", f"request {job.request_id!r} is already scheduled",
                                     status_code=400)
        no_replica = self.no_replica()
        if no_replica is not None:
            return no_replica
        tier_policy = cfg.tier(job.tier)
        biggest = max(e.capacity for e in self._engines)
        if biggest and job.input_tokens > cfg.kv_watermark_high * biggest:
            return SchedulerRejected(
                "kv_capacity_exceeded",
                f"prompt of {job.input_tokens} tokens exceeds the engine's KV room "
                f"({int(cfg.kv_watermark_high * biggest)} tokens)", status_code=400)
        t = self._tenants.get(job.tenant_id)
        refusal = self.policy.admission(t or TenantState(job.tenant_id, self._tier(tier_policy.name), 1.0), now)
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
        fair_slots = self._fair_queue_slots(t)
        if fair_slots is not None and t is not None and t.n_queued + 1 > fair_slots:
            return SchedulerRejected(
                "queue_full", f"the queue is {self._queued_total / cfg.max_queued_total:.0%} full and tenant "
                f"{job.tenant_id!r} holds {t.n_queued} of it, its fair share ({fair_slots:.0f})",
                retry_after_s=self._projected_wait(t, now))
        deadline = self._deadline_of(job, tier_policy)
        if deadline is not None:
            if now >= deadline:
                return SchedulerRejected("deadline", "the request's deadline has already passed",
                                         retry_after_s=0.0)
            if cfg.reject_on_projected_wait and t is not None:
                wait = self._projected_wait(t, now)
                lead = min(e.first_token_lead_s(job.input_tokens) for e in self._engines)
                if wait + lead > deadline - now:
                    return SchedulerRejected(
                        "projected_wait",
                        f"projected queue wait {wait:.1f} s (+ {lead:.1f} s to a first token) exceeds the "
                        f"{deadline - now:.1f} s left before the request's deadline", retry_after_s=wait)
        return None

    def _fair_queue_slots(self, t: TenantState | None) -> float | None:
        """Queue slots ``t`` may hold once the global queue is ``overload_queue_fill`` full (with
        overload control): its weighted share — tier weight over the backlogged tiers', tenant
        weight over its tier's backlogged tenants' — of that fill. None while the rule is off (the
        queue below the fill, overload control off, or ``t`` with nothing queued: a tenant under
        its share may always take the free slots above the fill, so a queue filled by one tenant
        does not refuse the next one)."""
        cfg = self.config
        fill = cfg.overload_queue_fill * cfg.max_queued_total
        if not cfg.overload_control or t is None or not t.n_queued or self._queued_total < fill:
            return None
        tier = t.tier
        share = (tier.weight / self._backlogged_tier_weight) * (t.weight / tier.backlogged_weight)
        return share * fill

    def check_admission(self, job: Job) -> None:
        """Refuse early if ``job`` cannot be queued or served in time.

        Raises:
            SchedulerRejected: ``invalid`` (400), ``no_replica_available`` (503: no engine
                replica can take work, :meth:`no_replica`), ``kv_capacity_exceeded`` (400),
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
        qj = QueuedJob(job, next(self._seq), t, self._deadline_of(job, tier_policy), job_cost(self.config, t, job))
        t.queue.append(qj)
        if tier_policy.protected and tier_policy.ttft_slo_s is not None and self.config.overload_control:
            t.tier.fifo.append(qj)  # for the pressure signal's oldest-wait look-up
        t.n_queued += 1
        t.queued_input += job.input_tokens
        t.queued_cost += qj.cost
        t.tier.queued_cost += qj.cost
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

    def _unqueue(self, qj: QueuedJob, state: int) -> None:
        """Take a queued job out (dispatched or gone); keeps every total consistent."""
        t = qj.tenant
        qj.state = state
        self._queued.pop(qj.job.request_id, None)
        t.n_queued -= 1
        t.queued_input -= qj.job.input_tokens
        t.queued_cost -= qj.cost
        t.tier.queued_cost -= qj.cost
        self._queued_total -= 1
        self._queued_cost_total -= qj.cost
        if not self._queued_total:
            self._rate.mark(self._clock.monotonic(), False)
        if t.n_queued == 0:
            t.queued_cost = 0.0
            self._on_idle(t)

    def _drop(self, qj: QueuedJob, reason: str, message: str, retry_after_s: float | None = None,
              status_code: int = 429) -> None:
        self._unqueue(qj, GONE)
        self.dropped_total[reason] = self.dropped_total.get(reason, 0) + 1
        self._dropped.append((qj.job, SchedulerRejected(reason, message, retry_after_s=retry_after_s,
                                                        status_code=status_code)))

    def cancel(self, request_id: str) -> bool:
        """Remove a queued job (client gone). Returns True if it was queued."""
        qj = self._queued.get(request_id)
        if qj is None or qj.state != QUEUED:
            return False
        self._unqueue(qj, GONE)
        self.dropped_total["cancelled"] = self.dropped_total.get("cancelled", 0) + 1
        return True

    def take_dropped(self) -> list[tuple[Job, SchedulerRejected]]:
        """Jobs dropped from the queues since the last call (deadline, shed, capacity), with why."""
        out, self._dropped = self._dropped, []
        return out

    # ------------------------------------------------------------------ dispatch
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
            candidates = open_engines(self._engines, cfg)
            if not candidates:
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
            route = None
            if self.router is not None:
                route = self.router.choose(candidates, job.prefix_blocks, cfg, job.input_tokens)
                engine = route.engine
            else:
                engine = most_free_kv(candidates) or candidates[0]
            if qj.deadline is not None and now + engine.first_token_lead_s(job.input_tokens) >= qj.deadline:
                # (the deadline is the first token's: dispatching a request that cannot make it
                # would spend the engine on a missed objective)
                self._drop(qj, "deadline", "the request's first token could not arrive before its deadline", 0.0)
                continue
            need = job.input_tokens
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
            if route is not None and self.router is not None:
                self.router.commit(route, job.prefix_blocks)
        return grants

    def set_engine_available(self, engine_idx: int, available: bool, down: bool = False) -> None:
        """Open or close replica ``engine_idx`` to new requests (``down``: closed because it is
        unhealthy; else drained by an operator); its running requests go on. A replica that comes
        back is forgotten by the router's prefix index when it went down (its cache is gone).

        When this closes the last open replica, every queued request is dropped at once with
        :meth:`no_replica`'s 503 (collected for :meth:`take_dropped`) rather than left to wait
        for its deadline — or, without one, forever; new requests are refused the same way at
        admission until a replica opens again.

        Raises:
            ValueError: for an engine index outside ``range(num_engines)``.
        """
        if not 0 <= engine_idx < len(self._engines):
            raise ValueError(f"engine_idx {engine_idx} outside 0..{len(self._engines) - 1}")
        e = self._engines[engine_idx]
        if e.available and not available and self.router is not None:
            self.router.index.forget(engine_idx)
        e.available = available
        e.down = down and not available
        refusal = self.no_replica()
        if refusal is not None and self._queued_total:
            for qj in list(self._queued.values()):
                if qj.state == QUEUED:
                    self._drop(qj, refusal.reason, refusal.message, refusal.retry_after_s, refusal.status_code)

    def no_replica(self) -> SchedulerRejected | None:
        """The refusal while no engine replica may take new requests — every one down or drained —,
        else None: 503 ``no_replica_available``, naming the model and how many replicas are down
        (unreachable, until a probe or scrape succeeds) and how many an operator drained. Nothing
        ran, so nothing is billed (the gateway's rule for a scheduler refusal)."""
        if any(e.available for e in self._engines):
            return None
        n = len(self._engines)
        down = sum(e.down for e in self._engines)
        model = f"model {self.model!r}" if self.model else "the model"
        every = "its one replica is" if n == 1 else f"all {n} of its replicas are"
        if down == n:
            state = f"{every} down (unreachable; served again once one answers)"
        elif down == 0:
            state = f"{every} drained by an operator"
        else:
            state = f"its {n} replicas are down ({down}) or drained by an operator ({n - down})"
        return SchedulerRejected("no_replica_available", f"no replica of {model} can take requests: {state}",
                                 status_code=503)

    def reroute(self, grant: Grant) -> int | None:
        """Move a dispatched request that its replica failed before answering to another
        available replica (an open one first, through the router: outcome ``failover``); its
        engine accounting moves with it.

        Returns:
            The new replica's index, or None when no other replica is available (the grant stays).
        """
        g = self._running.get(grant.job.request_id)
        if g is None:
            return None
        others = [e for e in self._engines if e.idx != g.engine_idx and e.available]
        if not others:
            return None
        pool = [e for e in open_engines(others, self.config)] or others
        if self.router is not None:
            route = self.router.choose(pool, g.job.prefix_blocks, self.config, g.job.input_tokens)
            route = Route(route.engine, "failover", route.matched_blocks)
        else:
            route = Route(most_free_kv(pool) or pool[0], "failover")
        old, new = self._engines[g.engine_idx], route.engine
        old.outstanding -= 1
        new.outstanding += 1
        new.since_report += 1
        if not g.started:
            old.unstarted -= 1
            old.unstarted_tokens -= g.job.input_tokens
            g.ahead_tokens, g.on_engine_s = new.unstarted_tokens, self._clock.monotonic()
            new.unstarted += 1
            new.unstarted_tokens += g.job.input_tokens
        g.engine_idx = grant.engine_idx = new.idx
        if self.router is not None:
            self.router.commit(route, g.job.prefix_blocks)
        return new.idx

    def _over_budget(self, t: TenantState, need: int) -> bool:
        """Would dispatching a ``need``-token prompt put ``t`` over its KV or prefill budget?
        (A tenant with nothing running, or nothing in prefill, may always dispatch one.)"""
        budget = self._kv_budget(t)
        if budget and t.running > 0 and t.active_kv + need > budget:
            return True
        pb = self.config.tenant_prefill_budget_tokens
        return bool(pb and t.unstarted > 0 and t.unstarted_tokens + need > pb)

    def _maybe_unblock(self, t: TenantState) -> None:
        if not t.kv_blocked:
            return
        nxt = t.head()
        if nxt is None or not self._over_budget(t, nxt.job.input_tokens):
            t.kv_blocked = False
            if t.n_queued:
                self._make_eligible(t)

    def _start(self, qj: QueuedJob, engine: EngineGate, now: float) -> CoreGrant:
        job, t = qj.job, qj.tenant
        self._charge(t, job.input_tokens * self.config.input_weight, now)
        self._unqueue(qj, DISPATCHED)
        priority = t.tier.policy.priority if self.policy.engine_priorities else 0
        expected = expected_output_tokens(self.config, t, job)
        grant = CoreGrant(job=job, dispatched_s=now, priority=priority, engine_idx=engine.idx, tenant_state=t,
                          ahead_tokens=engine.unstarted_tokens, expected_output=expected)
        t.pending_output += expected
        self._running[job.request_id] = grant
        engine.outstanding += 1
        engine.unstarted += 1
        engine.unstarted_tokens += job.input_tokens
        engine.since_report += 1
        t.unstarted += 1
        t.unstarted_tokens += job.input_tokens
        t.running += 1
        t.tier.running += 1
        t.active_kv += job.input_tokens
        t.dispatched += 1
        t.wait_sum += max(0.0, now - job.arrival_s)
        t.in_tokens += job.input_tokens
        return grant

    def _charge(self, t: TenantState, cost: float, now: float) -> None:
        t.service += cost
        t.counter += cost / t.weight
        if self.counter_log is not None:
            self.counter_log.charged(t.id, cost / t.weight)
        if t.n_queued:  # backlogged: its weight × counter is in the tier's sum
            t.tier.backlogged_wc += cost
        t.tier.counter += cost / t.tier.weight
        self.service_total += cost
        self._rate.add(now, cost)

    def raise_counters(self, counters: Mapping[str, float]) -> int:
        """Raise tenants' VTC counters to shared values (service given by other gateway processes,
        :mod:`.shared_service`); a counter never goes down.

        A raise is service given elsewhere: it is added to the tier's counter too (``Δ × tenant
        weight / tier weight``, as :meth:`_charge` does) but not to the tenant's ``service`` here,
        which stays this process's own. The order heaps tolerate keys that grow in place
        (:mod:`._heap`). A tenant not seen here yet starts at its shared counter when it arrives.

        Args:
            counters: tenant id → counter (weight-normalised service units).
        Returns:
            How many known tenants' counters rose.
        """
        raised = 0
        for tenant_id, value in counters.items():
            t = self._tenants.get(tenant_id)
            if t is None:
                if value > self._shared_counters.get(tenant_id, 0.0):
                    self._shared_counters[tenant_id] = value
                continue
            delta = value - t.counter
            if not delta > 0:
                continue
            t.counter = value
            if t.n_queued:  # backlogged: its weight × counter is in the tier's sum
                t.tier.backlogged_wc += t.weight * delta
            t.tier.counter += delta * t.weight / t.tier.weight
            raised += 1
        return raised

    # ------------------------------------------------------------------ running requests
    def charge_output(self, grant: Grant, tokens: int) -> None:
        """Charge ``tokens`` newly streamed output tokens to the grant's tenant.

        The first call with ``tokens > 0`` marks the request started (its prompt is then in the
        engine's KV report), records its time to first token and adds it to the replica's
        first-token lead model (:class:`~.gating.FirstTokenLead`).
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
        t.pending_output -= max(0.0, g.expected_output - g.output_tokens) - \
            max(0.0, g.expected_output - (g.output_tokens + tokens))
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
            e.unstarted_tokens -= g.job.input_tokens
            t.unstarted -= 1
            t.unstarted_tokens -= g.job.input_tokens
            # the first-token lead model's sample: what it waited on, how long (see .gating)
            since = g.dispatched_s if math.isnan(g.on_engine_s) else g.on_engine_s
            e.lead.observe(g.ahead_tokens + g.job.input_tokens, now - since)
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
            e.unstarted_tokens -= g.job.input_tokens
            t.unstarted -= 1
            t.unstarted_tokens -= g.job.input_tokens
        t.running -= 1
        t.tier.running -= 1
        t.pending_output = max(0.0, t.pending_output - max(0.0, g.expected_output - g.output_tokens)) \
            if t.running else 0.0
        t.active_kv -= g.job.input_tokens + g.output_tokens
        t.completed += 1
        n = g.output_tokens
        t.ewma_out = n if t.ewma_out is None else 0.8 * t.ewma_out + 0.2 * n
        self._record_slo(t, g, now)
        self._maybe_unblock(t)

    def _record_slo(self, t: TenantState, g: CoreGrant, now: float) -> None:
        tier = t.tier
        pol = tier.policy
        n = g.output_tokens
        tier.completed += 1
        tier.out_tokens += n
        if not g.started:
            return
        ttft = g.first_token_s - g.job.arrival_s
        tpot = (now - g.first_token_s) / (n - 1) if n > 1 else 0.0
        if pol.meets_slo(ttft, tpot):
            tier.slo_met += 1
            tier.good_tokens += n
        if pol.protected and pol.itl_slo_s is not None and n > 1:
            self._pressure.record_protected_tpot(tpot / pol.itl_slo_s)

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

    def observe_engine_latency(self, engine_idx: int, *, itl_sum_s: float = 0.0, itl_count: int = 0,
                               ttfts_s: Sequence[float] = ()) -> None:
        """Record one engine step's latencies for the adaptive running limit (:mod:`.gating`).

        The serving path passes the engine hooks' step stats (vLLM ``IterationStats``: its
        ``inter_token_latencies_iter`` and ``time_to_first_tokens_iter``), the simulator its
        replica's step outcome — the same numbers from either engine.

        Args:
            engine_idx: the reporting engine.
            itl_sum_s, itl_count: the step's inter-token latencies (seconds) summed, and how many.
            ttfts_s: engine-side times to first token (engine arrival → first token, seconds) of
                the requests that produced their first token in the step.
        Raises:
            ValueError: for an engine index outside ``range(num_engines)``, a negative count or
                a negative or non-finite latency.
        """
        if not 0 <= engine_idx < len(self._engines):
            raise ValueError(f"engine_idx {engine_idx} outside 0..{len(self._engines) - 1}")
        if itl_count < 0 or not 0.0 <= itl_sum_s < _INF or any(not 0.0 <= x < _INF for x in ttfts_s):
            raise ValueError(f"bad latency report: itl_sum_s={itl_sum_s!r}, itl_count={itl_count!r}")
        gate = self._engines[engine_idx].adaptive
        if gate is not None:
            gate.observe(itl_sum_s, itl_count, ttfts_s)

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
            if qj.state == QUEUED:
                self._drop(qj, "deadline", "the request's deadline passed while it was queued", 0.0)

    def tick(self, now: float | None = None) -> None:
        """Deadline drops, engine-limit control, pressure re-evaluation and fairness sampling due
        at ``now`` (cheap when nothing is due: a few comparisons)."""
        if now is None:
            now = self._clock.monotonic()
        self._expire(now)
        itl_target, ttft_target = self._latency_targets
        queue_ratio = None
        for e in self._engines:
            if e.adaptive is not None and e.adaptive.due(now):
                if queue_ratio is None:  # (protected tiers' queues are tracked with overload control on)
                    queue_ratio = oldest_protected_wait_ratio(self._tiers.values(), now) / \
                        (1.0 - self.config.engine_ttft_target_ratio)
                e.adaptive.update(now, e.outstanding, itl_target, ttft_target, queue_ratio)
        if self.config.overload_control and now >= self._next_pressure_eval:
            self._next_pressure_eval = now + self.config.pressure_eval_interval_s
            protected_active = any(t.policy.protected and (t.running or t.backlogged) for t in self._tiers.values())
            level = self._pressure.evaluate(now, self._queued_total / self.config.max_queued_total,
                                            oldest_protected_wait_ratio(self._tiers.values(), now),
                                            protected_active=protected_active)
            if level != self._pressure.level:
                self.set_pressure_level(level)
        if self._fairness.due(now):
            self._fairness.sample(now, self._tiers.values(), self._backlogged_tier_weight)

    def set_pressure_level(self, level: int) -> None:
        """Apply pressure ``level`` (0–2): pause / unpause tiers and drop shed-able queued work.

        Normally set by the core itself from queue fill and protected-tier waits (:mod:`.pressure`);
        public so an operator (or a test) can force it. Raises ValueError outside 0–2.
        """
        if level not in (PRESSURE_NORMAL, PRESSURE_ELEVATED, PRESSURE_OVERLOAD):
            raise ValueError(f"pressure level must be 0, 1 or 2, got {level!r}")
        self._pressure.set_level(level, self._clock.monotonic())
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
                        if qj.state == QUEUED:
                            self._drop(qj, "shed", f"overloaded: queued {pol.name} work is shed",
                                       self._shed_retry_after(self._clock.monotonic()))

    def _shed_retry_after(self, now: float) -> float:
        return max(1.0, 2.0 * self.config.pressure_eval_interval_s)

    # ------------------------------------------------------------------ projections and stats
    def _projected_wait(self, t: TenantState | None, now: float) -> float:
        if not self._queued_total:
            return 0.0
        # a paused tier is served nothing: the backlogged tiers that are not share the drain rate
        active_w = sum(x.weight for x in self._backlogged_tiers if not x.paused)
        return projected_wait(t, rate=self._rate.rate(now), queued_cost_total=self._queued_cost_total,
                              backlogged_tier_weight=active_w, counter_ordered=self.policy.counter_ordered,
                              output_weight=self.config.output_weight)

    def projected_wait(self, tenant_id: str, tier: str | None = None) -> float:
        """Projected queue wait (seconds) of a new request of ``tenant_id`` (of ``tier`` when the
        tenant is new): :func:`.projection.projected_wait` at the drain rate measured while
        requests were queued. 0.0 when nothing is queued or no rate has been measured yet."""
        now = self._clock.monotonic()
        t = self._tenants.get(tenant_id)
        if t is None and self.policy.counter_ordered:
            name = tier if tier is not None and tier in self.config.tiers else self.config.default_tier
            t = TenantState(tenant_id, self._tier(name), float(self.config.tenant_weights.get(tenant_id, 1.0)))
        return self._projected_wait(t, now)

    def snapshot(self, include_tenants: bool = True) -> SchedulerStats:
        """The current :class:`SchedulerStats` (O(tenants) when ``include_tenants``)."""
        now = self._clock.monotonic()
        tenants = [tenant_stats(t, now, projected_wait_s=self._projected_wait(t, now),
                                kv_budget_tokens=self._kv_budget(t))
                   for t in self._tenants.values()] if include_tenants else []
        return SchedulerStats(
            wall_ts=self._clock.wall(), policy=self.policy.name, pressure_level=self.pressure_level,
            queued_total=self._queued_total, running_total=len(self._running),
            service_rate_per_s=self._rate.rate(now), jain_index=self._fairness.jain_index(),
            max_service_gap=self.max_service_gap, service_gap=self.service_gap,
            rejected_total=dict(self.rejected_total), dropped_total=dict(self.dropped_total),
            engines_kv_watermark=[e.load.kv_watermark_ratio for e in self._engines],
            engines_running_limit=[e.running_limit(self.config) for e in self._engines],
            tiers=[tier_stats(tier) for tier in self._tiers.values()], tenants=tenants)

    def tenants(self) -> Iterable[str]:
        """Ids of every tenant seen."""
        return list(self._tenants)
