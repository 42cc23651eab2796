"""Redis unreachable: per-dimension outage policy, a degraded signal, recovery without restart.

The outage is real: the test's own redis-server is terminated and later started again on the same
port; the gate and its store objects stay the same throughout.
"""

from __future__ import annotations

import pytest

from kvmeter.bus import StatsBus
from kvmeter.serving.quota import (
    FailoverQuotaStore,
    HierarchicalQuota,
    MemoryQuotaStore,
    QuotaRejected,
    RedisQuotaStore,
)
from kvmeter.serving.tenancy import TenantDirectory
from kvmeter.stats import QuotaStoreState
from quota_testlib import TcpProxy, estimate, price, tree, used

ACME, OTHER = "sk-test-key-one", "sk-test-other-one"


def config() -> str:
    # acme: 40 requests/min at the org (10 per replica when degraded, 4 replicas); no spend limit.
    # other: a daily spend budget (fails closed while Redis is down).
    text = tree(org_limits="{requests_per_minute: 40, concurrent_requests: 400}")
    return text.replace("  other:\n    tier: enterprise\n",
                        "  other:\n    tier: enterprise\n    limits: {spend_per_day: '5.00'}\n")


async def test_outage_policy_degraded_signal_and_recovery(own_redis_server, clock):
    bus = StatsBus()
    states: list[QuotaStoreState] = []
    bus.subscribe(QuotaStoreState, states.append)
    redis_store = RedisQuotaStore.from_url(own_redis_server.url, timeout_s=0.5)
    store = FailoverQuotaStore(redis_store, replicas=4, probe_interval_s=5.0, clock=clock, bus=bus)
    directory = TenantDirectory(config(), clock=clock)
    gate = HierarchicalQuota(directory, store, price=price, clock=clock)
    acme, other = directory.authenticate(ACME), directory.authenticate(OTHER)
    try:
        before = await gate.reserve(acme, estimate("m", 10, 10, principal=acme))        # held on Redis
        await gate.reserve(other, estimate("m", 10, 10, principal=other))
        assert not store.degraded and states == []

        own_redis_server.stop()                                             # the outage

        # rate limits fall back to local limits: 40/min / 4 replicas = 10 on this replica
        admitted = []
        for _ in range(12):
            try:
                admitted.append(await gate.reserve(acme, estimate("m", 10, 10, principal=acme)))
            except QuotaRejected as e:
                assert (e.status_code, e.reason, e.level, e.dimension) == (
                    429, "rate_limited", "org", "requests_per_minute")
        assert len(admitted) == 10
        assert store.degraded
        assert [(s.store, s.degraded) for s in states] == [("redis", True)]

        # spend fails closed: 503 naming the dimension, Retry-After = the probe interval
        with pytest.raises(QuotaRejected) as info:
            await gate.reserve(other, estimate("m", 10, 10, principal=other))
        e = info.value
        assert (e.status_code, e.reason, e.level, e.dimension) == (503, "quota_store_unavailable", "org",
                                                                  "spend_per_day")
        assert e.headers["retry-after"] == "5"

        # a reservation taken on Redis before the outage is reconciled later, not lost
        await gate.reconcile(before, used(10, 0, 5))
        assert store.pending_settles == 1
        assert gate.reconcile_errors == 0
        # a local reservation reconciles locally
        await gate.reconcile(admitted[0], used(10, 0, 5))

        own_redis_server.start()                                            # Redis is back
        with pytest.raises(QuotaRejected):  # before the probe interval: still local (and still full)
            await gate.reserve(acme, estimate("m", 10, 10, principal=acme))
        clock.advance(5.0)
        await gate.reserve(other, estimate("m", 10, 10, principal=other))               # probe → Redis again
        assert not store.degraded and store.pending_settles == 0
        assert [(s.degraded, s.reason) for s in states][-1] == (False, "recovered")
        # the pre-outage hold was released on Redis by the replayed reconciliation
        # (the fresh redis-server lost its data with the restart, so the counter is simply absent)
        (conc,) = await redis_store.get_values(["kvq:o:{acme}:conc"])
        assert conc is None
        r = await gate.reserve(acme, estimate("m", 10, 10, principal=acme))
        # counted on Redis again: the org's full 40/min (a local count would show this replica's 10)
        assert (r.headers["x-ratelimit-limit-requests"], r.headers["x-ratelimit-remaining-requests"]) == ("40", "39")
    finally:
        await store.aclose()


async def test_replayed_reconciliation_releases_holds_that_survived_the_outage(own_redis_server, clock):
    """A network outage (Redis keeps its data): the reconciliation queued while degraded releases
    the concurrency slot taken before the outage once the path is back."""
    proxy = TcpProxy(own_redis_server.port)
    await proxy.start()
    redis_store = RedisQuotaStore.from_url(proxy.url, timeout_s=0.5)
    store = FailoverQuotaStore(redis_store, replicas=1, probe_interval_s=1.0, clock=clock)
    gate = HierarchicalQuota(TenantDirectory(tree(key_limits="{concurrent_requests: 1}"), clock=clock), store,
                             price=price, clock=clock)
    pr = gate.directory.authenticate(ACME)
    direct = RedisQuotaStore.from_url(own_redis_server.url)
    key = "kvq:k:{acme}/ws/proj/k1:conc"
    try:
        held = await gate.reserve(pr, estimate("m", 10, 10, principal=pr))
        assert await direct.get_values([key]) == [1]
        await proxy.stop()                                   # the network path is cut
        await gate.reconcile(held, used(10, 0, 10))
        assert store.degraded and store.pending_settles == 1
        assert await direct.get_values([key]) == [1]         # Redis still holds the slot
        await proxy.start()                                  # the path is back
        clock.advance(1.0)
        await gate.reserve(pr, estimate("m", 10, 10, principal=pr))   # probe succeeds; the queue replays first
        assert not store.degraded and store.pending_settles == 0
        assert await direct.get_values([key]) == [1]         # old hold released, the new one held
        with pytest.raises(QuotaRejected) as info:           # and the limit of 1 holds on Redis again
            await gate.reserve(pr, estimate("m", 10, 10, principal=pr))
        assert info.value.dimension == "concurrent_requests"
    finally:
        await store.aclose()
        await direct.aclose()
        await proxy.stop()


async def test_open_policy_and_policy_validation(clock):
    class Down(MemoryQuotaStore):
        async def reserve(self, *a, **k):  # a store whose server is gone
            from kvmeter.serving.quota import StoreUnavailable
            raise StoreUnavailable("down")

    store = FailoverQuotaStore(Down(), replicas=2, policy={"spend_per_day": "open"}, clock=clock)
    gate = HierarchicalQuota(TenantDirectory(tree(org_limits="{spend_per_day: '0.0005'}"), clock=clock), store,
                             price=price, clock=clock)
    pr = gate.directory.authenticate(ACME)
    for _ in range(3):  # spend not enforced while degraded under "open"
        await gate.reserve(pr, estimate("m", 100, 100, principal=pr))
    assert store.degraded_reserves == 3
    with pytest.raises(ValueError, match="closed, local or open"):
        FailoverQuotaStore(Down(), policy={"spend_per_day": "maybe"})
    with pytest.raises(ValueError, match="replicas"):
        FailoverQuotaStore(Down(), replicas=0)


async def test_plain_redis_store_down_is_a_503_and_reconcile_never_raises(clock):
    from quota_testlib import free_port

    store = RedisQuotaStore.from_url(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)
    gate = HierarchicalQuota(TenantDirectory(tree(), clock=clock), store, price=price, clock=clock)
    pr = gate.directory.authenticate(ACME)
    try:
        with pytest.raises(QuotaRejected) as info:
            await gate.reserve(pr, estimate("m", 10, 10, principal=pr))
        assert (info.value.status_code, info.value.reason) == (503, "quota_store_unavailable")
        with pytest.raises(QuotaRejected) as info:
            await gate.report_tool_call(pr, "run-1")
        assert info.value.status_code == 503
    finally:
        await store.aclose()
