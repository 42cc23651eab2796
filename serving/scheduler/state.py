"""The scheduler core's bookkeeping records: a queued job, a tenant, a tier and a dispatched grant.

Plain mutable records with ``__slots__`` (a decision touches a few of them; see the cost figures in
``bench/fairness/RESULTS.md``). They are internal to :mod:`kvmeter.serving.scheduler`: the core
(:mod:`.core`) owns and mutates them; the ordering policies (:mod:`.policy`), the wait projection
(:mod:`.projection`), the pressure controller (:mod:`.pressure`) and the snapshot builders
(:mod:`.snapshot`) read them. Engine-side state is :class:`~.gating.EngineGate`'s.

Units: token counts in tokens; ``service``/``counter`` in VTC service units (``input_weight ×
prompt tokens + output_weight × output tokens``, the counter divided by the weight); times in
monotonic-clock seconds.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmeter.serving.tenancy.tiers import TierPolicy

from ._heap import LazyMinHeap
from .base import Grant, Job

if TYPE_CHECKING:  # pragma: no cover
    from .policy import OrderingPolicy

__all__ = ["QUEUED", "DISPATCHED", "GONE", "QueuedJob", "TenantState", "TierState", "CoreGrant"]

#: A queued job's state.
QUEUED, DISPATCHED, GONE = 0, 1, 2
_INF = float("inf")


class QueuedJob:
    """A queued job and its bookkeeping.

    Attributes:
        job: the job.
        seq: global arrival sequence number (FCFS order; ≥ 1).
        tenant: its tenant's state.
        state: ``QUEUED``, ``DISPATCHED`` or ``GONE`` (dropped or cancelled); queues drop
            non-queued entries lazily.
        deadline: monotonic seconds by which it must be dispatched, or ``None``.
        cost: its expected service (prompt + expected output, service units), for projections.
    """

    __slots__ = ("job", "seq", "tenant", "state", "deadline", "cost")

    def __init__(self, job: Job, seq: int, tenant: "TenantState", deadline: float | None, cost: float):
        self.job = job
        self.seq = seq
        self.tenant = tenant
        self.state = QUEUED
        self.deadline = deadline
        self.cost = cost


class TenantState:
    """Per-tenant state (identity-hashed; lives in its tier's heaps).

    Attributes:
        id, tier, weight: identity, its tier's state, its weight inside the tier (> 0).
        counter: the VTC counter (weight-normalised service, lifted on re-activation).
        queue: its queued jobs in arrival order (lazy: dispatched/gone entries are skipped).
        n_queued, queued_input, queued_cost: live queued requests, their prompt tokens and cost.
        running: dispatched, unreleased requests; ``active_kv`` their input + output tokens.
        kv_blocked: at its KV or prefill budget (out of the order heap until it progresses).
        unstarted, unstarted_tokens: dispatched requests without a first token and their prompts.
        service, in_tokens, out_tokens: totals charged since start.
        ewma_out: moving average of its requests' output lengths (None before the first).
        pending_output: output tokens its running requests are still expected to stream —
            ``Σ max(0, expected − streamed)`` over them, the expectation fixed at dispatch
            (:func:`~.projection.expected_output_tokens`); the lift credits it (see the core).
        dispatched, completed, wait_sum: counts and the summed queue wait of dispatched requests.
    """

    __slots__ = ("id", "tier", "weight", "counter", "queue", "n_queued", "queued_input",
                 "queued_cost", "running", "active_kv", "kv_blocked", "unstarted", "unstarted_tokens",
                 "service", "in_tokens", "out_tokens", "ewma_out", "pending_output", "dispatched", "completed",
                 "wait_sum")

    def __init__(self, tenant_id: str, tier: "TierState", weight: float) -> None:
        self.id = tenant_id
        self.tier = tier
        self.weight = weight
        self.counter = 0.0
        self.queue: deque[QueuedJob] = deque()
        self.n_queued = 0
        self.queued_input = 0
        self.queued_cost = 0.0
        self.running = 0
        self.active_kv = 0
        self.kv_blocked = False
        self.unstarted = 0
        self.unstarted_tokens = 0
        self.service = 0.0
        self.in_tokens = 0
        self.out_tokens = 0
        self.ewma_out: float | None = None
        self.pending_output = 0.0
        self.dispatched = 0
        self.completed = 0
        self.wait_sum = 0.0

    def head(self) -> QueuedJob | None:
        """The oldest live queued job (dead entries are dropped on the way)."""
        q = self.queue
        while q and q[0].state != QUEUED:
            q.popleft()
        return q[0] if q else None

    def head_seq(self) -> float:
        """Arrival sequence number of the oldest live queued job (inf when none)."""
        h = self.head()
        return _INF if h is None else float(h.seq)


class TierState:
    """Per-tier state: its tenants' order heap, its VTC counter, its goodput counters.

    Attributes:
        name, policy, weight: the tier and its :class:`TierPolicy`.
        counter: the tier's VTC counter (service / tier weight, lifted like a tenant's).
        vtime, last_leaver: the counter of the last tenant that left the backlog (the lift floor
            when nobody is backlogged) and that tenant.
        order: eligible tenants by the policy's key; ``counters``: the same tenants by counter
            (the same heap under VTC).
        backlogged: tenants with queued work; ``backlogged_weight`` their summed weights;
            ``backlogged_wc`` the sum of their ``weight × counter`` (so ``backlogged_wc /
            backlogged_weight`` is their weighted mean counter, the tier's fair-share point);
            ``queued_cost`` the expected service of the tier's queued jobs (service units).
        fifo: the tier's queued jobs in arrival order (lazy; kept for protected tiers only).
        n_eligible: tenants in ``order``; ``paused``: paused by overload control.
        running: the tier's dispatched, unreleased requests.
        tenants: every tenant seen in the tier.
        completed, slo_met, out_tokens, good_tokens: goodput counters of released requests.
    """

    __slots__ = ("name", "policy", "weight", "counter", "vtime", "last_leaver", "order", "counters",
                 "backlogged", "n_eligible", "backlogged_weight", "backlogged_wc", "queued_cost", "paused",
                 "tenants", "completed", "slo_met", "fifo", "out_tokens", "good_tokens", "running")

    def __init__(self, policy: TierPolicy, ordering: "OrderingPolicy") -> None:
        self.name = policy.name
        self.policy = policy
        self.weight = policy.weight
        self.counter = 0.0
        self.vtime = 0.0
        self.last_leaver: TenantState | None = None
        self.order: LazyMinHeap[TenantState] = LazyMinHeap(ordering.tenant_key)
        self.counters: LazyMinHeap[TenantState] = (
            self.order if ordering.counter_ordered else LazyMinHeap(lambda t: t.counter))
        self.backlogged: set[TenantState] = set()
        self.fifo: deque[QueuedJob] = deque()
        self.n_eligible = 0
        self.backlogged_weight = 0.0
        self.backlogged_wc = 0.0
        self.queued_cost = 0.0
        self.paused = False
        self.running = 0
        self.tenants: dict[str, TenantState] = {}
        self.completed = 0
        self.slo_met = 0
        self.out_tokens = 0
        self.good_tokens = 0

    def oldest_queued(self) -> QueuedJob | None:
        """The tier's oldest live queued job from ``fifo`` (protected tiers only), or None."""
        fifo = self.fifo
        while fifo and fifo[0].state != QUEUED:
            fifo.popleft()
        return fifo[0] if fifo else None


@dataclass(slots=True)
class CoreGrant(Grant):
    """A :class:`Grant` with the core's bookkeeping (the gateway only reads :class:`Grant` fields)."""

    tenant_state: TenantState = field(kw_only=True)  # the core always passes it (by keyword)
    started: bool = False
    first_token_s: float = math.nan
    #: prompt tokens of its replica's unstarted requests when it was dispatched (or rerouted) there
    ahead_tokens: int = 0
    #: when it was dispatched (or rerouted) to its current replica (monotonic s; NaN: dispatched_s)
    on_engine_s: float = math.nan
    released: bool = False
    #: output tokens expected at dispatch (:func:`~.projection.expected_output_tokens`)
    expected_output: float = 0.0
