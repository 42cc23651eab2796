"""VTC counters shared between gateway processes through Redis (issue 17: fairness global).

Without sharing, each gateway process runs VTC (Sheng et al., "Fairness in Serving Large Language
Models", OSDI 2024) over the service *it* gave: a tenant that spreads its requests over N gateways
is compared, on each, only with what it got there, and can take up to N× its share of the fleet.
With :class:`SharedServiceSync` every process's counters follow the fleet's:

* the core reports each counter change (:class:`~.base.CounterLog`): a charge (``service /
  weight``) and a lift (VTC's rule on a tenant's return, :meth:`.core.SchedulerCore._on_backlogged`);
  they collect here as, per tenant, an increment and a floor (the lifted value plus what was
  charged after the lift);
* every ``interval_s`` one Lua call (:data:`SYNC_LUA`, atomic) adds each increment to the pool's
  hash, raises the result to the floor where the floor is higher, and returns the whole hash:
  every tenant's **global counter**;
* the core's counters are raised to ``global + what was charged here while the call was out``
  (:meth:`.core.SchedulerCore.raise_counters`; never lowered).

So a counter is the tenant's weight-normalised service over all processes, lifted by whichever
process saw it return; two processes lifting the same tenant at once take the larger floor, never
the sum. The lift floor is the least counter of the tenants backlogged *in this process* (counters
that are global), the process's nearest view of the fleet's minimum; and between two syncs a
process sees other processes' service up to ``interval_s`` late — the fairness bound of the core
widens by the service the fleet gives in one interval.

Tier counters (the tier level of the hierarchical weights) are not shared: a raise adds to this
process's tier counter as service given elsewhere (:meth:`.core.SchedulerCore.raise_counters`), so
between tiers the order follows the fleet's service approximately (a remote lift counts there as
service). A tenant's ``service`` here (its metric) stays this process's own; summed over the
processes it is the fleet's.

Keys: one hash per scheduler pool (a model's engines): ``{key_prefix}{<pool>}:vtc``. The pool name
is the hash tag, so the pool's counters live in one slot and the script runs on a Redis Cluster.
Every process of a pool must use the same tenant weights (the counters are divided by them).

Outage: a sync that fails (Redis down, a timeout — the client's own, ``redis_client``'s 0.25 s by
default) keeps the unsent changes for the next one and leaves the counters as they are: dispatch
never waits on Redis, fairness degrades to this process's own, one warning is logged when an
outage starts and one line when it ends, and :attr:`SharedServiceSync.failures_total` counts the
failed syncs (``SchedulerStats.shared_service_failures_total`` →
``kvmeter_scheduler_shared_service_sync_errors_total``). Nothing charged during the outage is lost:
it is sent by the first sync that succeeds.

Costs: one ``EVALSHA`` per interval with three arguments per tenant charged since the last sync,
and an ``HGETALL`` of the pool's tenants inside it (O(tenants) per interval, not per request).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from kvmeter.aio import PeriodicTask

if TYPE_CHECKING:  # pragma: no cover
    from .core import SchedulerCore

__all__ = ["SharedServiceSync", "SYNC_LUA", "DEFAULT_SYNC_INTERVAL_S", "counters_key"]

log = logging.getLogger(__name__)

#: Seconds between syncs (serve config ``scheduler.shared_service_interval_s``).
DEFAULT_SYNC_INTERVAL_S = 0.5

_NO_FLOOR = -math.inf

#: KEYS[1] the pool's hash; ARGV triples (tenant, increment, floor or ""). Adds each increment,
#: raises to the floor, stores with ``%.17g`` (a double's exact round trip) and returns HGETALL.
SYNC_LUA = """
local key = KEYS[1]
for i = 1, #ARGV, 3 do
  local v = tonumber(redis.call('HGET', key, ARGV[i]) or '0') + tonumber(ARGV[i + 1])
  if ARGV[i + 2] ~= '' then
    local floor = tonumber(ARGV[i + 2])
    if floor > v then v = floor end
  end
  redis.call('HSET', key, ARGV[i], string.format('%.17g', v))
end
return redis.call('HGETALL', key)
"""


def counters_key(key_prefix: str, pool: str) -> str:
    """The pool's hash: ``{key_prefix}{<pool>}:vtc`` (the pool is the Redis Cluster hash tag).

    Raises:
        ValueError: a pool name that is empty or holds a brace.
    """
    if not pool or "{" in pool or "}" in pool:
        raise ValueError(f"scheduler pool name must be non-empty without braces, got {pool!r}")
    return f"{key_prefix}{{{pool}}}:vtc"


class SharedServiceSync:
    """Shares one scheduler core's VTC counters with the other processes of its pool (see the
    module docstring). It is the core's :class:`~.base.CounterLog`; :meth:`sync` runs one
    exchange, :meth:`start` a task that runs one every ``interval_s``.

    Args:
        client: a ``redis.asyncio`` ``Redis`` or ``RedisCluster`` (best
            :func:`~kvmeter.serving.quota.redis_store.redis_client`: short timeouts, one retry).
        pool: the scheduler pool (e.g. the served model); one hash per pool.
        key_prefix: namespace of the key.
        interval_s: seconds between syncs of :meth:`start`'s task (> 0).
        sleep: the wait between syncs (injectable; default ``asyncio.sleep``).
    Raises:
        ValueError: a bad pool name or interval.
    """

    def __init__(self, client: Any, *, pool: str = "default", key_prefix: str = "kvs:",
                 interval_s: float = DEFAULT_SYNC_INTERVAL_S,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        if not interval_s > 0 or not math.isfinite(interval_s):
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.key = counters_key(key_prefix, pool)
        self.interval_s = interval_s
        self._client = client
        self._script = client.register_script(SYNC_LUA)
        self._sleep = sleep
        # tenant -> [increment, floor (-inf: none)] not yet sent
        self._pending: dict[str, list[float]] = {}
        self._periodic: PeriodicTask | None = None
        #: successful and failed syncs since start; whether the last one succeeded
        self.syncs_total = 0
        self.failures_total = 0
        self.healthy = True

    # ------------------------------------------------------------------ CounterLog
    def charged(self, tenant_id: str, counter_delta: float) -> None:
        p = self._pending.get(tenant_id)
        if p is None:
            self._pending[tenant_id] = [counter_delta, _NO_FLOOR]
            return
        p[0] += counter_delta
        p[1] += counter_delta  # (-inf stays -inf)

    def lifted(self, tenant_id: str, counter: float) -> None:
        p = self._pending.get(tenant_id)
        if p is None:
            self._pending[tenant_id] = [0.0, counter]
        elif counter > p[1]:
            p[1] = counter

    # ------------------------------------------------------------------ exchange
    async def sync(self, core: "SchedulerCore") -> bool:
        """Send the changes collected since the last sync, read the pool's global counters and
        raise ``core``'s to them. Never raises for a Redis failure (see the module docstring).

        Returns:
            True when the exchange succeeded; False when Redis failed (the changes are kept).
        """
        sent, self._pending = self._pending, {}
        args: list[str] = []
        for tenant, (incr, floor) in sent.items():
            args += [tenant, repr(incr), "" if floor == _NO_FLOOR else repr(floor)]
        try:
            reply = await self._script(keys=[self.key], args=args)
        except asyncio.CancelledError:
            self._restore(sent)
            raise
        except Exception as exc:  # noqa: BLE001 — an outage degrades to local fairness
            self._restore(sent)
            self.failures_total += 1
            if self.healthy:
                log.warning("scheduler: shared service counters unreachable (%s: %s); fairness is "
                            "this process's own until Redis answers", type(exc).__name__, exc)
            self.healthy = False
            return False
        counters: dict[str, float] = {}
        for i in range(0, len(reply) - 1, 2):
            tenant = reply[i].decode() if isinstance(reply[i], bytes) else str(reply[i])
            # what this process charged while the call was out is in its counters, not yet in Redis
            counters[tenant] = float(reply[i + 1]) + self._pending.get(tenant, (0.0,))[0]
        core.raise_counters(counters)
        self.syncs_total += 1
        if not self.healthy:
            log.warning("scheduler: shared service counters reachable again (after %d failed syncs)",
                        self.failures_total)
        self.healthy = True
        return True

    def _restore(self, sent: dict[str, list[float]]) -> None:
        """Put unsent changes back in front of those collected since (sent first, then newer)."""
        newer, self._pending = self._pending, sent
        for tenant, (incr, floor) in newer.items():
            p = sent.get(tenant)
            if p is None:
                sent[tenant] = [incr, floor]
            else:
                p[0] += incr
                p[1] = max(p[1] + incr, floor)

    # ------------------------------------------------------------------ periodic task
    @property
    def running(self) -> bool:
        return self._periodic is not None and self._periodic.running

    def start(self, core: "SchedulerCore", on_synced: Callable[[], None] | None = None) -> None:
        """Run :meth:`sync` every ``interval_s`` on the running loop (idempotent); ``on_synced``
        runs after each successful one (the scheduler re-evaluates dispatch)."""
        if not self.running:
            self._periodic = PeriodicTask(functools.partial(self._tick, core, on_synced), self.interval_s,
                                          name="kvmeter-shared-service", sleep=self._sleep)
            self._periodic.start()

    async def stop(self) -> None:
        """Stop the periodic task (changes not yet sent stay unsent)."""
        periodic, self._periodic = self._periodic, None
        if periodic is not None:
            await periodic.stop()

    async def aclose(self) -> None:
        """Stop the task and close the client's connections."""
        await self.stop()
        await self._client.aclose()

    async def _tick(self, core: "SchedulerCore", on_synced: Callable[[], None] | None) -> None:
        try:
            if await self.sync(core) and on_synced is not None:
                on_synced()
        except Exception:  # noqa: BLE001 — keep syncing; never end the task on a fault
            log.exception("scheduler: shared service sync failed")
