"""Quota backends by URI scheme: the one place a ``quota_store`` URL becomes a store and an
idempotency manager.

As the ``limits`` library picks its storage from a URI (``limits.storage.storage_from_string``: a
registry of storage classes keyed by scheme), ``kvmeter serve`` picks its quota state here:

===========================  ==================================================================
URL                          backend
===========================  ==================================================================
``memory://``                :class:`~.memory.MemoryQuotaStore` and
                             :class:`~.idempotency.MemoryIdempotencyManager`: this process only
                             (the default; idempotency records live as long as the process)
``redis://host:port/db``     :class:`~.failover.FailoverQuotaStore` over
``rediss://...`` (TLS)       :class:`~.redis_store.RedisQuotaStore` (the outage policy of the
                             quota package) and :class:`~.idempotency.RedisIdempotencyManager`:
                             shared by every gateway replica, kept across restarts; a
                             process's concurrency / KV holds expire ``lease_s`` (serve config
                             ``quota_lease_s``, default 30 s) after its last lease renewal
===========================  ==================================================================

A scheme maps to one factory (:func:`register_scheme` adds one, e.g. ``redis+cluster`` later); an
unknown scheme is refused when the backend is built, naming the scheme and the known ones. Nothing
connects here: Redis clients open their connections at the first command.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvmeter.bus import StatsBus
from kvmeter.clock import SYSTEM_CLOCK, Clock
from kvmeter.serving.quota.failover import FailoverQuotaStore
from kvmeter.serving.quota.leases import DEFAULT_LEASE_S
from kvmeter.serving.quota.idempotency import (IdempotencyManager, MemoryIdempotencyManager,
                                               RedisIdempotencyManager)
from kvmeter.serving.quota.memory import MemoryQuotaStore
from kvmeter.serving.quota.redis_store import RedisQuotaStore, redis_client
from kvmeter.serving.quota.store import QuotaStore

__all__ = ["QuotaBackend", "BackendOptions", "QuotaStoreURLError", "open_quota_backend",
           "register_scheme", "known_schemes", "scheme_of"]


class QuotaStoreURLError(ValueError):
    """A ``quota_store`` URL with no scheme or an unknown one. The message names the scheme and
    the known ones, never the rest of the URL (it may hold a password)."""


@dataclass(frozen=True, slots=True)
class BackendOptions:
    """What every backend factory is given besides the URL.

    Attributes:
        replicas: gateway replicas sharing a shared store (≥ 1; the local fallback's share).
        clock: injected clock.
        bus: where the stores' and managers' signals go (None: nowhere).
        lease_s: seconds a shared store's concurrency / KV holds, and a shared idempotency
            manager's running attempts, outlive their process's last lease renewal (> 0;
            :mod:`.leases`); the in-memory backend has no leases.
    """

    replicas: int = 1
    clock: Clock = SYSTEM_CLOCK
    bus: StatsBus | None = None
    lease_s: float = DEFAULT_LEASE_S


@dataclass(frozen=True, slots=True)
class QuotaBackend:
    """The quota state of one gateway: the store admission reserves in and the idempotency manager
    that remembers ``Idempotency-Key`` replays, on the same backend.

    Attributes:
        scheme: the URL's scheme (``memory``, ``redis``, ``rediss``).
        store: the :class:`~.store.QuotaStore`.
        idempotency: the :class:`~.idempotency.IdempotencyManager`.
        clock: the clock lease renewals read (:meth:`start`).
    """

    scheme: str
    store: QuotaStore
    idempotency: IdempotencyManager
    clock: Clock = SYSTEM_CLOCK

    def start(self) -> None:
        """Start the lease renewals on the running loop — the store's holds and the idempotency
        manager's running attempts (nothing for the in-memory backend)."""
        self.store.start_renewing(self.clock)
        self.idempotency.start_renewing()

    async def aclose(self) -> None:
        """Stop the lease renewal and release both parts' connections."""
        await self.store.aclose()
        await self.idempotency.aclose()


BackendFactory = Callable[[str, BackendOptions], QuotaBackend]
_SCHEMES: dict[str, BackendFactory] = {}


def register_scheme(scheme: str, factory: BackendFactory) -> None:
    """Make ``scheme://...`` URLs build their backend with ``factory(url, options)``.

    Raises:
        ValueError: for an empty scheme or one with characters RFC 3986 does not allow.
    """
    s = scheme.lower()
    if not s or not s[0].isalpha() or not all(c.isalnum() or c in "+-." for c in s):
        raise ValueError(f"invalid URI scheme {scheme!r}")
    _SCHEMES[s] = factory


def known_schemes() -> tuple[str, ...]:
    """The registered schemes, sorted."""
    return tuple(sorted(_SCHEMES))


def _known() -> str:
    return ", ".join(f"{s}://" for s in known_schemes())


def scheme_of(url: str) -> str:
    """The registered scheme of ``url`` (lower case).

    Raises:
        QuotaStoreURLError: ``url`` has no ``scheme://`` or an unregistered scheme.
    """
    scheme, sep, _ = url.partition("://")
    if not sep or not scheme:
        raise QuotaStoreURLError(f"quota store URL needs a scheme; known: {_known()}")
    scheme = scheme.lower()
    if scheme not in _SCHEMES:
        raise QuotaStoreURLError(f"unknown quota store scheme {scheme!r}; known: {_known()}")
    return scheme


def open_quota_backend(url: str, *, replicas: int = 1, clock: Clock = SYSTEM_CLOCK,
                       bus: StatsBus | None = None, lease_s: float = DEFAULT_LEASE_S) -> QuotaBackend:
    """The backend of ``url`` (see the module docstring for the schemes). Call
    :meth:`QuotaBackend.start` on the running loop to start its lease renewal.

    Raises:
        QuotaStoreURLError: no scheme or an unknown one.
        ValueError: a setting the chosen backend refuses (``replicas`` < 1, ``lease_s`` <= 0, a
            malformed Redis URL).
    """
    scheme = scheme_of(url)
    if not lease_s > 0:
        raise ValueError(f"quota lease_s must be > 0, got {lease_s}")
    return _SCHEMES[scheme](url, BackendOptions(replicas=replicas, clock=clock, bus=bus, lease_s=lease_s))


def _memory(url: str, options: BackendOptions) -> QuotaBackend:
    return QuotaBackend("memory", MemoryQuotaStore(),
                        MemoryIdempotencyManager(clock=options.clock, bus=options.bus), options.clock)


def _redis(url: str, options: BackendOptions) -> QuotaBackend:
    store = FailoverQuotaStore(RedisQuotaStore(redis_client(url), lease_s=options.lease_s),
                               replicas=options.replicas, clock=options.clock, bus=options.bus)
    # the running attempts' leases follow the holds' (one process, one lease): a killed gateway's
    # attempts may be retried ``lease_s`` after its last renewal
    idempotency = RedisIdempotencyManager(redis_client(url), clock=options.clock, bus=options.bus,
                                          lease_s=options.lease_s)
    return QuotaBackend(scheme_of(url), store, idempotency, options.clock)


register_scheme("memory", _memory)
register_scheme("redis", _redis)
register_scheme("rediss", _redis)
