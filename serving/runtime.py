"""Wiring ``kvmeter serve``: build every part from a :class:`~kvmeter.serving.config.ServeConfig`.

This is the composition root, the one place that knows all packages: the engine publishes stats on
the bus; the scheduler, exporters and ledger subscribe; the gateway calls the tenancy directory,
quota, scheduler, engine and ledger in turn. Nothing below this module imports an exporter.

Lifecycle: :meth:`ServeRuntime.start` (engine load, ledger open) runs in the ASGI lifespan, so
uvicorn accepts connections only once the model is loaded; :meth:`ServeRuntime.stop` drains the
ledger's spool and shuts the engine down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import gc
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry
from starlette.applications import Starlette
from starlette.routing import Route

from kvmeter.bus import StatsBus
from kvmeter.clock import SYSTEM_CLOCK, Clock
from kvmeter.collectors.gpu import GpuPoller, NvmlCollector
from kvmeter.events import UsageEvent
from kvmeter.exporters.prometheus import install_prometheus, metrics_asgi_app
from kvmeter.exporters.prometheus.config import PrometheusConfig
from kvmeter.exporters.signals import SignalRecorder, SignalSampler
from kvmeter.ledger.config import LedgerConfig
from kvmeter.ledger.ledger import Ledger
from kvmeter.ledger.prices import load_price_list
from kvmeter.ledger.read_api import read_routes
from kvmeter.ledger.reconciler import Reconciler
from kvmeter.ledger.records import AttemptRecord
from kvmeter.ledger.step_records import default_replica
from kvmeter.serving.config import ServeConfig
from kvmeter.ledger.agent_records import AgentRecord
from kvmeter.serving.agents import AgentRuns, ApprovalDesk, open_agent_store
from kvmeter.serving.engines.base import Engine, EngineError
from kvmeter.serving.engines.pool import EnginePool
from kvmeter.serving.gateway.app import create_app
from kvmeter.serving.gateway.approvals import approval_routes
from kvmeter.serving.gateway.handler import Gateway, GatewaySettings
from kvmeter.serving.gateway.models import ServedModel, ServedModels
from kvmeter.serving.gateway.reprefill import PrefixReuse
from kvmeter.serving.gateway.replicas import replica_routes
from kvmeter.serving.gateway.tools import tool_call_routes
from kvmeter.serving.openai_api.layer import OpenAIApi
from kvmeter.serving.quota import HierarchicalQuota, open_quota_backend, redis_client
from kvmeter.serving.quota.backends import scheme_of
from kvmeter.serving.scheduler import FairScheduler, SchedulerConfig
from kvmeter.serving.scheduler.router import Router
from kvmeter.serving.scheduler.shared_service import SharedServiceSync
from kvmeter.serving.selfcheck.bounds import PhysicalBounds, count_parameters
from kvmeter.serving.selfcheck.monitor import SelfCheckMonitor
from kvmeter.serving.tenancy import TenantDirectory, TierPolicy
from kvmeter.stats import EngineLoad, EngineStepShares, EngineStepStats, ReplicaHealth

if TYPE_CHECKING:  # app() imports the dashboards' routes when it builds the app
    from kvmeter.dashboards.routes import DashboardRoutes

__all__ = ["ServeRuntime", "build_engine", "build_model_pools", "ledger_config_of", "scheduler_config_from_tiers",
           "shared_service_for"]

log = logging.getLogger(__name__)


def build_engine(config: ServeConfig, bus: StatsBus, clock: Clock = SYSTEM_CLOCK) -> Engine:
    """The engine named by ``config.engine.kind`` (model resolved/prepared here).

    The local engines (``vllm``, ``instant``) publish their stats on ``bus`` — each finished
    request's :class:`~kvmeter.stats.EngineRequestStats` is the engine view that the ledger stores
    for reconciliation; ``clock`` stamps the instant engine's (vLLM's hooks use their own). The
    remote engine publishes what it scrapes from its upstream's ``/metrics``
    (``engine.remote_metrics_url``) there: :class:`~kvmeter.stats.RemoteEngineStats` and its
    :class:`~kvmeter.stats.EngineLoad`, every ``engine.remote_scrape_interval_s`` on ``clock``.

    Raises:
        ModelError: the model cannot be found or prepared.
        EngineError: an unusable engine setting.
    """
    from kvmeter.model import resolve_model

    eng = config.engine
    if eng.models:
        raise EngineError("engine.models serves several engine pools: build_model_pools builds them")
    if eng.kind == "remote" and eng.replicas:
        from kvmeter.serving.engines.pool import EnginePool

        model_dir, name = resolve_model(eng.model)
        return EnginePool(eng.replicas, model_dir=model_dir, model_name=eng.remote_model or name,
                          max_model_len=eng.max_model_len, scrape=eng.remote_metrics_url.lower() != "off",
                          scrape_interval_s=eng.remote_scrape_interval_s,
                          probe_interval_s=eng.replica_probe_interval_s, bus=bus, clock=clock)
    if eng.kind == "remote":
        from kvmeter.serving.engines.remote import RemoteEngine

        if not eng.remote_url:
            raise EngineError("engine.kind=remote needs engine.remote_url (or engine.replicas: an engine pool)")
        model_dir, name = resolve_model(eng.model)
        metrics_url = None if eng.remote_metrics_url.lower() == "off" else eng.remote_metrics_url
        return RemoteEngine(eng.remote_url, model_dir=model_dir, model_name=eng.remote_model or name,
                            max_model_len=eng.max_model_len, metrics_url=metrics_url,
                            scrape_interval_s=eng.remote_scrape_interval_s, bus=bus, clock=clock)
    model_dir, name = resolve_model(eng.model)
    if eng.kind == "instant":
        from kvmeter.serving.engines.hf_tokenizer import HFTokenizer
        from kvmeter.serving.engines.instant import InstantEngine

        return InstantEngine(HFTokenizer(model_dir), name, max_model_len=eng.max_model_len or 8192,
                             bus=bus, clock=clock)
    from kvmeter.serving.engines.vllm_args import serving_argv
    from kvmeter.serving.engines.vllm_engine import VllmEngine, VllmEngineConfig

    return VllmEngine(VllmEngineConfig(
        model_dir=str(model_dir), served_name=name, max_model_len=eng.max_model_len,
        kv_cache_space_gib=eng.kv_cache_space_gib,
        gpu_memory_utilization=eng.gpu_memory_utilization, max_num_seqs=eng.max_num_seqs,
        max_num_batched_tokens=eng.max_num_batched_tokens,
        enable_prefix_caching=eng.enable_prefix_caching,
        extra={"long_prefill_token_threshold": eng.long_prefill_token_threshold}
        if eng.long_prefill_token_threshold else {},
        vllm_argv=serving_argv(config.openai.flags())), bus=bus)


def build_model_pools(config: ServeConfig, bus: StatsBus, clock: Clock = SYSTEM_CLOCK) -> list[EnginePool]:
    """One :class:`~kvmeter.serving.engines.pool.EnginePool` per ``engine.models`` entry, in order:
    served as its ``name``, estimating with the tokenizer and chat template of its ``model``
    (default ``engine.model``), its replicas scraped unless ``engine.remote_metrics_url: off``.

    Raises:
        ModelError: a model's tokenizer cannot be found or prepared.
    """
    from kvmeter.model import resolve_model

    eng = config.engine
    pools = []
    for m in eng.models:
        model_dir, _ = resolve_model(m.model if m.model is not None else eng.model)
        pools.append(EnginePool(m.replicas, model_dir=model_dir, model_name=m.name,
                                max_model_len=m.max_model_len or eng.max_model_len,
                                scrape=eng.remote_metrics_url.lower() != "off",
                                scrape_interval_s=eng.remote_scrape_interval_s,
                                probe_interval_s=eng.replica_probe_interval_s, bus=bus, clock=clock))
    return pools


def scheduler_config_from_tiers(directory: TenantDirectory, base: SchedulerConfig | None = None,
                                **options) -> SchedulerConfig:
    """The scheduler's config with the tenants config's tiers: the directory's
    :class:`~kvmeter.serving.tenancy.TierPolicy` objects themselves (weights, priorities, SLOs,
    deadline rule and overload behaviour: one definition for the scheduler and the gateway), its
    default tier as the scheduler's fallback, and ``options`` (``SchedulerConfig`` fields)."""
    base = base or SchedulerConfig()
    snapshot = directory.snapshot
    return dataclasses.replace(base, tiers=dict(snapshot.tiers), default_tier=snapshot.default_tier, **options)


def ledger_config_of(config: ServeConfig) -> LedgerConfig:
    """The ledger settings ``config`` names (DSN, spool dir, prices, engine_steps retention) over
    ``KVMETER_LEDGER_*``.

    Raises:
        ConfigError: an invalid DSN or ``KVMETER_LEDGER_*`` variable (a ``ValueError``).
    """
    base = LedgerConfig.from_env()
    return dataclasses.replace(
        base, dsn=config.ledger_dsn or base.dsn,
        spool_dir=Path(config.spool_dir).expanduser().absolute() if config.spool_dir else base.spool_dir,
        prices_path=Path(config.prices) if config.prices else base.prices_path,
        engine_steps_retention_days=(base.engine_steps_retention_days if config.engine_steps_retention_days is None
                                     else config.engine_steps_retention_days))


def shared_service_for(config: ServeConfig, model: str | None = None) -> SharedServiceSync | None:
    """The scheduler's shared VTC counters for ``config`` (``scheduler.shared_service``): on the
    quota store's Redis when it is ``redis://`` / ``rediss://`` (``auto``, ``on``), else None.
    The pool is ``scheduler.shared_service_pool``, else the served model's name (braces, Redis
    Cluster's hash-tag marks, replaced by ``_``), else ``default``. With several models
    (``engine.models``) each model's scheduler has its own: ``model`` (its name), after
    ``scheduler.shared_service_pool`` and a ``/`` when that is set.

    Raises:
        ValueError: ``shared_service: on`` with a quota store that is not Redis.
    """
    settings = config.scheduler
    on_redis = scheme_of(config.quota_store) in ("redis", "rediss")
    if settings.shared_service == "off" or (settings.shared_service == "auto" and not on_redis):
        return None
    if not on_redis:
        raise ValueError("scheduler.shared_service: on needs a redis:// or rediss:// quota_store, "
                         f"got {config.quota_store!r}")
    if model is not None:
        pool = f"{settings.shared_service_pool}/{model}" if settings.shared_service_pool else model
    else:
        pool = settings.shared_service_pool or config.engine.remote_model or config.engine.model or "default"
    pool = pool.replace("{", "_").replace("}", "_")
    return SharedServiceSync(redis_client(config.quota_store), pool=pool,
                             interval_s=settings.shared_service_interval_s)


class _LedgerRecorder:
    """The gateway's recorder: the ledger once it is open."""

    def __init__(self) -> None:
        self.ledger: Ledger | None = None

    async def record(self, event: UsageEvent) -> None:
        if self.ledger is None:
            raise RuntimeError("ledger not open")
        await self.ledger.record(event)

    async def record_attempt(self, attempt: AttemptRecord) -> None:
        if self.ledger is None:
            raise RuntimeError("ledger not open")
        await self.ledger.record_attempt(attempt)

    async def record_agent(self, record: AgentRecord) -> None:
        if self.ledger is None:
            raise RuntimeError("ledger not open")
        await self.ledger.record_agent(record)


class ServeRuntime:
    """All of ``kvmeter serve``'s parts, built from one config.

    Args:
        config: the serve configuration.
        clock: injected clock (tests); the system clock by default.
        registry: Prometheus registry (tests pass a fresh one).
        engine: an already-built engine (tests share one vLLM engine across apps); it publishes
            its stats on whatever bus it was built with, so pass that bus as ``bus``.
        bus: the stats bus every part shares (default: a new one, which a built engine gets).
        nvml: the NVML module for the GPU poller (default: the real ``pynvml``; tests pass the
            capture-backed stand-in).
        worker: this process's worker slot under ``kvmeter serve --workers N`` (0-based; ``None``:
            the one process). A worker spools into its slot's own directory under the spool dir
            (:func:`kvmeter.serving.workers.worker_spool_dir`), counts every worker as a quota
            replica (the outage fallback's share) and runs the fleet-wide readers — periodic
            reconciliation and the signal history — only in slot 0 (docs/ARCHITECTURE.md, "How
            each part starts").
    Raises:
        ValueError: an invalid setting, the ledger's included (its DSN, its ``KVMETER_LEDGER_*``
            variables: :class:`~kvmeter.ledger.errors.ConfigError`), checked here rather than
            when :meth:`start` opens the ledger, so ``kvmeter serve`` refuses it in one line.
        ModelError / EngineError: the engine cannot be built.
        VllmArgsError: vLLM refuses the serving flags (``openai:``; a ``ValueError``).
    """

    def __init__(self, config: ServeConfig, *, clock: Clock = SYSTEM_CLOCK,
                 registry: CollectorRegistry | None = REGISTRY, engine: Engine | None = None,
                 bus: StatsBus | None = None, nvml: object | None = None, worker: int | None = None) -> None:
        self.config = config
        self.worker = worker
        self.ledger_config()  # raises ConfigError (a ValueError) before anything is built
        self.clock = clock
        self.bus = bus or StatsBus()
        self.registry = registry
        self.directory = TenantDirectory.from_file(config.tenants_path(), bus=self.bus, clock=clock)
        self.prices = load_price_list(config.prices)
        # the quota store and the idempotency manager, chosen by the URL's scheme (an unknown one
        # is refused here, before the engine is built)
        replicas = config.quota_replicas if worker is None else max(config.quota_replicas, config.server.workers)
        self.quota_backend = open_quota_backend(config.quota_store, replicas=replicas,
                                                clock=clock, bus=self.bus, lease_s=config.quota_lease_s)
        self.quota = HierarchicalQuota(self.directory, self.quota_backend.store,
                                       price=self.prices.cost, clock=clock, bus=self.bus,
                                       publish_decisions=False)
        self.idempotency = self.quota_backend.idempotency
        self.recorder = _LedgerRecorder()
        # agent runs: tool policy, approvals, idempotency, loop stops; run state beside the quota's
        self.agent_store = open_agent_store(self.quota_backend, config.quota_store)
        self.agents = AgentRuns(self.directory, self.quota, self.agent_store, recorder=self.recorder, bus=self.bus,
                                clock=clock)
        self.approvals = ApprovalDesk(self.directory, self.agent_store, recorder=self.recorder, bus=self.bus,
                                      clock=clock)
        # several models (engine.models): an engine pool each; the first is `engine`, the default
        multi = engine is None and bool(config.engine.models)
        engines: list[Engine] = (list(build_model_pools(config, self.bus, clock)) if multi
                                 else [engine or build_engine(config, self.bus, clock)])
        self.engine = engines[0]
        self._owns_engine = engine is None
        sched_cfg = scheduler_config_from_tiers(self.directory, **config.scheduler.options)
        routing = {m.name: m.routing or config.engine.routing for m in config.engine.models}
        served: list[ServedModel] = []
        #: each served model's scheduler, by name (in order)
        self.schedulers: dict[str, FairScheduler] = {}
        for i, eng in enumerate(engines):
            # VTC counters shared with the pool's other gateway processes on a Redis quota store
            shared = shared_service_for(config, eng.model_name if multi else None)
            # an engine pool: one scheduler gate per replica, the router picks among the open ones
            pool = eng if isinstance(eng, EnginePool) else None
            router = None if pool is None else Router(
                routing.get(pool.model_name, config.engine.routing), clock=clock, model=pool.model_name,
                replica_names=pool.names, on_decision=self.bus.publish)
            # the scheduler-wide series (kvmeter_scheduler_*, the signal history's) carry no model
            # label: the first model's scheduler publishes them (docs/ARCHITECTURE.md)
            scheduler = FairScheduler(sched_cfg, policy=config.scheduler.policy, clock=clock,
                                      bus=self.bus if i == 0 else None, shared_service=shared,
                                      num_engines=len(pool) if pool else 1, router=router,
                                      model=eng.model_name)
            served.append(ServedModel(eng.model_name, eng, scheduler))
            self.schedulers[eng.model_name] = scheduler
            if i == 0:
                self.shared_service, self.router, self.scheduler = shared, router, scheduler
        #: every served model, in order: its engine (pool) and its scheduler
        self.models = ServedModels(served)
        # engine load → KV gating: the hosted engines' step stats, the remote engines' scraped loads
        # (a pool's replica's to its own gate), a pool's replica health → its gate open or closed
        self._unsubscribe = [self.bus.subscribe(EngineStepStats, self.scheduler.on_step_stats),  # (in-process)
                             self.bus.subscribe(EngineLoad, self._on_engine_load),
                             self.bus.subscribe(ReplicaHealth, self._on_replica_health)]
        # vLLM's OpenAI serving layer for an in-process engine (its arguments checked here, before
        # the engine loads; the layer itself is built once the engine has started)
        self.openai = OpenAIApi(self.engine, config.openai.flags()) if OpenAIApi.supports(self.engine) else None
        self.gateway = Gateway(
            engine=self.engine, authenticator=self.directory, quota=self.quota,
            scheduler=self.scheduler, recorder=self.recorder, bus=self.bus, clock=clock,
            settings=GatewaySettings(max_body_bytes=config.server.max_body_bytes,
                                     body_read_timeout_s=config.server.body_read_timeout_s,
                                     stream_stall_timeout_s=config.server.stream_stall_timeout_s),
            tier_policy=self._tier_policy, idempotency=self.idempotency, openai=self.openai,
            agents=self.agents, models=self.models)
        prom = PrometheusConfig.from_env(top_k_tenants=config.metrics_top_k_tenants)
        if not prom.model:  # KVMETER_PROM_MODEL, else the served model: the engine series' label
            prom = dataclasses.replace(prom, model=self.engine.model_name)
        self.exporter = install_prometheus(self.bus, registry, config=prom, clock=clock)
        # plausibility checks on every request (kvmeter_selfcheck_* metrics, `kvmeter check`)
        sc = config.selfcheck
        params = sc.model_params
        if params is None and self.engine.weights_dir is not None:  # the vLLM engine
            params = count_parameters(self.engine.weights_dir)
        self.selfcheck = SelfCheckMonitor(
            self.bus, PhysicalBounds(params, peak_flops_per_s=sc.peak_flops_per_s, ttft_floor_s=sc.ttft_floor_s),
            input_ratio=sc.reservation_input_ratio)
        self.otel = None
        if config.otel:
            from kvmeter.exporters.otel import install_otel

            self.otel = install_otel(self.bus)
        # GPU readings with no flag: polled on a GPU machine; without one, a "no GPU" line at start
        self.gpu = GpuPoller(NvmlCollector(nvml, bus=self.bus, clock=clock))
        # signal history (ClickHouse ``signals``): sampled from now, written once the ledger is open
        self.signals = SignalSampler(self.bus, clock=clock, model=self.engine.model_name)
        self.signal_recorder: SignalRecorder | None = None
        # periodic three-way reconciliation (kvmeter_reconciliation_* metrics), once the ledger is open
        self.reconciler: Reconciler | None = None
        self.ready = False
        self._watch: asyncio.Task | None = None
        self._dashboard_routes: DashboardRoutes | None = None

    # -- parts ------------------------------------------------------------------------------------
    def _scheduler_of(self, model: str) -> FairScheduler | None:
        """The scheduler of served model ``model`` ("": the first's, for loads that name none)."""
        return self.schedulers.get(model) if model else self.scheduler

    def _on_engine_load(self, load: EngineLoad) -> None:
        scheduler = self._scheduler_of(load.model) if len(self.models) > 1 else self.scheduler
        if scheduler is not None and load.replica < scheduler.core.num_engines:
            scheduler.on_engine_load(load, load.replica)

    def _on_replica_health(self, health: ReplicaHealth) -> None:
        scheduler = self._scheduler_of(health.model)
        if scheduler is not None and health.index < scheduler.core.num_engines:
            scheduler.set_engine_available(health.index, health.available, down=not health.healthy)

    def _outstanding(self, model: str, engine_idx: int) -> int:
        """Requests dispatched to replica ``engine_idx`` of ``model``'s pool and not ended (the
        replicas API)."""
        scheduler = self._scheduler_of(model)
        return 0 if scheduler is None else scheduler.core.engine_gates[engine_idx].outstanding

    def _tier_policy(self, tier: str) -> TierPolicy | None:
        """The gateway's tier policy: the live tenants config's (follows reloads)."""
        return self.directory.snapshot.tiers.get(tier)

    def ledger_config(self) -> LedgerConfig:
        """The ledger's settings: the config's DSN, spool dir and prices over ``KVMETER_LEDGER_*``;
        a worker's spool dir is its slot's (:func:`kvmeter.serving.workers.worker_spool_dir`)."""
        config = ledger_config_of(self.config)
        if self.worker is None:
            return config
        from kvmeter.serving.workers import worker_spool_dir

        return dataclasses.replace(config, spool_dir=worker_spool_dir(config.spool_dir, self.worker))

    # -- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the ledger, load the engine, start the scheduler, GPU poller, signal recorder,
        periodic reconciliation and config watcher."""
        ledger = await asyncio.to_thread(Ledger.open, self.ledger_config(), bus=self.bus,
                                         clock=self.clock, prices=self.prices)
        self.recorder.ledger = ledger
        # per-step engine work per tenant → the ledger's engine_steps (interference reads)
        self._unsubscribe.append(self.bus.subscribe(EngineStepShares, functools.partial(
            ledger.record_step_shares, model=self.engine.model_name, replica=default_replica(self.worker))))
        started: list[Engine] = []
        try:
            if self._owns_engine:
                for m in self.models:  # (every model's pool; one that no replica answers is fatal)
                    await m.engine.start()
                    started.append(m.engine)
        except BaseException:
            for eng in started:  # the pools that started before the one that failed
                await eng.shutdown()
            ledger.close()
            raise
        if self.openai is not None:
            try:
                await self.openai.layer()  # vLLM's serving objects, before the first request
            except BaseException:
                if self._owns_engine:
                    await self.engine.shutdown()
                ledger.close()
                raise
        block = self.engine.prefix_cache_block_size_tokens
        window = self.config.server.reprefill_window_s
        if block and window:  # the prompt-cache thrash signal, in whole blocks of the engine's cache
            self.gateway.reprefill = PrefixReuse(block, window_s=window, clock=self.clock,
                                                 max_blocks=self.config.server.reprefill_max_blocks)
        for scheduler in self.schedulers.values():
            await scheduler.start()
        self.quota_backend.start()  # lease renewal of the shared quota store's holds
        # Only an engine that measures its KV cache keeps reporting its load: vLLM after every
        # step (its step stats), the remote engine after every scrape of its upstream's
        # /metrics (an EngineLoad on the bus; this is its load at start, published before the
        # scheduler listened when the engine was started by the caller). One empty per-step
        # report from an engine that never reports again (instant, a remote upstream that is
        # not scraped) would make the scheduler count every dispatch as still waiting in the
        # engine, and stall all traffic after max_engine_waiting requests; without reports it
        # counts dispatched requests that have no first token yet instead, as it does between
        # a remote engine's scrapes.
        for m in self.models:
            loads = m.engine.loads() if isinstance(m.engine, EnginePool) else [m.engine.load()]
            for load in loads:  # (each replica's, for an engine pool)
                if load.kv_capacity_tokens > 0 or not load.per_step:
                    self.schedulers[m.name].on_engine_load(load, load.replica)
            if isinstance(m.engine, EnginePool):  # each replica's health (published before we listened when
                m.engine.publish_health()          # the caller started the pool): gates and kvmeter_replica_up
        await asyncio.to_thread(self.gpu.start)
        if self.worker in (None, 0):  # once per fleet: slot 0 (a replacement takes a dead one's slot)
            self.signal_recorder = SignalRecorder(self.signals, ledger.write_signals, clock=self.clock)
            self.signal_recorder.start()
            rec = self.config.reconciliation
            # on the ledger's own query client, from a worker thread (see kvmeter.ledger.reconciler)
            self.reconciler = Reconciler(ledger.queries, self.bus, clock=self.clock, interval_s=rec.interval_s,
                                         first_run_delay_s=rec.first_run_delay_s, lookback_s=rec.lookback_s)
            self.reconciler.start()
        if self.directory.path is not None:
            self._watch = self.directory.start_watching(2.0)
        # Everything built so far (model tokenizer, price list, tenancy, ledger, modules) lives as
        # long as the process: move it out of the collector's reach, so the full collections that
        # per-request garbage triggers do not walk it again and again (each took ~0.2 s, a latency
        # spike, on the instant-engine benchmark; bench/quota/RESULTS.md).
        gc.collect()
        gc.freeze()
        self.ready = True

    async def stop(self) -> None:
        """Stop taking work, write a last signal sample, drain the ledger's spool, shut the engine
        and the GPU poller down, close the quota store's connections."""
        self.ready = False
        gc.unfreeze()  # back to the collector: frozen objects are never finalized at exit otherwise
        if self._watch is not None:
            self._watch.cancel()
        for scheduler in self.schedulers.values():
            await scheduler.stop()
        if self.reconciler is not None:  # a run in progress finishes before the ledger closes
            await self.reconciler.stop()
        if self.signal_recorder is not None:  # its last sample goes in before the ledger closes
            await self.signal_recorder.stop()
        await asyncio.to_thread(self.gpu.stop)
        if self._dashboard_routes is not None:
            self._dashboard_routes.close()  # its ClickHouse client, before the ledger closes
        if self.recorder.ledger is not None:
            await asyncio.to_thread(self.recorder.ledger.close)
        if self._owns_engine:
            for m in self.models:
                await m.engine.shutdown()
        await self.quota_backend.aclose()
        for scheduler in self.schedulers.values():
            if scheduler.shared_service is not None:
                await scheduler.shared_service.aclose()
        await self.agent_store.aclose()
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self.exporter.close()

    def app(self) -> Starlette:
        """The ASGI app: OpenAI API, /healthz, /metrics, the ledger's read API (with the
        dashboards' reads: the embedded ledger can only be read through this process), tool-call
        reports, approvals."""
        from kvmeter.dashboards.routes import serve_routes

        queries = _LazyQueries(self.recorder)
        self._dashboard_routes = serve_routes(self)
        routes: list[Route] = [*read_routes(queries, self.directory.authenticate, prices=self.prices,
                                            agent_runs=_LazyQueries(self.recorder, "agent_runs"),
                                            timezones=lambda: self.directory.snapshot.billing_timezones,
                                            interference=_LazyQueries(self.recorder, "interference"),
                                            slos=lambda: [(t.name, t.ttft_slo_s, t.itl_slo_s)
                                                          for t in self.directory.snapshot.tiers.values()]),
                               *self._dashboard_routes.routes,
                               *tool_call_routes(self.gateway, self.quota, self.agents),
                               *approval_routes(self.gateway, self.approvals),
                               *replica_routes(self.gateway, self._outstanding)]
        return create_app(self.gateway, extra_routes=routes, metrics_app=metrics_asgi_app(self.registry),
                          on_startup=[self.start], on_shutdown=[self.stop], ready=lambda: self.ready)


class _LazyQueries:
    """The ledger's queries (``ledger.queries``, or another reader of the ledger named by
    ``attribute``), resolved when a read arrives (the ledger opens in the lifespan)."""

    def __init__(self, recorder: _LedgerRecorder, attribute: str = "queries") -> None:
        self._recorder = recorder
        self._attribute = attribute

    def __getattr__(self, name: str):
        ledger = self._recorder.ledger
        if ledger is None:
            raise RuntimeError("ledger not open")
        return getattr(getattr(ledger, self._attribute), name)
