"""Fairness across two real gateway processes on one Redis, under HTTP load (issue 17): the same
setting as ``bench/fairness/two_gateways.py`` (which drives two scheduler cores), here with two real
``kvmeter serve`` processes, real HTTP clients and a real ``redis-server``.

Setting:

* two engines: ``bench/quota/upstream.py --delay-s D`` each (an OpenAI-compatible upstream whose
  every answer takes ``D`` seconds however many run at once), one per gateway;
* two gateways: ``kvmeter serve --engine remote`` on their own ports, both on the one Redis quota
  store, with the plain scheduler baseline (no overload control, adaptive limit or budgets, so only
  the dispatch order differs) and ``max_engine_running`` = ``--slots``: each gateway's engine
  serves ``slots / D`` requests per second;
* load (one client process, httpx): tenant A keeps ``--backlog`` requests in flight at gateway 1;
  tenant B keeps ``--backlog`` in flight at gateway 1 too, and sends to gateway 2 open-loop at half
  gateway 2's capacity (so gateway 2 is never the bottleneck: B gets those whatever sharing does).
  Every request is the same (one chat message, 16 output tokens), so service ∝ answered requests.

Expected: without sharing, gateway 1 splits its capacity A:B 1:1, and B gets gateway 2's half on
top — A:B ≈ 1:2 (B takes twice A's share by spreading over two gateways). With the shared VTC
counters (``scheduler.shared_service``), gateway 1 sees B's gateway-2 service and gives A more —
A:B ≈ 1:1, the max-min fair split of the fleet. Target: within 1:1.1 shared.

Both sides run in one invocation, alternating (``off``, ``on``, ``off``, ``on`` … ``--rounds``), each
``--seconds`` long after a ``--warmup-s`` (answers counted by completion time inside the window).

Run: .venv/bin/python bench/fleet/fairness_http.py [--rounds 2] [--seconds 40] [--json out.json]
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
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.redis_servers import RedisServer
from kvmeter.net import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PY = sys.executable
KVMETER = Path(PY).with_name("kvmeter")
MODEL = "SmolLM2-135M-Instruct"
KEYS = {"A": "sk-bench-fleet-a-0001", "B": "sk-bench-fleet-b-0001"}
BODY = {"model": MODEL, "max_tokens": 16,
        "messages": [{"role": "user", "content": "One line: why is the request a poor unit of load?"}]}


def tenants_yaml() -> str:
    """Two tenants, no limits, one tier: only the scheduler decides who is served."""
    keys = "\n".join(f"""\
          {t.lower()}:
            tier: paid_interactive
            workspaces:
              ws:
                projects:
                  p:
                    api_keys:
                      k{t.lower()}: {{key: {key}}}""" for t, key in KEYS.items())
    return "version: 1\ndefault_tier: paid_interactive\norgs:\n" + textwrap.indent(textwrap.dedent(keys), "  ") + "\n"


def serve_config(slots: int, shared: bool, pool: str) -> dict:
    from kvmeter.serving.scheduler.config import PLAIN_BASELINE

    return {"scheduler": {"policy": "vtc", "shared_service": "on" if shared else "off",
                          "shared_service_pool": pool,
                          "options": {**PLAIN_BASELINE, "max_engine_running": slots,
                                      "max_engine_waiting": slots}}}


@dataclass
class Side:
    """One measured interval: answered requests per tenant (and per gateway) inside the window."""

    shared: bool
    answered: dict[str, int] = field(default_factory=lambda: {"A": 0, "B": 0})
    per_gateway: list[dict[str, int]] = field(default_factory=lambda: [{"A": 0, "B": 0}, {"A": 0, "B": 0}])
    errors: dict[str, int] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.answered["B"] / max(1, self.answered["A"])


class Stack:
    """Redis, two upstreams and two gateways, started fresh for one side (so no counter, queue or
    connection carries over from the other side)."""

    def __init__(self, root: Path, redis_url: str, args: argparse.Namespace, shared: bool, tag: str) -> None:
        self.root, self.args = root / tag, args
        self.root.mkdir(parents=True)
        (self.root / "tenants.yaml").write_text(tenants_yaml())
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []
        self.gateways: list[str] = []
        env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        env["TOKENIZERS_PARALLELISM"] = "false"
        for g in range(2):
            up = free_port()
            self._start(f"upstream{g}", [PY, str(ROOT / "bench/quota/upstream.py"), "--port", str(up),
                                         "--delay-s", str(args.delay_s)], env)
            port = free_port()
            cfg = self.root / f"serve{g}.yaml"
            cfg.write_text(yaml.safe_dump(serve_config(args.slots, shared, f"fleet-{tag}")))
            self._start(f"gateway{g}", [str(KVMETER), "--log-level", "WARNING", "serve", "--config", str(cfg),
                                        "--engine", "remote", "--remote-url", f"http://127.0.0.1:{up}",
                                        "--remote-metrics-url", "off", "--port", str(port),
                                        "--tenants", str(self.root / "tenants.yaml"), "--quota-store", redis_url,
                                        "--spool-dir", str(self.root / f"spool{g}"),
                                        "--ledger-dsn", f"chdb://{self.root}/chdb{g}"], env)
            self.gateways.append(f"http://127.0.0.1:{port}")

    def _start(self, name: str, cmd: list[str], env: dict) -> None:
        log = self.root / f"{name}.log"
        proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, cwd=self.root,
                                start_new_session=True)
        self.procs.append((name, proc, log))

    async def wait_healthy(self, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2) as client:
            for url in self.gateways:
                while True:
                    for name, proc, log in self.procs:
                        if proc.poll() is not None:
                            raise RuntimeError(f"{name} exited:\n{log.read_text()[-3000:]}")
                    try:
                        if (await client.get(url + "/healthz")).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{url} did not become healthy")
                    await asyncio.sleep(0.5)

    def stop(self) -> None:
        for _, proc, _ in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for _, proc, _ in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


async def drive(stack: Stack, side: Side, args: argparse.Namespace) -> None:
    """The load of one side; counts answers that complete inside [warmup, warmup + seconds)."""
    t0 = time.monotonic()
    start, end = t0 + args.warmup_s, t0 + args.warmup_s + args.seconds
    limits = httpx.Limits(max_connections=4 * args.backlog + 64, max_keepalive_connections=4 * args.backlog + 64)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def one(tenant: str, g: int) -> None:
            try:
                r = await client.post(stack.gateways[g] + "/v1/chat/completions", json=BODY,
                                      headers={"Authorization": f"Bearer {KEYS[tenant]}"})
                ok = r.status_code == 200
                what = str(r.status_code)
                if not ok:
                    err = r.json().get("error", {})
                    what += f" {err.get('code') or err.get('type')}"
            except httpx.HTTPError as e:
                ok, what = False, type(e).__name__
            now = time.monotonic()
            if start <= now < end:
                if ok:
                    side.answered[tenant] += 1
                    side.per_gateway[g][tenant] += 1
                else:
                    side.errors[what] = side.errors.get(what, 0) + 1

        async def closed(tenant: str, g: int) -> None:
            while time.monotonic() < end:
                await one(tenant, g)

        async def open_loop(tenant: str, g: int, rate: float) -> None:
            tasks: set[asyncio.Task] = set()
            n = 0
            while (now := time.monotonic()) < end:
                n += 1
                await asyncio.sleep(max(0.0, t0 + n / rate - now))
                task = asyncio.create_task(one(tenant, g))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.gather(*tasks)

        async def progress() -> None:
            while time.monotonic() < end:
                await asyncio.sleep(10)
                left = max(0.0, end - time.monotonic())
                print(f"  shared={'on' if side.shared else 'off'}: A {side.answered['A']}, "
                      f"B {side.answered['B']} answered; {left:.0f} s left", flush=True)

        capacity = args.slots / args.delay_s
        loads = [closed("A", 0) for _ in range(args.backlog)] + [closed("B", 0) for _ in range(args.backlog)]
        loads.append(open_loop("B", 1, capacity / 2))
        await asyncio.gather(*loads, progress())


async def run(args: argparse.Namespace) -> dict:
    root = Path(tempfile.mkdtemp(prefix="kvmeter-fleet-"))
    redis = RedisServer(root / "redis")
    redis.start()
    sides: list[Side] = []
    load_start = os.getloadavg()
    try:
        for r in range(args.rounds):
            for shared in ((False, True) if r % 2 == 0 else (True, False)):
                tag = f"r{r}-{'on' if shared else 'off'}"
                print(f"round {r}, shared counters {'on' if shared else 'off'}: starting", flush=True)
                stack = Stack(root, redis.url, args, shared, tag)
                try:
                    await stack.wait_healthy()
                    side = Side(shared)
                    await drive(stack, side, args)
                    sides.append(side)
                    print(f"  → A {side.answered['A']}, B {side.answered['B']}: 1 : {side.ratio:.3f} "
                          f"(errors {side.errors or 'none'})", flush=True)
                finally:
                    stack.stop()
    finally:
        redis.stop()
    report = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "load_start": load_start,
              "load_end": os.getloadavg(), "args": _args(args),
              "sides": [{"shared": s.shared, "answered": s.answered, "per_gateway": s.per_gateway,
                         "errors": s.errors, "ratio_b_to_a": round(s.ratio, 4)} for s in sides]}
    shutil.rmtree(root, ignore_errors=True)
    return report


def _args(args: argparse.Namespace) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def markdown(report: dict) -> str:
    lines = ["| round | shared VTC counters | A answered | B answered (gw1 + gw2) | A : B | errors |",
             "|---|---|---|---|---|---|"]
    for i, s in enumerate(report["sides"]):
        g = s["per_gateway"]
        lines.append(f"| {i // 2} | {'on' if s['shared'] else 'off'} | {s['answered']['A']} | "
                     f"{s['answered']['B']} ({g[0]['B']} + {g[1]['B']}) | 1 : {s['ratio_b_to_a']:.3f} | "
                     f"{sum(s['errors'].values())} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="each round runs both sides (order alternates)")
    ap.add_argument("--seconds", type=float, default=40.0, help="measured window per side (s)")
    ap.add_argument("--warmup-s", type=float, default=8.0)
    ap.add_argument("--delay-s", type=float, default=0.25, help="each engine answer's service time (s)")
    ap.add_argument("--slots", type=int, default=4, help="max_engine_running per gateway")
    ap.add_argument("--backlog", type=int, default=12, help="requests each backlogged tenant keeps in flight")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    report = asyncio.run(run(args))
    print(markdown(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
