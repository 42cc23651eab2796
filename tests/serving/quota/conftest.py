"""Fixtures for the quota tests: a real redis-server on loopback, stores, gates.

The Redis fixtures start the Debian ``redis-server`` binary on a free loopback port in a temporary
directory (no persistence). If the binary is missing, Redis-backed tests are skipped with a reason
that says how to install it; the in-memory variants still run.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import AsyncIterator, Callable

import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from kvmeter.clock import ManualClock
from kvmeter.serving.quota import HierarchicalQuota, MemoryQuotaStore, QuotaStore, RedisQuotaStore
from kvmeter.serving.tenancy import TenantDirectory
from tests.conftest import run_async_tests_on_session_loop
from quota_testlib import NO_REDIS, REDIS_BIN, REDIS_CLI, RedisClusterServers, RedisServer, price


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> RedisClusterServers:
    """A real 3-master Redis Cluster on loopback for the session (skipped without redis-server)."""
    if REDIS_BIN is None or REDIS_CLI is None:
        pytest.skip(NO_REDIS)
    cluster = RedisClusterServers(tmp_path_factory.mktemp("redis-cluster"))
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    yield cluster
    cluster.stop()


@pytest.fixture
def own_redis_server(tmp_path: Path) -> RedisServer:
    """A private redis-server the test may stop and restart (outage tests)."""
    if REDIS_BIN is None:
        pytest.skip(NO_REDIS)
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture(params=["memory", "redis", "cluster"])
def store_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest_asyncio.fixture
async def store(store_kind: str, request: pytest.FixtureRequest) -> AsyncIterator[QuotaStore]:
    """The same test body on the in-memory store, on a real Redis and on a real 3-master Redis
    Cluster (unique key prefix)."""
    prefix = f"t{uuid.uuid4().hex[:10]}:"
    if store_kind == "memory":
        yield MemoryQuotaStore(prefix)
        return
    server = request.getfixturevalue("redis_server" if store_kind == "redis" else "redis_cluster")
    s = RedisQuotaStore.from_url(server.url, key_prefix=prefix, timeout_s=2.0)
    yield s
    await s.aclose()


@pytest_asyncio.fixture
async def redis_client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url, socket_timeout=2.0)
    yield client
    await client.aclose()


@pytest.fixture
def clock() -> ManualClock:
    # 2024-05-17 12:00:00 UTC: mid-day, mid-month
    return ManualClock(start_wall=1_715_947_200.0)


@pytest.fixture
def make_gate(store: QuotaStore, clock: ManualClock) -> Callable[..., HierarchicalQuota]:
    """Build a gate on the parametrized store from a YAML config."""

    def build(yaml_text: str, **kwargs) -> HierarchicalQuota:
        directory = TenantDirectory(yaml_text, clock=clock)
        kwargs.setdefault("price", price)
        kwargs.setdefault("clock", clock)
        return HierarchicalQuota(directory, store, **kwargs)

    return build


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run this folder's async tests on the session event loop, where the async fixtures live."""
    run_async_tests_on_session_loop(Path(__file__).parent, items)


def _uses_redis(item: pytest.Item) -> bool:
    names = set(getattr(item, "fixturenames", ()))
    if names & {"redis_server", "own_redis_server", "redis_client", "redis_cluster"}:
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    return bool({"redis", "cluster"} & {params.get("store_kind"), params.get("idem_kind"), params.get("backend_url")})


@pytest.hookimpl(trylast=True)
def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark every test that starts or talks to redis-server with ``redis`` (``-m "not redis"``)."""
    if Path(__file__).parent in item.path.parents and _uses_redis(item):
        item.add_marker(pytest.mark.redis)
