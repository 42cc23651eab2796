"""``kvmeter demo`` — the main job on the embedded defaults, end to end on real input.

1. prepares the bundled SmolLM2-135M-Instruct (once) and starts ``kvmeter serve`` on it: vLLM's CPU
   engine in-process, the demo tenants, the fair scheduler, an embedded chDB ledger in a fresh run
   directory under ``var/demo/`` — engine settings and scheduler options from ``serving/config.py``
   (``DEMO_ENGINE_SETTINGS``, ``DEMO_SCHEDULER_OPTIONS``), written to the run's ``serve.yaml``;
2. replays the start of the real Azure LLM inference trace (2023, conversation) through the HTTP
   API as five tenants — one of them a noisy neighbour with long prompts — scaled to the model by
   the rule in :mod:`kvmeter.serving.replay.plan`;
3. prints a per-tenant table computed by ClickHouse (through the serve process's read API, since
   the embedded ledger belongs to the serve process): requests, input/cached/output tokens, TTFT
   and ITL p50/p95 — beside each tenant's share of requests and of tokens, the gap
   docs/ARCHITECTURE.md, "Why tokens, not requests" is about — and, as the clients saw it, how
   many requests met their tier's SLOs and why the others were refused;
4. says where the metrics, the ledger and the dashboards are, and stops the server (unless
   ``--keep-running``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx

from kvmeter.serving.replay.plan import DEMO_TENANTS
from kvmeter.net import free_port

__all__ = ["add_arguments", "run"]

log = logging.getLogger(__name__)

ADMIN_KEY = "sk-demo-admin-0001"
TIERS = {"acme": "enterprise", "globex": "paid_interactive", "initech": "batch", "hobbyist": "free",
         "umbrella": "paid_interactive"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", default="azure-conv", help="trace name or path (default azure-conv)")
    parser.add_argument("--requests", type=int, default=300, help="requests taken from the trace's start")
    parser.add_argument("--time-compression", type=float, default=2.0, help="arrival speed-up (default 2)")
    parser.add_argument("--token-scale", type=float, default=1 / 8, help="token length scale (default 1/8)")
    parser.add_argument("--port", type=int, default=0, help="serve port (default: a free one)")
    parser.add_argument("--workdir", default="var/demo", help="where run directories go")
    parser.add_argument("--scheduler", choices=["vtc", "fcfs"], default="vtc")
    parser.add_argument("--keep-running", action="store_true", help="leave the server up at the end")
    parser.add_argument("--seed", type=int, default=7)


def _write_serve_config(path: Path, policy: str) -> Path:
    """The serve config of the demo: the CPU engine's settings and the scheduler's options for
    ``policy`` (``serving/config.py``: ``DEMO_ENGINE_SETTINGS``, ``DEMO_SCHEDULER_OPTIONS``)."""
    import yaml

    from kvmeter.serving.config import DEMO_ENGINE_SETTINGS, DEMO_SCHEDULER_OPTIONS

    path.write_text(yaml.safe_dump({"engine": dict(DEMO_ENGINE_SETTINGS), "scheduler": {
        "policy": policy, "options": dict(DEMO_SCHEDULER_OPTIONS[policy])}}))
    return path


def wait_ready(proc: subprocess.Popen, base_url: str, log_path: Path, timeout_s: float = 900.0) -> float:
    """Wait until ``kvmeter serve`` at ``base_url`` answers ``GET /healthz`` with 200; print a progress
    line every 10 s. Returns the start-up time in seconds.

    Raises:
        RuntimeError: the process exited first (with the last 25 lines of ``log_path``), or it was
            not ready after ``timeout_s`` seconds.
    """
    start = time.monotonic()
    last = 0.0
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace").splitlines()[-25:]
            raise RuntimeError("kvmeter serve exited during start-up:\n  " + "\n  ".join(tail))
        try:
            if httpx.get(f"{base_url}/healthz", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        if time.monotonic() - last > 10:
            last = time.monotonic()
            print(f"  loading the engine ... {time.monotonic() - start:.0f}s", flush=True)
        time.sleep(1)
    raise RuntimeError(f"kvmeter serve was not ready after {timeout_s:.0f}s (log: {log_path})")


def stop_server(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Stop a ``kvmeter serve`` started by the demo or a bench: SIGINT (graceful: in-flight
    requests end, the spool drains into ClickHouse, the ledger closes), SIGKILL after
    ``timeout_s`` seconds. Nothing if it has already exited."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _fmt(value: float | None, unit: str = "s") -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f}ms" if unit == "s" and value < 1 else f"{value:.2f}{unit}"


def print_table(rows: list[dict], client_results: list) -> None:
    """The per-tenant table: requests the replay sent (``sent``, ``sent%`` of all sent) and refused
    (``rej``), beside the ledger's figures (``reqs``: requests recorded in ClickHouse; ``tok%``:
    share of all recorded input + output tokens)."""
    by_tenant = {r["tenant_id"]: r for r in rows}
    total_tok = sum(r["input_tokens"] + r["output_tokens"] for r in rows) or 1
    rejected: dict[str, int] = {}
    sent: dict[str, int] = {}
    for res in client_results:
        sent[res.tenant] = sent.get(res.tenant, 0) + 1
        if res.status != 200:
            rejected[res.tenant] = rejected.get(res.tenant, 0) + 1
    total_sent = len(client_results) or 1
    head = (f"{'tenant':<10} {'tier':<17} {'sent':>5} {'sent%':>5} {'rej':>4} {'reqs':>5} {'tok%':>5} {'input':>8} "
            f"{'cached':>7} {'output':>7} {'TTFT p50':>9} {'p95':>8} {'ITL p50':>8} {'p95':>7}")
    print(head)
    print("-" * len(head))
    for name, *_ in DEMO_TENANTS:
        r = by_tenant.get(name)
        if r is None:
            print(f"{name:<10} {TIERS[name]:<17} {sent.get(name, 0):>5} "
                  f"{100 * sent.get(name, 0) / total_sent:>4.0f}% {rejected.get(name, 0):>4} {'0':>5}")
            continue
        tokens = r["input_tokens"] + r["output_tokens"]
        print(f"{name:<10} {TIERS[name]:<17} {sent.get(name, 0):>5} {100 * sent.get(name, 0) / total_sent:>4.0f}% "
              f"{rejected.get(name, 0):>4} {r['requests']:>5} {100 * tokens / total_tok:>4.0f}% "
              f"{r['input_tokens']:>8} {r['cached_input_tokens']:>7} {r['output_tokens']:>7} "
              f"{_fmt(r['ttft_p50_s']):>9} {_fmt(r['ttft_p95_s']):>8} {_fmt(r['itl_p50_s']):>8} "
              f"{_fmt(r['itl_p95_s']):>7}")
    _print_scheduler_story(client_results)
    noisy = by_tenant.get("umbrella")
    if noisy:
        ntok = noisy["input_tokens"] + noisy["output_tokens"]
        print(f"\nThe request is not the unit of load: umbrella sent {100 * sent.get('umbrella', 0) / total_sent:.0f}% "
              f"of the requests; the ledger holds {100 * ntok / total_tok:.0f}% of the tokens as umbrella's.")


def _slo_met(res, policy) -> bool:
    """Did the client see the tier's TTFT and mean-ITL (TPOT) objectives met for this request
    (:meth:`~kvmeter.serving.tenancy.TierPolicy.meets_slo`)?"""
    if res.status != 200 or res.error or res.ttft_s is None:
        return False
    n = res.output_tokens or 0
    tpot = (res.e2e_s - res.ttft_s) / (n - 1) if n > 1 and res.e2e_s is not None else 0.0
    return policy.meets_slo(res.ttft_s, tpot)


def _print_scheduler_story(client_results: list) -> None:
    """Per tenant, as the clients saw it: how many requests met the tier's SLOs (of those sent) and
    why the others were refused — protected tiers should keep their promises, batch and free
    should absorb the refusals."""
    from kvmeter.serving.tenancy import DEMO_TENANTS_FILE, TenantDirectory

    directory = TenantDirectory.from_file(DEMO_TENANTS_FILE)
    print("\nAs the clients saw it (SLOs from serving/defaults/demo-tenants.yaml; refusals by reason):")
    for name, *_ in DEMO_TENANTS:
        mine = [r for r in client_results if r.tenant == name]
        if not mine:
            continue
        pol = directory.tier_policy(TIERS[name])
        met = sum(_slo_met(r, pol) for r in mine)
        reasons: dict[str, int] = {}
        for r in mine:
            if r.status != 200:
                key = r.code or f"http {r.status}"
                reasons[key] = reasons.get(key, 0) + 1
        slo = (f"TTFT ≤ {pol.ttft_slo_s:g}s, ITL ≤ {pol.itl_slo_s:g}s" if pol.ttft_slo_s and pol.itl_slo_s
               else "no latency SLO")
        refused = ", ".join(f"{k} {v}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])) or "none"
        print(f"  {name:<10} {TIERS[name]:<17} SLO met {met:>3}/{len(mine):<3} ({slo}); refused: {refused}")


def run(args: argparse.Namespace) -> int:
    from kvmeter.ledger.http_client import LedgerHttpClient
    from kvmeter.ledger.period import Period
    from kvmeter.model import ModelError, resolve_model
    from kvmeter.serving.engines.hf_tokenizer import HFTokenizer
    from kvmeter.serving.replay.client import replay
    from kvmeter.serving.replay.plan import ReplayTenant, ScalingRule, build_plan
    from kvmeter.serving.replay.prompts import PromptSynthesizer
    from kvmeter.traces import TraceError, load_trace

    # one INFO line per request from the replay's HTTP client would bury the progress lines
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))

    print("kvmeter demo: real trace → OpenAI gateway → vLLM (CPU) → ClickHouse ledger")
    print("[1/4] preparing the model (dequantized once, then cached) ...", flush=True)
    try:
        model_dir, model_name = resolve_model(None)
        trace = load_trace(args.trace, limit=args.requests)
    except (ModelError, TraceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    run_dir = Path(args.workdir) / datetime.now().strftime("run-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    port = args.port or free_port()
    base_url = f"http://127.0.0.1:{port}"
    log_path = run_dir / "serve.log"
    config_path = _write_serve_config(run_dir / "serve.yaml", args.scheduler)
    cmd = [sys.executable, "-m", "kvmeter.cli", "serve", "--config", str(config_path), "--port", str(port),
           "--ledger-dsn", f"chdb://{(run_dir / 'ledger').absolute()}",
           "--spool-dir", str((run_dir / "spool").absolute())]
    print(f"[2/4] starting kvmeter serve on {base_url} (log: {log_path}) ...", flush=True)
    started_at = datetime.now(timezone.utc) - timedelta(minutes=1)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "TOKENIZERS_PARALLELISM": "false"}
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    try:
        wait_ready(proc, base_url, log_path)
        tenants = [ReplayTenant(n, k, s, noisy) for n, k, s, noisy in DEMO_TENANTS]
        synth = PromptSynthesizer(HFTokenizer(model_dir), seed=args.seed)
        rule = ScalingRule(time_compression=args.time_compression, token_scale=args.token_scale,
                           min_input_tokens=synth.overhead + 1)
        plan = build_plan(trace, tenants, rule, seed=args.seed)
        span = plan[-1].arrival_s if plan else 0.0
        print(f"[3/4] replaying {len(plan)} requests of {args.trace} over {span:.0f}s as "
              f"{len(tenants)} tenants (tokens × {rule.token_scale:g}, time ÷ {rule.time_compression:g}; "
              f"umbrella sends {rule.noisy_input_tokens}-token prompts) ...", flush=True)
        results = asyncio.run(replay(base_url, model_name, plan,
                                     lambda r: synth.messages(r.input_tokens, seed=args.seed * 100_003 + r.index)))
        print("[4/4] per-tenant results, computed by ClickHouse from the usage ledger:\n", flush=True)
        period = Period(started_at, datetime.now(timezone.utc) + timedelta(minutes=1), "demo")
        with LedgerHttpClient(base_url, ADMIN_KEY) as reader:
            rows = []
            for _ in range(30):  # the spool drains to ClickHouse within a second or two
                rows = reader.usage_summary(period)
                if sum(r["requests"] for r in rows) >= sum(1 for r in results if r.status == 200):
                    break
                time.sleep(1)
        print_table(rows, results)
        ledger_dir = (run_dir / 'ledger').absolute()
        print(f"""
Where to look next
  metrics (Prometheus text):  {base_url}/metrics        (while the server runs)
  usage read API:             {base_url}/v1/usage/summary?period=<YYYY-MM-DD>   (Bearer <tenant or admin key>)
  ledger (embedded chDB):     {ledger_dir}
  dashboards:                 kvmeter dashboard --ledger-dsn chdb://{ledger_dir}
                              (or, with the server up: kvmeter dashboard --server {base_url} --api-key {ADMIN_KEY})
  billing:                    kvmeter billing report --ledger-dsn chdb://{ledger_dir} --period <YYYY-MM>
  server log:                 {log_path}""")
        if args.keep_running:
            print(f"\nThe server keeps running (pid {proc.pid}); stop it with: kill -INT {proc.pid}")
            return 0
        return 0
    except (RuntimeError, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.keep_running:
            stop_server(proc)
