"""Reservations per second on one Redis and on a 3-master Redis Cluster, side by side in one run.

Workload: ``--orgs`` orgs (default 48), each with one workspace, one project and two API keys; all
7 counted dimensions limited (high) on every level, so each request does the full reserve and
reconcile: 4 levels × 7 = 28 counters in the org's hash slot, with leases on (the default) — the
concurrency / KV holds also counted under the holder, its lease set. Variants:

* ``single``          one redis-server, leases on (what ``redis://`` serves).
* ``single-nolease``  the same without leases (``lease_s=None``): the cost of the leases.
* ``cluster``         3 masters on loopback (``redis-cli --cluster create``), leases on.
* ``*+global``        the same plus 7 global limits: on one Redis still one script (35 counters);
                      on the cluster two (the ``{_global}`` slot, then the org's), and every
                      reservation passes through the one node that owns the global slot.

Each variant is driven by ``--procs`` client processes (default 2), each with ``--concurrency``
requests in flight (default 32), ``--n`` reserve + reconcile pairs in all. Reported per variant:
pairs/s over the whole run (wall clock), and redis-server CPU per pair (µs of user + system time,
``INFO cpu``, summed over the nodes, the busiest node separately; in brackets the part spent
running the scripts, ``INFO commandstats``) — the number that says how far one Redis
goes whatever the client: one redis-server runs scripts on one core, so it saturates near
``1e6 / µs-per-pair`` pairs/s. On a 2-core machine the Python clients, not Redis, set the
wall-clock rate; read the µs.

Usage::

    .venv/bin/python bench/quota/bench_cluster.py [--n 20000] [--procs 2] [--concurrency 32] [--orgs 48]

Starts redis-server processes itself (Debian package), prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import platform
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import redis

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))  # bench.redis_servers
sys.path.insert(0, str(HERE.parent))

from bench_quota import ACTUAL, BIG, ESTIMATE, price  # noqa: E402
from bench.redis_servers import RedisClusterServers, RedisServer  # noqa: E402

from kvmeter.serving.quota import HierarchicalQuota, RedisQuotaStore  # noqa: E402
from kvmeter.serving.tenancy import TenantDirectory  # noqa: E402


def config_yaml(orgs: int, with_global: bool) -> str:
    lines = ["version: 1", f"global: {{limits: {BIG if with_global else '{}'}}}", "orgs:"]
    for o in range(orgs):
        lines += [f"  org{o}:", "    tier: enterprise", f"    limits: {BIG}", "    workspaces:",
                  "      ws:", f"        limits: {BIG}", "        projects:",
                  "          proj:", f"            limits: {BIG}", "            api_keys:"]
        for k in range(2):
            lines.append(f"              key{o}-{k}: {{key: sk-bench-{o:03d}-{k}, limits: {BIG}}}")
    return "\n".join(lines) + "\n"


async def _drive(url: str, orgs: int, with_global: bool, lease: bool, n: int, concurrency: int,
                 prefix: str, seed: int) -> tuple[int, float]:
    directory = TenantDirectory(config_yaml(orgs, with_global))
    principals = [directory.authenticate(f"sk-bench-{o:03d}-{k}") for o in range(orgs) for k in range(2)]
    store = RedisQuotaStore.from_url(url, key_prefix=prefix, timeout_s=5.0, max_connections=concurrency,
                                     lease_s=30.0 if lease else None)
    gate = HierarchicalQuota(directory, store, price=price)
    per = n // concurrency

    async def worker(w: int) -> None:
        for i in range(per):
            pr = principals[(seed * 7919 + w * per + i) % len(principals)]
            await gate.reconcile(await gate.reserve(pr, ESTIMATE), ACTUAL)

    try:
        for pr in principals:  # warm-up: scripts loaded, plans built, slot map read
            await gate.reconcile(await gate.reserve(pr, ESTIMATE), ACTUAL)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        wall = time.perf_counter() - t0
        assert gate.reconcile_errors == 0
        return per * concurrency, wall
    finally:
        await store.aclose()


def _proc(args: tuple) -> tuple[int, float]:
    return asyncio.run(_drive(*args))


def _server_cpu_us(ports: list[int]) -> list[float]:
    """Each redis-server's CPU so far (user + system, µs; ``INFO cpu``): scripts, parsing, I/O."""
    out = []
    for port in ports:
        with redis.Redis(port=port) as r:
            cpu = r.info("cpu")
            out.append((float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])) * 1e6)
    return out


def _script_us(ports: list[int], reset: bool = False) -> float:
    """Microseconds the nodes spent running scripts (``INFO commandstats``, EVALSHA and EVAL)."""
    total = 0.0
    for port in ports:
        with redis.Redis(port=port) as r:
            if reset:
                r.config_resetstat()
            else:
                stats = r.info("commandstats")
                total += sum(v.get("usec", 0) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))
    return total


def run_variant(name: str, url: str, ports: list[int], args: argparse.Namespace, with_global: bool,
                lease: bool) -> dict:
    prefix = f"b{uuid.uuid4().hex[:6]}:"
    per_proc = args.n // args.procs
    jobs = [(url, args.orgs, with_global, lease, per_proc, args.concurrency, prefix, s) for s in range(args.procs)]
    _script_us(ports, reset=True)
    cpu0 = _server_cpu_us(ports)
    ctx = multiprocessing.get_context("spawn")
    t0 = time.perf_counter()
    with ctx.Pool(args.procs) as pool:
        results = pool.map(_proc, jobs)
    total_wall = time.perf_counter() - t0
    done = sum(r[0] for r in results)
    # the processes start at different times: the rate is pairs over the longest timed window
    wall = max(r[1] for r in results)
    usec = [b - a for a, b in zip(cpu0, _server_cpu_us(ports), strict=True)]
    script = _script_us(ports)
    warm = args.procs * args.orgs * 2
    return {"variant": name, "pairs": done, "rate_per_s": done / wall, "run_s": total_wall,
            "server_us_per_pair": sum(usec) / (done + warm), "busiest_node_us_per_pair": max(usec) / (done + warm),
            "script_us_per_pair": script / (done + warm)}


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20_000, help="reserve + reconcile pairs per variant")
    ap.add_argument("--procs", type=int, default=2, help="client processes")
    ap.add_argument("--concurrency", type=int, default=32, help="requests in flight per client process")
    ap.add_argument("--orgs", type=int, default=48)
    args = ap.parse_args()
    load0 = _load()
    started = datetime.now(timezone.utc)
    with tempfile.TemporaryDirectory(prefix="kvmeter-bench-cluster-") as tmp:
        single = RedisServer(Path(tmp) / "single")
        cluster = RedisClusterServers(Path(tmp) / "cluster")
        single.start()
        try:
            cluster.start()
            version = redis.Redis(port=single.port).info()["redis_version"]
            sp, cp = [single.port], [n.port for n in cluster.nodes]
            rows = [run_variant("single", single.url, sp, args, False, True),
                    run_variant("single-nolease", single.url, sp, args, False, False),
                    run_variant("cluster", cluster.url, cp, args, False, True),
                    run_variant("single+global", single.url, sp, args, True, True),
                    run_variant("cluster+global", cluster.url, cp, args, True, True)]
        finally:
            cluster.stop()
            single.stop()
    load1 = _load()
    print(f"## Quota store: one Redis vs a 3-master Redis Cluster — {started:%Y-%m-%d %H:%M} UTC\n")
    print(f"`bench/quota/bench_cluster.py --n {args.n} --procs {args.procs} --concurrency {args.concurrency} "
          f"--orgs {args.orgs}`; redis-server {version} on loopback, redis-py {redis.__version__}; "
          f"{platform.machine()}, {os.cpu_count()} cores; load average {load0} → {load1}.\n")
    print("| variant | pairs/s (reserve + reconcile, wall) | redis-server CPU µs per pair, all nodes "
          "(of which in scripts) | busiest node CPU µs per pair | ceiling ≈ 1e6 / busiest node's µs (pairs/s) |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['rate_per_s']:,.0f} | {r['server_us_per_pair']:.0f} "
              f"({r['script_us_per_pair']:.0f}) | {r['busiest_node_us_per_pair']:.0f} | "
              f"{1e6 / r['busiest_node_us_per_pair']:,.0f} |")


if __name__ == "__main__":
    main()
