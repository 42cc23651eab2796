"""Moving quota keys of the old layout (no hash tag) to the tagged names, on a real Redis."""

from __future__ import annotations

import uuid

from kvmeter.serving.quota.key_migration import main, migrate_keys, tagged_key
from kvmeter.serving.quota.plan import build_plan
from kvmeter.serving.tenancy import TenantDirectory
from quota_testlib import tree


def test_old_names_map_to_the_names_plans_build_now(clock):
    assert tagged_key("kvq:o:acme:rpm") == "kvq:o:{acme}:rpm"
    assert tagged_key("kvq:k:acme/ws/proj/k1:sd:2024-05-17") == "kvq:k:{acme}/ws/proj/k1:sd:2024-05-17"
    assert tagged_key("kvq:g::sm:2024-05") == "kvq:g:{_global}:sm:2024-05"
    assert tagged_key("kvq:r:acme/run:1/{x}:mc") == "kvq:r:{acme}/run:1/{x}:mc"
    for not_ours in ("kvq:o:{acme}:rpm", "kvq:idem:acme:abc", "kvq:lease:{acme}", "other:o:acme:rpm", "kvq:o:acme"):
        assert tagged_key(not_ours) is None, not_ours
    directory = TenantDirectory(tree(org_limits="{requests_per_minute: 5, spend_per_day: '1'}",
                                     global_limits="{requests_per_minute: 5}",
                                     key_limits="{concurrent_requests: 1}", run_budget="{max_model_calls: 3}"),
                                clock=clock)
    plan = build_plan(directory.snapshot.keys["k1"], "kvq:")
    new = [k.decode() for k in plan.keys(clock.wall()) + plan.run_keys("r-1")]
    old = [k.replace("{_global}", "").replace("{", "").replace("}", "") for k in new]
    assert [tagged_key(k) for k in old] == new


async def test_migration_renames_keeps_ttls_drops_old_holds_and_reports_conflicts(redis_client):
    p = f"m{uuid.uuid4().hex[:8]}:"
    await redis_client.set(f"{p}o:acme:rpm", "1715947200.5")
    await redis_client.set(f"{p}o:acme:sd:2024-05-17", "450000", ex=172_800)
    await redis_client.set(f"{p}k:acme/ws/proj/k1:conc", "3")            # leaked by a killed gateway
    await redis_client.set(f"{p}r:acme/run-1:mc", "2", ex=604_800)
    await redis_client.set(f"{p}o:other:itpm", "1")
    await redis_client.set(f"{p}o:{{other}}:itpm", "7")                  # a new gateway wrote it already
    await redis_client.set(f"{p}idem:acme:abc", "x")                     # the idempotency manager's

    dry = await migrate_keys(redis_client, p, dry_run=True)
    assert len(dry.renamed) == 4 and len(dry.dropped) == 1
    assert await redis_client.exists(f"{p}o:acme:rpm") == 1              # a dry run changes nothing

    report = await migrate_keys(redis_client, p)
    assert sorted(report.renamed) == sorted([
        (f"{p}o:acme:rpm", f"{p}o:{{acme}}:rpm"), (f"{p}o:acme:sd:2024-05-17", f"{p}o:{{acme}}:sd:2024-05-17"),
        (f"{p}r:acme/run-1:mc", f"{p}r:{{acme}}/run-1:mc")])
    assert report.dropped == [f"{p}k:acme/ws/proj/k1:conc"] and report.conflicts == [f"{p}o:other:itpm"]
    assert await redis_client.get(f"{p}o:{{acme}}:rpm") == b"1715947200.5"
    assert 172_000 < await redis_client.ttl(f"{p}o:{{acme}}:sd:2024-05-17") <= 172_800
    assert await redis_client.ttl(f"{p}r:{{acme}}/run-1:mc") > 604_000
    assert await redis_client.exists(f"{p}k:acme/ws/proj/k1:conc", f"{p}k:{{acme}}/ws/proj/k1:conc") == 0
    assert await redis_client.get(f"{p}o:{{other}}:itpm") == b"7" and await redis_client.get(f"{p}o:other:itpm") == b"1"
    assert await redis_client.get(f"{p}idem:acme:abc") == b"x"
    assert (await migrate_keys(redis_client, p)).renamed == []           # a second run has nothing to do


def test_the_command_line_reports_and_fails_on_conflicts(redis_server, capsys):
    import redis

    p = f"m{uuid.uuid4().hex[:8]}:"
    with redis.Redis.from_url(redis_server.url) as r:
        r.set(f"{p}o:acme:rpm", "1")
    assert main([redis_server.url, "--prefix", p]) == 0
    assert "renamed 1 keys, dropped 0 old holds, 0 conflicts" in capsys.readouterr().out
