"""Quota admission: hierarchical, multi-dimensional limits with estimate → reserve → admit → reconcile.

Public surface (the modules are internals):

* :class:`QuotaGate`, :class:`UsageEstimate`, :class:`Reservation`, :class:`QuotaRejected`,
  :class:`UnlimitedQuota` — the gateway boundary (:mod:`.base`); estimates, reservations and the
  actual usage reconciled are :class:`kvmeter.tokens.TokenCounts`.
* :class:`HierarchicalQuota` — the implementation over a
  :class:`~kvmeter.serving.tenancy.TenantDirectory` (:mod:`.gate`; its docstring lists every
  rejection, status code and ``Retry-After`` rule, including 402 vs 429 for spend).
* Stores: :class:`MemoryQuotaStore` (default), :class:`RedisQuotaStore` (shared, one Lua script
  per reserve and per reconcile), :class:`FailoverQuotaStore` (Redis with the documented outage
  policy) (:mod:`.store`, :mod:`.memory`, :mod:`.redis_store` with its Lua in
  :mod:`.redis_scripts`, :mod:`.failover`). On Redis, concurrency and KV holds carry per-process
  leases (:mod:`.leases`, ``quota_lease_s``); one org's keys share a hash tag, so the Redis store
  also runs on a Redis Cluster; :mod:`.key_migration` moves keys of the older, untagged layout.
* Backends by URL scheme: :func:`open_quota_backend` turns ``memory://`` / ``redis://`` /
  ``rediss://`` into the store and the idempotency manager, the one place that choice is made
  (:class:`QuotaBackend`, :func:`register_scheme`, :class:`QuotaStoreURLError`; :mod:`.backends`).
* Idempotency: :class:`MemoryIdempotencyManager`, :class:`RedisIdempotencyManager`,
  :class:`StoredResponse`, :class:`AttemptOutcome`, :class:`IdempotencyTicket` and the
  :class:`IdempotencyError` family (:mod:`.idempotency`).
* Stats published on the bus live in :mod:`kvmeter.stats.quota`: ``ReservationDrift``,
  ``QuotaStoreState``, ``IdempotencyAttempt``, ``ToolCallReported``; admission decisions are
  :class:`kvmeter.stats.AdmissionDecision`.

A default config example ships in ``examples/principals.yaml`` (:data:`EXAMPLE_CONFIG`).

Operator notes
--------------

**An exhausted spend budget answers 402, not 429.** When ``spend_per_day`` or ``spend_per_month``
of any level (org, workspace, project, key) cannot hold a request's reserved cost (the price of
its input plus ``max_tokens`` at list price), the gateway answers::

    HTTP/1.1 402 Payment Required
    retry-after: 43200                  # seconds to the next day (month) boundary of the tenant's
                                        # billing_timezone (UTC for global limits)
    x-kvmeter-quota-level: org
    x-kvmeter-quota-dimension: spend_per_day
    {"error": {"type": "insufficient_quota", "code": "spend_exhausted", "level": "org",
               "dimension": "spend_per_day", "message": "... 0.0003 of 0.0005 spent or reserved ..."}}

Why 402: a 429 tells a client to back off and retry, and OpenAI-compatible SDKs retry 429s
automatically — against a budget that refills only at the next period that is a retry storm with
no chance of success. 402 is not retried by those SDKs and says what is wrong (money, not speed).
A cheaper request (shorter prompt, lower ``max_tokens``) may still fit: budgets count money, and
reservations are reconciled to the engine-true cost when a request ends. To follow OpenAI's own
convention instead (429 with code ``insufficient_quota``), build the gate with
``HierarchicalQuota(..., spend_status_code=429)``. An agent run's ``max_cost`` is a run budget
and answers 429 ``run_budget_exceeded`` (dimension ``cost``), like the other run budgets.

**When Redis is unreachable** (``quota_store: redis://...``; the gateway wraps the store in
:class:`FailoverQuotaStore`): every dimension has an outage policy (:data:`DEFAULT_OUTAGE_POLICY`):

=====================================================  =========================================
dimensions                                             while Redis is down
=====================================================  =========================================
spend_per_day, spend_per_month, agent run ``cost``     fail **closed**: 503
                                                       ``quota_store_unavailable`` with
                                                       ``retry-after`` = the probe interval (1 s)
requests / input / output tokens per minute,           **local**: enforced on each replica's own
concurrent_requests, active_kv_tokens, and the other   memory at ``limit // replicas`` (set
run budgets (model/tool calls, retries, branches,      ``quota_replicas`` in the serve config or
runtime)                                               ``KVMETER_QUOTA_REPLICAS``), so the fleet
                                                       stays at or under the global limit if the
                                                       load balancer spreads traffic evenly
=====================================================  =========================================

The stats: :class:`~kvmeter.stats.QuotaStoreState` on the bus (``degraded=True`` at the first failure,
``degraded=False`` on recovery, with the number of reconciliations waiting), exported by the
Prometheus exporter, and an ERROR log line naming the store. Recovery needs no restart: every
probe interval one request tries Redis again; on success the reconciliations queued during the
outage are replayed on Redis (so holds taken there before the outage are released) and Redis is
used again. Counters kept locally during the outage are not copied to Redis: after recovery a key
may use up to its Redis-side remainder again (the overshoot is bounded by one outage's local
share). Idempotency records live in the same Redis: while it is down, a request with an
``Idempotency-Key`` is answered 503 (it cannot be checked for an earlier attempt, so it is not
run twice); requests without the header are served under the policy above.
"""

from pathlib import Path

from kvmeter.serving.quota.base import (
    QuotaGate,
    QuotaRejected,
    Reservation,
    UnlimitedQuota,
    UsageEstimate,
)
from kvmeter.serving.quota.backends import (QuotaBackend, QuotaStoreURLError, open_quota_backend,
                                            register_scheme)
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
from kvmeter.serving.quota.store import QuotaStore, ReserveResult, StoreUnavailable

#: The example principals config shipped with the package.
EXAMPLE_CONFIG = Path(__file__).with_name("examples") / "principals.yaml"

__all__ = [
    "QuotaGate",
    "UsageEstimate",
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
    "QuotaBackend",
    "QuotaStoreURLError",
    "open_quota_backend",
    "register_scheme",
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
    "EXAMPLE_CONFIG",
]
