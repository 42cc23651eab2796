"""``kvmeter serve --workers 2``: two gateway processes on one port share the quota, the metrics and
the ledger's spools, and a worker killed with SIGKILL leaves nothing stuck.

A real ``kvmeter serve --workers 2 --engine remote`` (uvicorn's supervisor, two spawned workers)
proxies to a scripted OpenAI-compatible upstream on loopback (it stands for the one vLLM server the
workers share), with a real redis-server as the quota store and a ClickHouse DSN that nothing
answers: the ledger's records stay durable in each worker's spool slot, and are drained into one
chDB ledger after the server stops. Requests come from the official ``openai`` SDK, one connection
each, so the kernel spreads them over both workers; every answer names its worker
(``x-kvmeter-worker``, ``x-kvmeter-worker-pid``). Time that matters is the quota lease
(``KVMETER_QUOTA_LEASE_S``), not sleeps: the test waits for the server's own state.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmeter.ledger import Ledger, LedgerConfig
from kvmeter.serving.workers import worker_spool_dir
from tests.conftest import free_port
from tests.serving.quota_http.conftest import MODEL, PRICES_YAML, one_project_tenants
from tests.serving.quota_http.gateway_procs import KVMETER
from tests.serving.quota_http.scripted_upstream import ScriptedUpstream, Stream, Whole, sse

pytestmark = [pytest.mark.slow, pytest.mark.redis]

K = 8            # requests per minute for the capped key, across the whole fleet
LEASE_S = 3.0    # the quota's hold lease: a killed worker's holds are free within it
CAPPED, HOLDER = "sk-test-workers-0001", "sk-test-workers-0002"
CFG = one_project_tenants(
    f"capped: {{key: {CAPPED}, limits: {{requests_per_minute: {K}}}}}",
    f"holder: {{key: {HOLDER}, limits: {{concurrent_requests: 1}}}}",
)
PROMPT = [100 + i for i in range(12)]
ANSWER = Whole({"id": "cmpl-up-1", "object": "text_completion", "created": 1796147740, "model": MODEL,
                "choices": [{"index": 0, "text": " Paris", "logprobs": None, "finish_reason": "length"}],
                "usage": {"prompt_tokens": len(PROMPT), "completion_tokens": 1, "total_tokens": len(PROMPT) + 1}})
#: one chunk, then the upstream waits until its client goes away: a request held open in a worker
HANG = Stream(sse({"id": "cmpl-up-2", "object": "text_completion", "created": 1796147740, "model": MODEL,
                   "choices": [{"index": 0, "text": " Par", "logprobs": None, "finish_reason": None}]}), hang=True)


def sdk(base: str, key: str) -> openai.AsyncOpenAI:
    """The official SDK, no retries, a new connection per request (no keep-alive): consecutive
    requests are accepted by whichever worker the kernel hands the connection to."""
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0,
                              http_client=httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0),
                                                            timeout=30))


def worker_of(headers: httpx.Headers) -> tuple[int, int]:
    return int(headers["x-kvmeter-worker"]), int(headers["x-kvmeter-worker-pid"])


async def complete(client: openai.AsyncOpenAI) -> tuple[int, tuple[int, int]]:
    """(status, (slot, pid)) of one completion; a refusal's status and worker too."""
    try:
        raw = await client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=1)
        return raw.status_code, worker_of(raw.headers)
    except openai.APIStatusError as exc:
        return exc.status_code, worker_of(exc.response.headers)


async def scrape(base: str) -> tuple[dict[tuple[str, tuple], float], tuple[int, int]]:
    async with httpx.AsyncClient(timeout=10) as client:
        resp = await client.get(f"{base}/metrics")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(resp.text) for s in fam.samples}
    return samples, worker_of(resp.headers)


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, lbl), v in samples.items()
               if n == name and all(dict(lbl).get(k) == want for k, want in labels.items()))


async def until(predicate, what: str, timeout_s: float = 60.0):  # noqa: ANN001
    """Poll an async ``predicate`` (the server's state, seen from outside) until it returns a
    truthy value; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = await predicate()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def start_server(tmp_path: Path, upstream: ScriptedUpstream, redis_url: str, port: int) -> subprocess.Popen:
    (tmp_path / "tenants.yaml").write_text(CFG)
    (tmp_path / "prices.yaml").write_text(PRICES_YAML)
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(KVMETER_QUOTA_LEASE_S=str(LEASE_S), TOKENIZERS_PARALLELISM="false")
    cmd = [str(KVMETER), "--log-level", "WARNING", "serve", "--workers", "2", "--engine", "remote",
           "--remote-url", upstream.url, "--remote-metrics-url", "off", "--port", str(port),
           "--tenants", str(tmp_path / "tenants.yaml"), "--prices", str(tmp_path / "prices.yaml"),
           "--quota-store", redis_url, "--spool-dir", str(tmp_path / "spool"),
           # ClickHouse over HTTP that nothing answers: every record stays durable in its spool
           "--ledger-dsn", f"http://default:@127.0.0.1:{free_port()}/kvmeter"]
    log = open(tmp_path / "serve.log", "wb")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                            start_new_session=True)


async def test_two_workers_share_quota_metrics_and_spools_and_survive_a_sigkill(tmp_path, redis_url):
    import redis

    redis.Redis.from_url(redis_url).flushall()
    upstream = await ScriptedUpstream(MODEL, answer=ANSWER).start()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(tmp_path, upstream, redis_url, port)
    ok = 0
    try:
        async def healthy():
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                async with httpx.AsyncClient(timeout=2) as client:
                    return (await client.get(f"{base}/healthz")).status_code == 200
            except httpx.HTTPError:
                return False

        await until(healthy, "the workers to start", 180)

        # -- one global cap: K requests a minute for the key, whichever worker takes each
        capped = sdk(base, CAPPED)
        started = time.monotonic()
        results = [await complete(capped) for _ in range(3 * K)]
        elapsed = time.monotonic() - started
        while len({slot for _, (slot, _) in results}) < 2 and len(results) < 200:
            results.append(await complete(capped))  # refused ones name their worker too
        statuses = [status for status, _ in results]
        ok = statuses.count(200)
        assert set(statuses) <= {200, 429}, statuses
        # GCRA with a burst of the whole limit refills K / 60 per second: two per-process limits
        # would admit 2K
        assert K <= ok <= K + 1 + int(K * elapsed / 60), (ok, elapsed)
        assert {slot for _, (slot, _) in results} == {0, 1}, results
        assert len({pid for _, (_, pid) in results}) == 2

        # -- metrics merged: every worker's /metrics counts both workers' requests
        async def both_scraped():
            seen = {}
            for _ in range(50):
                samples, (slot, _) = await scrape(base)
                seen[slot] = total(samples, "kvmeter_requests_total", tenant="acme", outcome="ok")
                if len(seen) == 2:
                    return seen
            return None

        assert await until(both_scraped, "a scrape from each worker") == {0: ok, 1: ok}

        # -- a request held open in one worker, which is then killed with SIGKILL
        upstream.answer = HANG
        holder = sdk(base, HOLDER)
        async with holder.completions.with_streaming_response.create(
                model=MODEL, prompt=PROMPT, max_tokens=50, stream=True) as held:
            victim_slot, victim = worker_of(held.headers)

            async def held_gauge():
                samples, _ = await scrape(base)
                value = total(samples, "kvmeter_tenant_active_kv_tokens", tenant="acme")
                return value if value > 0 else None

            in_flight = await until(held_gauge, "the held request's KV in the merged gauge")
            assert in_flight >= len(PROMPT)
            os.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()
            upstream.answer = ANSWER
            # the dead worker's concurrency hold outlives it until its lease passes
            status, _ = await complete(holder)
            assert status == 429
            assert time.monotonic() - killed_at < LEASE_S - 1.0, "the first retry came too late to see the hold"

            async def admitted():
                status, _ = await complete(holder)
                return status == 200

            await until(admitted, "the killed worker's hold to expire", LEASE_S + 5)
            freed_after = time.monotonic() - killed_at
            ok += 1
            # at most one lease after the dead worker's last renewal, which was before the kill
            assert freed_after <= LEASE_S + 1.0, freed_after

            # the in-flight gauge is back where the live worker puts it (it holds nothing now)
            async def dropped():
                samples, _ = await scrape(base)
                return total(samples, "kvmeter_tenant_active_kv_tokens", tenant="acme") == 0

            await until(dropped, "the killed worker's gauge to drop out", 30)

            # uvicorn replaces the dead worker; the replacement claims its slot (and its spool)
            async def replaced():
                async with httpx.AsyncClient(timeout=2) as client:
                    slot, pid = worker_of((await client.get(f"{base}/healthz")).headers)
                return slot == victim_slot and pid != victim

            await until(replaced, "the replacement worker in the dead worker's slot", 120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
        await upstream.stop()
    assert proc.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]

    # -- nothing lost: every admitted request is a usage row in one of the two slots' spools
    chdb = f"chdb://{tmp_path}/chdb"
    slots = sorted(p for p in (tmp_path / "spool").glob("worker-*") if p.is_dir())
    assert slots == [worker_spool_dir(tmp_path / "spool", 0), worker_spool_dir(tmp_path / "spool", 1)]
    rows = 0
    for spool in slots:
        ledger = Ledger.open(LedgerConfig(dsn=chdb, spool_dir=spool, prices_path=tmp_path / "prices.yaml"))
        try:
            assert ledger.flush(30.0)
        finally:
            ledger.close()
    ledger = Ledger.open(LedgerConfig(dsn=chdb, spool_dir=tmp_path / "reader-spool",
                                      prices_path=tmp_path / "prices.yaml"))
    try:
        result = ledger.query_client().query(
            "SELECT count() FROM usage_events FINAL WHERE outcome = 'ok' AND tenant_id = 'acme'")
        rows = int(result.result_rows[0][0])
    finally:
        ledger.close()
    assert rows == ok
