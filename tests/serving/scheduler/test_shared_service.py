"""VTC counters shared between gateway processes through a real redis-server (and a real 3-master
Redis Cluster): the two-gateway 1:2 case, lifts that do not add up, an outage that never stops
dispatch and loses nothing, and the serve config's choice."""

from __future__ import annotations

import asyncio
import logging
import uuid
from pathlib import Path

import pytest

from bench.fairness.two_gateways import run_two_gateways, run_two_processes
from kvmeter.clock import ManualClock
from kvmeter.serving.config import ServeConfig, load_serve_config
from kvmeter.serving.quota import redis_client
from kvmeter.serving.quota.redis_store import redis_cluster_client
from kvmeter.serving.runtime import shared_service_for
from kvmeter.serving.scheduler import FairScheduler, SchedulerConfig, SchedulerCore
from kvmeter.serving.scheduler.shared_service import SharedServiceSync, counters_key
from kvmeter.stats import EngineLoad
from tests.serving.quota.quota_testlib import NO_REDIS, REDIS_BIN, REDIS_CLI, RedisClusterServers, RedisServer

from .helpers import job


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    if REDIS_BIN is None:
        pytest.skip(NO_REDIS)
    server = RedisServer(tmp_path_factory.mktemp("redis-vtc"))
    server.start()
    yield server.url
    server.stop()


def _syncs(url: str, n: int = 2) -> list[SharedServiceSync]:
    pool = f"t{uuid.uuid4().hex[:10]}"  # a fresh hash per test
    return [SharedServiceSync(redis_client(url), pool=pool) for _ in range(n)]


async def _close(syncs: list[SharedServiceSync]) -> None:
    for s in syncs:
        await s.aclose()


async def test_a_tenant_spread_over_two_gateways_gets_its_fair_share_only_with_sharing(redis_url: str):
    """Demand A:B = 1:2, A on gateway 1 only, B on both (bench/fairness/two_gateways.py): each
    gateway's VTC alone gives B 2× A; the shared counters bring it within 1:1.1."""
    local = await run_two_gateways(None, ticks=500)
    assert local.ratio_b_to_a == pytest.approx(2.0, rel=0.05)
    syncs = _syncs(redis_url)
    try:
        shared = await run_two_gateways(syncs, ticks=500)
    finally:
        await _close(syncs)
    assert shared.failed_syncs == 0
    assert 1 / 1.1 <= shared.ratio_b_to_a <= 1.1
    # gateway 2 serves only B either way (work-conserving); the fairness comes from gateway 1
    assert shared.per_gateway[1]["B"] == local.per_gateway[1]["B"]
    assert shared.per_gateway[0]["A"] > 1.4 * local.per_gateway[0]["A"]


def test_two_gateway_processes_share_their_counters(redis_url: str):
    """The same case with each gateway in its own OS process, in lock-step over pipes: the two
    processes' syncs race on Redis as two gateways' would."""
    shared = run_two_processes(redis_url, ticks=500)
    assert shared.failed_syncs == 0
    assert 1 / 1.1 <= shared.ratio_b_to_a <= 1.1


async def test_charges_add_up_and_two_lifts_of_one_tenant_take_the_larger(redis_url: str):
    s1, s2 = _syncs(redis_url)
    c1, c2 = (SchedulerCore(SchedulerConfig.plain_baseline(), clock=ManualClock()) for _ in range(2))
    try:
        s1.charged("x", 5.0)
        s2.charged("x", 7.0)
        s1.lifted("y", 100.0)
        s2.lifted("y", 100.0)  # the same returning tenant lifted on both gateways at once
        s2.charged("y", 3.0)  # … and charged after its lift on gateway 2
        assert await s1.sync(c1) and await s2.sync(c2)
        assert await s1.sync(c1)  # (gateway 1 read the hash before gateway 2 had written)
        raw = await s1._client.hgetall(s1.key)
        assert {k.decode(): float(v) for k, v in raw.items()} == {"x": 12.0, "y": 103.0}
        # tenants not seen by a core yet start at their shared counter when they arrive
        c1.submit(job("r1", "x"))
        assert c1.tenant_counter("x") == 12.0
        assert c2.tenant_counter("y") == 0.0  # (not arrived on c2 yet)
        c2.submit(job("r2", "y"))
        assert c2.tenant_counter("y") == 103.0
    finally:
        await _close([s1, s2])


async def test_raised_counters_reorder_dispatch_and_never_go_down(redis_url: str):
    """A counter raised by the sync changes who is served next; a lower shared value is ignored."""
    core = SchedulerCore(SchedulerConfig.plain_baseline(max_engine_running=1), clock=ManualClock())
    core.on_engine_load(EngineLoad(0.0, 100_000, 0, 0))
    core.submit(job("a1", "a"))
    core.submit(job("b1", "b"))
    core.submit(job("a2", "a"))
    core.submit(job("b2", "b"))
    assert core.raise_counters({"a": 1_000.0}) == 1  # a was served 1,000 units elsewhere
    (g,) = core.dispatch()
    assert g.job.tenant_id == "b"
    assert core.raise_counters({"a": 10.0, "b": 0.0}) == 0
    assert core.tenant_counter("a") == 1_000.0


async def test_redis_down_dispatch_continues_and_nothing_charged_is_lost(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture):
    if REDIS_BIN is None:
        pytest.skip(NO_REDIS)
    server = RedisServer(tmp_path / "redis")  # not started: every sync fails (connection refused)
    syncs = _syncs(server.url)
    try:
        with caplog.at_level(logging.WARNING, logger="kvmeter.serving.scheduler.shared_service"):
            down = await run_two_gateways(syncs, ticks=50)
        local = await run_two_gateways(None, ticks=50)
        # every tick dispatched its capacity: local fairness, exactly the unshared run
        assert down.per_gateway == local.per_gateway
        assert down.failed_syncs == 2 * (50 // 5)
        assert all(not s.healthy for s in syncs)
        assert len(caplog.records) == 2  # one line per gateway when its outage began, not per sync
        server.start()
        try:
            cores = [SchedulerCore(), SchedulerCore()]
            assert all([await s.sync(c) for s, c in zip(syncs, cores, strict=True)])
            raw = await syncs[0]._client.hgetall(syncs[0].key)
            shared = {k.decode(): float(v) for k, v in raw.items()}
            # what both gateways charged during the outage reached Redis (no lift in this run:
            # both tenants stay backlogged from the first tick, weights 1)
            assert shared == {"A": down.service["A"], "B": down.service["B"]}
            assert all(s.healthy for s in syncs)
        finally:
            server.stop()
    finally:
        await _close(syncs)


async def test_fair_scheduler_runs_the_sync_between_start_and_stop(redis_url: str):
    steps: asyncio.Queue[None] = asyncio.Queue()
    waits = 0
    second_wait = asyncio.Event()

    async def step(_s: float) -> None:  # the sync task's sleep, stepped by the test
        nonlocal waits
        waits += 1
        if waits == 2:  # the first exchange is over
            second_wait.set()
        await steps.get()

    sync = SharedServiceSync(redis_client(redis_url), pool=f"t{uuid.uuid4().hex[:10]}", sleep=step)
    sched = FairScheduler(SchedulerConfig.plain_baseline(), clock=ManualClock(), shared_service=sync)
    sched.on_engine_load(EngineLoad(0.0, 100_000, 0, 0))
    assert sched.core.counter_log is sync
    try:
        await sched.start()
        grant = await sched.acquire(job("r1", "a", prompt=100))
        sched.charge_output(grant, 10)
        sched.release(grant)
        steps.put_nowait(None)
        await asyncio.wait_for(second_wait.wait(), 10)  # (a bound on a hang, not a timing)
        assert sync.syncs_total == 1
        assert float(await sync._client.hget(sync.key, "a")) == 100 + 2 * 10
        assert sched.snapshot().shared_service_failures_total == 0
    finally:
        await sched.stop()
        await sync.aclose()
    assert not sync.running


async def test_counters_live_in_one_slot_on_a_redis_cluster(tmp_path: Path):
    if REDIS_BIN is None or REDIS_CLI is None:
        pytest.skip(NO_REDIS)
    cluster = RedisClusterServers(tmp_path / "cluster")
    try:
        cluster.start()
        pool = f"t{uuid.uuid4().hex[:10]}"
        syncs = [SharedServiceSync(redis_cluster_client(cluster.url, timeout_s=2.0), pool=pool) for _ in range(2)]
        try:
            shared = await run_two_gateways(syncs, ticks=200)
            assert shared.failed_syncs == 0
            assert 1 / 1.1 <= shared.ratio_b_to_a <= 1.1
        finally:
            await _close(syncs)
    finally:
        cluster.stop()


def test_counters_key_puts_the_pool_in_the_hash_tag():
    assert counters_key("kvs:", "llama-3") == "kvs:{llama-3}:vtc"
    with pytest.raises(ValueError):
        counters_key("kvs:", "a{b}")


async def test_serve_shares_counters_on_a_redis_quota_store_only(monkeypatch: pytest.MonkeyPatch):
    assert shared_service_for(ServeConfig()) is None  # memory://: one process
    on_redis = shared_service_for(ServeConfig(quota_store="redis://127.0.0.1:1/0",
                                              engine={"model": "smollm2"}))
    assert on_redis is not None and on_redis.key == "kvs:{smollm2}:vtc" and on_redis.interval_s == 0.5
    await on_redis.aclose()
    assert shared_service_for(ServeConfig(quota_store="redis://127.0.0.1:1/0",
                                          scheduler={"shared_service": "off"})) is None
    with pytest.raises(ValueError, match="shared_service"):
        shared_service_for(ServeConfig(scheduler={"shared_service": "on"}))
    monkeypatch.setenv("KVMETER_QUOTA_STORE", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("KVMETER_SCHEDULER_SHARED_SERVICE", "off")
    assert shared_service_for(load_serve_config()) is None


async def test_each_served_model_shares_its_own_counters():
    """engine.models: one scheduler per model, so one shared hash per model (a tenant's service on
    one model is not its service on another), under scheduler.shared_service_pool when set."""
    config = ServeConfig(quota_store="redis://127.0.0.1:1/0")
    keys = []
    for model in ("llama", "qwen{7b}"):
        sync = shared_service_for(config, model)
        assert sync is not None
        keys.append(sync.key)
        await sync.aclose()
    assert keys == ["kvs:{llama}:vtc", "kvs:{qwen_7b_}:vtc"]
    fleet = shared_service_for(ServeConfig(quota_store="redis://127.0.0.1:1/0",
                                           scheduler={"shared_service_pool": "eu"}), "llama")
    assert fleet is not None and fleet.key == "kvs:{eu/llama}:vtc"
    await fleet.aclose()

