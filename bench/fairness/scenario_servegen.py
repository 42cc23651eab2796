"""The ServeGen per-client workload: Jain's index and max service gap under FCFS, RPM and VTC.

Arrivals: ServeGen's per-client rates for its busiest hour (``servegen_m-large_perclient_2days.csv``;
each client's 10-minute windows as gamma renewal processes matching the window's rate and CV),
scaled to 1.3× the probed capacity; token lengths drawn from the Azure conv 2023 trace. All
tenants in one tier so that fairness among tenants is what is measured. Deployment: Llama-3.1-70B,
one replica of 4 × H200 (simulated). RPM-limit: each tenant may send 2× an equal split of the
probed capacity per minute (a generous static quota); we count its refusals issued while the
scheduler had no queue (capacity free). VTC runs with kvmeter's defaults (overload control on).
Latency is also shown for the tenants that offer less than an equal split of capacity: a fair
scheduler owes them all they ask for, fast.

Run: .venv/bin/python bench/fairness/scenario_servegen.py [--seconds 1800]
"""

from __future__ import annotations

import argparse
import random

from common import capacity_rps, md_table, run_policies, save
from kvmeter.serving.simulator import SimConfig, Simulation, build_report
from kvmeter.serving.simulator.tenants import busiest_hour_start, load_servegen_rates, servegen_arrivals
from kvmeter.traces import load_trace
from kvmeter.serving.scheduler import SchedulerConfig

SIM = SimConfig(model="llama-3.1-70b", gpu="h200", tp=4)


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=1800.0)
    ap.add_argument("--load", type=float, default=1.3, help="offered load as a multiple of capacity")
    args = ap.parse_args()
    lengths = load_trace("azure-conv")
    rnd = random.Random(0)
    cap = capacity_rps(lambda n: [rnd.choice(lengths) for _ in range(n)], SIM, n=3000)
    rates = load_servegen_rates()
    start = busiest_hour_start(rates)
    reqs = servegen_arrivals(rates, start_s=start, duration_s=args.seconds, lengths=lengths,
                             total_rate_rps=args.load * cap, seed=7, tier_of=lambda t: "paid_interactive")
    tenants = sorted({r.tenant_id for r in reqs})
    print(f"capacity ≈ {cap:.2f} req/s; {len(reqs)} requests from {len(tenants)} ServeGen clients "
          f"(hour starting at {start} s), offered {len(reqs) / args.seconds:.2f} req/s")
    rpm = 2 * cap * 60 / len(tenants)
    offered: dict[str, int] = {}
    for r in reqs:
        offered[r.tenant_id] = offered.get(r.tenant_id, 0) + 1
    top5 = sorted(offered, key=offered.get, reverse=True)[:5]
    print(f"5 heaviest clients {top5} offer {sum(offered[t] for t in top5) / len(reqs):.0%} of requests")
    # tenants asking for less than an equal split of capacity: a fair scheduler owes them all of it
    heavy = {t for t, n in offered.items() if n / args.seconds >= cap / len(tenants)}
    print(f"{len(tenants) - len(heavy)} of {len(tenants)} tenants offer less than an equal share "
          f"({cap / len(tenants):.3f} req/s) — {sum(n for t, n in offered.items() if t not in heavy) / len(reqs):.0%} "
          "of requests")
    runs = run_policies(reqs, SIM, rpm_limit=rpm, vtc_config=SchedulerConfig(), label="servegen")
    # VTC order alone (the plain baseline's settings: no deadlines, shedding, KV or prefill budget
    # or adaptive engine limit), to separate ordering from overload control
    plain = SchedulerConfig.plain_baseline()
    res = Simulation(reqs, policy="vtc", scheduler_config=plain, sim=SIM).run()
    runs["vtc, overload control off"] = (res, build_report(res, trace="servegen"))
    rows, figures = [], {}
    for policy, (res, rep) in runs.items():
        o = rep["overall"]
        rej = [r for r in res.records if r.outcome == "rejected"]
        rej_free = sum(1 for r in rej if r.queued_at_arrival == 0)
        light = [r.first_token_s - r.arrival_s for r in res.records
                 if r.outcome == "ok" and r.tenant_id not in heavy]
        light.sort()
        small_ttft_p95 = light[int(0.95 * (len(light) - 1))] if light else None
        light_all = [r for r in res.records if r.tenant_id not in heavy]
        light_served = sum(1 for r in light_all if r.outcome == "ok") / len(light_all)
        done_in_window = sum(r.generated for r in res.records if r.outcome == "ok" and r.finish_s <= args.seconds)
        figures[policy] = {
            "jain_index": o["jain_index"], "jain_tenants": o["jain_tenants"],
            "max_service_gap": o["max_service_gap"],
            "throughput_output_tokens_per_s": o["throughput_output_tokens_per_s"],
            "output_tokens_per_s_in_window": done_in_window / args.seconds,
            "goodput_output_tokens_per_s": o["goodput_output_tokens_per_s"], "slo_attainment": o["slo_attainment"],
            "completed": o["completed"], "rejected": o["rejected"], "dropped": o["dropped"],
            "rejected_while_capacity_free": rej_free, "ttft_p50": o["ttft_s"]["p50"], "ttft_p95": o["ttft_s"]["p95"],
            "under_equal_share_ttft_p95": small_ttft_p95, "under_equal_share_served_fraction": light_served,
            "sg104_service_share": rep["tenants"]["sg-104"]["service_share"],
            "kv_watermark_mean": o["kv_watermark_mean"], "sim_span_s": res.sim_end_s, "wall_s": res.wall_s,
        }
        rows.append([policy, o["jain_index"], o["max_service_gap"], round(done_in_window / args.seconds, 1),
                     o["goodput_output_tokens_per_s"], o["completed"], sum(o["rejected"].values()),
                     sum(o["dropped"].values()), rej_free, o["ttft_s"]["p50"], o["ttft_s"]["p95"],
                     small_ttft_p95, round(light_served, 4), rep["tenants"]["sg-104"]["service_share"]])
    table = md_table(["policy", "Jain", "max service gap", "out tok/s in window", "goodput tok/s", "completed",
                      "rejected", "dropped", "rejected while queue empty", "TTFT p50 s", "TTFT p95 s",
                      "TTFT p95 s, tenants under an equal share", "served fraction, same tenants", "sg-104 share"],
                     rows)
    print(table)
    save("servegen", {"capacity_rps": cap, "requests": len(reqs), "tenants": len(tenants), "rpm_limit": rpm,
                      "servegen_start_s": start, "figures": figures, "table": table})
    return figures


if __name__ == "__main__":
    main()
