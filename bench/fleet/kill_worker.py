"""``kill -9`` of one gateway process mid-load (issue 17): its quota holds expire within the lease,
and nothing is lost or doubled in the ledger.

Setting: ``kvmeter serve --workers 2 --engine remote`` (two gateway processes on one port under
uvicorn's supervisor) in front of ``bench/quota/upstream.py --delay-s D`` (every answer takes ``D``
seconds), a real ``redis-server`` as the quota store with the lease ``--lease-s``
(``KVMETER_QUOTA_LEASE_S``), and a ClickHouse DSN nothing answers, so every record stays durable
in the workers' spools; after the stop the spools are drained into one chDB ledger.

Load: ``--clients`` closed-loop clients (a new connection per attempt, so the kernel spreads them
over both workers) on one API key limited to ``--cap`` concurrent requests (fewer than the clients: the cap
binds, as a tenant's concurrency limit does under load). Each logical request carries its own
``Idempotency-Key`` and is retried with the same key until it succeeds: after a 429 (the cap),
a 409 (its first attempt still running) or a broken connection. ``--kill-at`` seconds in, one
worker is killed with SIGKILL (the lower slot, once both have answered); the load goes on for
``--after-s`` more seconds.

Measured:

* **holds** — the lease hashes (``kvq:lease:{<tag>}``: holder id → deadline) polled every 0.1 s:
  the dead worker's holder is the one whose deadline stops moving; the seconds from the kill until
  its entry is gone (its holds given back by a reservation the cap would refuse) — at most the
  lease after its last renewal, which precedes the kill;
* **the ledger** — per logical request (``event_id``, one per Idempotency-Key), the billed rows
  (``classified_usage_sql``'s billed classes): every request the clients saw answered must have
  exactly one billed ``ok`` row (none lost), no logical request two billed rows (none doubled);
  and the rows of the attempts the kill cut (they have none: the dead process never wrote them —
  their engine work is the upstream's, seen by reconciliation, not by the gateway's ledger).

Run: .venv/bin/python bench/fleet/kill_worker.py [--lease-s 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.redis_servers import RedisServer
from kvmeter.net import free_port

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
KVMETER = Path(PY).with_name("kvmeter")
MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-bench-kill-0001"
ORG = "acme"
BODY = {"model": MODEL, "max_tokens": 16,
        "messages": [{"role": "user", "content": "One line: why is the request a poor unit of load?"}]}
PRICES_YAML = f"""
version: "bench-1"
currency: USD
rounding: {{quantum: "0.000001", mode: ROUND_HALF_EVEN}}
tiers: {{}}
models:
  {MODEL}: {{input: 1.00, cached_input: 0.50, output: 2.00}}
"""


def tenants_yaml(cap: int) -> str:
    return textwrap.dedent(f"""\
        version: 1
        default_tier: paid_interactive
        orgs:
          {ORG}:
            workspaces:
              ws:
                projects:
                  p:
                    api_keys:
                      k: {{key: {KEY}, limits: {{concurrent_requests: {cap}}}}}
        """)


@dataclass
class Load:
    """What the clients saw."""

    answered: int = 0                       # logical requests answered 200
    attempts: dict[str, int] = field(default_factory=dict)   # status / error → count
    retried_after_kill: int = 0             # logical requests that needed a retry across the kill
    keys_answered: set[str] = field(default_factory=set)

    def saw(self, what: str) -> None:
        self.attempts[what] = self.attempts.get(what, 0) + 1


def _start(root: Path, name: str, cmd: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=open(root / f"{name}.log", "wb"), stderr=subprocess.STDOUT, env=env,
                            cwd=root, start_new_session=True)


async def _wait_healthy(url: str, procs: dict[str, subprocess.Popen], root: Path, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2) as client:
        while time.monotonic() < deadline:
            for name, p in procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited:\n{(root / f'{name}.log').read_text()[-3000:]}")
            try:
                if (await client.get(url + "/healthz")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{url} did not become healthy")


async def drive(base: str, load: Load, args: argparse.Namespace, kill_event: asyncio.Event,
                stop: asyncio.Event, pids: dict[int, int]) -> None:
    async def client_loop(c: int) -> None:
        async with httpx.AsyncClient(base_url=base, timeout=120,
                                     limits=httpx.Limits(max_connections=1)) as client:
            while not stop.is_set():
                key, crossed = uuid.uuid4().hex, False
                while True:
                    before_kill = not kill_event.is_set()
                    try:
                        # a connection per attempt, so the kernel spreads attempts over both workers
                        r = await client.post("/v1/chat/completions", json=BODY,
                                              headers={"Authorization": f"Bearer {KEY}", "Idempotency-Key": key,
                                                       "Connection": "close"})
                        slot, pid = r.headers.get("x-kvmeter-worker"), r.headers.get("x-kvmeter-worker-pid")
                        if slot is not None and pid is not None:
                            pids[int(slot)] = int(pid)
                        what = str(r.status_code)
                        if r.status_code != 200:
                            err = r.json().get("error", {})
                            what += f" {err.get('code') or err.get('type')}"
                    except httpx.HTTPError as e:
                        r, what = None, type(e).__name__
                    load.saw(what)
                    if r is not None and r.status_code == 200:
                        load.answered += 1
                        load.keys_answered.add(key)
                        load.retried_after_kill += crossed
                        break
                    if before_kill and kill_event.is_set():
                        crossed = True
                    if stop.is_set():
                        break
                    await asyncio.sleep(0.05)

    await asyncio.gather(*(client_loop(c) for c in range(args.clients)))


async def watch_leases(redis_url: str, kill_event: asyncio.Event, stop: asyncio.Event, out: dict) -> None:
    """Poll the lease hashes every 0.1 s; keep each change of their content after the kill in
    ``out["timeline"]`` (seconds since the kill, holder → its deadline in seconds after the kill),
    and the content at the kill in ``out["holders_at_kill"]``. :func:`holds_freed` reads them."""
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(redis_url)
    last: dict[str, float] = {}
    timeline: list = out.setdefault("timeline", [])
    try:
        while not stop.is_set():
            now = time.monotonic()
            leases: dict[str, float] = {}
            async for key in r.scan_iter(match="kvq:lease:*"):  # the org's hash tag, whatever its form
                for k, v in (await r.hgetall(key)).items():
                    leases[k.decode()] = max(float(v), leases.get(k.decode(), 0.0))
            if kill_event.is_set():
                wall0 = out["killed_at_wall"]
                if "holders_at_kill" not in out:
                    out["holders_at_kill"] = {h: round(d - wall0, 3) for h, d in last.items()}
                    held: dict[str, dict[str, int]] = {}  # holder → quota key → units it holds
                    async for key in r.scan_iter(match="kvq:held:*"):
                        for k, v in (await r.hgetall(key)).items():
                            holder, _, qkey = k.decode().partition("|")
                            held.setdefault(holder, {})[qkey] = int(float(v))
                    out["held_at_kill"] = held
                if leases != last:
                    timeline.append([round(now - out["killed_at_monotonic"], 2),
                                     {h: round(d - wall0, 3) for h, d in leases.items()}])
            last = leases
            await asyncio.sleep(0.1)
    finally:
        await r.aclose()


def holds_freed(holds: dict, settle_s: float = 0.5) -> dict:
    """From :func:`watch_leases`'s record: the holders whose deadline never moved once ``settle_s``
    had passed after the kill (the dead worker's store: a script it sent just before the kill may
    land just after it), their deadline (s after the kill) and when the last of them was gone (s
    after the kill; None if never within the run)."""
    timeline = holds.get("timeline", [])
    base = dict(holds.get("holders_at_kill", {}))
    for t, leases in timeline:
        if t <= settle_s:
            base = dict(leases)
    moved = {h for t, leases in timeline if t > settle_s for h, d in leases.items() if h in base and d != base[h]}
    dead = sorted(h for h in base if h not in moved)
    gone = None
    for t, leases in timeline:
        present = [h for h in dead if h in leases]
        if dead and not present and gone is None:
            gone = t
        elif present:
            gone = None
    return {"dead_holders": dead, "dead_deadlines_after_kill_s": [base[h] for h in dead],
            "holds_freed_s": gone, "live_holders_at_kill": len(base) - len(dead),
            "dead_held_units": {q: u for h in dead for q, u in holds.get("held_at_kill", {}).get(h, {}).items()}}


def ledger_check(root: Path, spool: Path, load: Load) -> dict:
    from kvmeter.ledger import Ledger, LedgerConfig
    from kvmeter.ledger.queries import BILLED_SQL, classified_usage_sql

    chdb = f"chdb://{root}/chdb"
    slots = sorted(p for p in spool.glob("worker-*") if p.is_dir())
    for s in slots:
        ledger = Ledger.open(LedgerConfig(dsn=chdb, spool_dir=s, prices_path=root / "prices.yaml"))
        try:
            assert ledger.flush(60.0), f"spool {s} did not drain"
        finally:
            ledger.close()
    ledger = Ledger.open(LedgerConfig(dsn=chdb, spool_dir=root / "reader-spool", prices_path=root / "prices.yaml"))
    try:
        q = ledger.query_client()
        rows = q.query(f"""
            SELECT event_id, countIf({BILLED_SQL}), countIf({BILLED_SQL} AND outcome = 'ok'), count()
            FROM {classified_usage_sql("tenant_id = %(t)s")} GROUP BY event_id""", parameters={"t": ORG}).result_rows
        outcomes = dict(q.query("SELECT outcome, count() FROM usage_events FINAL WHERE tenant_id = %(t)s "
                                "GROUP BY outcome", parameters={"t": ORG}).result_rows)
    finally:
        ledger.close()
    billed_once = sum(1 for _, b, ok, _ in rows if b == 1 and ok == 1)
    doubled = sum(1 for _, b, _, _ in rows if b > 1)
    billed_ok_events = sum(1 for _, _, ok, _ in rows if ok >= 1)
    return {"spool_slots": len(slots), "logical_requests_in_ledger": len(rows), "billed_once_ok": billed_once,
            "doubled": doubled, "billed_ok_events": billed_ok_events, "client_answered": load.answered,
            "lost": load.answered - billed_ok_events, "rows_by_outcome": {str(k): int(v) for k, v in outcomes.items()}}


async def run(args: argparse.Namespace) -> dict:
    root = Path(tempfile.mkdtemp(prefix="kvmeter-kill-"))
    (root / "tenants.yaml").write_text(tenants_yaml(args.cap))
    (root / "prices.yaml").write_text(PRICES_YAML)
    redis = RedisServer(root / "redis")
    redis.start()
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(KVMETER_QUOTA_LEASE_S=str(args.lease_s), TOKENIZERS_PARALLELISM="false")
    up, port = free_port(), free_port()
    procs = {"upstream": _start(root, "upstream", [PY, str(ROOT / "bench/quota/upstream.py"), "--port", str(up),
                                                   "--delay-s", str(args.delay_s)], env)}
    procs["serve"] = _start(root, "serve", [
        str(KVMETER), "--log-level", "WARNING", "serve", "--workers", "2", "--engine", "remote",
        "--remote-url", f"http://127.0.0.1:{up}", "--remote-metrics-url", "off", "--port", str(port),
        "--tenants", str(root / "tenants.yaml"), "--prices", str(root / "prices.yaml"),
        "--quota-store", redis.url, "--spool-dir", str(root / "spool"),
        "--ledger-dsn", f"http://default:@127.0.0.1:{free_port()}/kvmeter"], env)
    base = f"http://127.0.0.1:{port}"
    load, leases, pids = Load(), {}, {}
    load_start = os.getloadavg()
    try:
        await _wait_healthy(base, procs, root)
        kill_event, stop = asyncio.Event(), asyncio.Event()
        t_start = time.monotonic()

        async def conductor() -> None:
            await asyncio.sleep(args.kill_at)
            while len(pids) < 2:  # both workers have answered (the kernel may favour one at first)
                await asyncio.sleep(0.5)
            slot = min(pids)
            victim = pids[slot]
            os.kill(victim, signal.SIGKILL)
            leases["killed_at_monotonic"] = time.monotonic()
            leases["killed_at_wall"] = time.time()
            leases["victim_pid"], leases["victim_slot"] = victim, slot
            kill_event.set()
            print(f"killed worker {slot} (pid {victim}) at {time.monotonic() - t_start:.0f} s; "
                  f"{load.answered} answered so far", flush=True)
            for _ in range(int(args.after_s // 5)):
                await asyncio.sleep(5)
                print(f"  {time.monotonic() - leases['killed_at_monotonic']:.0f} s after the kill: "
                      f"{load.answered} answered", flush=True)
            stop.set()

        await asyncio.gather(drive(base, load, args, kill_event, stop, pids),
                             watch_leases(redis.url, kill_event, stop, leases), conductor())
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs.values():
            p.wait(timeout=120)
        redis.stop()
    ledger = ledger_check(root, root / "spool", load)
    holds = {k: v for k, v in leases.items() if not k.endswith("monotonic")}
    holds.update(holds_freed(holds))
    report = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "load_start": load_start,
              "load_end": os.getloadavg(), "args": _args(args), "serve_exit": procs["serve"].returncode,
              "attempts": load.attempts, "answered": load.answered, "retried_across_kill": load.retried_after_kill,
              "holds": holds, "ledger": ledger}
    shutil.rmtree(root, ignore_errors=True)
    return report


def _args(args: argparse.Namespace) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def markdown(r: dict) -> str:
    h, led = r["holds"], r["ledger"]
    return "\n".join([
        "| measure | value |", "|---|---|",
        f"| lease (`quota_lease_s`) | {r['args']['lease_s']} s |",
        f"| dead worker's holds given back after the kill | {h['holds_freed_s']} s (its lease deadline was "
        f"{', '.join(str(d) for d in h['dead_deadlines_after_kill_s']) or '?'} s after the kill; "
        f"{len(h['dead_holders'])} dead and {h['live_holders_at_kill']} live holders at the kill; the dead one "
        f"held {', '.join(f'{q}: {u}' for q, u in h.get('dead_held_units', {}).items()) or 'unknown'}) |",
        f"| logical requests answered / of them retried across the kill | {r['answered']} / "
        f"{r['retried_across_kill']} |",
        f"| attempts seen by the clients | {', '.join(f'{k}: {v}' for k, v in sorted(r['attempts'].items()))} |",
        f"| ledger: logical requests / billed once (ok) / doubled / lost | {led['logical_requests_in_ledger']} / "
        f"{led['billed_once_ok']} / {led['doubled']} / {led['lost']} |",
        f"| ledger rows by outcome | {', '.join(f'{k}: {v}' for k, v in sorted(led['rows_by_outcome'].items()))} |",
        f"| serve exit status | {r['serve_exit']} |"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lease-s", type=float, default=6.0)
    ap.add_argument("--delay-s", type=float, default=0.5, help="each upstream answer's service time (s)")
    ap.add_argument("--cap", type=int, default=8, help="the key's concurrent_requests limit")
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--kill-at", type=float, default=15.0)
    ap.add_argument("--after-s", type=float, default=25.0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--from-json", type=Path, help="re-derive the holds and print the table of a kept run")
    args = ap.parse_args(argv)
    if args.from_json:
        report = json.loads(args.from_json.read_text())
        report["holds"].update(holds_freed(report["holds"]))
        print(markdown(report))
        args.from_json.write_text(json.dumps(report, indent=2))
        return 0
    report = asyncio.run(run(args))
    print(markdown(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    led = report["ledger"]
    ok = led["doubled"] == 0 and led["lost"] == 0 and report["holds"]["holds_freed_s"] is not None
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
