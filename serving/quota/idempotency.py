"""Idempotent retries: one logical request per (tenant, ``Idempotency-Key``) within a window.

The gateway, for a request carrying an ``Idempotency-Key`` header and before quota admission::

    try:
        ticket = await idem.begin(principal.tenant_id, key, fingerprint=sha256(body))
    except IdempotencyError as e:               # 422 key reused with another body,
        return error(e.status_code, e.code)     # 409 first attempt still running, 400 bad key
    if ticket.outcome is not AttemptOutcome.FIRST:
        return replay(ticket.response)          # JOINED or REPLAYED: never billed again
    try:
        reservation = await quota.reserve(principal, UsageEstimate(..., attempt=ticket.attempt))
    except QuotaRejected:
        await idem.abandon(ticket)              # nothing ran: let a later retry run
        raise
    ... run; collect status, headers and every body byte sent ...
    await idem.complete(ticket, StoredResponse(status, headers, body, streamed=...))
    # on an engine error or a client gone before the end: await idem.abandon(ticket)

Outcomes of :meth:`IdempotencyManager.begin`:

* ``FIRST`` — no attempt of this key ran, or the last one was abandoned (then ``attempt`` counts
  up) or its lease expired (its replica died). This attempt runs and must end with ``complete``
  or ``abandon``.
* ``JOINED`` — an attempt was running; this call waited for it and carries its result.
* ``REPLAYED`` — an attempt had finished; this call carries its stored result.

Each call publishes an :class:`~kvmeter.stats.IdempotencyAttempt` — the gateway
records the attempt from ``ticket`` as well.

What a replay returns: exactly what the first attempt sent — its status, headers and body bytes.
For a streamed first attempt that is the complete ``text/event-stream`` byte sequence (every
``data:`` event through ``data: [DONE]``), replayed as one stream; the gateway should add
``x-kvmeter-idempotent-replay: true``. A streamed attempt that did not reach its end (client gone,
engine error) is abandoned, not stored: a truncated answer is never replayed, and the next retry
runs as attempt ``n + 1`` (the ledger records each attempt that did work; see UsageEvent.attempt).
A body over ``max_body_bytes`` is stored without its body (``StoredResponse.body_omitted``): a
replay must then answer 409 rather than run the request again.

Keys are scoped by tenant (two tenants may use the same key). Results live ``window_s`` seconds
after completion (default 24 h, as Stripe's idempotency keys).
"""

from __future__ import annotations

import abc
import asyncio
import enum
import hashlib
import json
import logging
import secrets
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Sequence, TypedDict, Unpack

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.commands.core import AsyncScript
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.typing import EncodableT

from kvmeter.aio import PeriodicTask
from kvmeter.bus import StatsBus
from kvmeter.clock import SYSTEM_CLOCK, Clock
from kvmeter.errors import Refusal
from kvmeter.serving.quota.leases import renew_interval_s
from kvmeter.stats import IdempotencyAttempt

__all__ = [
    "AttemptOutcome",
    "StoredResponse",
    "IdempotencyTicket",
    "IdempotencyError",
    "IdempotencyConflict",
    "IdempotencyInProgress",
    "InvalidIdempotencyKey",
    "IdempotencyUnavailable",
    "IdempotencyManager",
    "MemoryIdempotencyManager",
    "RedisIdempotencyManager",
    "MAX_KEY_CHARS",
]

log = logging.getLogger(__name__)

#: Longest accepted ``Idempotency-Key`` (Stripe's limit).
MAX_KEY_CHARS = 255


class AttemptOutcome(str, enum.Enum):
    """How an attempt was answered (see module docstring)."""

    FIRST = "first"
    JOINED = "joined"
    REPLAYED = "replayed"


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A response the gateway can send again byte for byte.

    Attributes:
        status_code: HTTP status.
        headers: ``(name, value)`` pairs as sent (order kept; names may repeat).
        body: the body bytes (for a stream: every SSE byte, concatenated).
        streamed: True if it was sent as ``text/event-stream``.
        body_omitted: True if the body exceeded the manager's ``max_body_bytes`` and was not kept.
    """

    status_code: int
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    streamed: bool = False
    body_omitted: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.status_code, int) or not 100 <= self.status_code <= 599:
            raise ValueError(f"status_code must be an int in 100-599, got {self.status_code!r}")
        if not isinstance(self.body, (bytes, bytearray)):
            raise TypeError(f"body must be bytes, got {type(self.body).__name__}")


@dataclass(slots=True)
class IdempotencyTicket:
    """The answer of :meth:`IdempotencyManager.begin`.

    Attributes:
        tenant_id, key: the scope and the client's key.
        outcome: :class:`AttemptOutcome`.
        attempt: the attempt number that runs (``FIRST``) or whose result is carried.
        response: the stored result for ``JOINED`` / ``REPLAYED``; None for ``FIRST``.
        token: the lease of a ``FIRST`` attempt (internal).
    """

    tenant_id: str
    key: str
    outcome: AttemptOutcome
    attempt: int
    response: StoredResponse | None = None
    token: str = field(default="", repr=False)

    @property
    def replayed(self) -> bool:
        """True when this answer was produced by an earlier attempt (not billed again)."""
        return self.outcome is not AttemptOutcome.FIRST


class IdempotencyError(Refusal):
    """Base of idempotency refusals (:class:`~kvmeter.errors.Refusal`s about the
    ``Idempotency-Key`` header, its ``param``). ``status_code`` and ``code`` map to the HTTP answer."""

    status_code = 400
    code = "invalid_idempotency_key"

    def __init__(self, message: str) -> None:
        super().__init__(message, param="Idempotency-Key")


class InvalidIdempotencyKey(IdempotencyError):
    """Empty, too long or non-printable key (400)."""


class IdempotencyConflict(IdempotencyError):
    """The key was used with a different request body (422, as Stripe)."""

    status_code = 422
    code = "idempotency_key_reused"


class IdempotencyInProgress(IdempotencyError):
    """The first attempt is still running and did not finish within the join timeout (409)."""

    status_code = 409
    code = "idempotency_in_progress"


class IdempotencyUnavailable(IdempotencyError):
    """The shared idempotency store cannot be reached (503). The request must not run, since it
    could not be deduplicated."""

    status_code = 503
    code = "idempotency_store_unavailable"


def _check_key(tenant_id: str, key: str) -> None:
    if not isinstance(tenant_id, str) or not tenant_id:
        raise InvalidIdempotencyKey("tenant_id must be a non-empty string")
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS or not key.isprintable():
        raise InvalidIdempotencyKey(f"Idempotency-Key must be 1-{MAX_KEY_CHARS} printable characters")


class _ManagerOptions(TypedDict, total=False):
    """The keyword arguments of :class:`IdempotencyManager` that its subclasses pass on."""

    window_s: float
    lease_s: float
    join_timeout_s: float
    max_body_bytes: int
    clock: Clock
    bus: StatsBus | None


class IdempotencyManager(abc.ABC):
    """Deduplicates attempts of one logical request.

    Args:
        window_s: seconds a finished result is kept (> 0).
        lease_s: seconds a running attempt is trusted after its process last renewed it before
            another attempt may take over (its process presumably died) (> 0). A shared manager
            renews its running attempts every ``lease_s / 3`` while :meth:`start_renewing` runs
            (the gateway starts it; without renewal choose ``lease_s`` above the longest request).
        join_timeout_s: longest wait of a concurrent retry for the running attempt (> 0).
        max_body_bytes: largest body stored for replay (≥ 0).
        clock: injected clock (monotonic for the memory manager; wall for Redis leases).
        bus: where :class:`IdempotencyAttempt` goes.
    """

    def __init__(self, *, window_s: float = 86_400.0, lease_s: float = 600.0, join_timeout_s: float = 600.0,
                 max_body_bytes: int = 4 << 20, clock: Clock = SYSTEM_CLOCK, bus: StatsBus | None = None) -> None:
        for name, v in (("window_s", window_s), ("lease_s", lease_s), ("join_timeout_s", join_timeout_s)):
            if v <= 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        if max_body_bytes < 0:
            raise ValueError(f"max_body_bytes must be >= 0, got {max_body_bytes}")
        self.window_s = window_s
        self.lease_s = lease_s
        self.join_timeout_s = join_timeout_s
        self.max_body_bytes = max_body_bytes
        self._clock = clock
        self._bus = bus
        self._waiting = 0

    @property
    def waiting(self) -> int:
        """Retries of this process currently waiting for a running first attempt (a gauge)."""
        return self._waiting

    @abc.abstractmethod
    async def begin(self, tenant_id: str, key: str, fingerprint: str = "") -> IdempotencyTicket:
        """Start, join or replay the attempt of ``(tenant_id, key)``.

        Args:
            fingerprint: a digest of the request (e.g. SHA-256 of the body); ``""`` skips the check.
        Raises:
            InvalidIdempotencyKey (400), IdempotencyConflict (422), IdempotencyInProgress (409),
            IdempotencyUnavailable (503).
        """

    @abc.abstractmethod
    async def complete(self, ticket: IdempotencyTicket, response: StoredResponse) -> bool:
        """Store the result of a ``FIRST`` attempt for replay; wakes joined retries.

        Returns:
            False if the lease was lost (another attempt took over) — nothing stored.
        """

    @abc.abstractmethod
    async def abandon(self, ticket: IdempotencyTicket) -> None:
        """The ``FIRST`` attempt produced no result to keep; the next retry runs (attempt + 1)."""

    def start_renewing(self, *, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        """Start renewing this process's running attempts on the running loop (nothing for a
        manager of one process, whose attempts live and die with it)."""
        return None

    async def renew_leases(self) -> int:
        """Extend the lease of every attempt this process is running; returns how many."""
        return 0

    async def aclose(self) -> None:
        """Release connections (no-op by default)."""
        return None

    def _fit(self, response: StoredResponse) -> StoredResponse:
        if len(response.body) > self.max_body_bytes:
            return StoredResponse(response.status_code, tuple(response.headers), b"", response.streamed, True)
        return response

    def _publish(self, tenant_id: str, outcome: str, attempt: int) -> None:
        if self._bus is not None:
            self._bus.publish(IdempotencyAttempt(tenant_id=tenant_id, outcome=outcome, attempt=attempt,
                                                 replayed=outcome in ("joined", "replayed"),
                                                 wall_ts=self._clock.wall()))

    def _answer(self, tenant_id: str, key: str, outcome: AttemptOutcome, attempt: int,
                response: StoredResponse | None = None, token: str = "") -> IdempotencyTicket:
        self._publish(tenant_id, outcome.value, attempt)
        return IdempotencyTicket(tenant_id, key, outcome, attempt, response, token)

    def _refuse(self, tenant_id: str, err: IdempotencyError, outcome: str, attempt: int) -> IdempotencyError:
        self._publish(tenant_id, outcome, attempt)
        return err


# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Entry:
    state: str                      # running | done | abandoned
    fingerprint: str
    attempt: int
    token: str
    lease_until: float              # monotonic seconds
    expires_at: float               # monotonic seconds
    response: StoredResponse | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)


class MemoryIdempotencyManager(IdempotencyManager):
    """Idempotency within one process (one event loop); the embedded default."""

    def __init__(self, **kwargs: Unpack[_ManagerOptions]) -> None:
        super().__init__(**kwargs)
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._begins = 0

    def _sweep(self, now: float) -> None:
        dead = [k for k, e in self._entries.items() if e.expires_at <= now and e.state != "running"]
        for k in dead:
            del self._entries[k]

    async def begin(self, tenant_id: str, key: str, fingerprint: str = "") -> IdempotencyTicket:
        _check_key(tenant_id, key)
        self._begins += 1
        if self._begins % 1024 == 0:
            self._sweep(self._clock.monotonic())
        waited = False
        while True:
            now = self._clock.monotonic()
            e = self._entries.get((tenant_id, key))
            if e is None or (e.state != "running" and e.expires_at <= now):
                token = secrets.token_hex(8)
                self._entries[(tenant_id, key)] = _Entry("running", fingerprint, 1, token,
                                                         now + self.lease_s, now + self.window_s)
                return self._answer(tenant_id, key, AttemptOutcome.FIRST, 1, token=token)
            if e.fingerprint and fingerprint and e.fingerprint != fingerprint:
                raise self._refuse(tenant_id, IdempotencyConflict(
                    "Idempotency-Key was already used with a different request"), "conflict", e.attempt)
            if e.state == "done":
                outcome = AttemptOutcome.JOINED if waited else AttemptOutcome.REPLAYED
                return self._answer(tenant_id, key, outcome, e.attempt, e.response)
            if e.state == "abandoned" or e.lease_until <= now:
                e.state, e.attempt, e.token = "running", e.attempt + 1, secrets.token_hex(8)
                e.lease_until, e.expires_at = now + self.lease_s, now + self.window_s
                e.fingerprint = e.fingerprint or fingerprint
                old, e.event = e.event, asyncio.Event()
                old.set()  # anyone still waiting on the dead attempt re-checks
                return self._answer(tenant_id, key, AttemptOutcome.FIRST, e.attempt, token=e.token)
            waited = True
            self._waiting += 1
            try:
                await asyncio.wait_for(e.event.wait(), self.join_timeout_s)
            except asyncio.TimeoutError:
                raise self._refuse(tenant_id, IdempotencyInProgress(
                    "a request with this Idempotency-Key is still being processed"), "in_progress",
                    e.attempt) from None
            finally:
                self._waiting -= 1

    async def complete(self, ticket: IdempotencyTicket, response: StoredResponse) -> bool:
        e = self._entries.get((ticket.tenant_id, ticket.key))
        if e is None or e.state != "running" or e.token != ticket.token or not ticket.token:
            log.warning("idempotent attempt %d of a key for tenant %s lost its lease; result not stored",
                        ticket.attempt, ticket.tenant_id)
            return False
        e.state, e.response, e.token = "done", self._fit(response), ""
        e.expires_at = self._clock.monotonic() + self.window_s
        e.event.set()
        return True

    async def abandon(self, ticket: IdempotencyTicket) -> None:
        e = self._entries.get((ticket.tenant_id, ticket.key))
        if e is None or e.state != "running" or e.token != ticket.token or not ticket.token:
            return
        e.state, e.token = "abandoned", ""
        e.event.set()


# ---------------------------------------------------------------------------------------------

_BEGIN_LUA = r"""
local h = redis.call('HMGET', KEYS[1], 'st', 'fp', 'at', 'lease')
local st, fp, at, lease = h[1], h[2], h[3], h[4]
local now = tonumber(ARGV[1])
if not st then
  redis.call('HSET', KEYS[1], 'st', 'running', 'fp', ARGV[2], 'at', 1, 'tok', ARGV[3],
             'lease', string.format('%.17g', now + tonumber(ARGV[4])))
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
  return {'first', 1}
end
if fp ~= '' and ARGV[2] ~= '' and fp ~= ARGV[2] then
  return {'conflict', tonumber(at)}
end
if st == 'done' then
  local r = redis.call('HMGET', KEYS[1], 'status', 'headers', 'body', 'streamed', 'omitted')
  return {'done', tonumber(at), r[1], r[2], r[3], r[4], r[5]}
end
if st == 'abandoned' or now > tonumber(lease) then
  local n = tonumber(at) + 1
  if fp == '' then fp = ARGV[2] end
  redis.call('HSET', KEYS[1], 'st', 'running', 'at', n, 'tok', ARGV[3], 'fp', fp,
             'lease', string.format('%.17g', now + tonumber(ARGV[4])))
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
  return {'first', n}
end
return {'running', tonumber(at)}
"""

_COMPLETE_LUA = r"""
if redis.call('HGET', KEYS[1], 'tok') ~= ARGV[1] or redis.call('HGET', KEYS[1], 'st') ~= 'running' then
  return 0
end
redis.call('HSET', KEYS[1], 'st', 'done', 'status', ARGV[2], 'headers', ARGV[3], 'body', ARGV[4],
           'streamed', ARGV[5], 'omitted', ARGV[6])
redis.call('HDEL', KEYS[1], 'tok')
redis.call('PEXPIRE', KEYS[1], ARGV[7])
return 1
"""

_ABANDON_LUA = r"""
if redis.call('HGET', KEYS[1], 'tok') ~= ARGV[1] or redis.call('HGET', KEYS[1], 'st') ~= 'running' then
  return 0
end
redis.call('HSET', KEYS[1], 'st', 'abandoned')
redis.call('HDEL', KEYS[1], 'tok')
return 1
"""

#: KEYS[1]: the key's hash; ARGV[1]: the attempt's token, ARGV[2]: now, ARGV[3]: lease seconds.
#: Extends the lease of a running attempt whose token still holds it; 0 when another attempt took over.
_RENEW_LUA = r"""
if redis.call('HGET', KEYS[1], 'tok') ~= ARGV[1] or redis.call('HGET', KEYS[1], 'st') ~= 'running' then
  return 0
end
redis.call('HSET', KEYS[1], 'lease', string.format('%.17g', tonumber(ARGV[2]) + tonumber(ARGV[3])))
return 1
"""

_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)


class RedisIdempotencyManager(IdempotencyManager):
    """Idempotency shared by every gateway replica, in Redis (one hash per key, Lua transitions).

    A concurrent retry on another replica polls the key every ``poll_interval_s`` until the first
    attempt finishes (at most ``join_timeout_s``); on the same replica it waits on the running
    attempt directly. Each running attempt carries a lease (``lease_s``, on the clock's wall time)
    that this process renews every ``lease_s / 3`` (:meth:`start_renewing`, the same rule as the
    quota's holds: :mod:`.leases`); when its process dies, a retry polling the key runs as the
    next attempt at most ``lease_s`` after the last renewal, instead of waiting for the join
    timeout (found by ``bench/fleet/kill_worker.py``: with a fixed 600 s lease, retries of the
    requests a killed worker held hung for minutes).

    Args:
        client: ``redis.asyncio.Redis`` with ``decode_responses=False``.
        key_prefix: namespace (``kvq:`` by default).
        poll_interval_s: seconds between polls of a running attempt on another replica (> 0).
        sleep: the wait used between polls (injectable; default ``asyncio.sleep``).
        **kwargs: see :class:`IdempotencyManager` (leases use the clock's wall time).
    """

    def __init__(self, client: aioredis.Redis, *, key_prefix: str = "kvq:", poll_interval_s: float = 0.05,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 **kwargs: Unpack[_ManagerOptions]) -> None:
        super().__init__(**kwargs)
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s}")
        self._client = client
        self.key_prefix = key_prefix
        self.poll_interval_s = poll_interval_s
        self._sleep = sleep
        self._begin = client.register_script(_BEGIN_LUA)
        self._complete = client.register_script(_COMPLETE_LUA)
        self._abandon = client.register_script(_ABANDON_LUA)
        self._renew = client.register_script(_RENEW_LUA)
        self._local: dict[str, asyncio.Event] = {}
        self._running: dict[str, str] = {}  # redis key → token of the attempt this process runs
        self._renewer: PeriodicTask | None = None

    def start_renewing(self, *, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        if self._renewer is None:
            self._renewer = PeriodicTask(self._renew_logged, renew_interval_s(self.lease_s),
                                         name="kvmeter-idempotency-leases", sleep=sleep)
        self._renewer.start()

    async def _renew_logged(self) -> None:
        try:
            await self.renew_leases()
        except IdempotencyUnavailable as e:  # the next tick tries again; the lease may lapse meanwhile
            log.warning("idempotency lease renewal failed: %s", e)

    async def renew_leases(self) -> int:
        """Extend the lease of every attempt this process is running (one script per key: the keys
        of different tenants may sit in different cluster slots). An attempt another process took
        over (its lease had lapsed) is forgotten here; its :meth:`complete` will report the loss.

        Raises:
            IdempotencyUnavailable: Redis could not be reached.
        """
        now, lease = repr(self._clock.wall()), repr(float(self.lease_s))
        renewed = 0
        for rkey, token in list(self._running.items()):
            if await self._call(self._renew, [rkey], [token, now, lease]):
                renewed += 1
            elif self._running.get(rkey) == token:
                del self._running[rkey]
        return renewed

    async def aclose(self) -> None:
        if self._renewer is not None:
            await self._renewer.stop()
        await self._client.aclose()

    def _redis_key(self, tenant_id: str, key: str) -> str:
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        return f"{self.key_prefix}idem:{tenant_id}:{digest}"

    async def _call(self, script: AsyncScript, keys: list[str], args: Sequence[EncodableT]) -> object:
        try:
            return await script(keys=keys, args=args)
        except _UNREACHABLE as e:
            raise IdempotencyUnavailable(f"idempotency store unreachable: {type(e).__name__}") from e

    async def begin(self, tenant_id: str, key: str, fingerprint: str = "") -> IdempotencyTicket:
        _check_key(tenant_id, key)
        rkey = self._redis_key(tenant_id, key)
        window_ms = int(self.window_s * 1000)
        polls = max(1, int(self.join_timeout_s / self.poll_interval_s))
        waited = False
        attempt = 1
        for _ in range(polls + 1):
            token = secrets.token_hex(8)
            res = await self._call(self._begin, [rkey], [repr(self._clock.wall()), fingerprint, token,
                                                         repr(float(self.lease_s)), window_ms])
            if not isinstance(res, list):  # _BEGIN_LUA always answers a table: {kind, attempt, ...}
                raise TypeError(f"idempotency begin script answered {res!r}, not a list")
            kind = res[0].decode() if isinstance(res[0], bytes) else res[0]
            attempt = int(res[1])
            if kind == "first":
                self._local[rkey] = asyncio.Event()
                self._running[rkey] = token
                return self._answer(tenant_id, key, AttemptOutcome.FIRST, attempt, token=token)
            if kind == "conflict":
                raise self._refuse(tenant_id, IdempotencyConflict(
                    "Idempotency-Key was already used with a different request"), "conflict", attempt)
            if kind == "done":
                _, _, status, headers, body, streamed, omitted = res
                stored = StoredResponse(int(status), tuple(tuple(h) for h in json.loads(headers)),
                                        bytes(body or b""), streamed == b"1", omitted == b"1")
                outcome = AttemptOutcome.JOINED if waited else AttemptOutcome.REPLAYED
                return self._answer(tenant_id, key, outcome, attempt, stored)
            waited = True
            local = self._local.get(rkey)
            self._waiting += 1
            try:
                if local is not None:  # the running attempt is ours: wait for it directly
                    try:
                        await asyncio.wait_for(local.wait(), self.join_timeout_s)
                    except asyncio.TimeoutError:
                        break
                else:
                    await self._sleep(self.poll_interval_s)
            finally:
                self._waiting -= 1
        raise self._refuse(tenant_id, IdempotencyInProgress(
            "a request with this Idempotency-Key is still being processed"), "in_progress", attempt)

    def _wake(self, rkey: str, token: str) -> None:
        if self._running.get(rkey) == token:
            del self._running[rkey]
        ev = self._local.pop(rkey, None)
        if ev is not None:
            ev.set()

    async def complete(self, ticket: IdempotencyTicket, response: StoredResponse) -> bool:
        rkey = self._redis_key(ticket.tenant_id, ticket.key)
        r = self._fit(response)
        try:
            ok = await self._call(self._complete, [rkey], [
                ticket.token, r.status_code, json.dumps([list(h) for h in r.headers]), bytes(r.body),
                "1" if r.streamed else "0", "1" if r.body_omitted else "0", int(self.window_s * 1000)])
        finally:
            self._wake(rkey, ticket.token)
        if not ok:
            log.warning("idempotent attempt %d of a key for tenant %s lost its lease; result not stored",
                        ticket.attempt, ticket.tenant_id)
        return bool(ok)

    async def abandon(self, ticket: IdempotencyTicket) -> None:
        rkey = self._redis_key(ticket.tenant_id, ticket.key)
        try:
            await self._call(self._abandon, [rkey], [ticket.token])
        finally:
            self._wake(rkey, ticket.token)
