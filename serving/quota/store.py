"""The quota store boundary: one small abstract class, an in-memory and a Redis implementation.

A store executes a reservation — a list of :class:`~kvmeter.serving.quota.plan.PlanItem` with
their concrete keys and amounts — **atomically and all or nothing**: it first checks every item,
and only if all fit does it apply them. It settles (reconciles) a reservation from the reserved and
the actual amounts. It knows nothing of principals, tiers, prices or HTTP.

Times passed as ``now`` are seconds on one shared clock — wall-clock epoch seconds from the gate's
injected clock, so that several processes sharing a Redis store agree (a Redis store may instead
read Redis's own ``TIME``; see :class:`~kvmeter.serving.quota.redis_store.RedisQuotaStore`).

Implementations: :class:`~kvmeter.serving.quota.memory.MemoryQuotaStore` (default, one process),
:class:`~kvmeter.serving.quota.redis_store.RedisQuotaStore` (shared by gateway replicas) and
:class:`~kvmeter.serving.quota.failover.FailoverQuotaStore` (Redis with a local fallback).
"""

from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

from kvmeter.clock import SYSTEM_CLOCK, Clock
from kvmeter.serving.quota.leases import LeaseRenewer, renew_interval_s
from kvmeter.serving.quota.plan import PlanItem

__all__ = ["QuotaStore", "ReserveResult", "StoreUnavailable"]


class StoreUnavailable(ConnectionError):
    """The store cannot be reached (Redis down, timeout). Translated from the client's errors at
    the store boundary; the failover store and the gate decide what it means for admission.

    Attributes:
        unsettled: from :meth:`QuotaStore.settle` over several hash slots that failed part way,
            the ``(items, keys)`` not yet settled (the rest was applied: replay only these);
            None when nothing was applied.
    """

    unsettled: "tuple[Sequence[PlanItem], Sequence[bytes]] | None" = None


@dataclass(slots=True)
class ReserveResult:
    """Outcome of :meth:`QuotaStore.reserve`.

    Attributes:
        admitted: True if every item was applied; False if none was.
        index: the first item that did not fit (``-1`` when admitted).
        retry_after_s: for a rate item that did not fit, seconds until it will (GCRA, exact).
        value: for the item that did not fit, its current state (rate: TAT seconds; counter:
            current value; deadline: the run's start time).
        states: when admitted, the new TAT (seconds) of each *rate* item, in item order (None
            for a rate item the store did not hold). May hold ``bytes`` from Redis; convert with
            ``float()``.
        now: the ``now`` the store decided with (Redis ``TIME`` when the store reads the server
            clock).
        unavailable: True when the failover store refused because the item's dimension fails
            closed while the shared store is down.
        token: opaque store data that :meth:`QuotaStore.settle` needs back (where it was held).
        item: the item as enforced when it differs from the one passed in (the failover store's
            per-replica limits), else None.
    """

    admitted: bool
    index: int = -1
    retry_after_s: float | None = None
    value: Any = None
    states: Sequence[Any] = field(default_factory=list)
    now: float = 0.0
    unavailable: bool = False
    token: Any = None
    item: PlanItem | None = None


class QuotaStore(abc.ABC):
    """Where quota counters live."""

    #: Short name for stats and logs (``memory``, ``redis``).
    name: str = "store"
    #: Prefix of every key this store is used with (plans are compiled with it).
    key_prefix: str = "kvq:"
    #: Seconds a holder's concurrency / KV holds outlive its last lease renewal, or None: the
    #: store keeps no leases (its holds live as long as its process; see :mod:`.leases`).
    lease_s: float | None = None
    _renewer: LeaseRenewer | None = None

    @abc.abstractmethod
    async def reserve(self, items: Sequence[PlanItem], keys: Sequence[bytes], src: Sequence[int],
                      now: float) -> ReserveResult:
        """Check all items, then apply all — or none.

        Args:
            items: what to count (same length as ``keys``).
            keys: the concrete store key of each item (UTF-8 bytes, as plans build them).
            src: the request's amount per source (``src[item.source]`` is what an item counts;
                7 entries, see ``plan.SRC_*``; ≥ 0; money in nano-units). Items whose amount
                exceeds their limit must be refused by the caller before (they can never fit).
            now: seconds on the shared clock.
        Raises:
            StoreUnavailable: the store cannot be reached (nothing was applied).
        """

    @abc.abstractmethod
    async def settle(self, items: Sequence[PlanItem], keys: Sequence[bytes], reserved: Sequence[int],
                     actual: Sequence[int], now: float, token: Any = None) -> None:
        """Reconcile a reservation: each item moves by its settle rule — ``adjust``:
        ``actual[src] − reserved[src]``, ``release``: ``−reserved[src]``, ``keep``: 0. Rate items
        return (or charge) units, counters move and never go below zero.

        Args:
            items, keys: as reserved.
            reserved, actual: per-source amounts (7 each) at reservation and at the end.
            token: the ``ReserveResult.token`` of the reservation.
        Raises:
            StoreUnavailable: the store cannot be reached (nothing was applied).
        """

    @abc.abstractmethod
    async def add(self, key: bytes | str, amount: int, ttl_s: int, now: float) -> int:
        """Add ``amount`` to a plain counter, refreshing its TTL (seconds from ``now``, 0 = none);
        returns the new value. Used for reported agent tool calls.

        Raises:
            StoreUnavailable: the store cannot be reached.
        """

    @abc.abstractmethod
    async def get_values(self, keys: Sequence[bytes | str]) -> list[float | None]:
        """Current raw values (TAT seconds for rate keys, counts for counters); None if absent.

        Raises:
            StoreUnavailable: the store cannot be reached.
        """

    async def renew_leases(self, now: float) -> int:
        """Renew this process's leases on every hold it has now, to ``now + lease_s`` (``now``:
        seconds on the store's clock). Returns the number of leases renewed (0 by default: no
        leases).

        Raises:
            StoreUnavailable: the store cannot be reached.
        """
        return 0

    def start_renewing(self, clock: Clock = SYSTEM_CLOCK, *,
                       sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        """Start the periodic lease renewal (every ``lease_s / 3`` of ``sleep``; see
        :class:`~.leases.LeaseRenewer`) on the running loop. Idempotent; nothing for a store
        without leases."""
        if self.lease_s is None:
            return
        if self._renewer is None:
            self._renewer = LeaseRenewer(self, clock, renew_interval_s(self.lease_s), sleep)
        self._renewer.start()

    async def stop_renewing(self) -> None:
        """Stop the renewal task (what a dead process amounts to: its holds expire ``lease_s``
        after its last renewal)."""
        if self._renewer is not None:
            await self._renewer.stop()

    async def aclose(self) -> None:
        """Stop renewing and release connections."""
        await self.stop_renewing()
