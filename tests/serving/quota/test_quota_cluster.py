"""The quota store on a real 3-master Redis Cluster: one org's keys share a hash slot, a reservation
with global limits stays all or nothing over two slots, and orgs spread over the nodes.

(The whole gate suite, ``test_quota_gate.py`` and the others on the ``store`` fixture, also runs on
the cluster: ``store_kind`` = ``cluster``.)
"""

from __future__ import annotations

import uuid

import pytest
import redis
import redis.asyncio
from redis.crc import key_slot

from kvmeter.serving.quota import HierarchicalQuota, QuotaRejected, RedisQuotaStore
from kvmeter.serving.quota.plan import build_plan
from kvmeter.serving.tenancy import TenantDirectory
from quota_testlib import estimate, price, tree, used

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
