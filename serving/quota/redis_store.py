"""Redis quota store: counters shared by every gateway replica.

One Lua script per reservation (:mod:`.redis_scripts`; check every item, then apply every item — Redis runs a script
atomically, so no other client sees a partial reservation) and one per reconciliation. Each item
travels as a 27-byte binary descriptor cached on its plan (read with Redis's ``struct``), and the
request as its 7 per-source amounts, so a 35-counter reservation is one ``EVALSHA`` of 35 keys (+ 2
lease keys) and 11 arguments doing one ``MGET``, one ``MSET`` and an ``INCRBY`` per TTL'd counter.
Money is counted in integer nano-units with ``INCRBY`` (exact int64); counter limits below 2**53
compare exactly as doubles, larger ones as decimal strings against a headroom computed exactly in
Python. GCRA times are doubles rendered with ``%.17g`` (exact round trip), computed with the same
operations as :mod:`kvmeter.serving.quota.gcra`.

Time: by default the gate's clock is passed in (``now``), which keeps tests deterministic and lets
replicas with NTP-synchronised clocks share buckets. With ``server_time=True`` the scripts read
Redis's ``TIME`` instead — one clock for all replicas, whatever their skew.

Expiry: node-level rate keys never expire (one per configured node and dimension; an absent key
and a full bucket are the same state). Agent-run keys expire a fixed time after the run started
(``plan.RUN_TTL_S``), spend keys two days / two months after their period's first request.

Deployment: a single Redis (or a primary with replicas), or a **Redis Cluster**
(:func:`redis_cluster_client`, ``redis+cluster://host:port``). Every key of one org carries the
org's hash tag (``kvq:o:{acme}:rpm``, see :mod:`.plan`), so on a cluster the org's part of a
reservation — its org, workspace, project, key and agent-run counters and their lease state — is
one script in one slot. Global limits live under their own tag (``{_global}``): with global limits
configured a reservation on a cluster runs two scripts, global first, and if the org's refuses,
the global one is settled back to zero at once (all or nothing still; for that one round trip
other requests may see the global part held — refused, never over-admitted). On one Redis it stays
one script. ``get_values`` on a cluster reads key by key (no cross-slot ``MGET``).

Leases (:mod:`.leases`): with ``lease_s`` set (the default, 30 s) every concurrency / KV /
parallel-branch hold is also counted under this store's holder id in the tag's held hash, and the
holder's lease deadline (the store's clock: the ``now`` passed in, or Redis ``TIME`` with
``server_time=True``; not ``PEXPIRE``, so tests can inject the clock) is set by each reservation
and by :meth:`RedisQuotaStore.renew_leases` (the periodic task of ``start_renewing``). A
reservation that a hold would refuse first gives back the holds of every holder whose lease has
passed (a killed gateway's), then decides again; a settle gives back at most what the held hash
still counts for its holder, so a hold is never released twice. The admission path gains one
``HINCRBY`` per hold and one ``HSET`` per reservation; the reclaim runs only on refusals.
Limitation: counters read with ``get_values`` still show a dead holder's holds until the next
refusal on them reclaims them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Sequence

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ClusterDownError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvmeter.serving.quota.leases import DEFAULT_LEASE_S, new_holder_id
from kvmeter.serving.quota.redis_scripts import ADD_LUA, RENEW_LUA, RESERVE_LUA, SETTLE_LUA
from kvmeter.serving.quota.plan import RATE, PlanItem
from kvmeter.serving.quota.store import QuotaStore, ReserveResult, StoreUnavailable

__all__ = ["RedisQuotaStore", "redis_client", "redis_cluster_client", "CLUSTER_SCHEME"]

log = logging.getLogger(__name__)

#: URL scheme of a Redis Cluster: ``redis+cluster://host:port`` (any one node).
CLUSTER_SCHEME = "redis+cluster"

_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, ClusterDownError, OSError)


try:  # redis-py packs commands in C with hiredis in its sync client only; do the same here
    from redis.connection import HiredisRespSerializer
    from redis.utils import HIREDIS_AVAILABLE
except ImportError:  # pragma: no cover — older redis-py
    HIREDIS_AVAILABLE = False


if HIREDIS_AVAILABLE:
    class _HiredisPackingConnection(aioredis.Connection):
        """redis-py's asyncio TCP connection, packing commands with ``hiredis.pack_command`` (through
        redis-py's own ``HiredisRespSerializer``) instead of its pure-Python packer, which costs
        ~100 µs for a 45-argument ``EVALSHA``."""

        _serializer = HiredisRespSerializer()

        def pack_command(self, *args: Any) -> list[bytes]:
            return self._serializer.pack(*args)


def redis_client(url: str, *, timeout_s: float = 0.25, max_connections: int = 64,
                 pool_timeout_s: float = 2.0) -> aioredis.Redis:
    """An asyncio Redis client tuned for admission: short timeouts, one immediate retry, and a
    blocking pool.

    redis-py's defaults would hurt here: a failing command is retried 10 times with backoff up to
    1 s (every request stalls for seconds while Redis is down), and a full connection pool raises
    "Too many connections" at once. Here a command is retried once, at once (that covers a pooled
    connection that died with a Redis restart), and a request waits up to ``pool_timeout_s`` for
    a free connection. With ``hiredis`` installed (a dependency), replies are parsed and, for
    ``redis://`` URLs, commands packed in C.

    Args:
        url: ``redis://host:port/db``.
        timeout_s: socket and connect timeout in seconds (> 0).
        max_connections: connection pool size (scripts in flight at once).
        pool_timeout_s: longest wait for a free pooled connection, seconds (> 0).
    """
    if timeout_s <= 0 or pool_timeout_s <= 0:
        raise ValueError(f"timeout_s and pool_timeout_s must be > 0, got {timeout_s}, {pool_timeout_s}")
    extra: dict[str, Any] = {"connection_class": _HiredisPackingConnection} if HIREDIS_AVAILABLE else {}
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=pool_timeout_s, socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s, decode_responses=False, retry=Retry(NoBackoff(), 1), **extra)
    return aioredis.Redis.from_pool(pool)


def redis_cluster_client(url: str, *, timeout_s: float = 0.25, max_connections: int = 64) -> RedisCluster:
    """An asyncio Redis Cluster client with the same short timeouts as :func:`redis_client` (the
    slot map is read from the node named at the first command).

    Args:
        url: ``redis+cluster://host:port`` (or ``rediss+cluster://`` for TLS), any node.
        timeout_s: socket and connect timeout in seconds (> 0).
        max_connections: connection pool size per node.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    scheme, sep, rest = url.partition("://")
    plain = {"redis+cluster": "redis", "rediss+cluster": "rediss"}.get(scheme.lower())
    if not sep or plain is None:
        raise ValueError("a Redis Cluster URL is redis+cluster://host:port or rediss+cluster://host:port")
    return RedisCluster.from_url(f"{plain}://{rest}", socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                 max_connections=max_connections, decode_responses=False)


def _number(raw: bytes | str) -> float | int:
    try:
        return int(raw)
    except ValueError:
        return float(raw)


def _tag(key: bytes) -> bytes:
    """What Redis hashes ``key`` by: its hash tag (between its first ``{`` and the next ``}``), or
    the whole key when it has none (so ``{`` + the result + ``}`` names a key in the same slot)."""
    i = key.find(b"{")
    if i < 0:
        return key
    j = key.find(b"}", i + 1)
    return key[i + 1:j] if j > i + 1 else key


class RedisQuotaStore(QuotaStore):
    """Quota counters in Redis or on a Redis Cluster (see module docstring).

    Args:
        client: a ``redis.asyncio.Redis`` or ``redis.asyncio.RedisCluster``
            (``decode_responses=False``), best made with :func:`redis_client` /
            :func:`redis_cluster_client` (short timeouts, no retry storm) so an unreachable
            Redis is detected quickly.
        key_prefix: namespace of every key (several deployments or tests can share one Redis).
        server_time: read Redis ``TIME`` in the scripts instead of the ``now`` passed in (lease
            deadlines too).
        lease_s: seconds this store's holds outlive its last lease renewal (> 0; see
            :mod:`.leases`), or None for no leases (holds are then plain counters that outlive a
            killed process).
        holder: this store's holder id (default: a new random one; one per process).
        max_in_flight: on a cluster, commands in flight at once (> 0); more wait for a turn, as
            :func:`redis_client`'s blocking pool makes them wait on one Redis (redis-py's cluster
            pool would refuse them instead).
    Errors:
        Unreachable Redis (connection refused/reset, timeout, cluster down) raises
        :class:`StoreUnavailable` from every method; other Redis errors propagate unchanged.
    """

    name = "redis"

    def __init__(self, client: aioredis.Redis | RedisCluster, *, key_prefix: str = "kvq:",
                 server_time: bool = False, lease_s: float | None = DEFAULT_LEASE_S,
                 holder: str | None = None, max_in_flight: int = 64) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if lease_s is not None and not lease_s > 0:
            raise ValueError(f"lease_s must be > 0 or None, got {lease_s}")
        if holder is not None and (not holder or "|" in holder):
            raise ValueError(f"holder id must be non-empty without '|', got {holder!r}")
        self._client = client
        self.key_prefix = key_prefix
        self.server_time = server_time
        self.cluster = isinstance(client, RedisCluster)
        self.lease_s = lease_s
        self.holder = holder or new_holder_id()
        self._holder_arg = self.holder if lease_s is not None else ""
        self._lease_arg = repr(float(lease_s or 0))
        self._prefix_b = key_prefix.encode()
        self._lease_keys: dict[bytes, tuple[bytes, bytes]] = {}
        #: lease hash -> this store's reservations under it not yet settled (what renewals renew)
        self._live: dict[bytes, int] = {}
        self._reserve = client.register_script(RESERVE_LUA)
        self._settle = client.register_script(SETTLE_LUA)
        self._add = client.register_script(ADD_LUA)
        self._renew = client.register_script(RENEW_LUA)
        self._turns = asyncio.Semaphore(max_in_flight) if self.cluster else None
        self._loaded = not self.cluster
        self._loading = asyncio.Lock()

    async def _run(self, script: Any, keys: Sequence[bytes | str], args: Sequence[Any]) -> Any:
        if self._turns is None:
            return await script(keys=keys, args=args)
        if not self._loaded:
            await self._load_scripts()
        async with self._turns:
            return await script(keys=keys, args=args)

    async def _load_scripts(self) -> None:
        """Load the scripts on every primary of the cluster once, before the first call: redis-py's
        cluster client, answering many concurrent ``NOSCRIPT`` replies by loading and retrying,
        sends some of the retries on connections it has closed (``AttributeError: 'NoneType'
        object has no attribute 'writelines'``, redis-py 8.1)."""
        async with self._loading:
            if not self._loaded:
                for script in (self._reserve, self._settle, self._add, self._renew):
                    await self._client.script_load(script.script)
                self._loaded = True

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 0.25, max_connections: int = 64,
                 key_prefix: str = "kvq:", server_time: bool = False,
                 lease_s: float | None = DEFAULT_LEASE_S) -> "RedisQuotaStore":
        """Build a store and its client from ``redis://host:port/db`` (one Redis) or
        ``redis+cluster://host:port`` (any node of a Redis Cluster; the others are discovered).

        Args:
            timeout_s: socket and connect timeout in seconds (> 0); a Redis that does not answer
                within it counts as unreachable.
            max_connections: connection pool size (concurrent scripts in flight; per node on a
                cluster).
        """
        client: aioredis.Redis | RedisCluster
        if url.lower().startswith(CLUSTER_SCHEME + "://"):
            client = redis_cluster_client(url, timeout_s=timeout_s, max_connections=max_connections)
        else:
            client = redis_client(url, timeout_s=timeout_s, max_connections=max_connections)
        return cls(client, key_prefix=key_prefix, server_time=server_time, lease_s=lease_s,
                   max_in_flight=max_connections)

    @property
    def client(self) -> aioredis.Redis | RedisCluster:
        """The underlying client."""
        return self._client

    def _now_arg(self, now: float) -> str:
        return "" if self.server_time else repr(float(now))

    def _leases_of(self, tag: bytes) -> tuple[bytes, bytes]:
        pair = self._lease_keys.get(tag)
        if pair is None:
            if len(self._lease_keys) > 100_000:
                self._lease_keys.clear()
            t = b"{" + tag + b"}"
            pair = (self._prefix_b + b"lease:" + t, self._prefix_b + b"held:" + t)
            self._lease_keys[tag] = pair
        return pair

    def _groups(self, keys: Sequence[bytes]) -> list[tuple[bytes, list[int] | None]]:
        """The scripts one reservation runs as: (hash tag, item indices or None for all). One
        Redis: one script, the lease state under the org's tag (the last key's). A cluster: one
        per tag, the org's (the last key's) last."""
        last = _tag(keys[-1])
        if not self.cluster:
            return [(last, None)]
        by: dict[bytes, list[int]] = {}
        for i, k in enumerate(keys):
            by.setdefault(_tag(k), []).append(i)
        if len(by) == 1:
            return [(last, None)]
        org = by.pop(last)
        return [*by.items(), (last, org)]

    async def reserve(self, items: Sequence[PlanItem], keys: Sequence[bytes], src: Sequence[int],
                      now: float) -> ReserveResult:
        if not items:
            return ReserveResult(True, -1, None, None, [], now=now)
        now_arg = self._now_arg(now)
        groups = self._groups(keys)
        try:
            if len(groups) == 1:
                res = await self._reserve_one(items, keys, src, now_arg, groups[0][0])
                if res[0] == 1:
                    self._hold(groups[0][0])
                    return ReserveResult(True, -1, None, None, res[2].split(), now=float(res[1]))
                retry = float(res[2]) if res[2] else None
                return ReserveResult(False, int(res[1]), retry, res[3], now=float(res[4]))
            return await self._reserve_groups(items, keys, src, now_arg, groups)
        except _UNREACHABLE as e:
            raise StoreUnavailable(f"redis unreachable: {type(e).__name__}: {e}") from e

    async def _reserve_one(self, items: Sequence[PlanItem], keys: Sequence[bytes], src: Sequence[int],
                           now_arg: str, tag: bytes) -> Any:
        args: list[Any] = [now_arg, *src, b"".join([it.desc for it in items]), self._holder_arg,
                           self._lease_arg]
        for it in items:
            if it.big:
                args.append(it.limit - src[it.source])
        if self._holder_arg:
            keys = [*keys, *self._leases_of(tag)]
        return await self._run(self._reserve, keys, args)

    async def _reserve_groups(self, items: Sequence[PlanItem], keys: Sequence[bytes], src: Sequence[int],
                              now_arg: str, groups: list[tuple[bytes, list[int] | None]]) -> ReserveResult:
        """A reservation over several hash slots (a cluster, global limits configured): one script
        per slot, in order; when one refuses, the slots already applied are settled back to zero
        (their rate units, holds and spend given back), so the whole stays all or nothing — other
        requests may see the first slot's part held for that one round trip (never over-admitting)."""
        done: list[tuple[bytes, list[int]]] = []
        tats: dict[int, Any] = {}
        now_s = 0.0
        for tag, idx in groups:
            assert idx is not None
            g_items, g_keys = [items[i] for i in idx], [keys[i] for i in idx]
            try:
                res = await self._reserve_one(g_items, g_keys, src, now_arg, tag)
            except _UNREACHABLE:
                await self._undo(items, keys, src, now_arg, done, best_effort=True)
                raise
            if res[0] != 1:
                await self._undo(items, keys, src, now_arg, done)
                retry = float(res[2]) if res[2] else None
                return ReserveResult(False, idx[int(res[1])], retry, res[3], now=float(res[4]))
            done.append((tag, idx))
            now_s = float(res[1])
            rate_idx = [i for i in idx if items[i].kind == RATE]
            tats.update(zip(rate_idx, res[2].split(), strict=True))
        for tag, _ in groups:
            self._hold(tag)
        states = [tats[i] for i, it in enumerate(items) if it.kind == RATE]
        return ReserveResult(True, -1, None, None, states, now=now_s)

    async def _undo(self, items: Sequence[PlanItem], keys: Sequence[bytes], src: Sequence[int], now_arg: str,
                    done: list[tuple[bytes, list[int]]], best_effort: bool = False) -> None:
        """Settle the slots of a multi-slot reservation already applied back to zero (newest
        first). ``best_effort``: after a failure elsewhere, an unreachable slot is logged (what it
        holds stays: holds until its lease passes, rate units until they drain, spend until the
        period's key expires) instead of raised."""
        zero = [0] * len(src)
        for tag, idx in reversed(done):
            try:
                await self._settle_one([items[i] for i in idx], [keys[i] for i in idx], src, zero, now_arg, tag)
            except _UNREACHABLE:
                if not best_effort:
                    raise
                log.error("quota reservation over several Redis Cluster slots failed part way; "
                          "slot {%s} could not be given back", tag.decode(errors="replace"))

    def _hold(self, tag: bytes) -> None:
        if self._holder_arg:
            lease = self._leases_of(tag)[0]
            self._live[lease] = self._live.get(lease, 0) + 1

    def _unhold(self, tag: bytes) -> None:
        if self._holder_arg:
            lease = self._leases_of(tag)[0]
            left = self._live.get(lease, 0) - 1
            if left > 0:
                self._live[lease] = left
            else:
                self._live.pop(lease, None)

    async def settle(self, items: Sequence[PlanItem], keys: Sequence[bytes], reserved: Sequence[int],
                     actual: Sequence[int], now: float, token: Any = None) -> None:
        if not items:
            return
        now_arg = self._now_arg(now)
        done: list[int] = []
        try:
            for tag, idx in self._groups(keys):
                if idx is None:
                    await self._settle_one(items, keys, reserved, actual, now_arg, tag)
                else:
                    await self._settle_one([items[i] for i in idx], [keys[i] for i in idx], reserved,
                                           actual, now_arg, tag)
                    done += idx
                # settled: this reservation no longer keeps the lease alive. A settle that failed
                # still does (the failover wrapper replays it; counting it out twice would let the
                # lease of this process's other holds lapse)
                self._unhold(tag)
        except _UNREACHABLE as e:
            err = StoreUnavailable(f"redis unreachable: {type(e).__name__}: {e}")
            if done:  # some slots were settled: only the others may be replayed (never twice)
                settled = set(done)
                left = [i for i in range(len(items)) if i not in settled]
                err.unsettled = ([items[i] for i in left], [keys[i] for i in left])
            raise err from e

    async def _settle_one(self, items: Sequence[PlanItem], keys: Sequence[bytes], reserved: Sequence[int],
                          actual: Sequence[int], now_arg: str, tag: bytes) -> None:
        args: list[Any] = [now_arg]
        args += [a - r for a, r in zip(actual, reserved, strict=True)]
        args += [-r for r in reserved]
        args.append(b"".join([it.desc for it in items]))
        args.append(self._holder_arg)
        if self._holder_arg:
            keys = [*keys, *self._leases_of(tag)]
        await self._run(self._settle, keys, args)

    async def renew_leases(self, now: float) -> int:
        """Set this holder's lease to ``now + lease_s`` (Redis ``TIME`` + ``lease_s`` with
        ``server_time``) in every lease hash it has unsettled reservations under; returns how many.

        Raises:
            StoreUnavailable: Redis is unreachable (the leases keep their last deadline).
        """
        if not self._holder_arg or not self._live:
            return 0
        leases = list(self._live)
        args = [self._now_arg(now), self.holder, self._lease_arg]
        try:
            for j in range(0, len(leases), 256):
                await asyncio.gather(*(self._run(self._renew, [k], args) for k in leases[j:j + 256]))
        except _UNREACHABLE as e:
            raise StoreUnavailable(f"redis unreachable: {type(e).__name__}: {e}") from e
        return len(leases)

    @property
    def live_leases(self) -> int:
        """Lease hashes this store renews now (tag groups it holds in)."""
        return len(self._live)

    async def add(self, key: bytes | str, amount: int, ttl_s: int, now: float) -> int:
        try:
            return int(await self._run(self._add, [key], [amount, ttl_s]))
        except _UNREACHABLE as e:
            raise StoreUnavailable(f"redis unreachable: {type(e).__name__}: {e}") from e

    async def get_values(self, keys: Sequence[bytes | str]) -> list[float | None]:
        if not keys:
            return []
        try:
            if self._turns is not None:  # MGET across slots is refused by a cluster: one GET per key
                async with self._turns:
                    raw = [await self._client.get(k) for k in keys]
            else:
                raw = await self._client.mget(list(keys))
        except _UNREACHABLE as e:
            raise StoreUnavailable(f"redis unreachable: {type(e).__name__}: {e}") from e
        return [None if r is None else _number(r) for r in raw]

    async def ping(self) -> bool:
        """True if Redis answers PING.

        Raises:
            StoreUnavailable: it does not.
        """
        try:
            return bool(await self._client.ping())
        except _UNREACHABLE as e:
            raise StoreUnavailable(f"redis unreachable: {type(e).__name__}: {e}") from e

    async def aclose(self) -> None:
        await self.stop_renewing()
        await self._client.aclose()
