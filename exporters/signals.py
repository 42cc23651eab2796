"""Signal history for ClickHouse: every ``interval_s`` the current signal set becomes rows of the
ledger's ``signals`` table (``ts, name, labels, value``), so dashboards can draw history that
Prometheus may not keep — with the **full per-tenant detail** that Prometheus labels bound to top-K.

Two parts (this module computes; the write goes through the ledger facade)::

    sampler = SignalSampler(bus, clock=clock, model="SmolLM2-135M-Instruct")  # subscribes now
    recorder = SignalRecorder(sampler, ledger.write_signals, clock=clock)      # SignalSamplerConfig.interval_s
    recorder.start()          # asyncio task: a sample every interval (decided on the injected clock)
    ...
    await recorder.stop()     # writes a last sample, then sampler.close()

What a sample holds (every name is declared in the one name table,
:data:`kvmeter.exporters.prometheus.names.SIGNAL_SERIES`: a gauge under its Prometheus metric's
name, a counter's rate named after the counter with ``_per_second`` for ``_total``, covering the
interval since the previous sample on the injected clock's monotonic reading):

* engines, labels ``engine``, ``model`` — from the latest :class:`EngineStepStats` per local engine
  and :class:`RemoteEngineStats` per scraped one: ``kvmeter_engine_kv_watermark_ratio``,
  ``kvmeter_engine_kv_used_blocks``, ``kvmeter_engine_running_requests``,
  ``kvmeter_engine_waiting_requests``; summed over the interval (local engines):
  ``kvmeter_engine_output_tokens_per_second``, ``kvmeter_engine_preemptions_per_second``,
  ``kvmeter_engine_prefix_cache_hit_ratio`` (hit / queried input tokens, when any were queried);
* engine work per tenant, labels ``engine``, ``model``, ``tier``, ``tenant`` (every tenant,
  unbounded) — from :class:`EngineStepShares` summed over the interval:
  ``kvmeter_engine_tenant_scheduled_prefill_tokens_per_second``,
  ``kvmeter_engine_tenant_scheduled_decode_tokens_per_second``,
  ``kvmeter_engine_tenant_kv_token_seconds_per_second`` (KV tokens held, time-averaged); a
  tenant with work in the previous interval and none in this one gets one row of 0;
* scheduler, no labels — latest :class:`SchedulerStats`: ``kvmeter_scheduler_queued_requests``,
  ``kvmeter_scheduler_running_requests``, ``kvmeter_scheduler_pressure_level``,
  ``kvmeter_scheduler_jain_index_ratio``, ``kvmeter_scheduler_max_service_gap_tokens``;
* tenants, labels ``tier``, ``tenant`` (every tenant, unbounded) — ``kvmeter_scheduler_queue_depth_requests``,
  ``kvmeter_scheduler_queue_oldest_wait_seconds``, ``kvmeter_tenant_active_kv_tokens``,
  ``kvmeter_tenant_running_requests``;
* tiers, from :class:`RequestCompletion` over the interval — ``kvmeter_requests_per_second``
  (``tier``, ``outcome``), ``kvmeter_throughput_tokens_per_second`` and
  ``kvmeter_goodput_tokens_per_second`` (``tier``, ``type`` = input / output; goodput = requests
  that ended ok inside their SLO, as ``kvmeter_goodput_tokens_total``), ``kvmeter_goodput_ratio``
  (``tier``);
* streams, labels ``tier``, ``tenant`` (every tenant), from :class:`StreamSendStats` over the
  interval, for tenants whose streams met back-pressure: ``kvmeter_stream_stall_cut_requests_per_second``
  (streams cut for a stalled reader) and ``kvmeter_stream_send_blocked_seconds_per_second``;
* prompt-cache thrash, labels ``tenant``, ``model`` (every tenant), from
  :attr:`RequestCompletion.reprefill_input_tokens` over the interval, for tenants that re-prefilled:
  ``kvmeter_prompt_reprefill_tokens_per_second``;
* engine pools, labels ``model``, ``replica`` (its URL) — the latest :class:`ReplicaHealth` of
  each replica: ``kvmeter_replica_up``, ``kvmeter_replica_available`` (up and not draining); from
  :class:`RoutingDecision` over the interval: ``kvmeter_replica_routed_requests_per_second``
  (``model``, ``replica``) and ``kvmeter_router_decisions_requests_per_second`` (``model``,
  ``policy``, ``outcome``: its ``prefix_hit`` share is the prefix-hit routing share), while
  requests are routed plus one row of 0 after; a replica's KV watermark and queue are its engine
  rows (``engine`` = its URL, from its scrape);
* GPUs, label ``gpu`` — latest :class:`GpuSample`: ``kvmeter_gpu_memory_used_bytes``,
  ``kvmeter_gpu_memory_total_bytes``, ``kvmeter_gpu_utilization_ratio``,
  ``kvmeter_gpu_sm_active_ratio``, ``kvmeter_gpu_tensor_active_ratio``,
  ``kvmeter_gpu_dram_bandwidth_ratio``, ``kvmeter_gpu_power_watts``,
  ``kvmeter_gpu_temperature_celsius`` (+ ``sensor``), per MIG instance (+ ``mig``)
  ``kvmeter_gpu_mig_memory_used_bytes``, ``kvmeter_gpu_mig_sm_active_ratio``;
* ledger — latest :class:`LedgerStats`: ``kvmeter_ledger_spool_depth_events``,
  ``kvmeter_ledger_spool_oldest_age_seconds``; quota — ``kvmeter_quota_store_degraded`` (``store``).

Rules:

* **Missing stays missing**: a reading the source reports as unknown (``None``: a GPU metric the
  device lacks) gives no row, never a 0.
* **Sparse tenants**: a tenant gets rows while it has queued or running work, plus one row of
  zeros the first sample after it has none (so a chart falls to 0 instead of stopping); idle
  tenants cost nothing. Tiers get rate rows while they have traffic, plus one zero sample after.
* **Staleness**: polled sources (GPU samples, remote engine scrapes) publish at a fixed pace, so a
  reading older than ``stale_after_s`` means the poller stopped: it is not sampled. Event-driven
  sources (engine steps, scheduler, ledger, quota store) keep their last value — an idle engine
  publishes no steps, and its last state stands.
* The goodput ratio is output goodput / output throughput over the interval, present only when
  output tokens ended in the interval.

Thread safety: bus callbacks may arrive on any thread (GPU poller, ledger writer, event loop);
state is guarded by one lock, and :meth:`SignalSampler.sample` copies under it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from dataclasses import dataclass, fields
from typing import Callable, Mapping

from kvmeter.aio import PeriodicTask
from kvmeter.bus import StatsBus
from kvmeter.clock import SYSTEM_CLOCK, Clock
from kvmeter.exporters.prometheus.names import rate_series, series
from kvmeter.ledger.records import SignalSample
from kvmeter.stats import (EngineStepShares, EngineStepStats, GpuSample, LedgerStats, QuotaStoreState,
                           RemoteEngineStats, ReplicaHealth, RequestCompletion, RoutingDecision, SchedulerStats,
                           StreamSendStats)

__all__ = ["SignalSampler", "SignalRecorder", "SignalSamplerConfig"]

log = logging.getLogger(__name__)

_ENV = {"interval_s": "KVMETER_SIGNALS_INTERVAL_S", "stale_after_s": "KVMETER_SIGNALS_STALE_AFTER_S"}
# Series names come from the one name table (exporters/prometheus/names.py, SIGNAL_SERIES): a gauge
# under its Prometheus metric's name, a counter as its rate; series() / rate_series() fail at import
# on a name the table does not declare.
_KV_WATERMARK = series("kvmeter_engine_kv_watermark_ratio")
_KV_USED = series("kvmeter_engine_kv_used_blocks")
_ENGINE_RUNNING = series("kvmeter_engine_running_requests")
_ENGINE_WAITING = series("kvmeter_engine_waiting_requests")
_OUTPUT_RATE = rate_series("kvmeter_engine_output_tokens_total")
_PREEMPTION_RATE = rate_series("kvmeter_engine_preemptions_total")
_PREFIX_HIT = series("kvmeter_engine_prefix_cache_hit_ratio")
_TENANT_WORK = (rate_series("kvmeter_engine_tenant_scheduled_prefill_tokens_total"),
                rate_series("kvmeter_engine_tenant_scheduled_decode_tokens_total"),
                rate_series("kvmeter_engine_tenant_kv_token_seconds_total"))
_QUEUED = series("kvmeter_scheduler_queued_requests")
_RUNNING = series("kvmeter_scheduler_running_requests")
_PRESSURE = series("kvmeter_scheduler_pressure_level")
_JAIN = series("kvmeter_scheduler_jain_index_ratio")
_SERVICE_GAP = series("kvmeter_scheduler_max_service_gap_tokens")
_QUEUE_DEPTH = series("kvmeter_scheduler_queue_depth_requests")
_OLDEST_WAIT = series("kvmeter_scheduler_queue_oldest_wait_seconds")
_TENANT_KV = series("kvmeter_tenant_active_kv_tokens")
_TENANT_RUNNING = series("kvmeter_tenant_running_requests")
_REQUEST_RATE = rate_series("kvmeter_requests_total")
_THROUGHPUT = rate_series("kvmeter_throughput_tokens_total")
_GOODPUT = rate_series("kvmeter_goodput_tokens_total")
_GOODPUT_RATIO = series("kvmeter_goodput_ratio")
_STALL_CUT_RATE = rate_series("kvmeter_stream_stall_cut_requests_total")
_SEND_BLOCKED_RATE = rate_series("kvmeter_stream_send_blocked_seconds_total")
_REPREFILL_RATE = rate_series("kvmeter_prompt_reprefill_tokens_total")
_REPLICA_UP = series("kvmeter_replica_up")
_REPLICA_AVAILABLE = series("kvmeter_replica_available")
_ROUTED_RATE = rate_series("kvmeter_replica_routed_requests_total")
_DECISION_RATE = rate_series("kvmeter_router_decisions_requests_total")
_GPU_FIELDS = ((series("kvmeter_gpu_memory_used_bytes"), "memory_used_bytes"),
               (series("kvmeter_gpu_memory_total_bytes"), "memory_total_bytes"),
               (series("kvmeter_gpu_utilization_ratio"), "utilization_gpu_ratio"),
               (series("kvmeter_gpu_sm_active_ratio"), "sm_active_ratio"),
               (series("kvmeter_gpu_tensor_active_ratio"), "tensor_active_ratio"),
               (series("kvmeter_gpu_dram_bandwidth_ratio"), "dram_bandwidth_ratio"),
               (series("kvmeter_gpu_power_watts"), "power_watts"))
_GPU_TEMPERATURE = series("kvmeter_gpu_temperature_celsius")
_MIG_MEMORY_USED = series("kvmeter_gpu_mig_memory_used_bytes")
_MIG_SM_ACTIVE = series("kvmeter_gpu_mig_sm_active_ratio")
_SPOOL_DEPTH = series("kvmeter_ledger_spool_depth_events")
_SPOOL_AGE = series("kvmeter_ledger_spool_oldest_age_seconds")
_STORE_DEGRADED = series("kvmeter_quota_store_degraded")
_OUTCOMES = ("ok", "aborted", "error")


@dataclass(frozen=True, slots=True)
class SignalSamplerConfig:
    """How often signals are sampled into ClickHouse.

    Attributes:
        interval_s: seconds between samples (> 0; default 10). Env ``KVMETER_SIGNALS_INTERVAL_S``.
        stale_after_s: a polled source's reading older than this is not sampled (> 0; default
            60). Env ``KVMETER_SIGNALS_STALE_AFTER_S``.
    Raises:
        ValueError: on a non-positive value, naming it.
    """

    interval_s: float = 10.0
    stale_after_s: float = 60.0

    def __post_init__(self) -> None:
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"SignalSamplerConfig.{f.name} must be > 0, got {getattr(self, f.name)!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: float) -> "SignalSamplerConfig":
        """``overrides``, then ``KVMETER_SIGNALS_*`` variables, then the defaults.

        Raises:
            ValueError: naming the variable whose value is not a number.
        """
        env = os.environ if env is None else env
        values: dict[str, float] = {}
        for name, var in _ENV.items():
            if name in overrides:
                values[name] = overrides[name]
            elif var in env:
                try:
                    values[name] = float(env[var])
                except ValueError:
                    raise ValueError(f"{var}={env[var]!r} is not a number") from None
        return cls(**values)


class _TierWindow:
    """Request and token counts of one tier since the last sample."""

    __slots__ = ("requests", "input", "output", "good_input", "good_output")

    def __init__(self) -> None:
        self.requests = dict.fromkeys(_OUTCOMES, 0)
        self.input = self.output = self.good_input = self.good_output = 0


class SignalSampler:
    """Keeps the latest signal set from the bus and turns it into :class:`SignalSample` rows.

    Args:
        bus: subscribed at construction (so nothing published before the first sample is lost).
        clock: ``wall()`` stamps the rows; ``monotonic()`` measures the rate interval and ages.
        model: ``model`` label of the locally hosted engine's rows.
        config: staleness (the interval belongs to :class:`SignalRecorder`).
    """

    def __init__(self, bus: StatsBus, *, clock: Clock = SYSTEM_CLOCK, model: str = "",
                 config: SignalSamplerConfig | None = None) -> None:
        self._clock = clock
        self._model = model
        self._config = config or SignalSamplerConfig.from_env()
        self._lock = threading.Lock()
        self._engines: dict[str, tuple[dict[str, str], EngineStepStats]] = {}
        # engine → [output tokens, preemptions, prefix-cache queried tokens, hit tokens]
        self._engine_counts: dict[str, list[int]] = {}
        # (engine, tier, tenant) → [prefill tokens, decode tokens, KV token-seconds] this interval
        self._tenant_work: dict[tuple[str, str, str], list[float]] = {}
        self._busy_tenant_work: set[tuple[str, str, str]] = set()
        self._remote: dict[str, tuple[float, RemoteEngineStats]] = {}
        self._scheduler: SchedulerStats | None = None
        self._tiers: dict[str, _TierWindow] = {}
        # (tier, tenant) → [streams cut for a stalled reader, seconds sends blocked] since the last sample
        self._streams: dict[tuple[str, str], list[float]] = {}
        self._streaming_tenants: set[tuple[str, str]] = set()
        # (tenant, model) → re-prefilled input tokens since the last sample
        self._reprefill: dict[tuple[str, str], int] = {}
        self._reprefilling: set[tuple[str, str]] = set()
        # (model, replica) → its latest health; routed requests and decisions since the last sample
        self._replicas: dict[tuple[str, str], ReplicaHealth] = {}
        self._routed: dict[tuple[str, str], int] = {}
        self._decisions: dict[tuple[str, str, str], int] = {}
        self._busy_routed: set[tuple[str, str]] = set()
        self._busy_decisions: set[tuple[str, str, str]] = set()
        self._gpus: dict[int, tuple[float, GpuSample]] = {}
        self._ledger: LedgerStats | None = None
        self._stores: dict[str, QuotaStoreState] = {}
        self._busy_tenants: set[tuple[str, str]] = set()  # (tier, tenant) with work last sample
        self._busy_tiers: set[str] = set()
        self._busy_engines: set[str] = set()
        self._last_sample = clock.monotonic()
        self._unsubscribe = [
            bus.subscribe(EngineStepStats, self._on_step),
            bus.subscribe(EngineStepShares, self._on_shares),
            bus.subscribe(RemoteEngineStats, self._on_remote),
            bus.subscribe(SchedulerStats, self._on_scheduler),
            bus.subscribe(RequestCompletion, self._on_completion),
            bus.subscribe(StreamSendStats, self._on_stream),
            bus.subscribe(GpuSample, self._on_gpu),
            bus.subscribe(ReplicaHealth, self._on_replica),
            bus.subscribe(RoutingDecision, self._on_decision),
            bus.subscribe(LedgerStats, self._on_ledger),
            bus.subscribe(QuotaStoreState, self._on_store),
        ]

    # ------------------------------------------------------------------ bus callbacks (cheap)
    def _on_step(self, s: EngineStepStats) -> None:
        key = str(s.engine_idx)
        with self._lock:
            self._engines[key] = ({"engine": key, "model": self._model}, s)
            counts = self._engine_counts.setdefault(key, [0, 0, 0, 0])
            counts[0] += s.output_tokens
            counts[1] += s.num_preempted
            counts[2] += s.prefix_cache_queries_tokens
            counts[3] += s.prefix_cache_hits_tokens

    def _on_shares(self, s: EngineStepShares) -> None:
        engine = str(s.engine_idx)
        with self._lock:
            for t in s.tenants:
                acc = self._tenant_work.setdefault((engine, t.tier or "unknown", t.tenant_id), [0, 0, 0.0])
                acc[0] += t.prefill_tokens
                acc[1] += t.decode_tokens
                acc[2] += t.kv_tokens * s.duration_s

    def _on_remote(self, s: RemoteEngineStats) -> None:
        with self._lock:
            self._remote[s.engine_id] = (self._clock.monotonic(), s)

    def _on_scheduler(self, s: SchedulerStats) -> None:
        with self._lock:
            self._scheduler = s

    def _on_completion(self, c: RequestCompletion) -> None:
        with self._lock:
            tier = c.attribution.tier or "unknown"
            w = self._tiers.get(tier)
            if w is None:
                w = self._tiers[tier] = _TierWindow()
            outcome = c.outcome if c.outcome in _OUTCOMES else "error"
            w.requests[outcome] += 1
            w.input += c.tokens.input_tokens
            w.output += c.tokens.output_tokens
            if outcome == "ok" and c.slo_met is not False:  # as kvmeter_goodput_tokens_total
                w.good_input += c.tokens.input_tokens
                w.good_output += c.tokens.output_tokens
            if c.reprefill_input_tokens > 0:
                key = (c.attribution.tenant_id, c.attribution.model or "unknown")
                self._reprefill[key] = self._reprefill.get(key, 0) + c.reprefill_input_tokens

    def _on_stream(self, s: StreamSendStats) -> None:
        if not (s.stall_cut or s.send_blocked_s > 0):
            return  # a stream its client read at once: nothing to chart
        with self._lock:
            w = self._streams.setdefault((s.attribution.tier or "unknown", s.attribution.tenant_id), [0.0, 0.0])
            w[0] += 1 if s.stall_cut else 0
            w[1] += s.send_blocked_s

    def _on_replica(self, h: ReplicaHealth) -> None:
        with self._lock:
            self._replicas[(h.model, h.replica)] = h

    def _on_decision(self, d: RoutingDecision) -> None:
        with self._lock:
            key = (d.model, d.replica)
            self._routed[key] = self._routed.get(key, 0) + 1
            dkey = (d.model, d.policy, d.outcome)
            self._decisions[dkey] = self._decisions.get(dkey, 0) + 1

    def _on_gpu(self, s: GpuSample) -> None:
        with self._lock:
            self._gpus[s.index] = (self._clock.monotonic(), s)

    def _on_ledger(self, s: LedgerStats) -> None:
        with self._lock:
            self._ledger = s

    def _on_store(self, s: QuotaStoreState) -> None:
        with self._lock:
            self._stores[s.store] = s

    # ------------------------------------------------------------------ sampling
    def sample(self) -> list[SignalSample]:
        """The current signal set as rows stamped ``clock.wall()``; starts a new rate interval.

        Returns:
            Rows in no particular order (empty when nothing has been published yet).
        """
        now = self._clock.monotonic()
        with self._lock:
            elapsed = now - self._last_sample
            self._last_sample = now
            engines = dict(self._engines)
            counts, self._engine_counts = self._engine_counts, {}
            work, self._tenant_work = self._tenant_work, {}
            remote = dict(self._remote)
            sched = self._scheduler
            tiers, self._tiers = self._tiers, {}
            streams, self._streams = self._streams, {}
            reprefill, self._reprefill = self._reprefill, {}
            gpus = dict(self._gpus)
            replicas = dict(self._replicas)
            routed, self._routed = self._routed, {}
            decisions, self._decisions = self._decisions, {}
            ledger = self._ledger
            stores = dict(self._stores)
        ts = self._clock.wall()
        rows: list[SignalSample] = []

        def add(name: str, value: float | int | None, labels: Mapping[str, str] | None = None) -> None:
            if value is not None:
                rows.append(SignalSample(ts, name, float(value), dict(labels) if labels else {}))

        stale = self._config.stale_after_s
        self._engine_rows(add, engines, counts, elapsed)
        self._tenant_work_rows(add, work, elapsed)
        for seen, r in remote.values():
            if now - seen > stale:
                continue
            labels = {"engine": r.engine_id, "model": r.model_name}
            add(_KV_WATERMARK, r.kv_cache_usage_ratio, labels)
            if r.kv_cache_usage_ratio is not None and r.kv_blocks_total is not None:
                add(_KV_USED, round(r.kv_cache_usage_ratio * r.kv_blocks_total), labels)
            add(_ENGINE_RUNNING, r.num_running, labels)
            add(_ENGINE_WAITING, r.num_waiting, labels)
        if sched is not None:
            self._scheduler_rows(add, sched)
        self._tier_rows(add, tiers, elapsed)
        self._stream_rows(add, streams, elapsed)
        if elapsed > 0:  # a tenant that re-prefilled: its rate, then one row of 0
            for tenant, model in set(reprefill) | self._reprefilling:
                add(_REPREFILL_RATE, reprefill.get((tenant, model), 0) / elapsed, {"tenant": tenant, "model": model})
            self._reprefilling = set(reprefill)
        self._pool_rows(add, replicas, routed, decisions, elapsed)
        for seen, g in gpus.values():
            if now - seen <= stale:
                self._gpu_rows(add, g)
        if ledger is not None:
            add(_SPOOL_DEPTH, ledger.spool_depth_events)
            add(_SPOOL_AGE, ledger.spool_oldest_age_seconds)
        for store, st in stores.items():
            add(_STORE_DEGRADED, 1 if st.degraded else 0, {"store": store})
        return rows

    def _engine_rows(self, add, engines, counts, elapsed: float) -> None:
        for labels, s in engines.values():
            add(_KV_WATERMARK, s.kv_watermark_ratio, labels)
            if s.kv_blocks_total > 0:  # 0 means unknown
                add(_KV_USED, s.kv_blocks_used, labels)
            add(_ENGINE_RUNNING, s.num_running, labels)
            add(_ENGINE_WAITING, s.num_waiting, labels)
        if elapsed <= 0:
            return
        busy = {k for k, c in counts.items() if c[0] or c[1] or c[2]}
        for key in busy | (self._busy_engines & engines.keys()):
            out, pre, queried, hit = counts.get(key, (0, 0, 0, 0))
            labels = engines[key][0]
            add(_OUTPUT_RATE, out / elapsed, labels)
            add(_PREEMPTION_RATE, pre / elapsed, labels)
            if queried > 0:
                add(_PREFIX_HIT, hit / queried, labels)
        self._busy_engines = busy

    def _tenant_work_rows(self, add, work: dict[tuple[str, str, str], list[float]], elapsed: float) -> None:
        """Per-second rates over the interval; a tenant busy last interval gets one row of 0."""
        if elapsed <= 0:
            return
        for key in set(work) | self._busy_tenant_work:
            engine, tier, tenant = key
            labels = {"engine": engine, "model": self._model, "tier": tier, "tenant": tenant}
            for name, total in zip(_TENANT_WORK, work.get(key, (0, 0, 0.0)), strict=True):
                add(name, total / elapsed, labels)
        self._busy_tenant_work = set(work)

    def _scheduler_rows(self, add, s: SchedulerStats) -> None:
        add(_QUEUED, s.queued_total)
        add(_RUNNING, s.running_total)
        add(_PRESSURE, s.pressure_level)
        add(_JAIN, s.jain_index)
        add(_SERVICE_GAP, s.service_gap)
        busy: set[tuple[str, str]] = set()
        for t in s.tenants:
            key = (t.tier, t.tenant_id)
            if t.queue_depth or t.running or t.active_kv_tokens:
                busy.add(key)
            elif key not in self._busy_tenants:
                continue  # idle now and at the last sample: no rows
            labels = {"tier": t.tier, "tenant": t.tenant_id}
            add(_QUEUE_DEPTH, t.queue_depth, labels)
            add(_OLDEST_WAIT, t.queue_wait_oldest_s, labels)
            add(_TENANT_KV, t.active_kv_tokens, labels)
            add(_TENANT_RUNNING, t.running, labels)
        self._busy_tenants = busy

    def _tier_rows(self, add, tiers: dict[str, _TierWindow], elapsed: float) -> None:
        if elapsed <= 0:
            return
        for tier in set(tiers) | self._busy_tiers:
            w = tiers.get(tier) or _TierWindow()
            for outcome, n in w.requests.items():
                add(_REQUEST_RATE, n / elapsed, {"tier": tier, "outcome": outcome})
            for kind, total, good in (("input", w.input, w.good_input), ("output", w.output, w.good_output)):
                labels = {"tier": tier, "type": kind}
                add(_THROUGHPUT, total / elapsed, labels)
                add(_GOODPUT, good / elapsed, labels)
            if w.output > 0:
                add(_GOODPUT_RATIO, w.good_output / w.output, {"tier": tier})
        self._busy_tiers = set(tiers)

    def _stream_rows(self, add, streams: dict[tuple[str, str], list[float]], elapsed: float) -> None:
        """Per tenant (every tenant, unbounded): stall cuts and seconds blocked sending, per second;
        a tenant with back-pressure in the interval, plus one row of zeros after."""
        if elapsed <= 0:
            return
        for tier, tenant in set(streams) | self._streaming_tenants:
            cuts, blocked = streams.get((tier, tenant), (0.0, 0.0))
            labels = {"tier": tier, "tenant": tenant}
            add(_STALL_CUT_RATE, cuts / elapsed, labels)
            add(_SEND_BLOCKED_RATE, blocked / elapsed, labels)
        self._streaming_tenants = set(streams)

    def _pool_rows(self, add, replicas: dict[tuple[str, str], ReplicaHealth], routed: dict[tuple[str, str], int],
                   decisions: dict[tuple[str, str, str], int], elapsed: float) -> None:
        """Each replica's last health; routed requests and routing decisions per second while
        requests are routed, plus one row of 0 after."""
        for (model, replica), h in replicas.items():
            labels = {"model": model, "replica": replica}
            add(_REPLICA_UP, 1 if h.healthy else 0, labels)
            add(_REPLICA_AVAILABLE, 1 if h.available else 0, labels)
        if elapsed <= 0:
            return
        for model, replica in set(routed) | self._busy_routed:
            add(_ROUTED_RATE, routed.get((model, replica), 0) / elapsed, {"model": model, "replica": replica})
        for model, policy, outcome in set(decisions) | self._busy_decisions:
            add(_DECISION_RATE, decisions.get((model, policy, outcome), 0) / elapsed,
                {"model": model, "policy": policy, "outcome": outcome})
        self._busy_routed, self._busy_decisions = set(routed), set(decisions)

    def _gpu_rows(self, add, g: GpuSample) -> None:
        gpu = {"gpu": str(g.index)}
        for name, attr in _GPU_FIELDS:
            add(name, getattr(g, attr), gpu)
        add(_GPU_TEMPERATURE, g.temperature_gpu_celsius, {**gpu, "sensor": "gpu"})
        add(_GPU_TEMPERATURE, g.temperature_memory_celsius, {**gpu, "sensor": "memory"})
        for m in g.mig:
            mig = {**gpu, "mig": "" if m.gpu_instance_id is None else str(m.gpu_instance_id)}
            add(_MIG_MEMORY_USED, m.memory_used_bytes, mig)
            add(_MIG_SM_ACTIVE, m.sm_active_ratio, mig)

    def close(self) -> None:
        """Unsubscribe from the bus (idempotent)."""
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe.clear()


class SignalRecorder:
    """Writes a :class:`SignalSampler` sample every ``interval_s`` through ``write``.

    Args:
        sampler: what to sample.
        write: takes a list of :class:`SignalSample` — ``Ledger.write_signals`` in ``kvmeter serve``
            (buffered, best effort: kept in memory while ClickHouse is away, oldest dropped).
        clock: decides when a sample is due (``monotonic()``).
        interval_s: seconds between samples (default: ``SignalSamplerConfig.from_env().interval_s``).
    Raises:
        ValueError: if ``interval_s`` is not positive.
    """

    def __init__(self, sampler: SignalSampler, write: Callable[[list[SignalSample]], object], *,
                 clock: Clock = SYSTEM_CLOCK, interval_s: float | None = None) -> None:
        interval_s = SignalSamplerConfig.from_env().interval_s if interval_s is None else interval_s
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.sampler = sampler
        self.interval_s = interval_s
        self._write = write
        self._clock = clock
        self._next_due = clock.monotonic() + interval_s
        self._task = PeriodicTask(self._wake, min(interval_s, 1.0), name="kvmeter-signal-recorder")
        self._tick_lock = threading.Lock()
        self.samples_total = 0
        self.rows_total = 0
        self.write_errors_total = 0

    def tick(self, *, force: bool = False) -> int:
        """Sample and write if ``interval_s`` has passed (or ``force``); returns rows written.

        A failing write is logged and counted, never raised (signals are best effort).
        """
        with self._tick_lock:  # a worker-thread tick may still run when stop() takes the last one
            return self._tick(force)

    def _tick(self, force: bool) -> int:
        now = self._clock.monotonic()
        if not force and now < self._next_due:
            return 0
        # the next sample is due one interval after this one was due, so a late tick does not
        # drift the schedule; after a pause longer than an interval it restarts from now
        self._next_due += self.interval_s
        if self._next_due <= now:
            self._next_due = now + self.interval_s
        try:
            rows = self.sampler.sample()
            if rows:
                self._write(rows)
        except Exception:  # noqa: BLE001 — history is best effort, serving goes on
            self.write_errors_total += 1
            log.exception("signal sample not written")
            return 0
        self.samples_total += 1
        self.rows_total += len(rows)
        return len(rows)

    def start(self) -> asyncio.Task:
        """Run :meth:`tick` from a task of the running event loop (idempotent). The task wakes at
        least once a second of real time; whether a sample is due is the injected clock's
        decision. A due sample is built on a worker thread (≈14 ms for 1,000 busy tenants, see
        bench/exporters/RESULTS.md), so the event loop keeps streaming meanwhile."""
        return self._task.start()

    async def _wake(self) -> None:
        if self._clock.monotonic() >= self._next_due:
            await asyncio.to_thread(self.tick)

    async def stop(self, *, final_sample: bool = True) -> None:
        """Stop the task, write one last sample (the interval in progress), unsubscribe."""
        await self._task.stop()
        if final_sample:
            self.tick(force=True)
        self.sampler.close()
