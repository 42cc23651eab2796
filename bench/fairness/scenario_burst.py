"""A 2× burst lasting 10 minutes over tiers: paid-interactive goodput stays ≥ 90 % of its pre-burst
value, queues stay bounded, free and batch are shed first.

Workload: 40 tenants — 4 enterprise, 20 paid interactive, 6 batch, 10 free — each a Poisson stream
of Azure conv 2023 requests (real lengths), together 0.7× the probed capacity for 10 minutes, then
2× that (1.4× capacity) for 10 minutes, then back for 10 minutes. Deployment: Llama-3.1-70B on one
4 × H200 replica (simulated). Goodput = output tokens/s of requests that met their tier's TTFT and
TPOT objectives, counted by arrival window (pre-burst 5–10 min, burst 10–20 min). RPM-limit allows
each tenant 1.5× an equal split of capacity.

Run: .venv/bin/python bench/fairness/scenario_burst.py
"""

from __future__ import annotations

import random

import numpy as np

from common import capacity_rps, md_table, run_policies, save, window_goodput
from kvmeter.serving.simulator import SimConfig
from kvmeter.traces import TraceRequest, load_trace
from kvmeter.serving.scheduler import SchedulerConfig

SIM = SimConfig(model="llama-3.1-70b", gpu="h200", tp=4)
LAYOUT = {"enterprise": 4, "paid_interactive": 20, "batch": 6, "free": 10}
BASE_LOAD, BURST = 0.7, 2.0
T_BURST0, T_BURST1, T_END = 600.0, 1200.0, 1800.0


def workload(cap: float, seed: int = 11) -> list[TraceRequest]:
    lengths = load_trace("azure-conv")
    rng = np.random.default_rng(seed)
    pick = random.Random(seed)
    tenants = [(f"{tier}-{i}", tier) for tier, n in LAYOUT.items() for i in range(n)]
    per_tenant = BASE_LOAD * cap / len(tenants)
    out = []
    for tenant, tier in tenants:
        t = 0.0
        while True:
            rate = per_tenant * (BURST if T_BURST0 <= t < T_BURST1 else 1.0)
            t += rng.exponential(1 / rate)
            if t >= T_END:
                break
            src = pick.choice(lengths)
            out.append(TraceRequest(t, src.input_tokens, src.output_tokens, tenant_id=tenant, tier=tier))
    return out


def main() -> dict:
    lengths = load_trace("azure-conv")
    rnd = random.Random(0)
    cap = capacity_rps(lambda n: [rnd.choice(lengths) for _ in range(n)], SIM, n=3000)
    reqs = workload(cap)
    print(f"capacity ≈ {cap:.2f} req/s; base {BASE_LOAD * cap:.2f} req/s, burst {BASE_LOAD * BURST * cap:.2f} "
          f"req/s; {len(reqs)} requests")
    runs = run_policies(reqs, SIM, rpm_limit=1.5 * cap * 60 / sum(LAYOUT.values()), vtc_config=SchedulerConfig(),
                        label="burst")
    rows, figures = [], {}
    for policy, (res, rep) in runs.items():
        pre = window_goodput(res, "paid_interactive", 300.0, T_BURST0)
        during = window_goodput(res, "paid_interactive", T_BURST0, T_BURST1)
        ent_pre = window_goodput(res, "enterprise", 300.0, T_BURST0)
        ent_during = window_goodput(res, "enterprise", T_BURST0, T_BURST1)
        refused = {tier: 0 for tier in LAYOUT}
        arrived = {tier: 0 for tier in LAYOUT}
        for r in res.records:
            if T_BURST0 <= r.arrival_s < T_BURST1:
                arrived[r.tier] += 1
                if r.outcome != "ok":
                    refused[r.tier] += 1
        max_q = max(s.queued_total for s in res.samples)
        burst_q = [s.queued_total for s in res.samples if T_BURST0 <= s.t < T_BURST1]
        figures[policy] = {
            "paid_goodput_pre": pre, "paid_goodput_burst": during,
            "paid_goodput_ratio": during / pre if pre else None,
            "enterprise_goodput_ratio": ent_during / ent_pre if ent_pre else None,
            "max_queued": max_q, "queued_at_burst_end": burst_q[-1] if burst_q else None,
            "refused_in_burst_by_tier": refused, "arrived_in_burst_by_tier": arrived,
            "reasons": {"rejected": rep["overall"]["rejected"], "dropped": rep["overall"]["dropped"]},
            "tier_slo_attainment": {t: g["slo_attainment"] for t, g in rep["tiers"].items()},
            "max_pressure_level": max(s.pressure_level for s in res.samples),
        }
        rows.append([policy, round(pre, 1), round(during, 1), f"{during / pre:.1%}" if pre else "–",
                     f"{ent_during / ent_pre:.1%}" if ent_pre else "–", max_q,
                     *(f"{refused[t]}/{arrived[t]}" for t in ("enterprise", "paid_interactive", "batch", "free")),
                     rep["tiers"]["paid_interactive"]["ttft_s"]["p95"]])
    table = md_table(["policy", "paid goodput pre tok/s", "paid goodput burst tok/s", "paid burst/pre",
                      "enterprise burst/pre", "max queued", "refused in burst: enterprise", "paid", "batch",
                      "free", "paid TTFT p95 s"], rows)
    print(table)
    save("burst", {"capacity_rps": cap, "requests": len(reqs), "figures": figures, "table": table})
    return figures


if __name__ == "__main__":
    main()
