"""What admission does while the shared (Redis) quota store is unreachable.

:class:`FailoverQuotaStore` wraps the shared store. While the shared store answers, it is used for
everything. When a call fails with :class:`StoreUnavailable`, the wrapper is *degraded*: it
publishes :class:`~kvmeter.stats.QuotaStoreState` (``degraded=True``) and decides
each item of a reservation by its dimension's **outage policy**:

``closed``  the request is refused (the gate answers 503 with ``Retry-After`` = the probe
            interval). Default for money: ``spend_per_day``, ``spend_per_month`` and the agent
            run's ``cost`` — an outage must not let spend run past a budget.
``local``   the item is enforced on this replica's own in-memory store at ``limit // replicas``
            (at least 1 when the limit is ≥ 1): the fleet as a whole stays at or below the global
            limit if traffic spreads evenly. Default for the rate limits, concurrency, active KV
            tokens and the other agent-run budgets. Local counters start empty, so during an
            outage a run's count restarts (a run may exceed its budget by at most that).
``open``    the item is not enforced.

Recovery without restart: every ``probe_interval_s`` (on the injected clock) one request tries the
shared store again; on success the wrapper flushes the reconciliations it queued while degraded
(so concurrency and KV holds taken on Redis before the outage are released there), publishes
``degraded=False`` and uses the shared store again. Reservations taken locally are reconciled
locally. The number of replicas is an argument, else the ``KVMETER_QUOTA_REPLICAS`` environment
variable, else 1.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from dataclasses import replace
from typing import Any, Mapping, Sequence

from kvmeter.bus import StatsBus
from kvmeter.clock import SYSTEM_CLOCK, Clock
from kvmeter.serving.quota.memory import MemoryQuotaStore
from kvmeter.serving.quota.plan import DEADLINE, RATE, PlanItem
from kvmeter.serving.quota.store import QuotaStore, ReserveResult, StoreUnavailable
from kvmeter.stats import QuotaStoreState

__all__ = ["FailoverQuotaStore", "DEFAULT_OUTAGE_POLICY", "FAIL_CLOSED", "LOCAL", "FAIL_OPEN"]

log = logging.getLogger(__name__)

FAIL_CLOSED, LOCAL, FAIL_OPEN = "closed", "local", "open"

#: Outage policy per dimension (see module docstring). Dimensions not listed use ``local``.
DEFAULT_OUTAGE_POLICY: Mapping[str, str] = {
    "requests_per_minute": LOCAL,
    "input_tokens_per_minute": LOCAL,
    "output_tokens_per_minute": LOCAL,
    "concurrent_requests": LOCAL,
    "active_kv_tokens": LOCAL,
    "spend_per_day": FAIL_CLOSED,
    "spend_per_month": FAIL_CLOSED,
    "model_calls": LOCAL,
    "tool_calls": LOCAL,
    "retries": LOCAL,
    "parallel_branches": LOCAL,
    "runtime_seconds": LOCAL,
    "cost": FAIL_CLOSED,
}

_LOCAL_TOKEN = "local"


class FailoverQuotaStore(QuotaStore):
    """A shared store with a per-replica local fallback (see module docstring).

    Args:
        primary: the shared store (normally a ``RedisQuotaStore``).
        local: the fallback store (default: a new ``MemoryQuotaStore`` with the same key prefix).
        replicas: gateway replicas sharing the primary (≥ 1); local limits are divided by it.
        policy: outage policy overrides, dimension → ``closed`` / ``local`` / ``open``.
        probe_interval_s: seconds between attempts to reach the primary while degraded (> 0).
        max_pending: reconciliations kept for replay after recovery (oldest dropped beyond it).
        clock: injected clock (monotonic, for probes; wall, for the stats' timestamps).
        bus: where :class:`QuotaStoreState` goes.
    Raises:
        ValueError: bad replicas / interval / policy value.
    """

    def __init__(self, primary: QuotaStore, *, local: QuotaStore | None = None, replicas: int | None = None,
                 policy: Mapping[str, str] | None = None, probe_interval_s: float = 1.0,
                 max_pending: int = 100_000, clock: Clock = SYSTEM_CLOCK, bus: StatsBus | None = None) -> None:
        if replicas is None:
            env = os.environ.get("KVMETER_QUOTA_REPLICAS", "1")
            try:
                replicas = int(env)
            except ValueError:
                raise ValueError(f"KVMETER_QUOTA_REPLICAS must be an integer >= 1, got {env!r}") from None
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        if probe_interval_s <= 0:
            raise ValueError(f"probe_interval_s must be > 0, got {probe_interval_s}")
        merged = dict(DEFAULT_OUTAGE_POLICY)
        for dim, value in (policy or {}).items():
            if value not in (FAIL_CLOSED, LOCAL, FAIL_OPEN):
                raise ValueError(f"outage policy for {dim!r} must be closed, local or open, got {value!r}")
            merged[dim] = value
        self.primary = primary
        self.local = local if local is not None else MemoryQuotaStore(primary.key_prefix)
        self.key_prefix = primary.key_prefix
        self.lease_s = primary.lease_s
        self.name = f"{primary.name}+local"
        self.replicas = replicas
        self.policy: Mapping[str, str] = merged
        self.probe_interval_s = probe_interval_s
        self._clock = clock
        self._bus = bus
        self._degraded = False
        self._last_probe = float("-inf")
        self._pending: deque[tuple[Sequence[PlanItem], Sequence[bytes], Sequence[int], Sequence[int], float]] = \
            deque(maxlen=max_pending)
        self._scaled: dict[PlanItem, PlanItem] = {}
        self._flush_lock = asyncio.Lock()
        self.dropped_settles = 0
        self.degraded_reserves = 0

    # -- state -------------------------------------------------------------------------------

    @property
    def degraded(self) -> bool:
        """True while the primary is considered unreachable."""
        return self._degraded

    @property
    def pending_settles(self) -> int:
        """Reconciliations waiting for the primary to come back."""
        return len(self._pending)

    def _policy(self, dimension: str) -> str:
        return self.policy.get(dimension, LOCAL)

    def _mark_degraded(self, err: Exception) -> None:
        self._last_probe = self._clock.monotonic()
        if not self._degraded:
            self._degraded = True
            log.error("quota store %s unreachable, degraded to local limits / %d: %s",
                      self.primary.name, self.replicas, err)
            self._publish(True, str(err))

    def _publish(self, degraded: bool, reason: str) -> None:
        if self._bus is not None:
            self._bus.publish(QuotaStoreState(store=self.primary.name, degraded=degraded, reason=reason,
                                              pending_settles=len(self._pending), wall_ts=self._clock.wall()))

    def _should_try_primary(self) -> bool:
        if not self._degraded:
            return True
        return self._clock.monotonic() - self._last_probe >= self.probe_interval_s

    async def _flush_pending(self) -> None:
        """Replay queued reconciliations on the primary, oldest first.

        Raises:
            StoreUnavailable: the primary failed again (the rest stays queued).
        """
        if not self._pending:
            return
        async with self._flush_lock:  # one flusher at a time: each queued entry is applied once
            while self._pending:
                items, keys, reserved, actual, now = self._pending[0]
                try:
                    await self.primary.settle(items, keys, reserved, actual, now)
                except StoreUnavailable as e:
                    if e.unsettled is not None:  # part of it landed: keep only the rest queued
                        self._pending[0] = (tuple(e.unsettled[0]), tuple(e.unsettled[1]), reserved, actual, now)
                    raise
                self._pending.popleft()

    def _recovered(self) -> None:
        if self._degraded:
            self._degraded = False
            log.warning("quota store %s reachable again; left degraded mode", self.primary.name)
            self._publish(False, "recovered")

    def _local_item(self, it: PlanItem) -> PlanItem:
        hit = self._scaled.get(it)
        if hit is None:
            if it.kind == DEADLINE or self.replicas == 1:
                hit = it
            else:
                limit = it.limit // self.replicas if it.limit else 0
                if it.limit and limit == 0:
                    limit = 1
                if it.kind == RATE:
                    interval = it.period_s / limit if limit > 0 else it.period_s
                    hit = replace(it, limit=limit, interval_s=interval)
                else:
                    hit = replace(it, limit=limit)
            if len(self._scaled) > 50_000:
                self._scaled.clear()
            self._scaled[it] = hit
        return hit

    # -- QuotaStore --------------------------------------------------------------------------

    async def reserve(self, items: Sequence[PlanItem], keys: Sequence[bytes], src: Sequence[int],
                      now: float) -> ReserveResult:
        if self._should_try_primary():
            try:
                await self._flush_pending()  # releases from before the outage land first
                res = await self.primary.reserve(items, keys, src, now)
            except StoreUnavailable as e:
                self._mark_degraded(e)
            else:
                self._recovered()
                return res
        self.degraded_reserves += 1
        local_idx: list[int] = []
        for i, it in enumerate(items):
            pol = self._policy(it.dimension)
            if pol == FAIL_CLOSED:
                return ReserveResult(False, i, self.probe_interval_s, None, now=now, unavailable=True)
            if pol == LOCAL:
                local_idx.append(i)
        l_items = [self._local_item(items[i]) for i in local_idx]
        for i, it in zip(local_idx, l_items, strict=True):
            if it.kind != DEADLINE and src[it.source] > it.limit:  # over this replica's share
                return ReserveResult(False, i, None, None, now=now, item=it)
        res = await self.local.reserve(l_items, [keys[i] for i in local_idx], src, now)
        if not res.admitted:
            res.item = l_items[res.index]
            res.index = local_idx[res.index]
            return res
        held = iter(res.states)  # TATs of the local rate items, in order
        local_set = set(local_idx)
        states = [next(held) if i in local_set else None
                  for i, it in enumerate(items) if it.kind == RATE]
        return ReserveResult(True, -1, None, None, states, now=res.now, token=_LOCAL_TOKEN)

    async def settle(self, items: Sequence[PlanItem], keys: Sequence[bytes], reserved: Sequence[int],
                     actual: Sequence[int], now: float, token: Any = None) -> None:
        if token == _LOCAL_TOKEN:
            idx = [i for i, it in enumerate(items) if self._policy(it.dimension) == LOCAL]
            await self.local.settle([self._local_item(items[i]) for i in idx], [keys[i] for i in idx],
                                    reserved, actual, now)
            return
        if self._degraded and not self._should_try_primary():
            self._queue(items, keys, reserved, actual, now)
            return
        queued = False
        try:
            if self._pending:
                self._queue(items, keys, reserved, actual, now)  # in order behind the queued ones
                queued = True
                await self._flush_pending()
            else:
                await self.primary.settle(items, keys, reserved, actual, now)
        except StoreUnavailable as e:
            if not queued:  # what a multi-slot settle did not apply, or all of it
                left_items, left_keys = e.unsettled if e.unsettled is not None else (items, keys)
                self._queue(left_items, left_keys, reserved, actual, now)
            self._mark_degraded(e)
        else:
            self._recovered()

    def _queue(self, items: Sequence[PlanItem], keys: Sequence[bytes], reserved: Sequence[int],
               actual: Sequence[int], now: float) -> None:
        if len(self._pending) == self._pending.maxlen:
            self.dropped_settles += 1
            log.error("quota reconciliation queue full (%d); dropping the oldest", self._pending.maxlen)
        self._pending.append((tuple(items), tuple(keys), tuple(reserved), tuple(actual), now))

    async def add(self, key: bytes | str, amount: int, ttl_s: int, now: float) -> int:
        if self._should_try_primary():
            try:
                await self._flush_pending()
                value = await self.primary.add(key, amount, ttl_s, now)
            except StoreUnavailable as e:
                self._mark_degraded(e)
            else:
                self._recovered()
                return value
        return await self.local.add(key, amount, ttl_s, now)

    async def get_values(self, keys: Sequence[bytes | str]) -> list[float | None]:
        if self._should_try_primary():
            try:
                await self._flush_pending()
                values = await self.primary.get_values(keys)
            except StoreUnavailable as e:
                self._mark_degraded(e)
            else:
                self._recovered()
                return values
        return await self.local.get_values(keys)

    async def renew_leases(self, now: float) -> int:
        """The primary's lease renewal; while degraded (and the primary still down) nothing is
        renewed and 0 returned: the primary's holds then expire after its lease, the local ones
        live with this process."""
        if not self._should_try_primary():
            return 0
        try:
            return await self.primary.renew_leases(now)
        except StoreUnavailable as e:
            self._mark_degraded(e)
            return 0

    async def aclose(self) -> None:
        await self.stop_renewing()
        await self.primary.aclose()
        await self.local.aclose()
