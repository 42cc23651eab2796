"""The quota store and the idempotency manager come from one place, chosen by the URL's scheme:
``memory://`` and ``redis://`` (a real redis-server) work end to end, an unknown scheme is refused
at construction naming the scheme and the known ones."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from kvmeter.bus import StatsBus
from kvmeter.serving.config import load_serve_config
from kvmeter.serving.quota import (FailoverQuotaStore, HierarchicalQuota, MemoryIdempotencyManager,
                                   MemoryQuotaStore, QuotaRejected, QuotaStoreURLError, RedisIdempotencyManager,
                                   RedisQuotaStore, open_quota_backend)
from kvmeter.serving.quota.backends import known_schemes, register_scheme
from kvmeter.serving.runtime import ServeRuntime
from kvmeter.serving.tenancy import TenantDirectory
from quota_testlib import estimate, price, tree


async def _reserve_and_remember(backend, clock) -> None:
    """One reservation through the gate and one idempotent attempt, on the backend's parts."""
    directory = TenantDirectory(tree(key_limits="{requests_per_minute: 1}"), clock=clock)
    gate = HierarchicalQuota(directory, backend.store, price=price, clock=clock)
    principal = directory.authenticate("sk-test-key-one")
    call = estimate("m", 10, 5, principal=principal)
    await gate.reserve(principal, call)
    with pytest.raises(QuotaRejected) as info:  # the store kept the first one
        await gate.reserve(principal, call)
    assert (info.value.code, info.value.dimension) == ("rate_limited", "requests_per_minute")
    ticket = await backend.idempotency.begin(principal.tenant_id, "idem-1", fingerprint="f")
    assert not ticket.replayed and ticket.attempt == 1


async def test_memory_url_gives_the_in_process_store_and_manager(clock):
    backend = open_quota_backend("memory://", clock=clock)
    assert backend.scheme == "memory"
    assert type(backend.store) is MemoryQuotaStore
    assert type(backend.idempotency) is MemoryIdempotencyManager
    await _reserve_and_remember(backend, clock)
    await backend.aclose()


async def test_redis_url_gives_the_shared_store_with_failover_and_the_redis_manager(redis_server, clock):
    url = redis_server.url.rsplit("/", 1)[0] + "/5"  # a database of its own
    inspect = aioredis.Redis.from_url(url, socket_timeout=2.0)
    await inspect.flushdb()
    try:
        backend = open_quota_backend(url, replicas=3, clock=clock, bus=StatsBus())
        assert backend.scheme == "redis"
        assert isinstance(backend.store, FailoverQuotaStore) and isinstance(backend.store.primary, RedisQuotaStore)
        assert backend.store.replicas == 3
        assert isinstance(backend.idempotency, RedisIdempotencyManager)
        await _reserve_and_remember(backend, clock)
        keys = [k.decode() for k in await inspect.keys("kvq:*")]  # both live on redis-server
        assert any(":idem:" in k for k in keys) and any(":idem:" not in k for k in keys), keys
        await backend.aclose()
    finally:
        await inspect.flushdb()
        await inspect.aclose()


def test_rediss_is_the_tls_form_of_the_redis_backend():
    backend = open_quota_backend("rediss://127.0.0.1:1/0")  # nothing connects at construction
    assert backend.scheme == "rediss" and isinstance(backend.store, FailoverQuotaStore)
    assert {"memory", "redis", "rediss"} <= set(known_schemes())


@pytest.mark.parametrize("url,words", [
    ("mongodb://user:hunter2@db:27017/q", "unknown quota store scheme 'mongodb'"),
    ("127.0.0.1:6379", "needs a scheme"),
    ("memory", "needs a scheme"),
    ("://host", "needs a scheme"),
])
def test_an_unknown_or_missing_scheme_is_refused_naming_it_and_the_known_ones(url, words):
    with pytest.raises(QuotaStoreURLError) as info:
        open_quota_backend(url)
    message = str(info.value)
    assert words in message and "known: memory://, redis://, rediss://" in message
    assert "hunter2" not in message


def test_register_scheme_refuses_a_malformed_scheme():
    with pytest.raises(ValueError, match="invalid URI scheme"):
        register_scheme("9p", lambda url, options: None)


def test_serve_refuses_an_unknown_quota_store_before_building_the_engine(tmp_path):
    # engine.kind=remote with no remote_url would fail in build_engine: the quota URL is checked first
    config = load_serve_config(None, {("engine", "kind"): "remote", ("quota_store",): "memcached://127.0.0.1:11211",
                                      ("spool_dir",): str(tmp_path / "spool")}, env={})
    with pytest.raises(QuotaStoreURLError, match="unknown quota store scheme 'memcached'"):
        ServeRuntime(config)
