"""Races: concurrent first requests never overshoot a budget; four processes share one Redis limit."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import redis

from kvmeter.serving.quota import MemoryQuotaStore, QuotaRejected, Reservation
from kvmeter.serving.quota.money import to_units
from quota_testlib import estimate, price, tree, used

K1 = "sk-test-key-one"
ONE_COST = price("m", "", used(100, 0, 100))  # 0.0002: what one request reserves

BUDGETS = {
    "spend_per_day": (f"{{spend_per_day: '{ONE_COST}'}}", "sd:2024-05-17", to_units(ONE_COST)),
    "concurrent_requests": ("{concurrent_requests: 1}", "conc", 1),
    "output_tokens_per_minute": ("{output_tokens_per_minute: 100}", None, None),
}


@pytest.mark.parametrize("dimension", list(BUDGETS))
async def test_1000_concurrent_first_requests_admit_exactly_one(make_gate, dimension):
    limits, code, one = BUDGETS[dimension]
    gate = make_gate(tree(org_limits=limits))
    pr = gate.directory.authenticate(K1)

    async def attempt(i: int) -> Reservation:
        return await gate.reserve(pr, estimate("m", 100, 100, request_id=f"r{i}", principal=pr))

    results = await asyncio.gather(*(attempt(i) for i in range(1000)), return_exceptions=True)
    admitted = [r for r in results if isinstance(r, Reservation)]
    rejected = [r for r in results if isinstance(r, QuotaRejected)]
    assert len(admitted) == 1 and len(rejected) == 999
    assert {(e.level, e.dimension) for e in rejected} == {("org", dimension)}
    if code is not None:  # the counter holds exactly one request's reservation: no overshoot at all
        (held,) = await gate.store.get_values([f"{gate.store.key_prefix}o:{{acme}}:{code}"])
        assert held == one


def test_1000_requests_from_8_os_threads_on_the_memory_store(clock):
    """The in-memory store's lock makes check-and-apply atomic across threads too."""
    from kvmeter.serving.quota import HierarchicalQuota
    from kvmeter.serving.tenancy import TenantDirectory

    store = MemoryQuotaStore()
    gate = HierarchicalQuota(TenantDirectory(tree(org_limits=BUDGETS["spend_per_day"][0])), store,
                             price=price, clock=clock)
    pr = gate.directory.authenticate(K1)
    admitted: list[Reservation] = []
    start = threading.Barrier(8)

    def worker() -> None:
        async def run() -> None:
            for _ in range(125):
                try:
                    admitted.append(await gate.reserve(pr, estimate("m", 100, 100, principal=pr)))
                except QuotaRejected as e:
                    assert e.reason == "spend_exhausted"
        start.wait()
        asyncio.run(run())

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(admitted) == 1
    assert asyncio.run(store.get_values(["kvq:o:{acme}:sd:2024-05-17"])) == [to_units(ONE_COST)]


def test_four_processes_sharing_redis_enforce_one_global_tokens_per_minute_limit(redis_server, tmp_path, clock):
    """4 replicas × 100 attempts × 100 prompt tokens against a global 10,000 tokens/min limit:
    exactly 100 are admitted fleet-wide (per-process limits would admit 400)."""
    cfg = tmp_path / "principals.yaml"
    cfg.write_text(tree(global_limits="{input_tokens_per_minute: 10000}"))
    prefix = f"mp{uuid.uuid4().hex[:8]}:"
    worker = Path(__file__).with_name("quota_mp_worker.py")
    keys = ["sk-test-key-one", "sk-test-key-two", "sk-test-key-three", "sk-test-other-one"]
    procs = [subprocess.Popen([sys.executable, str(worker), "--config", str(cfg), "--url", redis_server.url,
                               "--prefix", prefix, "--key", k, "--wall", str(clock.wall())],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in keys]
    try:
        for p in procs:
            line = p.stdout.readline().strip()
            assert line == "ready", (line, p.stderr.read() if p.poll() is not None else "")
        with redis.Redis.from_url(redis_server.url) as r:
            r.rpush(prefix + "go", *["go"] * len(procs))  # release all four at once
        outputs = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    total = sum(o["admitted"] for o in outputs)
    assert total == 100, outputs
    assert all(o["rejections"] in ([], ["429:rate_limited:global/input_tokens_per_minute"]) for o in outputs), outputs
