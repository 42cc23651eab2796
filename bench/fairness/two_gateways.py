"""Fairness across two gateway processes on one Redis (issue 17 item 2): with and without the
shared VTC counters (``serving/scheduler/shared_service.py``).

Setting: two scheduler cores — two gateways, each with its own :class:`SchedulerCore` and its own
Redis connection and :class:`SharedServiceSync` — on one :class:`ManualClock` (virtual time, 0.1 s
ticks). Each gateway's engine serves ``capacity`` requests per tick (100 input + 50 output tokens:
200 service units each). Demand, requests per tick: tenant A sends 4 to gateway 1 only; tenant B
sends 6 to gateway 1 and 2 to gateway 2 — A:B demand 1:2, both over what gateway 1 can serve.
Gateway 2 has only B's 2 (half its capacity), so whatever sharing does, B gets those.

* Without sharing, gateway 1's VTC splits its 4 slots 2:2, and B gets 2 more on gateway 2:
  A:B service ≈ 1:2 (B takes 2× A by spreading).
* With sharing (a sync every ``sync_every`` ticks), gateway 1 sees B's gateway-2 service in B's
  counter and gives A 3 slots, B 1: A:B ≈ 1:1 — the max-min fair split of the fleet.

Service is each core's own (``tenant_service``), summed over the two gateways. The scheduler
settings are the plain baseline (no overload control, budgets or adaptive limit) so only the
dispatch order differs.

Run: .venv/bin/python bench/fairness/two_gateways.py [--ticks 2000] [--sync-every 5] [--redis URL]
[--processes] (without ``--redis`` a private ``redis-server`` from PATH is started on a free
loopback port; ``--processes`` runs each gateway in its own OS process, stepped in lock-step by
this one over pipes, so the two Lua calls of a sync race on Redis as two gateways' would).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvmeter.attribution import Attribution
from kvmeter.clock import ManualClock
from kvmeter.serving.scheduler import Job, SchedulerConfig, SchedulerCore
from kvmeter.serving.scheduler.shared_service import SharedServiceSync
from kvmeter.net import free_port as _free_port

__all__ = ["DEMAND", "Gateway", "TwoGatewayResult", "run_two_gateways", "run_two_processes"]

#: requests per tick: (tenant, gateway index) → count
DEMAND: dict[tuple[str, int], int] = {("A", 0): 4, ("B", 0): 6, ("B", 1): 2}
PROMPT_TOKENS, OUTPUT_TOKENS = 100, 50


@dataclass(frozen=True)
class TwoGatewayResult:
    """Service units per tenant summed over the gateways, and per gateway."""

    service: dict[str, float]
    per_gateway: list[dict[str, float]]
    failed_syncs: int

    @property
    def ratio_b_to_a(self) -> float:
        return self.service["B"] / self.service["A"]


class Gateway:
    """One gateway: a :class:`SchedulerCore` whose engine completes ``capacity`` requests per tick,
    fed with its part of the demand, optionally with a :class:`SharedServiceSync`."""

    def __init__(self, idx: int, clock: ManualClock, sync: SharedServiceSync | None, *, capacity: int,
                 demand: dict[tuple[str, int], int]) -> None:
        self.idx, self.clock, self.sync, self.capacity = idx, clock, sync, capacity
        self.core = SchedulerCore(SchedulerConfig.plain_baseline(), clock=clock, counter_log=sync)
        self.arrivals = [(tenant, n) for (tenant, gw), n in demand.items() if gw == idx]
        self._seq = 0

    def step(self) -> None:
        """Submit this tick's arrivals, then dispatch, run and release up to ``capacity``."""
        now = self.clock.monotonic()
        for tenant, n in self.arrivals:
            for _ in range(n):
                self._seq += 1
                self.core.submit(Job(request_id=f"g{self.idx}-{self._seq}", attribution=Attribution(tenant),
                                     input_tokens=PROMPT_TOKENS, max_tokens=OUTPUT_TOKENS, arrival_s=now))
        for grant in self.core.dispatch(max_grants=self.capacity):
            self.core.charge_output(grant, OUTPUT_TOKENS)
            self.core.release(grant)

    def service(self) -> dict[str, float]:
        return {t: self.core.tenant_service(t) for t in ("A", "B")}


def _result(per: list[dict[str, float]], failed: int) -> TwoGatewayResult:
    return TwoGatewayResult(service={t: sum(p[t] for p in per) for t in ("A", "B")}, per_gateway=per,
                            failed_syncs=failed)


async def run_two_gateways(syncs: Sequence[SharedServiceSync] | None, *, ticks: int = 2000,
                           tick_s: float = 0.1, capacity: int = 4, sync_every: int = 5,
                           demand: dict[tuple[str, int], int] | None = None) -> TwoGatewayResult:
    """Drive two gateways in one process in virtual time (see the module docstring).

    Args:
        syncs: one :class:`SharedServiceSync` per gateway (the same pool), or None: no sharing.
        ticks: ticks to run; ``tick_s`` seconds of virtual time each.
        capacity: requests each gateway's engine completes per tick.
        sync_every: ticks between syncs (``sync_every × tick_s`` is the sync interval).
        demand: requests per tick by (tenant, gateway); default :data:`DEMAND`.
    """
    demand = DEMAND if demand is None else demand
    clock = ManualClock()
    gws = [Gateway(i, clock, None if syncs is None else syncs[i], capacity=capacity, demand=demand)
           for i in range(2)]
    for tick in range(ticks):
        for gw in gws:
            gw.step()
        clock.advance(tick_s)
        if syncs is not None and (tick + 1) % sync_every == 0:
            for gw in gws:
                assert gw.sync is not None
                await gw.sync.sync(gw.core)
    return _result([gw.service() for gw in gws],
                   0 if syncs is None else sum(s.failures_total for s in syncs))


async def _child(idx: int, url: str | None, pool: str, capacity: int, tick_s: float) -> None:
    """One gateway in its own OS process, stepped by the parent over stdin: ``t`` a tick, ``s`` a
    sync, ``q`` print the service as JSON and stop; each command is answered with one line."""
    from kvmeter.serving.quota import redis_client

    sync = None if url is None else SharedServiceSync(redis_client(url), pool=pool)
    gw = Gateway(idx, ManualClock(), sync, capacity=capacity, demand=DEMAND)
    loop = asyncio.get_running_loop()
    while True:
        cmd = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
        if cmd == "t":
            gw.step()
            gw.clock.advance(tick_s)
        elif cmd == "s" and sync is not None:
            await sync.sync(gw.core)
        elif cmd in ("q", ""):
            print(json.dumps({"service": gw.service(), "failed": 0 if sync is None else sync.failures_total}),
                  flush=True)
            if sync is not None:
                await sync.aclose()
            return
        print("ok", flush=True)


def run_two_processes(url: str | None, *, ticks: int = 2000, sync_every: int = 5, capacity: int = 4,
                      tick_s: float = 0.1) -> TwoGatewayResult:
    """The same run with each gateway in its own OS process (``python two_gateways.py --child``),
    in lock-step: every tick both step, every ``sync_every`` ticks both sync at once (their Lua
    calls race on Redis, as two gateways' would). ``url`` None: no sharing."""
    pool = f"bench-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                         os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(i), "--pool", pool,
                               "--capacity", str(capacity), *(["--redis", url] if url else [])],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
             for i in range(2)]

    def command(cmd: str) -> list[str]:
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(cmd + "\n")
            p.stdin.flush()
        out = []
        for p in procs:
            assert p.stdout is not None
            out.append(p.stdout.readline().strip())
        return out

    try:
        for tick in range(ticks):
            command("t")
            if url is not None and (tick + 1) % sync_every == 0:
                command("s")
        finals = [json.loads(line) for line in command("q")]
    finally:
        for p in procs:
            p.wait(timeout=30)
    return _result([f["service"] for f in finals], sum(f["failed"] for f in finals))


def _start_redis(workdir: str) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not on PATH (apt-get install redis-server), or pass --redis URL")
    port = _free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5)
    deadline = time.monotonic() + 15
    while True:  # wait for the server to accept connections
        try:
            if client.ping():
                break
        except redis.exceptions.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"redis-server did not start on port {port}") from None
            time.sleep(0.02)
    client.close()
    return proc, f"redis://127.0.0.1:{port}/0"


async def _both(url: str, ticks: int, sync_every: int) -> tuple[TwoGatewayResult, TwoGatewayResult]:
    from kvmeter.serving.quota import redis_client

    local = await run_two_gateways(None, ticks=ticks, sync_every=sync_every)
    pool = f"bench-{uuid.uuid4().hex[:8]}"
    syncs = [SharedServiceSync(redis_client(url), pool=pool) for _ in range(2)]
    try:
        shared = await run_two_gateways(syncs, ticks=ticks, sync_every=sync_every)
    finally:
        for s in syncs:
            await s.aclose()
    return local, shared


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ticks", type=int, default=2000)
    ap.add_argument("--sync-every", type=int, default=5, help="ticks (0.1 s each) between syncs")
    ap.add_argument("--redis", default=None, help="redis://host:port/db (default: a private redis-server)")
    ap.add_argument("--processes", action="store_true", help="each gateway in its own OS process")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--pool", default="bench", help=argparse.SUPPRESS)
    ap.add_argument("--capacity", type=int, default=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        asyncio.run(_child(args.child, args.redis, args.pool, args.capacity, 0.1))
        return
    proc = None
    with tempfile.TemporaryDirectory() as tmp:
        url = args.redis
        if url is None:
            proc, url = _start_redis(tmp)
        try:
            t0 = time.perf_counter()
            if args.processes:
                local = run_two_processes(None, ticks=args.ticks, sync_every=args.sync_every)
                shared = run_two_processes(url, ticks=args.ticks, sync_every=args.sync_every)
            else:
                local, shared = asyncio.run(_both(url, args.ticks, args.sync_every))
            wall = time.perf_counter() - t0
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=10)
    where = "two OS processes" if args.processes else "two cores in one process"
    print(f"two gateways ({where}), one Redis; demand A:B = 1:2 (A 4/tick on gw1; B 6/tick on gw1, "
          f"2/tick on gw2); capacity 4/tick per gateway; {args.ticks} ticks of 0.1 s; "
          f"sync every {args.sync_every * 0.1:.1f} s")
    for name, r in (("without sharing", local), ("with sharing", shared)):
        print(f"  {name:16s} service A {r.service['A']:>10,.0f}  B {r.service['B']:>10,.0f}  "
              f"A:B = 1:{r.ratio_b_to_a:.3f}   (gw1 A {r.per_gateway[0]['A']:,.0f} B {r.per_gateway[0]['B']:,.0f}; "
              f"gw2 B {r.per_gateway[1]['B']:,.0f})")
    print(f"  failed syncs {shared.failed_syncs}; wall {wall:.2f} s; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
