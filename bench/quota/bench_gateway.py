"""Gateway benchmark over HTTP: the quota's added latency, LiteLLM's proxy side by side, and the
gateway's own ceiling against a bare Starlette endpoint — all in one run, on one machine.

Processes started (each its own process, all on loopback; kvmeter ones each with their own chDB
ledger and spool):

* ``upstream`` — ``bench/quota/upstream.py``: a tiny OpenAI-compatible Starlette app that answers
  at once (and the bare ``POST /bare`` JSON endpoint);
* ``kvmeter/unlimited`` — ``kvmeter serve --engine instant`` with the quota replaced by the no-op
  ``UnlimitedQuota`` (``serve_variant.py --unlimited``): auth, tokenization, scheduler, metering
  and ledger, no quota work;
* ``kvmeter/memory``, ``kvmeter/redis`` — the same with the real quota (5 levels × 7 dimensions
  limited, limits high enough that nothing is refused) on the in-memory store / on Redis
  (``FailoverQuotaStore(RedisQuotaStore)``, a real ``redis-server`` on loopback);
* ``kvmeter/remote`` — kvmeter (quota on memory) in front of ``upstream`` (``--engine remote``);
* ``litellm`` — LiteLLM's proxy (PyPI ``litellm[proxy]``) in front of ``upstream``, with per-key
  TPM/RPM limits. Without a database LiteLLM has no virtual keys; its documented ``custom_auth``
  hook returns each key's ``UserAPIKeyAuth(tpm_limit=..., rpm_limit=...)``, which its rate
  limiter (``parallel_request_limiter_v3``) enforces from its in-process cache. Its master key
  must be set (it refuses to start otherwise).

Measured:

1. **Latency, one request at a time** (``--n`` requests per target, interleaved over ``--rounds``
   rounds so drift on a shared machine hits every target alike): p50 / p99 / mean of the HTTP
   round trip seen by the client (``httpx``, keep-alive) and the server process's CPU time per
   request (``/proc``; stable when the wall clock is not). Added latency of the quota =
   ``kvmeter/memory`` (or ``/redis``) − ``kvmeter/unlimited``; overhead of a proxy = proxy −
   ``upstream`` direct.
2. **Ceiling**: requests/s from ``wrk`` (Debian package; a Lua script makes the POSTs),
   ``--connections`` connections, one wrk thread, ``--ceiling-s`` seconds per run, every target
   once per round for ``--ceiling-rounds`` rounds (side by side, so a shared machine's drift hits
   all alike): the bare endpoint, ``upstream``'s own ``/v1/chat/completions``, ``kvmeter/memory``
   (instant engine), ``kvmeter/remote`` and ``litellm`` (both in front of ``upstream``: the path
   that fronts a fleet of vLLM servers), and, with ``--ceiling-workers N`` (default 2; 0: off),
   the same proxies as N processes: ``kvmeter serve --workers N --engine remote`` (it needs a
   shared quota store and a networked ledger: the ``redis-server`` above and a ClickHouse HTTP DSN
   that nothing answers, so records stay durable in each worker's spool, as
   ``tests/serving/quota_http/test_serve_workers.py`` runs it) beside ``kvmeter/remote (redis)``,
   its one-process baseline with the same quota store, and LiteLLM's ``--num_workers N``. Each
   run also records the server's CPU time per request (user + system, summed over the process
   and all its descendants, from ``/proc``). Ratios reported per round: kvmeter / LiteLLM
   (goal ≥ 5×) and N processes / 1 process for each.

LiteLLM is not a kvmeter dependency: install it in a venv of its own and pass its entry point,
``--litellm-bin /path/to/venv/bin/litellm`` (default: ``litellm`` beside this Python).

Usage::

    .venv/bin/python bench/quota/bench_gateway.py [--n 2000] [--rounds 10] [--ceiling-s 10] \
        [--only-ceiling] [--litellm-bin /work/litellm-venv/bin/litellm]

Prints a Markdown report for bench/quota/RESULTS.md; ``--json`` writes the raw figures too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from bench_quota import BIG, free_port, start_redis  # noqa: E402

HERE = Path(__file__).parent
PY = sys.executable
MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-bench-gateway-0001"
LITELLM_KEY = "sk-bench-litellm-0001"
LITELLM_TIGHT_KEY = "sk-bench-litellm-tight"
LITELLM_MASTER = "sk-bench-litellm-master-5d2c8e0b7a914f36b1e4a09c"
#: ~40 prompt tokens after the chat template; 16 output tokens.
BODY = {"model": MODEL, "max_tokens": 16,
        "messages": [{"role": "user", "content": "Summarise in one line why request count is a poor "
                                                 "unit of load for multi-tenant LLM serving."}]}
CLK_TCK = os.sysconf("SC_CLK_TCK")


def tenants_yaml() -> str:
    """One key on a 5-level chain (global, org, workspace, project, key), every dimension limited."""
    return textwrap.dedent(f"""\
        version: 1
        global: {{limits: {BIG}}}
        orgs:
          bench:
            tier: enterprise
            limits: {BIG}
            workspaces:
              ws:
                limits: {BIG}
                projects:
                  proj:
                    limits: {BIG}
                    api_keys:
                      key0: {{key: {KEY}, limits: {BIG}}}
        """)


LITELLM_AUTH = f'''\
"""Per-key limits for LiteLLM's proxy without a database (its documented custom_auth hook)."""
from fastapi import Request
from litellm.proxy._types import UserAPIKeyAuth

KEYS = {{
    "{LITELLM_KEY}": {{"tpm_limit": 1_000_000_000, "rpm_limit": 1_000_000_000}},
    "{LITELLM_TIGHT_KEY}": {{"tpm_limit": 1_000_000, "rpm_limit": 2}},
}}


async def user_api_key_auth(request: Request, api_key: str) -> UserAPIKeyAuth:
    limits = KEYS.get(api_key)
    if limits is None:
        raise Exception("invalid api key")
    return UserAPIKeyAuth(api_key=api_key, **limits)
'''


def litellm_config(upstream_port: int) -> str:
    return textwrap.dedent(f"""\
        model_list:
          - model_name: {MODEL}
            litellm_params:
              model: openai/{MODEL}
              api_base: http://127.0.0.1:{upstream_port}/v1
              api_key: sk-upstream-unused
        general_settings:
          master_key: {LITELLM_MASTER}
          custom_auth: litellm_keys.user_api_key_auth
        litellm_settings:
          telemetry: false
        """)


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen
    port: int
    log: Path
    health: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cpu_s(self) -> float:
        """User + system CPU seconds of the process (all its threads)."""
        return pid_cpu_s(self.proc.pid)

    def tree_cpu_s(self) -> float:
        """User + system CPU seconds of the process and every live descendant (worker processes),
        seconds; a descendant that exits between two readings drops out of the later one."""
        return sum(pid_cpu_s(pid) for pid in process_tree(self.proc.pid))


def pid_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads), from ``/proc/<pid>/stat``;
    0.0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants (``/proc/<pid>/task/<tid>/children``)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except (FileNotFoundError, ProcessLookupError):
                pass
    return found


@dataclass
class Target:
    name: str
    proc: Proc
    path: str
    key: str
    lat_s: list[float] = field(default_factory=list)
    cpu_s: float = 0.0


def start(name: str, cmd: list[str], port: int, root: Path, health: str, env: dict | None = None,
          cwd: Path | None = None) -> Proc:
    log = root / f"{name.replace('/', '_')}.log"
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=cwd or root,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})
    return Proc(name, proc, port, log, health)


def wait_healthy(procs: list[Proc], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        while True:
            if p.proc.poll() is not None:
                raise RuntimeError(f"{p.name} exited:\n{p.log.read_text()[-3000:]}")
            try:
                if httpx.get(p.url + p.health, timeout=2.0).status_code < 500:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{p.name} not up after {timeout_s} s:\n{p.log.read_text()[-3000:]}")
            time.sleep(0.5)


def stop(procs: list[Proc]) -> None:
    for p in procs:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.proc.kill()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def check_answers(targets: list[Target]) -> dict[str, str]:
    """One request per target (must be 200), and LiteLLM's tight key refused on its 3rd request."""
    notes = {}
    with httpx.Client(timeout=30) as client:
        for t in targets:
            resp = client.post(t.proc.url + t.path, json=BODY, headers={"authorization": f"Bearer {t.key}"})
            if resp.status_code != 200:
                raise RuntimeError(f"{t.name} answered {resp.status_code}: {resp.text[:500]}")
        litellm = next((t for t in targets if t.name == "litellm"), None)
        if litellm is not None:
            codes = []
            for _ in range(3):
                resp = client.post(litellm.proc.url + litellm.path, json=BODY,
                                   headers={"authorization": f"Bearer {LITELLM_TIGHT_KEY}"})
                codes.append(resp.status_code)
            limits = [f"{k}={v}" for k, v in resp.headers.items() if k.startswith("x-ratelimit")]
            notes["litellm_tight_key"] = (
                f"LiteLLM key with rpm_limit 2 (functional check): status codes {codes}; the 429 carried "
                f"retry-after={resp.headers.get('retry-after')!r} and "
                + (", ".join(limits) if limits else "no x-ratelimit-* headers")
                + f"; body: {resp.text[:200]}")
    return notes


def measure_latency(targets: list[Target], n: int, rounds: int) -> None:
    per_round = max(1, n // rounds)
    clients = {t.name: httpx.Client(base_url=t.proc.url, timeout=30,
                                    headers={"authorization": f"Bearer {t.key}"}) for t in targets}
    body = json.dumps(BODY).encode()
    hdrs = {"content-type": "application/json"}
    perf = time.perf_counter
    try:
        for t in targets:  # warm-up: connections, caches, JIT-free but lazy imports
            for _ in range(50):
                clients[t.name].post(t.path, content=body, headers=hdrs)
        for _ in range(rounds):
            for t in targets:
                client = clients[t.name]
                cpu0 = t.proc.cpu_s()
                for _ in range(per_round):
                    s = perf()
                    resp = client.post(t.path, content=body, headers=hdrs)
                    t.lat_s.append(perf() - s)
                    if resp.status_code != 200:
                        raise RuntimeError(f"{t.name}: {resp.status_code} {resp.text[:300]}")
                t.cpu_s += t.proc.cpu_s() - cpu0
    finally:
        for c in clients.values():
            c.close()


def wrk_rps(url: str, script: Path, seconds: int, connections: int, proc: Proc | None = None) -> dict:
    """One wrk run; with ``proc``, also the server's CPU ms per completed request (its process tree)."""
    cpu0 = proc.tree_cpu_s() if proc else 0.0
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", str(script), url],
                         capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors = re.search(r"Socket errors:(.*)", out)
    p50 = re.search(r"\s50%\s+([\d.]+\w+)", out)
    p99 = re.search(r"\s99%\s+([\d.]+\w+)", out)
    return {"rps": rps, "non_2xx": int(non2xx.group(1)) if non2xx else 0,
            "socket_errors": errors.group(1).strip() if errors else "", "p50": p50.group(1) if p50 else "",
            "p99": p99.group(1) if p99 else "",
            "cpu_ms_per_req": ((proc.tree_cpu_s() - cpu0) / max(1, requests_done(out)) * 1e3) if proc else None}


def requests_done(wrk_out: str) -> int:
    m = re.search(r"(\d+) requests in", wrk_out)
    return int(m.group(1)) if m else 0


def lua_post(path: Path, body: bytes, key: str | None) -> Path:
    lines = ['wrk.method = "POST"', f"wrk.body = {json.dumps(body.decode())}",
             'wrk.headers["Content-Type"] = "application/json"']
    if key:
        lines.append(f'wrk.headers["Authorization"] = "Bearer {key}"')
    path.write_text("\n".join(lines) + "\n")
    return path


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="sequential requests per target")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--ceiling-s", type=int, default=10, help="seconds per wrk run")
    ap.add_argument("--ceiling-rounds", type=int, default=2)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--skip-litellm", action="store_true")
    ap.add_argument("--litellm-bin", type=Path, default=Path(PY).with_name("litellm"),
                    help="LiteLLM's proxy entry point (its own venv; default: litellm beside this Python)")
    ap.add_argument("--ceiling-workers", type=int, default=2, metavar="N",
                    help="also measure the ceiling of kvmeter serve --workers N and LiteLLM --num_workers N "
                         "(0: off)")
    ap.add_argument("--only-ceiling", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--before", type=Path, metavar="LAUNCHER",
                    help="also run kvmeter/memory from an older tree (a launcher script that runs "
                         "serve_variant.py on it) in the same run: before/after figures")
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk not found (Debian: apt-get install -y wrk)")

    root = Path(tempfile.mkdtemp(prefix="kvq-gw-bench-"))
    (root / "tenants.yaml").write_text(tenants_yaml())
    (root / "litellm_keys.py").write_text(LITELLM_AUTH)
    redis_server = start_redis()
    redis_url, redis_version = redis_server.url, redis_server.version()
    up_port = free_port()
    (root / "litellm.yaml").write_text(litellm_config(up_port))
    load_start = loadavg()
    procs: list[Proc] = []
    try:
        procs.append(start("upstream", [PY, str(HERE / "upstream.py"), "--port", str(up_port)], up_port, root,
                           "/v1/models"))
        wait_healthy(procs)

        def kvm(name: str, *flags: str, launcher: list[str] | None = None) -> Proc:
            port = free_port()
            home = root / name.replace("/", "_").replace(" ", "_").strip("()")
            home.mkdir()
            return start(name, [PY, *(launcher or []), str(HERE / "serve_variant.py"), "--port", str(port),
                                "--tenants", str(root / "tenants.yaml"), "--ledger-dsn", f"chdb://{home}/chdb",
                                "--spool-dir", str(home / "spool"), *flags], port, home, "/healthz")

        variants = [kvm("kvmeter/unlimited", "--engine", "instant", "--unlimited"),
                    kvm("kvmeter/memory", "--engine", "instant", "--quota-store", "memory://"),
                    kvm("kvmeter/redis", "--engine", "instant", "--quota-store", redis_url),
                    kvm("kvmeter/remote", "--engine", "remote", "--remote-url", f"http://127.0.0.1:{up_port}",
                        "--quota-store", "memory://")]
        if args.before:
            variants.append(kvm("kvmeter/memory (before)", "--engine", "instant", "--quota-store", "memory://",
                                launcher=[str(args.before)]))
        procs += variants
        if not args.skip_litellm:
            procs.append(litellm(args.litellm_bin, "litellm", root, 1))
        n_workers = args.ceiling_workers
        if n_workers > 1:
            procs.append(kvm("kvmeter/remote (redis)", "--engine", "remote", "--remote-url",
                             f"http://127.0.0.1:{up_port}", "--quota-store", redis_url))
            procs.append(kvm_workers(f"kvmeter/remote x{n_workers}", n_workers, root, up_port, redis_url))
            if not args.skip_litellm:
                procs.append(litellm(args.litellm_bin, f"litellm x{n_workers}", root, n_workers))
        wait_healthy(procs)
        by = {p.name: p for p in procs}
        chat = "/v1/chat/completions"
        targets = [Target("upstream (direct)", by["upstream"], chat, "unused")]
        if not args.skip_litellm:
            targets.append(Target("litellm", by["litellm"], chat, LITELLM_KEY))
        targets += [Target("kvmeter/remote", by["kvmeter/remote"], chat, KEY),
                    Target("kvmeter/unlimited", by["kvmeter/unlimited"], chat, KEY),
                    Target("kvmeter/memory", by["kvmeter/memory"], chat, KEY),
                    Target("kvmeter/redis", by["kvmeter/redis"], chat, KEY)]
        if args.before:
            targets.append(Target("kvmeter/memory (before)", by["kvmeter/memory (before)"], chat, KEY))
        notes = check_answers(targets)
        started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
        if not args.only_ceiling:
            measure_latency(targets, args.n, args.rounds)

        body = json.dumps(BODY).encode()
        bare_lua = lua_post(root / "bare.lua", body, None)
        kvm_lua = lua_post(root / "kvm.lua", body, KEY)
        ll_lua = lua_post(root / "litellm.lua", body, LITELLM_KEY)
        up_lua = lua_post(root / "up.lua", body, "unused")
        ceiling_targets = [("bare", "upstream", "/bare", bare_lua), ("upstream", "upstream", chat, up_lua),
                           ("kvmeter", "kvmeter/memory", chat, kvm_lua)]
        if args.before:
            ceiling_targets.append(("before", "kvmeter/memory (before)", chat, kvm_lua))
        ceiling_targets.append(("remote", "kvmeter/remote", chat, kvm_lua))
        if not args.skip_litellm:
            ceiling_targets.append(("litellm", "litellm", chat, ll_lua))
        if n_workers > 1:
            ceiling_targets += [("remote_redis", "kvmeter/remote (redis)", chat, kvm_lua),
                                ("remote_n", f"kvmeter/remote x{n_workers}", chat, kvm_lua)]
            if not args.skip_litellm:
                ceiling_targets.append(("litellm_n", f"litellm x{n_workers}", chat, ll_lua))
        keys = {bare_lua: None, up_lua: "unused", kvm_lua: KEY, ll_lua: LITELLM_KEY}
        for _, name, path, lua in ceiling_targets:  # each must answer 200; then a 2 s warm-up
            resp = httpx.post(by[name].url + path, json=BODY, timeout=30,
                              headers={"authorization": f"Bearer {keys[lua]}"} if keys[lua] else {})
            if resp.status_code != 200:
                raise RuntimeError(f"{name} answered {resp.status_code}: {resp.text[:500]}")
            wrk_rps(by[name].url + path, lua, 2, args.connections)
        ceiling = []
        for i in range(args.ceiling_rounds):
            row = {}
            for key, name, path, lua in ceiling_targets:
                row[key] = wrk_rps(by[name].url + path, lua, args.ceiling_s, args.connections, by[name])
                print(f"ceiling round {i + 1}/{args.ceiling_rounds}: {name} {path} {row[key]['rps']:,.0f} req/s, "
                      f"{row[key]['cpu_ms_per_req']:.2f} ms CPU / request, load {loadavg()}",
                      file=sys.stderr, flush=True)
            row["ratio"] = row["kvmeter"]["rps"] / row["bare"]["rps"]
            ceiling.append(row)
    finally:
        stop(procs)
        redis_server.stop()
    ll_version = litellm_version(args.litellm_bin) if not args.skip_litellm else "skipped"
    report = {"date_utc": started, "machine": machine(redis_version, ll_version), "load_start": load_start,
              "load_end": loadavg(), "n": args.n, "rounds": args.rounds, "notes": notes,
              "latency": {t.name: summarize(t) for t in targets if t.lat_s}, "ceiling": ceiling,
              "connections": args.connections, "ceiling_s": args.ceiling_s, "ceiling_workers": n_workers,
              "litellm_version": ll_version}
    print(markdown(report, args))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    shutil.rmtree(root, ignore_errors=True)  # kept (with every server's log) when a step failed


def litellm(bin_: Path, name: str, root: Path, workers: int) -> Proc:
    """LiteLLM's proxy (``workers`` uvicorn processes) in front of ``upstream``; its custom auth
    module (``litellm_keys.py`` in ``root``) on its ``PYTHONPATH``."""
    port = free_port()
    return start(name, [str(bin_), "--config", str(root / "litellm.yaml"), "--host", "127.0.0.1",
                        "--port", str(port), "--num_workers", str(workers),
                        # uvicorn's default 5 s health check kills workers still importing LiteLLM on
                        # a loaded machine (a restart loop); only the start is affected
                        *(["--timeout_worker_healthcheck", "120"] if workers > 1 else [])],
                 port, root, "/health/liveliness",
                 env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONPATH": str(root)})


def kvm_workers(name: str, n: int, root: Path, up_port: int, redis_url: str) -> Proc:
    """``kvmeter serve --workers n --engine remote`` in front of ``upstream``: quota on Redis, a
    ClickHouse HTTP ledger DSN that nothing answers (records stay durable in each worker's spool)."""
    port = free_port()
    home = root / name.replace("/", "_").replace(" ", "_")
    home.mkdir()
    return start(name, [str(Path(PY).with_name("kvmeter")), "--log-level", "WARNING", "serve", "--workers", str(n),
                        "--engine", "remote", "--remote-url", f"http://127.0.0.1:{up_port}", "--port", str(port),
                        "--tenants", str(root / "tenants.yaml"), "--quota-store", redis_url,
                        "--spool-dir", str(home / "spool"),
                        "--ledger-dsn", f"http://default:@127.0.0.1:{free_port()}/kvmeter"],
                 port, home, "/healthz")


def litellm_version(bin_: Path) -> str:
    """The ``litellm`` distribution's version in the venv of ``bin_`` (its ``python`` beside it)."""
    out = subprocess.run([str(bin_.with_name("python")), "-c",
                          "from importlib.metadata import version; print(version('litellm'))"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def summarize(t: Target) -> dict:
    lat = t.lat_s
    return {"n": len(lat), "p50_ms": pct(lat, 0.50) * 1e3, "p99_ms": pct(lat, 0.99) * 1e3,
            "mean_ms": statistics.fmean(lat) * 1e3, "cpu_ms_per_req": t.cpu_s / len(lat) * 1e3}


def machine(redis_version: str, litellm: str) -> str:
    from importlib.metadata import version

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return (f"{os.cpu_count()} cores, {cpu}; Python {platform.python_version()}; uvicorn {version('uvicorn')} "
            f"(uvloop, httptools); starlette {version('starlette')}; litellm {litellm}; "
            f"redis-server {redis_version} on loopback; wrk {wrk_version()}")


def wrk_version() -> str:
    out = subprocess.run(["wrk", "-v"], capture_output=True, text=True)
    m = re.search(r"wrk (\S+)", out.stdout + out.stderr)
    return m.group(1) if m else "?"


def markdown(r: dict, args: argparse.Namespace) -> str:
    lat = r["latency"]
    out = ["- command: `.venv/bin/python bench/quota/bench_gateway.py " + " ".join(sys.argv[1:]) + "`",
           f"- date (UTC): {r['date_utc']}",
           f"- machine: {r['machine']}; load average at start / end: {r['load_start']} / {r['load_end']}",
           "- request: chat completion, ~40 prompt tokens after the chat template, max_tokens 16, one at a time "
           "(latency); wrk, one thread, " f"{r['connections']} connections, {r['ceiling_s']} s per run (ceiling)", ""]
    if lat:
        out += ["| target | p50 ms | p99 ms | mean ms | server CPU ms / request |", "|---|---|---|---|---|"]
        for name, s in lat.items():
            out.append(f"| {name} | {s['p50_ms']:.3f} | {s['p99_ms']:.3f} | {s['mean_ms']:.3f} | "
                       f"{s['cpu_ms_per_req']:.3f} |")
        out.append("")

        def diff(a: str, b: str) -> str:
            if a not in lat or b not in lat:
                return "—"
            x, y = lat[a], lat[b]
            return (f"p50 {x['p50_ms'] - y['p50_ms']:+.3f} ms, p99 {x['p99_ms'] - y['p99_ms']:+.3f} ms, "
                    f"CPU {x['cpu_ms_per_req'] - y['cpu_ms_per_req']:+.3f} ms / request")

        out += ["| added by | vs | difference |", "|---|---|---|",
                f"| this round's gateway changes | kvmeter/memory (before) | "
                f"{diff('kvmeter/memory', 'kvmeter/memory (before)')} |",
                f"| quota on memory (kvmeter/memory) | kvmeter/unlimited | "
                f"{diff('kvmeter/memory', 'kvmeter/unlimited')} |",
                f"| quota on Redis (kvmeter/redis) | kvmeter/unlimited | "
                f"{diff('kvmeter/redis', 'kvmeter/unlimited')} |",
                f"| LiteLLM proxy (per-key TPM/RPM) | upstream (direct) | {diff('litellm', 'upstream (direct)')} |",
                f"| kvmeter gateway (quota on memory, remote engine) | upstream (direct) | "
                f"{diff('kvmeter/remote', 'upstream (direct)')} |", ""]
    if r["ceiling"]:
        n = r["ceiling_workers"] if r["ceiling_workers"] > 1 else "N"  # N: not measured (--ceiling-workers 0)
        names = {"bare": "bare Starlette endpoint (upstream /bare)", "upstream": "upstream (direct) chat",
                 "kvmeter": "kvmeter/memory (instant engine)", "before": "kvmeter/memory (before)",
                 "remote": "kvmeter/remote (quota on memory)", "litellm": "litellm (1 worker)",
                 "remote_redis": "kvmeter/remote (quota on Redis)",
                 "remote_n": f"kvmeter/remote --workers {n} (Redis, spool)", "litellm_n": f"litellm --num_workers {n}"}
        out += ["| round | target | req/s | server CPU ms / request | p50 / p99 | non-2xx | socket errors |",
                "|---|---|---|---|---|---|---|"]
        for i, c in enumerate(r["ceiling"], 1):
            for key, label in names.items():
                if key in c:
                    m = c[key]
                    out.append(f"| {i} | {label} | {m['rps']:,.0f} | {m['cpu_ms_per_req']:.2f} | {m['p50']} / "
                               f"{m['p99']} | {m['non_2xx']} | {m['socket_errors'] or '—'} |")
        out.append("")

        def ratio(c: dict, a: str, b: str) -> str:
            return f"{c[a]['rps'] / c[b]['rps']:.2f}×" if a in c and b in c else "—"

        out += ["| round | kvmeter/memory ÷ bare | kvmeter/remote ÷ litellm (goal ≥ 5×) | "
                f"kvmeter ×{n} ÷ litellm ×{n} | kvmeter ×{n} ÷ kvmeter/remote (Redis) | litellm ×{n} ÷ litellm |",
                "|---|---|---|---|---|---|"]
        for i, c in enumerate(r["ceiling"], 1):
            out.append(f"| {i} | {ratio(c, 'kvmeter', 'bare')} | {ratio(c, 'remote', 'litellm')} | "
                       f"{ratio(c, 'remote_n', 'litellm_n')} | {ratio(c, 'remote_n', 'remote_redis')} | "
                       f"{ratio(c, 'litellm_n', 'litellm')} |")
        out.append("")
    for note in r["notes"].values():
        out.append(f"- {note}")
    return "\n".join(out)


if __name__ == "__main__":
    main()
