"""Leases on concurrency and KV holds: a gateway process that stops keeps no capacity.

A *hold* is a counter a reservation raises and its reconciliation lowers again —
``concurrent_requests``, ``active_kv_tokens`` and an agent run's ``parallel_branches``
(``SETTLE_RELEASE`` counters). On a shared store every gateway process (a *holder*, named by a
random id per store instance) records what it holds, and the store keeps a *lease* per holder: a
deadline on the store's clock (the ``now`` the gate passes, or Redis ``TIME`` with
``server_time=True``), set to ``now + lease_s`` by each reservation that takes a hold and by the
holder's periodic renewal (every ``lease_s / 3`` seconds while it holds anything). When a
reservation would be refused by a hold counter, the store first gives back the holds of every
holder whose lease has passed, then decides again. So the capacity a killed (``kill -9``),
partitioned or hung process held is free again at most ``lease_s`` after its last renewal — in
the worst case ``lease_s`` after it stopped — plus the clock skew between the gateways' hosts
(none with ``server_time=True``).

A live process whose renewals stop for longer than ``lease_s`` (an event loop blocked that long,
or Redis unreachable that long) loses its holds the same way: its later reconciliations give back
only what the store still records for it, never more, so nothing is released twice, but until
they end its requests in flight are not counted (the fleet may admit up to that many more). Pick
``lease_s`` well above the longest stall you expect; the default is 30 s.

Configuration: ``quota_lease_s`` in the serve config (``KVMETER_QUOTA_LEASE_S``), default
:data:`DEFAULT_LEASE_S`. The in-memory store has the same interface and no leases: its holds live
and die with its process.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import TYPE_CHECKING, Awaitable, Callable

from kvmeter.aio import PeriodicTask
from kvmeter.clock import Clock

if TYPE_CHECKING:
    from kvmeter.serving.quota.store import QuotaStore

__all__ = ["DEFAULT_LEASE_S", "LeaseRenewer", "new_holder_id", "renew_interval_s"]

log = logging.getLogger(__name__)

#: Seconds a holder's holds outlive its last renewal (serve config ``quota_lease_s``).
DEFAULT_LEASE_S = 30.0


def new_holder_id() -> str:
    """A random holder id (32 hex digits): one per store instance, i.e. per gateway process."""
    return uuid.uuid4().hex


def renew_interval_s(lease_s: float) -> float:
    """Seconds between renewals: a third of the lease, so two renewals may fail in a row."""
    return lease_s / 3.0


class LeaseRenewer:
    """The periodic renewal task of one store: every ``interval_s`` of ``sleep`` it calls
    ``store.renew_leases(clock.wall())``; a failure is logged and the next tick tries again.

    Args:
        store: the store whose leases it renews.
        clock: injected clock (its wall seconds are the ``now`` of each renewal).
        interval_s: seconds between renewals (> 0).
        sleep: the wait between renewals (injectable; default ``asyncio.sleep``).
    """

    def __init__(self, store: "QuotaStore", clock: Clock, interval_s: float,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._store = store
        self._clock = clock
        self.interval_s = interval_s
        self._task = PeriodicTask(self._renew, interval_s, name="kvmeter-quota-leases", sleep=sleep)
        self.renewals = 0

    @property
    def running(self) -> bool:
        """True while the task runs."""
        return self._task.running

    def start(self) -> None:
        """Start the task on the running loop (idempotent)."""
        self._task.start()

    async def stop(self) -> None:
        """Stop the task (its holds expire ``lease_s`` after the last renewal)."""
        await self._task.stop()

    async def _renew(self) -> None:
        try:
            await self._store.renew_leases(self._clock.wall())
            self.renewals += 1
        except Exception:  # noqa: BLE001 — keep renewing; the lease outlives a few failures
            log.exception("quota lease renewal failed (store %s)", self._store.name)
