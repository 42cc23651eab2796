"""Quota admission: hierarchical, multi-dimensional limits with estimate → reserve → admit → reconcile.

Public surface (the modules are internals):

* :class:`QuotaGate`, :class:`UsageEstimate`, :class:`ActualUsage`, :class:`Reservation`,
  :class:`QuotaRejected`, :class:`UnlimitedQuota` — the gateway boundary (:mod:`.base`).
* :class:`HierarchicalQuota` — the implementation over a
  :class:`~kvmeter.serving.tenancy.TenantDirectory` (:mod:`.gate`; its docstring lists every
  rejection, status code and ``Retry-After`` rule, including 402 vs 429 for spend).
* Stores: :class:`MemoryQuotaStore` (default), :class:`RedisQuotaStore` (shared, one Lua script
  per reserve and per reconcile), :class:`FailoverQuotaStore` (Redis with the documented outage
  policy) (:mod:`.store`, :mod:`.memory`, :mod:`.redis_store`, :mod:`.failover`).
* Idempotency: :class:`MemoryIdempotencyManager`, :class:`RedisIdempotencyManager`,
  :class:`StoredResponse`, :class:`AttemptOutcome`, :class:`IdempotencyTicket` and the
  :class:`IdempotencyError` family (:mod:`.idempotency`).
* Signals (plain dataclasses for the bus): :class:`ReservationDrift`, :class:`QuotaStoreState`,
  :class:`IdempotencyAttempt`, :class:`ToolCallReported`; admission decisions are
  :class:`kvmeter.stats.AdmissionDecision` (:mod:`.signals`).

A default config example ships in ``examples/principals.yaml`` (:data:`EXAMPLE_CONFIG`).
"""

from pathlib import Path

from kvmeter.serving.quota.base import (
    ActualUsage,
    QuotaGate,
    QuotaRejected,
    Reservation,
    UnlimitedQuota,
    UsageEstimate,
)
from kvmeter.serving.quota.failover import DEFAULT_OUTAGE_POLICY, FailoverQuotaStore
from kvmeter.serving.quota.gate import HierarchicalQuota, PriceFn, RunUsage, ToolCallReport
from kvmeter.serving.quota.idempotency import (
    AttemptOutcome,
    IdempotencyConflict,
    IdempotencyError,
    IdempotencyInProgress,
    IdempotencyManager,
    IdempotencyTicket,
    IdempotencyUnavailable,
    InvalidIdempotencyKey,
    MemoryIdempotencyManager,
    RedisIdempotencyManager,
    StoredResponse,
)
from kvmeter.serving.quota.memory import MemoryQuotaStore
from kvmeter.serving.quota.redis_store import RedisQuotaStore, redis_client
from kvmeter.serving.quota.signals import IdempotencyAttempt, QuotaStoreState, ReservationDrift, ToolCallReported
from kvmeter.serving.quota.store import QuotaStore, ReserveResult, StoreUnavailable

#: The example principals config shipped with the package.
EXAMPLE_CONFIG = Path(__file__).with_name("examples") / "principals.yaml"

__all__ = [
    "QuotaGate",
    "UsageEstimate",
    "ActualUsage",
    "Reservation",
    "QuotaRejected",
    "UnlimitedQuota",
    "HierarchicalQuota",
    "PriceFn",
    "ToolCallReport",
    "RunUsage",
    "QuotaStore",
    "ReserveResult",
    "StoreUnavailable",
    "MemoryQuotaStore",
    "RedisQuotaStore",
    "redis_client",
    "FailoverQuotaStore",
    "DEFAULT_OUTAGE_POLICY",
    "IdempotencyManager",
    "MemoryIdempotencyManager",
    "RedisIdempotencyManager",
    "StoredResponse",
    "AttemptOutcome",
    "IdempotencyTicket",
    "IdempotencyError",
    "IdempotencyConflict",
    "IdempotencyInProgress",
    "InvalidIdempotencyKey",
    "IdempotencyUnavailable",
    "ReservationDrift",
    "QuotaStoreState",
    "IdempotencyAttempt",
    "ToolCallReported",
    "EXAMPLE_CONFIG",
]
