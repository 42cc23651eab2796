"""Weights 1:2:3:4, all four tenants backlogged: service shares must be 1:2:3:4 within ±2 %.

Same simulated deployment as the two-tenant scenario (Llama-2-7B on one A10-class GPU); each tenant
offers 3 req/s of 256/256-token requests (≈ 5× capacity in all), so all stay backlogged for the
whole arrival window. Shares are the weighted service received in [60 s, end of arrivals]
(after warm-up, while everyone is backlogged). FCFS and RPM ignore weights; RPM's limit is a static
weighted split of the probed capacity (1:2:3:4 of it), the best a rate limiter can do.

Run: .venv/bin/python bench/fairness/scenario_weights.py [--seconds 1800]
"""

from __future__ import annotations

import argparse

import numpy as np

from common import capacity_rps, md_table, run_policies, save, service_in_window
from kvmeter.serving.simulator import SimConfig
from kvmeter.traces import TraceRequest
from kvmeter.serving.scheduler import SchedulerConfig

SIM = SimConfig(model="llama-2-7b", gpu="a10", tp=1, max_num_batched_tokens=4096)
WEIGHTS = {"w1": 1.0, "w2": 2.0, "w3": 3.0, "w4": 4.0}


def workload(seconds: float, seed: int = 1) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    out = []
    for tenant in WEIGHTS:
        t = rng.exponential(1 / 3.0)
        while t < seconds:
            out.append(TraceRequest(float(t), 256, 256, tenant_id=tenant, tier="paid_interactive"))
            t += rng.exponential(1 / 3.0)
    return out


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=1800.0)
    args = ap.parse_args()
    cap = capacity_rps(lambda n: [TraceRequest(0.0, 256, 256, tenant_id="x")] * n, SIM, n=1000)
    reqs = workload(args.seconds)
    vtc = SchedulerConfig.plain_baseline(tenant_weights=WEIGHTS)
    # RPM: each tenant limited to its weighted part of the probed capacity (w/10 of it)
    limits = {t: cap * w / 10 * 60 for t, w in WEIGHTS.items()}
    runs = run_policies(reqs, SIM, rpm_limit=cap * 60, vtc_config=vtc, label="weights",
                        baseline_extra={"tenant_weights": WEIGHTS, "tenant_rpm_limits": limits})
    rows, figures = [], {}
    for policy, (res, rep) in runs.items():
        svc = service_in_window(res, 60.0, args.seconds)
        total = sum(svc[t] for t in WEIGHTS)
        shares = {t: svc[t] / total for t in WEIGHTS}
        err = {t: shares[t] / (WEIGHTS[t] / 10) - 1 for t in WEIGHTS}
        figures[policy] = {"shares": shares, "relative_error": err,
                           "max_abs_relative_error": max(abs(e) for e in err.values()),
                           "rejected": rep["overall"]["rejected"]}
        rows.append([policy] + [f"{shares[t]:.4f} ({err[t]:+.1%})" for t in WEIGHTS] +
                    [f"{max(abs(e) for e in err.values()):.1%}", sum(rep["overall"]["rejected"].values())])
    table = md_table(["policy", "w1 share (target 0.1)", "w2 (0.2)", "w3 (0.3)", "w4 (0.4)", "max |error|",
                      "rejected"], rows)
    print(table)
    save("weights", {"capacity_rps": cap, "requests": len(reqs), "figures": figures, "table": table})
    return figures


if __name__ == "__main__":
    main()
