"""Scheduler cost: one dispatch decision with 10,000 tenants and 100,000 queued requests.

Must show ≤ 20 µs per decision. The core holds 100,000 queued requests spread over 10,000 tenants
(random prompt lengths); each iteration times one ``dispatch(max_grants=1)`` (pick tier, pick
tenant, check gates and budgets, charge the prompt, make the grant), then — untimed — streams a
few output tokens, releases the grant, reports engine load and submits a new request so the queue
stays at 100,000. The clock advances 1 ms per iteration and the periodic ``tick()`` (pressure
evaluation every 0.5 s, fairness sampling every 1 s, both O(backlogged tenants)) runs each
iteration, timed apart and reported amortised per decision. Submit (admission + enqueue) and
charge_output costs are timed too. Run: .venv/bin/python bench/fairness/bench_scheduler_cost.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from common import md_table, save
from kvmeter.attribution import Attribution
from kvmeter.clock import ManualClock
from kvmeter.serving.scheduler import Job, SchedulerConfig, SchedulerCore
from kvmeter.stats import EngineLoad


def run(policy: str, tenants: int, queued: int, decisions: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    clock = ManualClock()
    cfg = SchedulerConfig(max_queued_total=2 * queued, max_queued_per_tenant=10 * queued // tenants,
                          max_engine_running=10 ** 9, max_engine_waiting=10 ** 9)
    core = SchedulerCore(cfg, policy=policy, clock=clock)
    load = EngineLoad(0.0, 10 ** 9, 0, 0)
    core.on_engine_load(load)
    n = 0

    def new_job() -> Job:
        nonlocal n
        n += 1
        return Job(f"r{n}", Attribution(f"t{rng.randrange(tenants)}", tier="paid_interactive"),
                   rng.randrange(16, 4096), 256, clock.monotonic(), deadline_s=1e12)

    t0 = time.perf_counter()
    for _ in range(queued):
        core.submit(new_job())
    fill_s = time.perf_counter() - t0
    dispatch_t, submit_t, charge_t = [], [], []
    tick_total = 0.0
    pc = time.perf_counter
    for _ in range(decisions):
        clock.advance(0.001)
        a = pc()
        core.tick()
        tick_total += pc() - a
        a = pc()
        grants = core.dispatch(max_grants=1)
        b = pc()
        dispatch_t.append(b - a)
        g = grants[0]
        a = pc()
        core.charge_output(g, 4)
        charge_t.append(pc() - a)
        core.release(g)
        core.on_engine_load(load)
        j = new_job()
        a = pc()
        core.submit(j)
        submit_t.append(pc() - a)
    assert core.queued_total == queued

    def us(xs, q):
        xs = sorted(xs)
        return xs[int(q * (len(xs) - 1))] * 1e6

    return {"policy": policy, "tenants": tenants, "queued": queued, "decisions": decisions,
            "dispatch_us_p50": us(dispatch_t, 0.5), "dispatch_us_p99": us(dispatch_t, 0.99),
            "dispatch_us_mean": statistics.fmean(dispatch_t) * 1e6,
            "submit_us_p50": us(submit_t, 0.5), "submit_us_p99": us(submit_t, 0.99),
            "charge_us_p50": us(charge_t, 0.5), "fill_s": fill_s,
            "tick_us_amortised_per_decision": tick_total / decisions * 1e6}


def main() -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tenants", type=int, default=10_000)
    ap.add_argument("--queued", type=int, default=100_000)
    ap.add_argument("--decisions", type=int, default=50_000)
    args = ap.parse_args()
    results = [run(p, args.tenants, args.queued, args.decisions) for p in ("vtc", "fcfs")]
    rows = [[r["policy"], r["tenants"], r["queued"], r["decisions"], round(r["dispatch_us_p50"], 2),
             round(r["dispatch_us_p99"], 2), round(r["dispatch_us_mean"], 2), round(r["submit_us_p50"], 2),
             round(r["submit_us_p99"], 2), round(r["charge_us_p50"], 2),
             round(r["tick_us_amortised_per_decision"], 2)] for r in results]
    table = md_table(["policy", "tenants", "queued", "decisions", "dispatch p50 µs", "dispatch p99 µs",
                      "dispatch mean µs", "submit p50 µs", "submit p99 µs", "charge_output p50 µs",
                      "periodic tick µs per decision (amortised)"], rows)
    print(table)
    save("scheduler_cost", {"results": results, "table": table})
    return results


if __name__ == "__main__":
    main()
