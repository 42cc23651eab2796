"""The run store of a quota backend: the agent-run state lives beside the quota's counters.

A run's tool-call permits are counted in the quota's own ``max_tool_calls`` counter, inside the
run store's atomic operation, so the two must share one backend: the in-memory quota store gets a
:class:`~.memory.MemoryAgentStore` over it, a Redis one (``redis://``, ``rediss://``) a
:class:`~.redis_store.RedisAgentStore` on the same Redis.
"""

from __future__ import annotations

from kvmeter.serving.quota import FailoverQuotaStore, MemoryQuotaStore, QuotaBackend, RedisQuotaStore, redis_client

from .memory import MemoryAgentStore
from .redis_store import RedisAgentStore
from .store import AgentStore

__all__ = ["open_agent_store"]


def open_agent_store(backend: QuotaBackend, url: str) -> AgentStore:
    """The run store for ``backend`` (built from ``url`` by
    :func:`~kvmeter.serving.quota.open_quota_backend`).

    Raises:
        ValueError: a quota store this module cannot put run state beside.
    """
    store = backend.store
    if isinstance(store, MemoryQuotaStore):
        return MemoryAgentStore(store)
    primary = store.primary if isinstance(store, FailoverQuotaStore) else store
    if isinstance(primary, RedisQuotaStore):
        return RedisAgentStore(redis_client(url))
    raise ValueError(f"no agent-run store for a {type(store).__name__} quota store")
