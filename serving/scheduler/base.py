"""The scheduler boundary: what the gateway asks of a scheduler, and the default pass-through.

The gateway calls, per admitted request::

    scheduler.check_admission(job)        # early: raises SchedulerRejected (429 + Retry-After)
    grant = await scheduler.acquire(job)  # waits in the tenant's queue until dispatched
    try:
        ... stream; scheduler.charge_output(grant, n) for each n output tokens ...
    finally:
        scheduler.release(grant)

Cancelling the task blocked in :meth:`Scheduler.acquire` (the client went away while queued) must
remove the job from its queue. Implementations: :class:`PassThroughScheduler` here (no queue: the
engine's own FCFS decides), and the fair scheduler (VTC) in this package.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Protocol

from kvmeter.attribution import Attribution
from kvmeter.clock import SYSTEM_CLOCK, Clock
from kvmeter.errors import Refusal

__all__ = ["Job", "Grant", "Scheduler", "SchedulerRejected", "PassThroughScheduler", "CounterLog"]


@dataclass(slots=True)
class Job:
    """A request waiting for dispatch.

    Attributes:
        request_id: kvmeter request id.
        attribution: the request's; its tenant is the queue the job waits in (:attr:`tenant_id`),
            its tier (:attr:`tier`) sets the fairness weight, shedding order and engine priority.
        input_tokens: input tokens (charged to the tenant's service at dispatch).
        max_tokens: output ceiling (bounds the KV the request can grow to).
        arrival_s: monotonic seconds at gateway arrival.
        deadline_s: monotonic seconds by which the first token is due, or ``None``.
        prefix_blocks: the prompt's prefix block hashes
            (:func:`~kvmeter.serving.scheduler.router.prefix_block_hashes`), for an engine pool's
            prefix-aware routing; empty when unknown or not routed.
    """

    request_id: str
    attribution: Attribution
    input_tokens: int
    max_tokens: int
    arrival_s: float
    deadline_s: float | None = None
    prefix_blocks: tuple[int, ...] = ()

    @property
    def tenant_id(self) -> str:
        """The tenant whose queue the job waits in (``attribution.tenant_id``)."""
        return self.attribution.tenant_id

    @property
    def tier(self) -> str:
        """The tenant's tier (``attribution.tier``)."""
        return self.attribution.tier


@dataclass(slots=True)
class Grant:
    """A dispatched job. ``priority`` is the engine priority to submit with (lower runs first);
    ``engine_idx`` the engine replica to submit to (0 with a single engine)."""

    job: Job
    dispatched_s: float
    priority: int = 0
    output_tokens: int = 0
    extra: dict = field(default_factory=dict)
    engine_idx: int = 0


class SchedulerRejected(Refusal):
    """The scheduler refuses or drops the job (a :class:`~kvmeter.errors.Refusal`).

    Attributes:
        code: ``queue_full``, ``projected_wait``, ``deadline``, ``shed`` (overload by tier), ...
            (also readable as ``reason``, the word the scheduler's counters use).
        retry_after_s: seconds the client should wait before retrying (≥ 0), or ``None``.
        status_code: HTTP status (429 for overload; 503 for ``no_replica_available``, an engine
            pool with every replica down or drained; 504 never — a missed deadline is answered 429
            or 503 early rather than a late timeout).
        level, dimension: ``global`` and ``scheduler`` (the admission decision's labels); the
            error body does not carry them.
    """

    status_code = 429

    def __init__(self, reason: str, message: str, *, retry_after_s: float | None = None,
                 status_code: int = 429) -> None:
        super().__init__(message, status_code=status_code, code=reason, retry_after_s=retry_after_s,
                         level="global", dimension="scheduler")

    @property
    def reason(self) -> str:
        """The same as :attr:`code`."""
        return self.code or ""


class Scheduler(abc.ABC):
    """Decides which tenant's request goes to the engine next."""

    @abc.abstractmethod
    def check_admission(self, job: Job) -> None:
        """Reject early (before any queueing) if the job cannot be served in time.

        Raises:
            SchedulerRejected: queue bounds hit, projected wait past the deadline, tier shed.
        """

    @abc.abstractmethod
    async def acquire(self, job: Job) -> Grant:
        """Wait until the job is dispatched; returns its grant.

        Raises:
            SchedulerRejected: the job was dropped while queued (deadline passed, shed).
            asyncio.CancelledError: propagated after removing the job from its queue.
        """

    @abc.abstractmethod
    def charge_output(self, grant: Grant, tokens: int) -> None:
        """Charge ``tokens`` (≥ 0) newly streamed output tokens to the grant's tenant."""

    def reroute(self, grant: Grant) -> int | None:
        """Move a dispatched request whose replica failed before answering to another replica of
        the pool; returns the new replica's index, or None (no other replica: the default)."""
        return None

    @abc.abstractmethod
    def release(self, grant: Grant) -> None:
        """The dispatched request ended (any outcome); free its slot and KV accounting."""


class PassThroughScheduler(Scheduler):
    """No kvmeter queue: every admitted job dispatches at once; the engine's FCFS decides.

    This is FCFS as far as kvmeter is concerned and is the baseline the fair scheduler is measured
    against. It still counts running jobs and charged tokens so its stats stay meaningful.
    """

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self._clock = clock
        self.running = 0
        self.output_tokens_total = 0

    def check_admission(self, job: Job) -> None:
        return None

    async def acquire(self, job: Job) -> Grant:
        self.running += 1
        return Grant(job=job, dispatched_s=self._clock.monotonic())

    def charge_output(self, grant: Grant, tokens: int) -> None:
        grant.output_tokens += tokens
        self.output_tokens_total += tokens

    def release(self, grant: Grant) -> None:
        self.running -= 1


class CounterLog(Protocol):
    """What a :class:`~kvmeter.serving.scheduler.core.SchedulerCore` tells about its VTC counters
    (weight-normalised service units), for a store that shares them between processes
    (:mod:`kvmeter.serving.scheduler.shared_service`). Both calls are synchronous and must not
    block: they only record.
    """

    def charged(self, tenant_id: str, counter_delta: float) -> None:
        """The tenant's counter grew by ``counter_delta`` (≥ 0) for service given here."""

    def lifted(self, tenant_id: str, counter: float) -> None:
        """The tenant's counter was lifted to ``counter`` on its return (VTC's lift rule)."""
