"""Every stats type kvmeter publishes on its :class:`~kvmeter.bus.StatsBus`, in one package.

Producers (the engines and their hooks, the remote engine's ``/metrics`` scraper, the gateway, the
quota, the tenant directory, the scheduler, the ledger, the GPU collector) build these plain
dataclasses and publish them; consumers (the Prometheus and OpenTelemetry exporters, the signal
history sampler, the scheduler's KV gating, tests) subscribe by type. Nothing here imports a
producer or an exporter, as vLLM keeps ``v1/metrics/stats.py`` apart from ``loggers.py``.

One module per producer:

* :mod:`.engine` — :class:`EngineStepStats`, :class:`EngineRequestStats`, :class:`EngineLoad`,
  :class:`EngineStepShares` with :class:`TenantStepShare` (an engine kvmeter hosts: vLLM
  in-process, instant, the simulator; the load the scheduler gates on, which the remote engine
  publishes after every scrape; who each engine step worked for);
* :mod:`.remote` — :class:`RemoteEngineStats` with :class:`HistogramSnapshot` and
  :class:`CounterAnomaly` (a vLLM server kvmeter scrapes but does not host);
* :mod:`.pool` — :class:`RoutingDecision`, :class:`ReplicaHealth` (an engine pool's router and
  replicas);
* :mod:`.gateway` — :class:`RequestCompletion` (with its :class:`RequestPhase` s), :class:`AdmissionDecision`,
  :class:`RequestRefused` and the refusal label sets, :class:`StreamSendStats` (a stream's sends);
* :mod:`.quota` — :class:`ReservationDrift`, :class:`QuotaStoreState`,
  :class:`IdempotencyAttempt`, :class:`ToolCallReported`;
* :mod:`.tenancy` — :class:`ConfigReloaded`;
* :mod:`.agents` — :class:`ToolCallDecided`, :class:`ApprovalEvent`, :class:`AgentRunStopped`
  (agent-run tool policy, approvals and loop stops);
* :mod:`.scheduler` — :class:`SchedulerStats`, :class:`TierSchedulerStats`,
  :class:`TenantSchedulerStats`;
* :mod:`.ledger` — :class:`LedgerStats`;
* :mod:`.selfcheck` — :class:`SelfCheckViolation` (serve's plausibility monitor);
* :mod:`.gpu` — :class:`GpuSample`, :class:`MigSample`, :class:`GpuProcessSample`,
  :class:`XidEvent`, :class:`GpuCollectorStatus`.

Units are in the field names or stated; timestamps say which clock they come from.
"""

from kvmeter.stats.agents import (APPROVAL_EVENTS, RISK_CLASSES, RUN_STOP_REASONS, TOOL_CALL_DECISIONS,
                                  TOOL_CALL_SOURCES, AgentRunStopped, ApprovalEvent, ToolCallDecided)
from kvmeter.stats.engine import EngineLoad, EngineRequestStats, EngineStepShares, EngineStepStats, TenantStepShare
from kvmeter.stats.gateway import (REFUSAL_CODES, REFUSAL_ENDPOINTS, TRACE_CONTEXT_HEADERS, AdmissionDecision,
                                   RequestCompletion, RequestPhase, RequestRefused, StreamSendStats)
from kvmeter.stats.gpu import (CLOCK_EVENT_REASONS, GpuCollectorStatus, GpuProcessSample, GpuSample, MigSample,
                               XidEvent, clock_event_reason_names)
from kvmeter.stats.ledger import (INGEST_STATUSES, RECONCILIATION_VIEWS, RUN_RESULTS, LedgerStats,
                                  ReconciliationStats)
from kvmeter.stats.pool import ROUTING_OUTCOMES, ReplicaHealth, RoutingDecision
from kvmeter.stats.quota import IdempotencyAttempt, QuotaStoreState, ReservationDrift, ToolCallReported
from kvmeter.stats.remote import CounterAnomaly, HistogramSnapshot, RemoteEngineStats
from kvmeter.stats.selfcheck import VIOLATION_CHECKS, SelfCheckViolation
from kvmeter.stats.scheduler import SchedulerStats, TenantSchedulerStats, TierSchedulerStats
from kvmeter.stats.tenancy import ConfigReloaded

__all__ = [
    # engine
    "EngineStepStats", "EngineRequestStats", "EngineLoad", "EngineStepShares", "TenantStepShare",
    # remote engine
    "RemoteEngineStats", "HistogramSnapshot", "CounterAnomaly",
    # engine pool
    "RoutingDecision", "ReplicaHealth", "ROUTING_OUTCOMES",
    # gateway
    "RequestCompletion", "RequestPhase", "AdmissionDecision", "RequestRefused", "REFUSAL_CODES", "REFUSAL_ENDPOINTS",
    "TRACE_CONTEXT_HEADERS", "StreamSendStats",
    # quota
    "ReservationDrift", "QuotaStoreState", "IdempotencyAttempt", "ToolCallReported",
    # tenancy
    "ConfigReloaded",
    # agent runs
    "ToolCallDecided", "ApprovalEvent", "AgentRunStopped", "TOOL_CALL_SOURCES", "TOOL_CALL_DECISIONS",
    "APPROVAL_EVENTS", "RUN_STOP_REASONS", "RISK_CLASSES",
    # scheduler
    "SchedulerStats", "TierSchedulerStats", "TenantSchedulerStats",
    # ledger
    "LedgerStats", "INGEST_STATUSES", "ReconciliationStats", "RECONCILIATION_VIEWS", "RUN_RESULTS",
    # self-checks
    "SelfCheckViolation", "VIOLATION_CHECKS",
    # GPU
    "GpuSample", "MigSample", "GpuProcessSample", "XidEvent", "GpuCollectorStatus",
    "CLOCK_EVENT_REASONS", "clock_event_reason_names",
]
