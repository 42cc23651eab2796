"""The quota store on a real 3-master Redis Cluster: one org's keys share a hash slot, a reservation
with global limits stays all or nothing over two slots, and orgs spread over the nodes.

(The whole gate suite, ``test_quota_gate.py`` and the others on the ``store`` fixture, also runs on
the cluster: ``store_kind`` = ``cluster``.)
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis
import redis.asyncio
from redis.crc import key_slot

from kvmeter.serving.quota import HierarchicalQuota, QuotaRejected, RedisQuotaStore
from kvmeter.serving.quota.plan import build_plan
from kvmeter.serving.tenancy import TenantDirectory
from quota_testlib import P_IN, P_OUT, estimate, price, tree, used

ALL_DIMS = ("{requests_per_minute: 1000, input_tokens_per_minute: 100000, output_tokens_per_minute: 100000, "
            "concurrent_requests: 10, active_kv_tokens: 100000, spend_per_day: '10', spend_per_month: '100'}")
RUNS = "{max_model_calls: 10, max_tool_calls: 10, max_retries: 3, max_parallel_branches: 2, max_cost: '1'}"


def test_every_key_of_one_org_is_in_one_slot_and_the_global_level_in_its_own(clock):
    directory = TenantDirectory(tree(org_limits=ALL_DIMS, ws_limits=ALL_DIMS, project_limits=ALL_DIMS,
                                     key_limits=ALL_DIMS, global_limits=ALL_DIMS, run_budget=RUNS,
                                     agent_run_limits=ALL_DIMS), clock=clock)
    store = RedisQuotaStore(redis.asyncio.Redis(), key_prefix="kvq:")  # no connection: key names only
    for secret in ("sk-test-key-one", "sk-test-key-three", "sk-test-other-one"):
        pr = directory.authenticate(secret)
        plan = build_plan(directory.snapshot.keys[pr.api_key_id], "kvq:")
        keys = plan.keys(clock.wall()) + plan.run_keys("run:{with}/odd:chars") + [plan.tool_calls_key("r")]
        glob = [k for k, it in zip(plan.keys(clock.wall()), plan.items, strict=True) if it.level == "global"]
        org = [k for k in keys if k not in glob] + list(store._leases_of(pr.tenant_id.encode()))  # noqa: SLF001
        assert len(glob) == 7 and len(org) > 10
        assert {key_slot(k) for k in org} == {key_slot(pr.tenant_id.encode())}
        assert {key_slot(k) for k in glob} == {key_slot(b"_global")}
    with pytest.raises(ValueError, match="braces"):
        build_plan(directory.snapshot.keys["k1"], "kvq{x}:")


async def test_a_refusal_at_the_org_gives_back_what_the_global_slot_took(redis_cluster, clock):
    prefix = f"c{uuid.uuid4().hex[:10]}:"
    store = RedisQuotaStore.from_url(redis_cluster.url, key_prefix=prefix, timeout_s=2.0)
    try:
        gate = HierarchicalQuota(TenantDirectory(tree(
            global_limits="{requests_per_minute: 600, concurrent_requests: 10, spend_per_day: '10'}",
            org_limits="{concurrent_requests: 1}"), clock=clock), store, price=price, clock=clock)
        pr = gate.directory.authenticate("sk-test-key-one")
        g = [f"{prefix}g:{{_global}}:{c}".encode() for c in ("rpm", "conc", "sd:2024-05-17")]
        assert key_slot(g[0]) != key_slot(f"{prefix}o:{{acme}}:conc".encode())
        first = await gate.reserve(pr, estimate(principal=pr))
        after_one = await store.get_values(g)
        for _ in range(3):
            with pytest.raises(QuotaRejected) as e:
                await gate.reserve(pr, estimate(principal=pr))
            assert (e.value.level, e.value.dimension) == ("org", "concurrent_requests")
        now = await store.get_values(g)                             # the global part was given back
        assert now[1:] == after_one[1:] and now[0] == pytest.approx(after_one[0], abs=1e-6)
        assert after_one[1] == 1 and after_one[0] == pytest.approx(clock.wall() + 0.1, abs=1e-6)
        other = gate.directory.authenticate("sk-test-other-one")
        r = await gate.reserve(other, estimate(principal=other))      # another org, another slot
        assert (await store.get_values(g))[1] == 2
        await gate.reconcile(first, used(input_tokens=100, output_tokens=1))
        await gate.reconcile(r, used())
        assert (await store.get_values(g))[1] is None
        assert gate.reconcile_errors == 0
    finally:
        await store.aclose()


def test_orgs_spread_over_the_cluster_nodes(redis_cluster):
    client = redis.RedisCluster(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    try:
        ports = {client.nodes_manager.get_node_from_slot(key_slot(f"kvq:o:{{org{i}}}:rpm".encode())).port
                 for i in range(30)}
    finally:
        client.close()
    assert ports == {n.port for n in redis_cluster.nodes}


async def test_a_settle_cut_off_between_two_slots_is_replayed_only_where_it_did_not_land(tmp_path, clock):
    """Global and org parts live on two nodes; the org's node goes down between the two settle
    scripts. The failover wrapper must replay only the org's part: the global spend is moved to
    the actual cost once, not twice."""
    from kvmeter.serving.quota import FailoverQuotaStore
    from kvmeter.serving.quota.money import to_units
    from quota_testlib import REDIS_BIN, REDIS_CLI, RedisClusterServers

    if REDIS_BIN is None or REDIS_CLI is None:
        pytest.skip("redis-server not on PATH")
    cluster = RedisClusterServers(tmp_path / "cluster")
    cluster.start()
    try:
        seed = redis.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
        node_of = {k: seed.nodes_manager.get_node_from_slot(key_slot(k)).port for k in (b"_global", b"acme")}
        seed.close()
        assert node_of[b"_global"] != node_of[b"acme"]
        org_node = next(n for n in cluster.nodes if n.port == node_of[b"acme"])
        primary = RedisQuotaStore.from_url(cluster.url, timeout_s=1.0)
        store = FailoverQuotaStore(primary, clock=clock)
        gate = HierarchicalQuota(TenantDirectory(tree(global_limits="{spend_per_day: '10'}",
                                                      org_limits="{spend_per_day: '10', concurrent_requests: 5}"),
                                                 clock=clock), store, price=price, clock=clock)
        pr = gate.directory.authenticate("sk-test-key-one")
        r = await gate.reserve(pr, estimate(principal=pr))               # 100 in + 100 out reserved
        g_sd, o_sd = b"kvq:g:{_global}:sd:2024-05-17", b"kvq:o:{acme}:sd:2024-05-17"

        real = primary._settle_one                                        # noqa: SLF001
        calls = 0

        async def settle_then_cut(*args, **kw):                            # the node dies after the global script
            nonlocal calls
            calls += 1
            if calls == 2:
                with redis.Redis(port=org_node.port) as r:
                    r.save()                                                # its data survives the restart
                org_node.stop()
            return await real(*args, **kw)

        primary._settle_one = settle_then_cut                             # noqa: SLF001
        await gate.reconcile(r, used(input_tokens=100, output_tokens=10))  # actual: 100 in, 10 out
        primary._settle_one = real                                        # noqa: SLF001
        assert store.degraded and store.pending_settles == 1
        queued_keys = store._pending[0][1]                                # noqa: SLF001 — the org's part only
        assert queued_keys and {key_slot(k) for k in queued_keys} == {key_slot(b"acme")}

        org_node.start()
        probe = redis.Redis(port=org_node.port)
        while probe.cluster("info").get("cluster_state") != "ok":        # the node rejoins (process start)
            await asyncio.sleep(0.05)
        probe.close()
        clock.advance(store.probe_interval_s)
        for _ in range(100):                                              # the client may need a moment
            try:
                await store.reserve([], [], (0,) * 7, clock.wall())
                if not store.pending_settles:
                    break
            except Exception:  # noqa: BLE001
                pass
            clock.advance(store.probe_interval_s)
            await asyncio.sleep(0.05)
        assert store.pending_settles == 0
        actual = to_units(P_IN * 100 + P_OUT * 10)
        assert await primary.get_values([g_sd, o_sd]) == [actual, actual]
        assert await primary.get_values([b"kvq:o:{acme}:conc"]) == [None]
        await store.aclose()
    finally:
        cluster.stop()
