"""Routing at GPU scale in the simulator, beside llm-d's published prefix-cache benchmark (issue 17).

llm-d's "KV-Cache Wins You Can See" (llm-d.ai/blog/kvcache-wins-you-can-see) measured 8 vLLM pods
× 2 H100 (TP 2) serving Qwen-32B to 150 tenants, each with a 6,000-token shared prefix and
1,200-token queries, Poisson arrivals ramped from 3 to 60 QPS: TTFT p90 0.54 s with precise
prefix-cache-aware scheduling, 31 s approximate, 95 s load-only. This script builds that
workload and runs it through the discrete-event simulator (``serving/simulator``) with each of
the engine pool router's policies (``serving/scheduler/router.py``) side by side, on the same
request list in the same process:

* ``prefix_aware`` — the router's LRU index of chained prefix-block hashes, scored against KV use
  and queue depth. It records what the router *sent* where (the index is not fed by the engines'
  KV events), so it is closer to llm-d's *approximate* scorer than to its precise one;
* ``least_kv`` — the replica with the most free KV (load only);
* ``round_robin``.

Workload: tenant ``k``'s prefix is 6,000 token ids drawn once from its own generator (vocabulary
152,064); every request is that prefix plus 1,200 fresh ids, its blocks hashed by the one
definition the router and the re-prefill tracker use (:func:`kvmeter.tokens.prefix_block_hashes`,
vLLM's chaining) in blocks of ``--group-tokens`` (400: a multiple of vLLM's 16-token block that
divides both 6,000 and 1,200, so the 15 prefix blocks are shared exactly as vLLM's 375 16-token
blocks are and the 3 query blocks never are; the simulator's prefix cache keys on the same
hashes). Tenants are drawn uniformly per request; arrivals are Poisson at each step's rate for
``--step-seconds``; outputs ``--output-tokens`` (default 128 — llm-d's run used short outputs; the
exact length is not in the post). Model ``qwen2.5-32b`` (``serving/simulator/models.py``), GPU
``h100`` (calibrated operator profile), TP 2, 8 replicas, prefix caching on, FCFS with plain
baseline settings (no kvmeter admission control, no budgets: llm-d compares routing, not
admission), vLLM's default engine limits.

Per arrival step it reports TTFT p50/p90 of the requests arriving in it, the prefix-cache hit
ratio (cached prompt tokens / prompt tokens of those requests) and throughput (output tokens of
requests finishing in the step's window, per second).

Run: .venv/bin/python bench/fairness/scenario_llmd.py [--step-seconds 60] [--steps 3 10 20 ...]
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from common import md_table, save
from kvmeter.serving.scheduler import SchedulerConfig
from kvmeter.serving.simulator import SimConfig, Simulation
from kvmeter.tokens import prefix_block_hashes
from kvmeter.traces import TraceRequest

ROUTINGS = ("prefix_aware", "least_kv", "round_robin")
#: llm-d's published TTFT p90 (seconds) over its 3 → 60 QPS ramp, by scheduler.
LLMD_TTFT_P90_S = {"precise prefix-cache aware": 0.54, "approximate prefix-cache aware": 31.0,
                   "load only": 95.0}
VOCAB = 152_064


def workload(steps: list[float], step_s: float, *, tenants: int, prefix: int, query: int, output: int,
             group_tokens: int, seed: int) -> list[TraceRequest]:
    """Poisson arrivals at ``steps[i]`` req/s during ``[i·step_s, (i+1)·step_s)``, each of a
    uniformly drawn tenant: its ``prefix`` shared ids + ``query`` fresh ids, ``output`` tokens out."""
    rng = np.random.default_rng(seed)
    prefixes = [np.random.default_rng([seed, k]).integers(0, VOCAB, prefix).tolist() for k in range(tenants)]
    out: list[TraceRequest] = []
    for i, qps in enumerate(steps):
        t = i * step_s + rng.exponential(1.0 / qps)
        while t < (i + 1) * step_s:
            k = int(rng.integers(tenants))
            ids = prefixes[k] + rng.integers(0, VOCAB, query).tolist()
            out.append(TraceRequest(round(t, 6), prefix + query, output,
                                    prefix_block_hashes(ids, group_tokens), tenant_id=f"t{k:03d}"))
            t += rng.exponential(1.0 / qps)
    return out


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else math.nan


def per_step(res, steps: list[float], step_s: float) -> list[dict]:
    rows = []
    for i, qps in enumerate(steps):
        lo, hi = i * step_s, (i + 1) * step_s
        arr = [r for r in res.records if lo <= r.arrival_s < hi]
        ok = [r for r in arr if r.outcome == "ok"]
        ttft = [r.first_token_s - r.arrival_s for r in ok]
        done = [r for r in res.records if r.outcome == "ok" and lo <= r.finish_s < hi]
        rows.append({"qps": qps, "requests": len(arr), "completed": len(ok),
                     "ttft_p50_s": _pct(ttft, 50), "ttft_p90_s": _pct(ttft, 90),
                     "prefix_hit_ratio": sum(r.cached_tokens for r in ok) / max(1, sum(r.input_tokens for r in ok)),
                     "throughput_output_tokens_per_s": sum(r.generated for r in done) / step_s})
    return rows


def overall(res) -> dict:
    ok = [r for r in res.records if r.outcome == "ok"]
    ttft = [r.first_token_s - r.arrival_s for r in ok]
    span = max(r.finish_s for r in ok) - min(r.arrival_s for r in res.records)
    return {"requests": len(res.records), "completed": len(ok), "ttft_p50_s": _pct(ttft, 50),
            "ttft_p90_s": _pct(ttft, 90),
            "prefix_hit_ratio": sum(r.cached_tokens for r in ok) / max(1, sum(r.input_tokens for r in ok)),
            "throughput_output_tokens_per_s": sum(r.generated for r in ok) / span,
            "sim_end_s": res.sim_end_s, "wall_s": res.wall_s}


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=float, nargs="+", default=[3, 10, 20, 30, 40, 50, 60],
                    help="QPS of each step of the ramp")
    ap.add_argument("--step-seconds", type=float, default=60.0)
    ap.add_argument("--tenants", type=int, default=150)
    ap.add_argument("--prefix-tokens", type=int, default=6000)
    ap.add_argument("--query-tokens", type=int, default=1200)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--group-tokens", type=int, default=400)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--routing", nargs="+", choices=ROUTINGS, default=list(ROUTINGS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    reqs = workload(args.steps, args.step_seconds, tenants=args.tenants, prefix=args.prefix_tokens,
                    query=args.query_tokens, output=args.output_tokens, group_tokens=args.group_tokens,
                    seed=args.seed)
    print(f"{len(reqs)} requests over {len(args.steps)} steps of {args.step_seconds:g} s "
          f"(built in {time.perf_counter() - t0:.1f} s)", flush=True)
    figures: dict = {"args": vars(args), "llmd_published_ttft_p90_s": LLMD_TTFT_P90_S, "runs": {}}
    step_rows, sum_rows = [], []
    for routing in args.routing:
        sim = SimConfig(model="qwen2.5-32b", gpu="h100", tp=2, replicas=args.replicas, routing=routing,
                        group_tokens=args.group_tokens)
        print(f"routing {routing}: simulating …", flush=True)
        res = Simulation(reqs, policy="fcfs", scheduler_config=SchedulerConfig.plain_baseline(), sim=sim,
                         progress=not args.no_progress).run()
        steps, tot = per_step(res, args.steps, args.step_seconds), overall(res)
        figures["runs"][routing] = {"steps": steps, "overall": tot, "cost_model": res.cost}
        print(f"routing {routing}: {res.sim_end_s:.0f} s simulated in {res.wall_s:.0f} s; TTFT p90 "
              f"{tot['ttft_p90_s']:.2f} s, hit ratio {tot['prefix_hit_ratio']:.3f}", flush=True)
        for s in steps:
            step_rows.append([routing, f"{s['qps']:g}", s["requests"], f"{s['ttft_p50_s']:.2f}",
                              f"{s['ttft_p90_s']:.2f}", f"{s['prefix_hit_ratio']:.3f}",
                              f"{s['throughput_output_tokens_per_s']:,.0f}"])
        sum_rows.append([routing, tot["requests"], f"{tot['ttft_p50_s']:.2f}", f"{tot['ttft_p90_s']:.2f}",
                         f"{tot['prefix_hit_ratio']:.3f}", f"{tot['throughput_output_tokens_per_s']:,.0f}",
                         f"{tot['wall_s']:.0f}"])
    steps_table = md_table(["routing", "QPS", "requests", "TTFT p50 s", "TTFT p90 s", "prefix hit ratio",
                            "output tok/s"], step_rows)
    summary = md_table(["routing", "requests", "TTFT p50 s", "TTFT p90 s", "prefix hit ratio",
                        "output tok/s", "wall s"], sum_rows)
    print(summary)
    print(steps_table)
    figures["steps_table"], figures["summary_table"] = steps_table, summary
    save("llmd", figures)
    return figures


if __name__ == "__main__":
    main()
