"""The noisy neighbour: one tenant at 20 requests/min with 150k-token prompts and long outputs
beside 50 small chat tenants, on a simulated Llama-3.1-70B on H200s.

Must show: the small tenants' TTFT p95 stays inside their SLO under kvmeter's scheduler and does
not under FCFS. All tenants are paid interactive (TTFT SLO 2 s): the protection comes from
fairness among tenants, not from tiers. Small tenants: Poisson, 6 requests/min each (5 req/s in
all), lengths drawn from the Azure conv 2023 trace. The noisy tenant: 20 requests/min, 150,000
prompt tokens and 2,000 output tokens each. Deployment: one replica of 8 × H200 (TP 8),
``--long-prefill-token-threshold 2048`` on the engine for every policy (vLLM's knob for keeping one
long prefill from taking a whole step). Llama-3.1-70B's context is 131,072 tokens, so the shape
is run with a 160k window (a RoPE-scaled variant; the issue's scenario asks for 150k prompts).
RPM-limit allows every tenant 6 requests/min (the small tenants' rate).

Run: .venv/bin/python bench/fairness/scenario_noisy_neighbour.py [--seconds 600] [--long-prefill-threshold 2048]
"""

from __future__ import annotations

import argparse
import dataclasses
import random

import numpy as np

from common import md_table, run_policies, save
from kvmeter.serving.simulator import SimConfig
from kvmeter.traces import TraceRequest, load_trace
from kvmeter.serving.scheduler import SchedulerConfig

SIM = SimConfig(model="llama-3.1-70b", gpu="h200", tp=8, max_model_len=160_000,
                long_prefill_token_threshold=2048)


def workload(seconds: float, seed: int = 5) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    pick = random.Random(seed)
    lengths = load_trace("azure-conv")
    out = []
    t = rng.exponential(3.0)
    while t < seconds:
        out.append(TraceRequest(float(t), 150_000, 2_000, tenant_id="noisy", tier="paid_interactive"))
        t += rng.exponential(3.0)
    for i in range(50):
        t = rng.exponential(10.0)
        while t < seconds:
            src = pick.choice(lengths)
            out.append(TraceRequest(float(t), src.input_tokens, src.output_tokens, tenant_id=f"chat-{i:02d}",
                                    tier="paid_interactive"))
            t += rng.exponential(10.0)
    return out


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--long-prefill-threshold", type=int, default=2048)
    args = ap.parse_args()
    sim = dataclasses.replace(SIM, long_prefill_token_threshold=args.long_prefill_threshold)
    reqs = workload(args.seconds)
    slo = SchedulerConfig().tier("paid_interactive").ttft_slo_s
    runs = run_policies(reqs, sim, rpm_limit=6.0, vtc_config=SchedulerConfig(), label="noisy")
    rows, figures = [], {}
    for policy, (res, rep) in runs.items():
        small = [r for r in res.records if r.tenant_id != "noisy"]
        ok = sorted(r.first_token_s - r.arrival_s for r in small if r.outcome == "ok")
        p95 = float(np.percentile(ok, 95)) if ok else None
        p50 = float(np.percentile(ok, 50)) if ok else None
        served = sum(1 for r in small if r.outcome == "ok") / len(small)
        itl_slo = SchedulerConfig().tier("paid_interactive").itl_slo_s
        tpots = [(r.finish_s - r.first_token_s) / (r.generated - 1)
                 for r in small if r.outcome == "ok" and r.generated > 1]
        met = sum(1 for r in small if r.outcome == "ok" and r.first_token_s - r.arrival_s <= slo and
                  (r.generated < 2 or (r.finish_s - r.first_token_s) / (r.generated - 1) <= itl_slo)) / len(small)
        worst_tenant = max((g["ttft_s"]["p95"] or 0.0) for t, g in rep["tenants"].items() if t != "noisy")
        noisy = rep["tenants"]["noisy"]
        small_itl = rep["tiers"]["paid_interactive"]["itl_s"]
        figures[policy] = {
            "small_ttft_p50": p50, "small_ttft_p95": p95, "small_ttft_slo_s": slo,
            "small_p95_within_slo": p95 is not None and p95 <= slo,
            "small_tpot_p50": float(np.percentile(tpots, 50)), "small_tpot_p95": float(np.percentile(tpots, 95)),
            "small_slo_met_fraction": met,
            "worst_small_tenant_ttft_p95": worst_tenant, "small_served_fraction": served,
            "noisy_completed": noisy["completed"], "noisy_rejected": noisy["rejected"],
            "noisy_dropped": noisy["dropped"],
            "noisy_service_share": noisy["service_share"], "throughput_output_tokens_per_s":
                rep["overall"]["throughput_output_tokens_per_s"], "itl_all_s": small_itl,
            "kv_watermark_mean": rep["overall"]["kv_watermark_mean"], "preemptions": rep["overall"]["preemptions"],
        }
        rows.append([policy, round(p50, 3) if p50 is not None else None, round(p95, 3) if p95 is not None else None,
                     "yes" if figures[policy]["small_p95_within_slo"] else "no", round(worst_tenant, 3),
                     f"{served:.1%}", round(float(np.percentile(tpots, 50)), 3),
                     round(float(np.percentile(tpots, 95)), 3),
                     f"{met:.1%}", noisy["completed"], sum(noisy["rejected"].values()),
                     sum(noisy["dropped"].values()), noisy["service_share"], rep["overall"]["preemptions"]])
    table = md_table(["policy", "small TTFT p50 s", "small TTFT p95 s", f"p95 ≤ SLO {slo:g} s",
                      "worst small tenant p95 s", "small served", "small TPOT p50 s", "small TPOT p95 s",
                      "small SLO met (TTFT and TPOT)", "noisy completed", "noisy rejected",
                      "noisy dropped", "noisy service share", "preemptions"], rows)
    print(table)
    name = "noisy_neighbour" if args.long_prefill_threshold == 2048 else \
        f"noisy_neighbour_threshold{args.long_prefill_threshold}"
    save(name, {"requests": len(reqs), "sim": repr(sim), "figures": figures, "table": table})
    return figures


if __name__ == "__main__":
    main()
