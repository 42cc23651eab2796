"""Leases on concurrency and KV holds: a gateway process that stops renewing loses its holds within
its lease, on one real Redis and on a real Redis Cluster.

Two gateway processes are two ``RedisQuotaStore`` instances (two holder ids) on one backend, with
one key prefix; the process that "dies" is the one whose renew task is stopped. Lease deadlines
live on the store's clock (the injected ``ManualClock``), so nothing sleeps.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import AsyncIterator

import pytest
import pytest_asyncio

from kvmeter.serving.config import ServeConfig, load_serve_config
from kvmeter.serving.quota import (HierarchicalQuota, MemoryQuotaStore, QuotaRejected, RedisQuotaStore,
                                   open_quota_backend)
from kvmeter.serving.quota.leases import DEFAULT_LEASE_S
from kvmeter.serving.tenancy import TenantDirectory
from quota_testlib import estimate, price, tree, used

LEASE_S = 10.0

#: acme may hold 2 requests and 1,000 KV tokens at once; its key k1 has its own rate limit too.
CONFIG = tree(org_limits="{concurrent_requests: 2, active_kv_tokens: 1000}",
              key_limits="{requests_per_minute: 1000}")


@pytest.fixture(params=["redis", "cluster"])
def backend_url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("redis_server" if request.param == "redis" else "redis_cluster").url


@pytest_asyncio.fixture
async def two_processes(backend_url: str) -> AsyncIterator[tuple[RedisQuotaStore, RedisQuotaStore]]:
    """Two gateway processes' stores on one backend and key prefix (distinct holders)."""
    prefix = f"l{uuid.uuid4().hex[:10]}:"
    a = RedisQuotaStore.from_url(backend_url, key_prefix=prefix, timeout_s=2.0, lease_s=LEASE_S)
    b = RedisQuotaStore.from_url(backend_url, key_prefix=prefix, timeout_s=2.0, lease_s=LEASE_S)
    assert a.holder != b.holder
    yield a, b
    await a.aclose()
    await b.aclose()


def gate(store, clock, config: str = CONFIG) -> HierarchicalQuota:
    return HierarchicalQuota(TenantDirectory(config, clock=clock), store, price=price, clock=clock)


async def refused(g: HierarchicalQuota, **kw) -> QuotaRejected:
    with pytest.raises(QuotaRejected) as e:
        await g.reserve(g.directory.authenticate("sk-test-key-one"), estimate(**kw))
    return e.value


async def org_counters(store: RedisQuotaStore) -> list:
    return await store.get_values([f"{store.key_prefix}o:{{acme}}:conc", f"{store.key_prefix}o:{{acme}}:kv"])


async def test_a_stopped_process_holds_expire_within_the_lease_and_are_never_released_twice(two_processes, clock):
    a_store, b_store = two_processes
    a, b = gate(a_store, clock), gate(b_store, clock)
    k1 = a.directory.authenticate("sk-test-key-one")
    a_store.start_renewing(clock)
    held = [await a.reserve(k1, estimate(input_tokens=100, max_output_tokens=100)) for _ in range(2)]
    await a_store.stop_renewing()  # process A dies here: no renewal after its reservations
    assert await org_counters(b_store) == [2, 400]

    e = await refused(b)                                   # within A's lease its holds count
    assert (e.reason, e.level, e.dimension) == ("concurrency_limited", "org", "concurrent_requests")
    clock.advance(LEASE_S - 0.01)
    await refused(b)
    clock.advance(0.02)                                    # A's lease has passed: its holds are given back
    mine = [await b.reserve(k1, estimate(input_tokens=100, max_output_tokens=100)) for _ in range(2)]
    assert await org_counters(b_store) == [2, 400]         # B's two holds, none of A's
    await refused(b)

    for r in held:                                         # A's late reconciliations release nothing
        await a.reconcile(r, used(input_tokens=100, output_tokens=10))
    assert await org_counters(b_store) == [2, 400]
    for r in mine:
        await b.reconcile(r, used(input_tokens=100, output_tokens=10))
    assert await org_counters(b_store) == [None, None]
    assert a.reconcile_errors == b.reconcile_errors == 0


async def test_kv_holds_of_a_stopped_process_expire_too(two_processes, clock):
    a_store, b_store = two_processes
    a, b = gate(a_store, clock), gate(b_store, clock)
    k1 = a.directory.authenticate("sk-test-key-one")
    await a.reserve(k1, estimate(input_tokens=500, max_output_tokens=400))        # 900 KV tokens held
    e = await refused(b, input_tokens=100, max_output_tokens=100)
    assert (e.reason, e.dimension) == ("kv_budget_exceeded", "active_kv_tokens")
    clock.advance(LEASE_S)
    r = await b.reserve(k1, estimate(input_tokens=100, max_output_tokens=100))
    assert await org_counters(b_store) == [1, 200]
    await b.reconcile(r, used())


async def test_a_live_process_keeps_its_holds_for_as_long_as_it_renews(two_processes, clock):
    a_store, b_store = two_processes
    a, b = gate(a_store, clock), gate(b_store, clock)
    k1 = a.directory.authenticate("sk-test-key-one")
    held = [await a.reserve(k1, estimate()) for _ in range(2)]
    for _ in range(10):                                    # 30 s, 3 leases, renewed every lease / 3
        clock.advance(LEASE_S / 3)
        assert await a_store.renew_leases(clock.wall()) == 1
        await refused(b)
    for r in held:
        await a.reconcile(r, used(input_tokens=100, output_tokens=1))
    assert await org_counters(b_store) == [None, None]
    assert await a_store.renew_leases(clock.wall()) == 0   # nothing held: nothing to renew
    await b.reserve(k1, estimate())


async def test_the_renew_task_renews_on_its_own_clock_and_sleep(two_processes, clock):
    a_store, _ = two_processes
    a = gate(a_store, clock)
    await a.reserve(a.directory.authenticate("sk-test-key-one"), estimate())
    ticks: asyncio.Queue[None] = asyncio.Queue()
    slept: list[float] = []

    async def sleep(seconds: float) -> None:                # the injected wait: one tick per put()
        await ticks.get()
        slept.append(seconds)
        clock.advance(seconds)

    lease_key = f"{a_store.key_prefix}lease:{{acme}}"
    start = clock.wall()
    a_store.start_renewing(clock, sleep=sleep)
    for n in (1, 2):
        ticks.put_nowait(None)
        while a_store._renewer.renewals < n:                # noqa: SLF001 — wait for the tick to land
            await asyncio.sleep(0)
        deadline = float(await a_store.client.hget(lease_key, a_store.holder))
        assert deadline == pytest.approx(start + n * LEASE_S / 3 + LEASE_S, abs=1e-3)
    assert slept == [LEASE_S / 3] * 2
    await a_store.stop_renewing()
    assert not a_store._renewer.running                      # noqa: SLF001


async def test_without_leases_the_holds_of_a_stopped_process_stay(redis_server, clock):
    """The behaviour before leases (``lease_s=None``): what the lease tests above guard against."""
    prefix = f"n{uuid.uuid4().hex[:10]}:"
    a_store = RedisQuotaStore.from_url(redis_server.url, key_prefix=prefix, lease_s=None)
    b_store = RedisQuotaStore.from_url(redis_server.url, key_prefix=prefix, lease_s=None)
    try:
        a, b = gate(a_store, clock), gate(b_store, clock)
        k1 = a.directory.authenticate("sk-test-key-one")
        for _ in range(2):
            await a.reserve(k1, estimate())
        clock.advance(100 * LEASE_S)
        await refused(b)
    finally:
        await a_store.aclose()
        await b_store.aclose()


async def test_the_in_memory_store_has_the_same_interface_and_no_leases(clock):
    store = MemoryQuotaStore()
    assert store.lease_s is None
    store.start_renewing(clock)
    assert await store.renew_leases(clock.wall()) == 0
    await store.stop_renewing()


def test_the_lease_is_a_serve_setting_with_a_default_and_an_environment_variable():
    assert ServeConfig().quota_lease_s == DEFAULT_LEASE_S == 30.0
    assert load_serve_config(None, env={"KVMETER_QUOTA_LEASE_S": "12.5"}).quota_lease_s == 12.5
    with pytest.raises(ValueError):
        open_quota_backend("memory://", lease_s=0)


async def test_the_redis_backend_builds_its_store_with_the_configured_lease(redis_server, clock):
    backend = open_quota_backend(redis_server.url, clock=clock, lease_s=7.0)
    try:
        assert backend.store.lease_s == backend.store.primary.lease_s == 7.0
        backend.start()
        assert backend.store._renewer.running                # noqa: SLF001
    finally:
        await backend.aclose()
    assert not backend.store._renewer.running                # noqa: SLF001
