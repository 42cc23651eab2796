"""Redis quota store: counters shared by every gateway replica.

One Lua script per reservation (check every item, then apply every item — Redis runs a script
atomically, so no other client sees a partial reservation) and one per reconciliation. Each item
travels as a 27-byte binary descriptor cached on its plan (read with Redis's ``struct``), and the
request as its 7 per-source amounts, so a 35-counter reservation is one ``EVALSHA`` of 35 keys + 9
arguments doing one ``MGET``, one ``MSET`` and an ``INCRBY`` per TTL'd counter.
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

Deployment: a single Redis (or a primary with replicas). A Redis Cluster would need every key of
one reservation in one hash slot, which global and org keys cannot all share; not supported.

Known limitation: concurrency and active-KV holds are plain counters. A gateway replica that dies
between reserve and reconcile leaves its holds counted on Redis until an operator clears them
(per-reservation leases that expire on their own are not implemented yet).
"""

from __future__ import annotations

from typing import Any, Sequence

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvmeter.serving.quota.plan import PlanItem
from kvmeter.serving.quota.store import QuotaStore, ReserveResult, StoreUnavailable

__all__ = ["RedisQuotaStore", "redis_client", "RESERVE_LUA", "SETTLE_LUA", "ADD_LUA"]

_PRELUDE = r"""
local function fmt(x) return string.format('%.17g', x) end
local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
else
  now = tonumber(ARGV[1])
end
"""

#: KEYS: one per item.
#: ARGV[1]: now ('' = Redis TIME); ARGV[2..8]: the request's amount per source (SRC_0..SRC_6);
#: ARGV[9]: the items' descriptors (PlanItem.desc, 27 bytes each, struct '<c1Bc1ddd'), in KEYS
#: order: kind ('r' rate, 'c' counter, 'd' deadline), source, settle rule, then
#:   rate      interval T s, tolerance tau s, key TTL ms (0 = none)
#:   counter   limit, TTL s from creation (0 = none), big (1 if limit >= 2^53)
#:   deadline  max age s, TTL s, 0
#: ARGV[10...]: for each big counter in item order, its headroom (limit - amount, exact decimal).
#: Check every item (one MGET), then apply every item. Keys without TTL are written with one MSET
#: (values computed from the MGET; exact, being below 2^53); counters with a TTL or a big limit
#: use INCRBY (SET would drop the TTL; doubles would round).
#: Returns {1, now, 'new TAT of each rate item, space-separated'} when admitted,
#:         {0, index (0-based), retry_after | '', value, now} when not (nothing applied).
RESERVE_LUA = _PRELUDE + r"""
local function le(a, b)  -- a <= b for decimal integer strings >= 0 without leading zeros
  if #a ~= #b then return #a < #b end
  return a <= b
end
local n = #KEYS
local amt = {}
for s = 0, 6 do amt[s] = tonumber(ARGV[2 + s]) end
local cur = redis.call('MGET', unpack(KEYS))
local D = ARGV[9]
if #D ~= 27 * n then return redis.error_reply('kvmeter reserve: descriptors do not match keys') end
local kind, src, A, B, C, st = {}, {}, {}, {}, {}, {}
local extra = 10
local pos = 1
for i = 1, n do
  local k, s, _, x, y, z
  k, s, _, x, y, z, pos = struct.unpack('<c1Bc1ddd', D, pos)
  local c = cur[i]
  kind[i], src[i], A[i], B[i], C[i] = k, s, x, y, z
  if k == 'r' then
    local tat = tonumber(c) or now
    if tat < now then tat = now end
    local new = tat + amt[s] * x
    if new - now > y then
      return {0, i - 1, fmt(new - y - now), fmt(tat), fmt(now)}
    end
    st[i] = new
  elseif k == 'c' then
    if z == 1 then
      local head = ARGV[extra]
      extra = extra + 1
      if not le(c or '0', head) then return {0, i - 1, '', c or '0', fmt(now)} end
    elseif (tonumber(c) or 0) + amt[s] > x then
      return {0, i - 1, '', c or '0', fmt(now)}
    end
  elseif c and now - tonumber(c) > x then
    return {0, i - 1, '', c, fmt(now)}
  end
end
local states, mset = {}, {}
for i = 1, n do
  local k = kind[i]
  if k == 'r' then
    local v = fmt(st[i])
    states[#states + 1] = v
    if C[i] > 0 then
      redis.call('SET', KEYS[i], v, 'PX', C[i])
    else
      mset[#mset + 1] = KEYS[i]
      mset[#mset + 1] = v
    end
  elseif k == 'c' then
    local a = amt[src[i]]
    if a ~= 0 then
      if B[i] > 0 or C[i] == 1 then
        redis.call('INCRBY', KEYS[i], ARGV[2 + src[i]])
        if B[i] > 0 and not cur[i] then redis.call('EXPIRE', KEYS[i], B[i]) end
      else
        mset[#mset + 1] = KEYS[i]
        mset[#mset + 1] = string.format('%d', (tonumber(cur[i]) or 0) + a)
      end
    end
  elseif not cur[i] then
    redis.call('SET', KEYS[i], fmt(now), 'EX', B[i])
  end
end
if #mset > 0 then redis.call('MSET', unpack(mset)) end
return {1, fmt(now), table.concat(states, ' ')}
"""

#: KEYS: the reservation's items. ARGV[1]: now; ARGV[2..8]: per source, actual - reserved (the
#: delta of 'adjust' items); ARGV[9..15]: per source, -reserved (the delta of 'release' items);
#: ARGV[16]: the descriptors, as for RESERVE_LUA. 'keep' items and zero deltas are skipped.
SETTLE_LUA = _PRELUDE + r"""
local n = #KEYS
local D = ARGV[16]
if #D ~= 27 * n then return redis.error_reply('kvmeter settle: descriptors do not match keys') end
local cur = redis.call('MGET', unpack(KEYS))
local mset, del = {}, {}
local pos = 1
for i = 1, n do
  local k, s, rule, x, y, z
  k, s, rule, x, y, z, pos = struct.unpack('<c1Bc1ddd', D, pos)
  local delta = '0'
  if rule == 'a' then delta = ARGV[2 + s] elseif rule == 'r' then delta = ARGV[9 + s] end
  if delta ~= '0' and k ~= 'd' then
    if k == 'r' then
      local tat = tonumber(cur[i]) or now
      if tat < now then tat = now end
      local new = tat + tonumber(delta) * x
      if new <= now then
        del[#del + 1] = KEYS[i]
      elseif z > 0 then
        redis.call('SET', KEYS[i], fmt(new), 'PX', z)
      else
        mset[#mset + 1] = KEYS[i]
        mset[#mset + 1] = fmt(new)
      end
    elseif y > 0 or z == 1 then
      local v = redis.call('INCRBY', KEYS[i], delta)
      if v <= 0 then
        del[#del + 1] = KEYS[i]
      elseif y > 0 and not cur[i] then
        redis.call('EXPIRE', KEYS[i], y)
      end
    else
      local v = (tonumber(cur[i]) or 0) + tonumber(delta)
      if v <= 0 then
        del[#del + 1] = KEYS[i]
      else
        mset[#mset + 1] = KEYS[i]
        mset[#mset + 1] = string.format('%d', v)
      end
    end
  end
end
if #mset > 0 then redis.call('MSET', unpack(mset)) end
if #del > 0 then redis.call('DEL', unpack(del)) end
return 1
"""

#: KEYS[1]: counter. ARGV: amount, ttl s ('0' none). Returns the new value.
ADD_LUA = r"""
local v = redis.call('INCRBY', KEYS[1], ARGV[1])
if ARGV[2] ~= '0' then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return v
"""

_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)


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


def _number(raw: bytes | str) -> float | int:
    try:
        return int(raw)
    except ValueError:
        return float(raw)


class RedisQuotaStore(QuotaStore):
    """Quota counters in Redis (see module docstring).

    Args:
        client: a ``redis.asyncio.Redis`` (``decode_responses=False``), best made with
            :func:`redis_client` (short timeouts, no retry storm) so an unreachable Redis is
            detected quickly.
        key_prefix: namespace of every key (several deployments or tests can share one Redis).
        server_time: read Redis ``TIME`` in the scripts instead of the ``now`` passed in.
    Errors:
        Unreachable Redis (connection refused/reset, timeout) raises :class:`StoreUnavailable`
        from every method; other Redis errors propagate unchanged.
    """

    name = "redis"

    def __init__(self, client: aioredis.Redis, *, key_prefix: str = "kvq:", server_time: bool = False) -> None:
        self._client = client
        self.key_prefix = key_prefix
        self.server_time = server_time
        self._reserve = client.register_script(RESERVE_LUA)
        self._settle = client.register_script(SETTLE_LUA)
        self._add = client.register_script(ADD_LUA)

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 0.25, max_connections: int = 64,
                 key_prefix: str = "kvq:", server_time: bool = False) -> "RedisQuotaStore":
        """Build a store and its client from ``redis://host:port/db``.

        Args:
            timeout_s: socket and connect timeout in seconds (> 0); a Redis that does not answer
                within it counts as unreachable.
            max_connections: connection pool size (concurrent scripts in flight).
        """
        client = redis_client(url, timeout_s=timeout_s, max_connections=max_connections)
        return cls(client, key_prefix=key_prefix, server_time=server_time)

    @property
    def client(self) -> aioredis.Redis:
        """The underlying client."""
        return self._client

    def _now_arg(self, now: float) -> str:
        return "" if self.server_time else repr(float(now))

    async def reserve(self, items: Sequence[PlanItem], keys: Sequence[bytes], src: Sequence[int],
                      now: float) -> ReserveResult:
        args: list[Any] = [self._now_arg(now), *src, b"".join([it.desc for it in items])]
        for it in items:
            if it.big:
                args.append(it.limit - src[it.source])
        try:
            res = await self._reserve(keys=keys, args=args)
        except _UNREACHABLE as e:
            raise StoreUnavailable(f"redis unreachable: {type(e).__name__}: {e}") from e
        if res[0] == 1:
            return ReserveResult(True, -1, None, None, res[2].split(), now=float(res[1]))
        retry = float(res[2]) if res[2] else None
        return ReserveResult(False, int(res[1]), retry, res[3], now=float(res[4]))

    async def settle(self, items: Sequence[PlanItem], keys: Sequence[bytes], reserved: Sequence[int],
                     actual: Sequence[int], now: float, token: Any = None) -> None:
        if not items:
            return
        args: list[Any] = [self._now_arg(now)]
        args += [a - r for a, r in zip(actual, reserved, strict=True)]
        args += [-r for r in reserved]
        args.append(b"".join([it.desc for it in items]))
        try:
            await self._settle(keys=keys, args=args)
        except _UNREACHABLE as e:
            raise StoreUnavailable(f"redis unreachable: {type(e).__name__}: {e}") from e

    async def add(self, key: bytes | str, amount: int, ttl_s: int, now: float) -> int:
        try:
            return int(await self._add(keys=[key], args=[amount, ttl_s]))
        except _UNREACHABLE as e:
            raise StoreUnavailable(f"redis unreachable: {type(e).__name__}: {e}") from e

    async def get_values(self, keys: Sequence[bytes | str]) -> list[float | None]:
        if not keys:
            return []
        try:
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
        await self._client.aclose()
