"""Quota admission benchmark: reservations per second and added latency, memory vs Redis.

The workload is the issue's: a 5-level hierarchy (global → org → workspace → project → API key)
with all 7 counted dimensions limited on every level (requests/min, input tokens/min, output
tokens/min, concurrent requests, active KV tokens, spend per day, spend per month — 35 counters
per reservation, plus the max-context check). Limits are set high enough that nothing is refused,
so every request does the full reserve (check 35, apply 35) and reconcile (settle 25) work.
Keys are spread over 4 orgs × 2 workspaces × 2 projects × 4 keys = 64 API keys.

Measured, side by side in one run:

* memory: ``HierarchicalQuota`` on ``MemoryQuotaStore`` vs the no-op ``UnlimitedQuota`` baseline
  (same loop, same calls) — reserve-only rate, reserve+reconcile rate, and per-request latency
  (reserve + reconcile) p50/p99.
* redis: ``HierarchicalQuota`` on ``RedisQuotaStore`` over loopback (and wrapped in the
  ``FailoverQuotaStore`` used in deployments) vs a baseline of one Redis round trip per request
  (an ``EVALSHA`` of a one-key ``INCR`` script, i.e. the cheapest possible shared-state admission)
  — throughput swept over ``--concurrency`` requests in flight (best reported, sweep listed),
  sequential latency p50/p99, and CPU per request on both sides (gateway process CPU time;
  redis-server microseconds from ``INFO commandstats``), which stay meaningful on a busy machine.

Usage::

    .venv/bin/python bench/quota/bench_quota.py [--n 20000] [--concurrency 1,4,8,16,32] [--redis-url URL]

Without ``--redis-url`` it starts ``redis-server`` (Debian package) on a free loopback port.
Prints a Markdown report (paste it into bench/quota/RESULTS.md) and, with ``--json``, raw figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis
import redis.asyncio as aioredis

from kvmeter.attribution import Attribution
from kvmeter.ledger.prices import parse_price_list
from kvmeter.serving.quota import (
    FailoverQuotaStore,
    HierarchicalQuota,
    MemoryQuotaStore,
    RedisQuotaStore,
    UnlimitedQuota,
    UsageEstimate,
    redis_client,
)
from kvmeter.serving.tenancy import TenantDirectory
from kvmeter.tokens import TokenCounts

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: make `bench.redis_servers` importable
    sys.path.insert(0, str(ROOT))

from bench.redis_servers import REDIS_BIN, RedisServer, free_port  # noqa: E402,F401 (free_port: bench_gateway's)

BIG = "{requests_per_minute: 1000000000, input_tokens_per_minute: 1000000000000, " \
      "output_tokens_per_minute: 1000000000000, concurrent_requests: 1000000000, " \
      "active_kv_tokens: 1000000000000, max_context_tokens: 1000000, " \
      "spend_per_day: '1000000000', spend_per_month: '1000000000'}"


def config_yaml() -> str:
    lines = ["version: 1", f"global: {{limits: {BIG}}}", "orgs:"]
    n = 0
    for o in range(4):
        lines += [f"  org{o}:", "    tier: enterprise", f"    limits: {BIG}", "    workspaces:"]
        for w in range(2):
            lines += [f"      ws{w}:", f"        limits: {BIG}", "        projects:"]
            for p in range(2):
                lines += [f"          proj{p}:", f"            limits: {BIG}", "            api_keys:"]
                for _k in range(4):
                    lines.append(f"              key{n}: {{key: sk-bench-key-{n:04d}, limits: {BIG}}}")
                    n += 1
    return "\n".join(lines) + "\n"


#: The ledger's price function (PriceList.cost), as kvmeter serve hands it to the quota: per 1M
#: tokens input 0.50, cached input 0.25, output 1.50.
price = parse_price_list({"version": "bench", "currency": "USD", "models": {
    "m": {"input": "0.50", "cached_input": "0.25", "output": "1.50"}}}, "bench_quota").cost

ESTIMATE = UsageEstimate(Attribution("org0", tier="enterprise", model="m", endpoint="chat.completions"),
                         TokenCounts(input_tokens=512, output_tokens=256))
ACTUAL = TokenCounts(input_tokens=512, cached_input_tokens=128, output_tokens=100)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def run_sequential(gate, principals, n: int, reconcile: bool = True) -> dict:
    """``n`` requests one after the other; latency of each reserve (+ reconcile)."""
    lat: list[float] = []
    held = []
    perf = time.perf_counter
    t0 = perf()
    for i in range(n):
        pr = principals[i % len(principals)]
        s = perf()
        r = await gate.reserve(pr, ESTIMATE)
        if reconcile:
            await gate.reconcile(r, ACTUAL)
        else:
            held.append(r)
        lat.append(perf() - s)
    wall = perf() - t0
    for r in held:  # release what a reserve-only run held (outside the timing)
        await gate.reconcile(r, ACTUAL)
    return {"n": n, "rate_per_s": n / wall, "p50_ms": pct(lat, 0.50) * 1e3, "p99_ms": pct(lat, 0.99) * 1e3,
            "mean_ms": statistics.fmean(lat) * 1e3}


async def run_concurrent(gate, principals, n: int, concurrency: int, reconcile: bool = True,
                         redis: aioredis.Redis | None = None) -> dict:
    """``n`` requests with ``concurrency`` in flight (reserve + reconcile, or reserve only).

    Also measures this process's CPU seconds per request and, given ``redis``, the server's
    microseconds per script call (``INFO commandstats``): both hold under a busy machine, where
    the wall-clock rates do not.
    """
    per = n // concurrency
    held: list = []

    async def worker(w: int) -> None:
        for i in range(per):
            r = await gate.reserve(principals[(w * per + i) % len(principals)], ESTIMATE)
            if reconcile:
                await gate.reconcile(r, ACTUAL)
            else:
                held.append(r)

    if redis is not None:
        await redis.config_resetstat()
    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    out = {"n": per * concurrency, "concurrency": concurrency, "rate_per_s": per * concurrency / wall,
           "client_cpu_us_per_request": cpu / (per * concurrency) * 1e6}
    if redis is not None:
        stats = await redis.info("commandstats")
        ev = stats.get("cmdstat_evalsha", {})
        out["redis_us_per_request"] = ev.get("usec", 0) / (per * concurrency)
    for r in held:
        await gate.reconcile(r, ACTUAL)
    return out


async def sweep(gate, principals, n: int, levels: list[int], redis: aioredis.Redis, reconcile: bool = True) -> dict:
    runs = [await run_concurrent(gate, principals, n, c, reconcile, redis) for c in levels]
    best = max(runs, key=lambda r: r["rate_per_s"])
    return {**best, "sweep": {r["concurrency"]: round(r["rate_per_s"]) for r in runs}}


class RoundTripBaseline:
    """Baseline 'gate' for Redis: one EVALSHA of a one-key INCR per reserve, nothing at reconcile."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._script = client.register_script("return redis.call('INCR', KEYS[1])")

    async def reserve(self, principal, estimate):
        await self._script(keys=["bench:baseline"], args=[])
        return None

    async def reconcile(self, reservation, actual) -> None:
        return None


def start_redis() -> RedisServer:
    """A redis-server on a free loopback port in a fresh temporary folder (exits without the binary)."""
    if REDIS_BIN is None:
        sys.exit("redis-server not found (Debian: apt-get install -y redis-server) — or pass --redis-url")
    server = RedisServer(Path(tempfile.mkdtemp(prefix="kvq-bench-")))
    server.start()
    return server


async def main(args: argparse.Namespace) -> dict:
    directory = TenantDirectory(config_yaml())
    principals = [directory.authenticate(f"sk-bench-key-{i:04d}") for i in range(64)]
    out: dict = {"n": args.n, "levels": 5, "dimensions": 7, "load_start": _load()}
    plan_items = len(HierarchicalQuota(directory, MemoryQuotaStore(), price=price)._plan(principals[0]).items)
    out["counters_per_reservation"] = plan_items

    # --- memory ----------------------------------------------------------------------------
    baseline = UnlimitedQuota()
    mem_gate = HierarchicalQuota(directory, MemoryQuotaStore(), price=price)
    await run_sequential(mem_gate, principals, 2000)  # warm-up (plans, period keys)
    out["memory_baseline_pair"] = await run_sequential(baseline, principals, args.n)
    out["memory_reserve_only"] = await run_sequential(mem_gate, principals, args.n, reconcile=False)
    out["memory_pair"] = await run_sequential(mem_gate, principals, args.n)

    # --- redis -----------------------------------------------------------------------------
    server = start_redis() if args.redis_url is None else None
    url = server.url if server is not None else args.redis_url
    out["redis_version"] = redis.Redis.from_url(url).info()["redis_version"]
    try:
        client = redis_client(url, timeout_s=2.0, max_connections=64)
        rt = RoundTripBaseline(client)
        store = RedisQuotaStore(client, key_prefix="bench:")
        red_gate = HierarchicalQuota(directory, store, price=price)
        fo_gate = HierarchicalQuota(directory, FailoverQuotaStore(store, replicas=1), price=price)
        await run_sequential(red_gate, principals, 1000)  # warm-up: scripts loaded, pool filled
        await run_concurrent(red_gate, principals, 2000, 8)
        levels = [int(c) for c in args.concurrency.split(",")]
        rn = max(args.n // 5, 2000)
        out["redis_baseline_concurrent"] = await sweep(rt, principals, rn, levels, client)
        out["redis_concurrent"] = await sweep(red_gate, principals, rn, levels, client)
        out["redis_reserve_only_concurrent"] = await sweep(red_gate, principals, rn, levels, client, reconcile=False)
        out["redis_failover_concurrent"] = await sweep(fo_gate, principals, rn, levels, client)
        sn = max(args.n // 10, 1000)
        out["redis_baseline_sequential"] = await run_sequential(rt, principals, sn)
        out["redis_sequential"] = await run_sequential(red_gate, principals, sn)
        await client.aclose()
    finally:
        if server is not None:
            server.stop()
    out["load_end"] = _load()
    return out


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def report(r: dict, args: argparse.Namespace) -> str:
    m0, mr, mp = r["memory_baseline_pair"], r["memory_reserve_only"], r["memory_pair"]
    rb, rc, ro, rf = (r["redis_baseline_concurrent"], r["redis_concurrent"], r["redis_reserve_only_concurrent"],
                      r["redis_failover_concurrent"])
    sb, sq = r["redis_baseline_sequential"], r["redis_sequential"]
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass

    def sw(x: dict) -> str:
        return ", ".join(f"{c}: {v:,}" for c, v in x["sweep"].items())

    lines = [
        f"- command: `{' '.join([os.path.relpath(sys.executable), *sys.argv])}`",
        f"- date (UTC): {time.strftime('%Y-%m-%d %H:%M', time.gmtime())}",
        f"- machine: {os.cpu_count()} cores, {cpu}; Python {platform.python_version()}; "
        f"redis-server {r['redis_version']} on loopback; redis-py {redis.__version__} with hiredis; "
        f"load average at start / end: {r['load_start']} / {r['load_end']} (a shared machine: other "
        "engineers' processes ran at the same time)",
        f"- workload: 5 levels × 7 dimensions = {r['counters_per_reservation']} counters per reservation, "
        f"64 API keys, prompt 512 / max_tokens 256, reconciled to 512 (128 cached) / 100",
        "",
        "| store | measure | kvmeter | baseline (same run) | ratio |",
        "|---|---|---|---|---|",
        f"| memory | reservations/s (reserve only, one task) | {mr['rate_per_s']:,.0f} | — | — |",
        f"| memory | requests/s (reserve + reconcile, one task) | {mp['rate_per_s']:,.0f} | {m0['rate_per_s']:,.0f} "
        f"(UnlimitedQuota) | {mp['rate_per_s'] / m0['rate_per_s']:.3f} |",
        f"| memory | added latency per request (reserve + reconcile) p50 / p99 | {mp['p50_ms'] * 1e3:.1f} µs / "
        f"{mp['p99_ms'] * 1e3:.1f} µs | {m0['p50_ms'] * 1e3:.2f} µs / {m0['p99_ms'] * 1e3:.2f} µs | — |",
        f"| redis | reservations/s (reserve only), best of in-flight sweep ({ro['concurrency']} in flight) | "
        f"{ro['rate_per_s']:,.0f} | {rb['rate_per_s']:,.0f} (1 EVALSHA INCR, {rb['concurrency']} in flight) | "
        f"{ro['rate_per_s'] / rb['rate_per_s']:.3f} |",
        f"| redis | requests/s (reserve + reconcile), best ({rc['concurrency']} in flight) | {rc['rate_per_s']:,.0f} "
        f"| {rb['rate_per_s']:,.0f} | {rc['rate_per_s'] / rb['rate_per_s']:.3f} |",
        f"| redis + failover wrapper | requests/s, best ({rf['concurrency']} in flight) | {rf['rate_per_s']:,.0f} "
        f"| {rb['rate_per_s']:,.0f} | {rf['rate_per_s'] / rb['rate_per_s']:.3f} |",
        f"| redis | added latency per request (reserve + reconcile, sequential) p50 / p99 | {sq['p50_ms']:.3f} ms / "
        f"{sq['p99_ms']:.3f} ms | {sb['p50_ms']:.3f} ms / {sb['p99_ms']:.3f} ms | — |",
        f"| redis | CPU per request (reserve + reconcile): gateway process / redis-server | "
        f"{rc['client_cpu_us_per_request']:.0f} µs / {rc['redis_us_per_request']:.0f} µs | "
        f"{rb['client_cpu_us_per_request']:.0f} µs / {rb['redis_us_per_request']:.0f} µs | — |",
        "",
        f"In-flight sweeps (requests/s by requests in flight) — reserve + reconcile: {sw(rc)}; "
        f"reserve only: {sw(ro)}; baseline: {sw(rb)}.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20_000, help="requests per memory measurement (default 20000)")
    ap.add_argument("--concurrency", default="1,4,8,16,32",
                    help="requests in flight for the Redis throughput sweep (comma-separated)")
    ap.add_argument("--redis-url", default=None, help="use this Redis instead of starting redis-server")
    ap.add_argument("--json", action="store_true", help="also print the raw figures as JSON")
    a = ap.parse_args()
    result = asyncio.run(main(a))
    print(report(result, a))
    if a.json:
        print(json.dumps(result, indent=2))
