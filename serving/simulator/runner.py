"""The simulator's fast path: a trace, the scheduler core and N replicas in virtual time.

Event loop (virtual seconds on a :class:`~kvmeter.clock.ManualClock`): the next event is the
earliest of the next trace arrival and the end of some replica's planned step. Arrivals go through
:meth:`SchedulerCore.submit` (admission, per-tenant queues); step ends report first tokens and
finishes, which are charged (:meth:`charge_output`) and released (:meth:`release`) exactly as the
gateway does on the real path, and report the step's inter-token latencies and engine-side TTFTs
(:meth:`observe_engine_latency`, as the engine hooks' step stats do there); after every event each
replica's :class:`EngineLoad` is reported (:meth:`on_engine_load`) and :meth:`dispatch` hands
grants to replicas (``grant.engine_idx``) with their tier's engine priority. The core is the same object the gateway's
:class:`~kvmeter.serving.scheduler.fair.FairScheduler` wraps — there is no simulator-only
scheduling code.

Output tokens stream in the simulator at every step; they are charged to the scheduler whenever a
decision or a measurement depends on them (before every dispatch while requests are queued, before
the queue turns non-empty, at each fairness sample, and at a request's end), which gives the VTC
counters and the drain-rate meter the values they would have with per-token charging.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Sequence

from tqdm import tqdm

from kvmeter.attribution import Attribution
from kvmeter.bus import StatsBus
from kvmeter.clock import ManualClock
from kvmeter.serving.scheduler.base import Grant, Job, SchedulerRejected
from kvmeter.serving.scheduler.config import SchedulerConfig
from kvmeter.serving.scheduler.core import SchedulerCore
from kvmeter.serving.scheduler.policy import OrderingPolicy
from kvmeter.serving.scheduler.router import Router
from kvmeter.traces import TraceRequest

from .costmodel import RooflineCostModel
from .hardware import get_accelerator
from .models import get_model
from .publish import SimPublisher
from .replica import SimReplica, SimRequest

__all__ = ["SimConfig", "RequestRecord", "Sample", "SimResult", "Simulation", "build_cost_model"]

log = logging.getLogger(__name__)
_INF = float("inf")
#: Tenant of trace requests that carry none.
DEFAULT_TENANT = "default"


@dataclass(frozen=True, slots=True)
class SimConfig:
    """The simulated deployment.

    Attributes:
        model, gpu: registry names (:data:`~.models.MODELS`, :data:`~.hardware.ACCELERATORS`).
        tp: tensor-parallel degree per replica.
        replicas: engine replicas behind the one scheduler.
        max_num_batched_tokens, max_num_seqs: vLLM limits (None: the accelerator's defaults).
        long_prefill_token_threshold: per-request prefill cap per step (None: no cap).
        enable_prefix_caching: prefix caching on hash groups.
        group_tokens: tokens per trace hash block (Mooncake: 512).
        compute_efficiency, memory_efficiency, step_overhead_s, memory_utilization: cost-model
            factors (None: the accelerator's defaults; an efficiency given here selects the plain
            roofline over the GPU operator calibration, see :mod:`.costmodel`).
        max_model_len: context window override (None: the model's).
        engine_scheduling: ``priority`` or ``fcfs`` inside the engine (None: ``priority`` for
            VTC, ``fcfs`` for the baselines — plain vLLM).
        routing: the replica choice — an engine pool's router policy
            (:mod:`kvmeter.serving.scheduler.router`: ``prefix_aware`` on the trace's hash blocks,
            ``least_kv``, ``round_robin``); None: the most free KV without a router.
    """

    model: str = "llama-3.1-70b"
    gpu: str = "h200"
    tp: int = 4
    replicas: int = 1
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    long_prefill_token_threshold: int | None = None
    enable_prefix_caching: bool = True
    group_tokens: int = 512
    compute_efficiency: float | None = None
    memory_efficiency: float | None = None
    step_overhead_s: float | None = None
    memory_utilization: float | None = None
    max_model_len: int | None = None
    engine_scheduling: str | None = None
    routing: str | None = None


def build_cost_model(cfg: SimConfig) -> RooflineCostModel:
    """The :class:`RooflineCostModel` of ``cfg`` (raises ValueError on unknown names/values)."""
    model = get_model(cfg.model)
    if cfg.max_model_len is not None:
        model = model.with_max_model_len(cfg.max_model_len)
    return RooflineCostModel(model, get_accelerator(cfg.gpu), tp=cfg.tp,
                             compute_efficiency=cfg.compute_efficiency,
                             memory_efficiency=cfg.memory_efficiency,
                             step_overhead_s=cfg.step_overhead_s,
                             memory_utilization=cfg.memory_utilization)


@dataclass(slots=True)
class RequestRecord:
    """The fate of one trace request.

    Attributes:
        outcome: ``ok`` (completed), ``rejected`` (at admission) or ``dropped`` (while queued).
        reason: rejection / drop reason (``""`` when ok).
        queued_at_arrival: requests queued in the scheduler when it arrived (0: engines had room).
        deadline_s: the virtual time its first token was due by (the trace's, else its tier's
            :meth:`~kvmeter.serving.tenancy.tiers.TierPolicy.deadline_s`; enforced with the
            scheduler's overload control), or ``None``.
        priority: the engine priority it was dispatched with (``None``: never dispatched).
        dispatch_s, first_token_s, finish_s: virtual times (NaN when not reached).
        generated: output tokens generated.
        cached_tokens: input tokens served from the prefix cache.
        spans, gap_itls, replica: ITL bookkeeping (segments of the replica's step log in which
            the request decoded one token per step; ITLs across preemptions).
    """

    request_id: str
    tenant_id: str
    tier: str
    arrival_s: float
    input_tokens: int
    output_tokens: int
    outcome: str = "ok"
    reason: str = ""
    queued_at_arrival: int = 0
    deadline_s: float | None = None
    priority: int | None = None
    retry_after_s: float | None = None
    dispatch_s: float = math.nan
    first_token_s: float = math.nan
    finish_s: float = math.nan
    generated: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    replica: int = -1
    spans: list[tuple[int, int]] = field(default_factory=list)
    gap_itls: list[float] = field(default_factory=list)


@dataclass(slots=True)
class Sample:
    """A periodic sample of queue and engine state (virtual time ``t``); ``service_by_tenant`` is
    each tenant's cumulative weighted service (output charged up to ``t``)."""

    t: float
    queued_total: int
    queued_by_tier: dict[str, int]
    running_total: int
    kv_watermark: list[float]
    pressure_level: int
    service_by_tenant: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class SimResult:
    """Everything a report needs."""

    records: list[RequestRecord]
    seg_t: list[list[float]]
    seg_k: list[list[int]]
    samples: list[Sample]
    policy: str
    scheduler_config: SchedulerConfig
    sim_config: SimConfig
    cost: dict
    sim_end_s: float
    wall_s: float
    backlogged_rates: dict[str, float]
    tenant_weights: dict[str, float]
    tier_weights: dict[str, float]
    tenant_service: dict[str, float]
    max_service_gap: float
    preemptions: int
    prefix_queries_tokens: int
    prefix_hits_tokens: int
    kv_watermark_mean: list[float]
    kv_watermark_max: list[float]
    rejected_total: dict[str, int]
    dropped_total: dict[str, int]


class Simulation:
    """Replay ``requests`` through one scheduler core and ``sim.replicas`` simulated replicas.

    Args:
        requests: the workload (any order; sorted here).
        policy: ``vtc``, ``fcfs``, ``rpm`` or an :class:`OrderingPolicy`.
        scheduler_config: the core's config (defaults if None).
        sim: the deployment (:class:`SimConfig`).
        progress: show a tqdm bar over arrivals.
        sample_interval_s: virtual seconds between queue/engine samples.
        jain_min_backlogged_s: tenants backlogged for less than this are left out of the run's
            backlogged service rates (Jain's index).
        bus: where to publish the serve path's stats from the simulated engine and scheduler
            (:mod:`.publish`: every engine step's :class:`~kvmeter.stats.EngineStepShares`, step
            stats, scheduler snapshots at each sample, request completions); None (the
            default): nothing is built or published.
        start_wall: wall-clock epoch seconds at virtual 0 (the clock's wall readings, the
            published records' ``wall_ts``).
    Raises:
        ValueError: on bad configuration.
    """

    def __init__(self, requests: Sequence[TraceRequest], *, policy: str | OrderingPolicy = "vtc",
                 scheduler_config: SchedulerConfig | None = None, sim: SimConfig | None = None,
                 progress: bool = False, sample_interval_s: float = 1.0,
                 jain_min_backlogged_s: float = 5.0, bus: StatsBus | None = None,
                 start_wall: float = 1_700_000_000.0) -> None:
        if not sample_interval_s > 0:
            raise ValueError("sample_interval_s must be > 0")
        self.requests = sorted(requests, key=lambda r: r.arrival_s)
        self.sim = sim or SimConfig()
        self.scfg = scheduler_config or SchedulerConfig()
        self.clock = ManualClock(start_wall=start_wall, start_monotonic=0.0)
        router = Router(self.sim.routing, clock=self.clock, block_tokens=self.sim.group_tokens) \
            if self.sim.routing else None
        self.core = SchedulerCore(self.scfg, policy=policy, clock=self.clock, num_engines=self.sim.replicas,
                                  router=router)
        self.cost = build_cost_model(self.sim)
        sched = self.sim.engine_scheduling or ("priority" if self.core.policy_name == "vtc" else "fcfs")
        self.publisher = (SimPublisher(bus, self.clock, model=self.sim.model, scheduler_config=self.scfg,
                                       group_tokens=self.sim.group_tokens) if bus is not None else None)
        self.replicas = [SimReplica(self.cost, idx=i, max_num_batched_tokens=self.sim.max_num_batched_tokens,
                                    max_num_seqs=self.sim.max_num_seqs,
                                    long_prefill_token_threshold=self.sim.long_prefill_token_threshold,
                                    scheduling=sched, enable_prefix_caching=self.sim.enable_prefix_caching,
                                    group_tokens=self.sim.group_tokens,
                                    step_sink=bus.publish if bus is not None else None, wall_offset_s=start_wall)
                         for i in range(self.sim.replicas)]
        self.progress = progress
        self.sample_interval_s = sample_interval_s
        self.jain_min_backlogged_s = jain_min_backlogged_s
        self.records: list[RequestRecord] = []
        self.samples: list[Sample] = []
        self._by_id: dict[str, tuple[RequestRecord, TraceRequest]] = {}
        self._next_sample_t = 0.0

    # ------------------------------------------------------------------ charging
    def _sync(self) -> None:
        core = self.core
        for rep in self.replicas:
            for req in rep.running_requests():
                out = rep.output_tokens(req)
                delta = out - req.charged
                if delta > 0:
                    req.charged = out
                    core.charge_output(req.payload, delta)

    # ------------------------------------------------------------------ events
    def _submit(self, i: int, tr: TraceRequest) -> None:
        now = self.clock.monotonic()
        rid = f"r{i}"
        tenant = tr.tenant_id or DEFAULT_TENANT
        rec = RequestRecord(rid, tenant, tr.tier or self.scfg.default_tier, tr.arrival_s, tr.input_tokens,
                            tr.output_tokens, queued_at_arrival=self.core.queued_total)
        self.records.append(rec)
        limit = min(self.cost.model.max_model_len, self.cost.kv_capacity_tokens)
        if tr.input_tokens + tr.output_tokens > limit:
            rec.outcome, rec.reason = "rejected", "context_length_exceeded"
            return
        # the trace's own deadline, else the tier's rule: the one serve's gateway applies
        rec.deadline_s = tr.deadline_s if tr.deadline_s is not None else self.scfg.tier(rec.tier).deadline_s(now)
        job = Job(request_id=rid, attribution=Attribution(tenant_id=tenant, tier=rec.tier,
                                                          agent_run_id=tr.agent_run_id),
                  input_tokens=tr.input_tokens, max_tokens=tr.output_tokens, arrival_s=now, deadline_s=rec.deadline_s,
                  prefix_blocks=tuple(tr.hash_ids or ()) if self.core.router is not None else ())
        core = self.core
        if core.queued_total == 0 or (core.policy.counter_ordered and core.tenant_queue_depth(tenant) == 0):
            # the queue turns non-empty (the drain-rate meter starts counting: output produced so
            # far belongs before it), or the counter lift compares up-to-date counters
            self._sync()
        try:
            core.submit(job)
        except SchedulerRejected as err:
            rec.outcome, rec.reason, rec.retry_after_s = "rejected", err.reason, err.retry_after_s
            return
        self._by_id[rid] = (rec, tr)

    def _complete(self, rep: SimReplica) -> None:
        outcome = rep.complete()
        core = self.core
        pub = self.publisher
        if pub is not None:
            pub.segment(rep, outcome)
        # the step's latencies, as the vLLM engine hooks report them on the serving path
        core.observe_engine_latency(rep.idx, itl_sum_s=outcome.itl_sum_s, itl_count=outcome.itl_count,
                                    ttfts_s=[r.engine_ttft_s() for r in outcome.first_tokens])
        for req in outcome.first_tokens:
            if req.charged == 0:
                req.charged = 1
                core.charge_output(req.payload, 1)
        for req in outcome.finished:
            delta = req.target - req.charged
            if delta > 0:
                req.charged = req.target
                core.charge_output(req.payload, delta)
            core.release(req.payload)
            rec, tr = self._by_id.pop(req.request_id)
            if pub is not None:
                pub.finished(req, arrival_s=rec.arrival_s, dispatch_s=rec.dispatch_s, agent_run_id=tr.agent_run_id)
            rec.first_token_s = req.first_token_s if req.first_token_s is not None else math.nan
            rec.finish_s = req.finish_s if req.finish_s is not None else math.nan
            rec.generated = req.target
            rec.cached_tokens = req.cached_tokens
            rec.preemptions = req.preemptions
            rec.spans = req.spans
            rec.gap_itls = req.gap_itls
        core.on_engine_load(rep.load(), rep.idx)

    def _dispatch(self, now: float, horizon: float) -> None:
        core = self.core
        if now >= core.next_sample_s or now >= self._next_sample_t:
            self._sync()
        core.tick(now)
        if core.queued_total:
            self._sync()  # VTC order and the drain-rate meter both need output charged by now
            touched = set()
            for grant in core.dispatch():
                self._start(grant, now)
                touched.add(grant.engine_idx)
            for idx in touched:
                rep = self.replicas[idx]
                core.on_engine_load(rep.load(), idx)
                rep.truncate(now)
        for job, err in core.take_dropped():
            rec, _ = self._by_id.pop(job.request_id, (None, None))
            if rec is not None:
                rec.outcome, rec.reason, rec.retry_after_s = "dropped", err.reason, err.retry_after_s
        for rep in self.replicas:
            if rep.busy_until is None and rep.has_work():
                rep.plan(now, horizon)
        if now >= self._next_sample_t:
            self._next_sample_t = now + self.sample_interval_s
            self.samples.append(Sample(
                t=now, queued_total=core.queued_total, queued_by_tier=core.queue_depth_by_tier(),
                running_total=core.running_total,
                kv_watermark=[rep.used_blocks() / rep.total_blocks for rep in self.replicas],
                pressure_level=core.pressure_level,
                service_by_tenant={t: core.tenant_service(t) for t in core.tenants()}))
            if self.publisher is not None:
                self.publisher.sample(core)

    def _start(self, grant: Grant, now: float) -> None:
        rec, tr = self._by_id[grant.job.request_id]
        rec.dispatch_s = now
        rec.replica = grant.engine_idx
        rec.priority = grant.priority
        req = SimRequest(grant.job.request_id, tr.input_tokens, tr.output_tokens, priority=grant.priority,
                         hash_ids=tr.hash_ids, tenant_id=rec.tenant_id, tier=rec.tier, payload=grant)
        self.replicas[grant.engine_idx].add(req, now)
        if self.publisher is not None:
            self.publisher.dispatched(req)

    # ------------------------------------------------------------------ main loop
    def run(self) -> SimResult:
        """Run to completion (every request completed, rejected or dropped)."""
        wall0 = time.perf_counter()
        reqs = self.requests
        n = len(reqs)
        i = 0
        for rep in self.replicas:
            self.core.on_engine_load(rep.load(), rep.idx)
        bar = tqdm(total=n, disable=not self.progress, unit="req", mininterval=1.0, desc="simulate")
        stalls = 0
        while True:
            t_arr = reqs[i].arrival_s if i < n else _INF
            t_rep, rep_next = _INF, None
            for rep in self.replicas:
                if rep.busy_until is not None and rep.busy_until < t_rep:
                    t_rep, rep_next = rep.busy_until, rep
            t = min(t_arr, t_rep)
            if t == _INF:
                if self.core.queued_total or self.core.running_total:
                    stalls += 1
                    self.clock.advance(1.0)
                    self._dispatch(self.clock.monotonic(), _INF)
                    if stalls > 3600:
                        log.error("simulation stalled with %d queued, %d running", self.core.queued_total,
                                  self.core.running_total)
                        break
                    continue
                break
            self.clock.set(max(t, self.clock.monotonic()))
            now = self.clock.monotonic()
            if rep_next is not None and t_rep <= t_arr:
                self._complete(rep_next)
            else:
                j = i
                while i < n and reqs[i].arrival_s <= t:
                    self._submit(i, reqs[i])
                    i += 1
                bar.update(i - j)
            horizon = reqs[i].arrival_s if i < n else _INF
            self._dispatch(now, horizon)
        bar.close()
        self._sync()
        self.core.tick(self.clock.monotonic())
        for rec, _ in self._by_id.values():  # only after a stall
            rec.outcome, rec.reason = "dropped", "simulation_stalled"
        core = self.core
        return SimResult(
            records=self.records, seg_t=[r.seg_t for r in self.replicas], seg_k=[r.seg_k for r in self.replicas],
            samples=self.samples, policy=core.policy_name, scheduler_config=self.scfg, sim_config=self.sim,
            cost=self.cost.describe(), sim_end_s=self.clock.monotonic(), wall_s=time.perf_counter() - wall0,
            backlogged_rates=core.backlogged_service_rates(self.jain_min_backlogged_s),
            tenant_weights={t: self.scfg.tenant_weights.get(t, 1.0) for t in core.tenants()},
            tier_weights={name: pol.weight for name, pol in self.scfg.tiers.items()},
            tenant_service={t: core.tenant_service(t) for t in core.tenants()},
            max_service_gap=core.max_service_gap,
            preemptions=sum(r.preemptions_total for r in self.replicas),
            prefix_queries_tokens=sum(r.cache.queries_tokens for r in self.replicas),
            prefix_hits_tokens=sum(r.cache.hits_tokens for r in self.replicas),
            kv_watermark_mean=[r.kv_watermark_integral / r.now if r.now else 0.0 for r in self.replicas],
            kv_watermark_max=[r.kv_watermark_max for r in self.replicas],
            rejected_total=dict(core.rejected_total), dropped_total=dict(core.dropped_total))
