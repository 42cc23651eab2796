"""The asyncio face of the fair scheduler: :class:`FairScheduler` implements the gateway's
:class:`~kvmeter.serving.scheduler.base.Scheduler` contract around one
:class:`~kvmeter.serving.scheduler.core.SchedulerCore` (the same core the simulator drives).

Wiring (gateway side)::

    sched = FairScheduler(SchedulerConfig(...), clock=clock, bus=bus)
    bus.subscribe(EngineStepStats, sched.on_step_stats)   # engine hooks → KV watermark gating
    await sched.start()                                    # periodic tick: deadlines, stats
    ...
    sched.check_admission(job)               # SchedulerRejected → 429 + Retry-After
    grant = await sched.acquire(job)         # waits in the tenant's queue
    engine_request.priority = grant.priority # tier → engine priority (vLLM priority policy)
    try:
        ... for each streamed delta: sched.charge_output(grant, n_new_tokens)
    finally:
        sched.release(grant)
    ...
    await sched.stop()

Dispatch is re-evaluated on every event that can open room or change the order: a submit, a
release, a charge, an engine-load report, a replica opening or closing and each tick. Dropped
queued jobs (deadline, shed, no replica left) make their :meth:`acquire` raise
:class:`SchedulerRejected`. Cancelling a task blocked in
:meth:`acquire` removes its job from the queue (or gives back a grant that raced the
cancellation). Scheduler errors are logged, never raised into the serving path.
"""

from __future__ import annotations

import asyncio
import logging

from kvmeter.aio import PeriodicTask
from kvmeter.bus import StatsBus
from kvmeter.clock import SYSTEM_CLOCK, Clock
from kvmeter.stats import EngineLoad, EngineStepStats, SchedulerStats

from .base import Grant, Job, Scheduler
from .config import SchedulerConfig
from .core import SchedulerCore
from .policy import OrderingPolicy
from .router import Router
from .shared_service import SharedServiceSync

__all__ = ["FairScheduler"]

log = logging.getLogger(__name__)


class FairScheduler(Scheduler):
    """Per-tenant fair queues (VTC by default) for the gateway.

    Args:
        config: :class:`SchedulerConfig` (defaults if None).
        policy: ``"vtc"``, ``"fcfs"``, ``"rpm"`` or an :class:`OrderingPolicy`.
        clock: monotonic time source.
        bus: where :class:`SchedulerStats` are published (every ``stats_interval_s``); None: none.
        num_engines: engine replicas (grants carry ``engine_idx``).
        stats_interval_s: clock seconds between published snapshots (> 0).
        tick_interval_s: real seconds between background ticks once :meth:`start` ran (> 0).
        shared_service: share the VTC counters with the pool's other gateway processes through
            Redis (:mod:`.shared_service`; its sync task runs between :meth:`start` and
            :meth:`stop`); None: this process's counters alone.
        router: an engine pool's replica choice (:class:`~.router.Router`); None: the most free KV.
        model: the served model (named by the ``no_replica_available`` refusal); "" unnamed.
    Raises:
        ValueError: on non-positive intervals (and as :class:`SchedulerCore`).
    """

    def __init__(self, config: SchedulerConfig | None = None, *, policy: str | OrderingPolicy = "vtc",
                 clock: Clock = SYSTEM_CLOCK, bus: StatsBus | None = None, num_engines: int = 1,
                 stats_interval_s: float = 1.0, tick_interval_s: float = 0.1,
                 shared_service: SharedServiceSync | None = None, router: Router | None = None,
                 model: str = "") -> None:
        if not stats_interval_s > 0 or not tick_interval_s > 0:
            raise ValueError("stats_interval_s and tick_interval_s must be > 0")
        self.core = SchedulerCore(config, policy=policy, clock=clock, num_engines=num_engines,
                                  counter_log=shared_service, router=router, model=model)
        self.shared_service = shared_service
        self._clock = clock
        self._bus = bus
        self._stats_interval_s = stats_interval_s
        self._next_stats = clock.monotonic()
        self._waiters: dict[str, asyncio.Future[Grant]] = {}
        self._task = PeriodicTask(self.tick, tick_interval_s, name="kvmeter-scheduler-tick")

    # ---------------------------------------------------------------- Scheduler contract
    def check_admission(self, job: Job) -> None:
        """Raises :class:`SchedulerRejected` when the job would be refused (see the core)."""
        self.core.check_admission(job)

    async def acquire(self, job: Job) -> Grant:
        """Queue ``job`` and wait for its dispatch.

        Raises:
            SchedulerRejected: refused at submit, or dropped while queued (deadline, shed).
            asyncio.CancelledError: after the job was removed from its queue.
        """
        loop = asyncio.get_running_loop()
        self.core.submit(job)
        fut: asyncio.Future[Grant] = loop.create_future()
        self._waiters[job.request_id] = fut
        self._pump()
        try:
            return await fut
        except asyncio.CancelledError:
            self._waiters.pop(job.request_id, None)
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.core.release(fut.result())  # granted as the caller went away: give it back
            else:
                self.core.cancel(job.request_id)
            self._pump()
            raise

    def charge_output(self, grant: Grant, tokens: int) -> None:
        """Charge ``tokens`` streamed output tokens (raises ValueError if negative)."""
        self.core.charge_output(grant, tokens)
        self._pump()

    def release(self, grant: Grant) -> None:
        """Free the grant's slot and KV accounting (idempotent)."""
        self.core.release(grant)
        self._pump()

    # ---------------------------------------------------------------- engine load reports
    def reroute(self, grant: Grant) -> int | None:
        """See :meth:`SchedulerCore.reroute`: the replica the request moved to, or None."""
        return self.core.reroute(grant)

    def set_engine_available(self, engine_idx: int, available: bool, down: bool = False) -> None:
        """See :meth:`SchedulerCore.set_engine_available`; a replica that opens re-evaluates
        dispatch, and the last one closing ends the queued requests' waits (``no_replica_available``)."""
        self.core.set_engine_available(engine_idx, available, down)
        self._pump()

    def on_engine_load(self, load: EngineLoad, engine_idx: int = 0) -> None:
        """Take an engine's load snapshot (e.g. from ``Engine.load()``) and re-evaluate dispatch."""
        try:
            self.core.on_engine_load(load, engine_idx)
        except ValueError:
            log.exception("scheduler: ignoring a bad engine load report")
            return
        self._pump()

    def on_step_stats(self, stats: EngineStepStats) -> None:
        """Bus callback for the engine hooks' :class:`EngineStepStats` (one per engine step): the
        KV and queue load for gating, and the step's ITLs and TTFTs for the adaptive limit."""
        try:
            self.core.observe_engine_latency(stats.engine_idx, itl_sum_s=float(sum(stats.itls_s)),
                                             itl_count=len(stats.itls_s), ttfts_s=stats.ttfts_s)
        except ValueError:
            log.exception("scheduler: ignoring a bad engine latency report")
        capacity = stats.kv_blocks_total * stats.kv_block_size_tokens
        self.on_engine_load(EngineLoad(kv_watermark_ratio=min(1.0, max(0.0, stats.kv_watermark_ratio)),
                                       kv_capacity_tokens=capacity, num_running=stats.num_running,
                                       num_waiting=stats.num_waiting), stats.engine_idx)

    # ---------------------------------------------------------------- time and stats
    def tick(self) -> None:
        """Deadline drops, pressure level, fairness sampling, dispatch and stats due now."""
        self._pump()

    async def start(self) -> None:
        """Start the background tick task (idempotent)."""
        self._task.start()
        if self.shared_service is not None:
            self.shared_service.start(self.core, self._pump)

    async def stop(self) -> None:
        """Stop the background tick task (and the shared-service sync)."""
        await self._task.stop()
        if self.shared_service is not None:
            await self.shared_service.stop()

    def snapshot(self) -> SchedulerStats:
        """The core's current :class:`SchedulerStats`."""
        return self._with_sync(self.core.snapshot())

    def _with_sync(self, snap: SchedulerStats) -> SchedulerStats:
        if self.shared_service is not None:
            snap.shared_service_failures_total = self.shared_service.failures_total
        return snap

    def publish_stats(self) -> SchedulerStats:
        """Build a snapshot and publish it on the bus (if any); returns it."""
        snap = self._with_sync(self.core.snapshot(include_tenants=True))
        if self._bus is not None:
            self._bus.publish(snap)
        return snap

    # ---------------------------------------------------------------- internals
    def _pump(self) -> None:
        try:
            self.core.tick()
            for grant in self.core.dispatch():
                fut = self._waiters.pop(grant.job.request_id, None)
                if fut is None or fut.done():
                    self.core.release(grant)  # nobody waits for it any more
                else:
                    fut.set_result(grant)
            for job, err in self.core.take_dropped():
                fut = self._waiters.pop(job.request_id, None)
                if fut is not None and not fut.done():
                    fut.set_exception(err)
            now = self._clock.monotonic()
            if self._bus is not None and now >= self._next_stats and \
                    self._bus.has_subscribers(SchedulerStats):
                self._next_stats = now + self._stats_interval_s
                self.publish_stats()
        except Exception:  # noqa: BLE001 — never raise scheduler faults into the serving path
            log.exception("scheduler: dispatch failed")
