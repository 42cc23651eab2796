"""Two backlogged tenants at 1.5 and 3 req/s, 256 input / 256 output tokens, over capacity.

Must show: FCFS serves them about 1:2; VTC within 1:1.05; VTC's throughput within 2 % of FCFS.
Setting: the VTC paper's (Sheng et al., OSDI 2024, §5.2) — Llama-2-7B on one A10-class GPU —
simulated. Service ratio = service received while both tenants were backlogged (the paper's
measure); throughput = tokens processed per second over the run. Every policy runs with the
plain baseline's settings (no overload control, KV or prefill budget) so that only the dispatch
order differs (a row with kvmeter's default KV budget is added); RPM-limit allows each tenant half
the probed capacity.

Run: .venv/bin/python bench/fairness/scenario_two_tenants.py [--seconds 1800]
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from common import capacity_rps, md_table, run_policies, save
from kvmeter.serving.simulator import SimConfig, Simulation, build_report
from kvmeter.traces import TraceRequest
from kvmeter.serving.scheduler import SchedulerConfig

SIM = SimConfig(model="llama-2-7b", gpu="a10", tp=1, max_num_batched_tokens=4096)


def workload(seconds: float, seed: int = 0) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    out = []
    for tenant, rate in (("A", 1.5), ("B", 3.0)):
        t = rng.exponential(1 / rate)
        while t < seconds:
            out.append(TraceRequest(float(t), 256, 256, tenant_id=tenant, tier="paid_interactive"))
            t += rng.exponential(1 / rate)
    return out


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=1800.0)
    args = ap.parse_args()
    cap = capacity_rps(lambda n: [TraceRequest(0.0, 256, 256, tenant_id="x")] * n, SIM, n=1000)
    print(f"capacity ≈ {cap:.2f} req/s; offered 4.5 req/s ({4.5 / cap:.1f}× capacity)")
    reqs = workload(args.seconds)
    vtc = SchedulerConfig.plain_baseline()
    runs = run_policies(reqs, SIM, rpm_limit=cap / 2 * 60, vtc_config=vtc, label="two-tenants")
    # the same with kvmeter's default per-tenant KV budget (half the KV), for transparency: the budget
    # is strict, so once only B is left (the drain) B cannot use the whole cache
    budget = dataclasses.replace(vtc, tenant_kv_budget_ratio=0.5)
    res = Simulation(reqs, policy="vtc", scheduler_config=budget, sim=SIM).run()
    runs["vtc+kv-budget"] = (res, build_report(res, trace="two-tenants"))
    rows, figures = [], {}
    for policy, (res, rep) in runs.items():
        rates = res.backlogged_rates
        ratio = rates.get("A", 0) / rates["B"] if rates.get("B") else None
        total_tokens = sum(r.input_tokens + r.generated for r in res.records if r.outcome == "ok")
        tput = total_tokens / res.sim_end_s
        svc = rep["tenants"]
        figures[policy] = {
            "service_ratio_A_to_B_while_backlogged": ratio,
            "throughput_tokens_per_s": tput,
            "makespan_s": res.sim_end_s,
            "completed": rep["overall"]["completed"], "rejected": rep["overall"]["rejected"],
            "ttft_p50_A": svc["A"]["ttft_s"]["p50"], "ttft_p50_B": svc["B"]["ttft_s"]["p50"],
            "jain_index": rep["overall"]["jain_index"], "max_service_gap": rep["overall"]["max_service_gap"],
        }
        rows.append([policy, f"1 : {1 / ratio:.3f}" if ratio else "–", round(tput, 1), round(res.sim_end_s, 1),
                     rep["overall"]["completed"], sum(rep["overall"]["rejected"].values()),
                     svc["A"]["ttft_s"]["p50"], svc["B"]["ttft_s"]["p50"], rep["overall"]["jain_index"],
                     rep["overall"]["max_service_gap"]])
    fcfs_t = figures["fcfs"]["throughput_tokens_per_s"]
    for f in figures.values():
        f["throughput_vs_fcfs"] = f["throughput_tokens_per_s"] / fcfs_t
    table = md_table(["policy", "service A:B (backlogged)", "throughput tok/s", "makespan s", "completed",
                      "rejected", "TTFT p50 A s", "TTFT p50 B s", "Jain", "max service gap"], rows)
    print(table)
    save("two_tenants", {"capacity_rps": cap, "sim": SIM.__repr__(), "requests": len(reqs),
                         "figures": figures, "table": table})
    return figures


if __name__ == "__main__":
    main()
