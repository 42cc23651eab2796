"""Fairness-aware admission (issue 17, item 3): two backlogged tenants at demand 1:3 through
``kvmeter simulate`` with its default settings, overload control on and off.

Must show: with overload control on (the default) the service ratio while both are backlogged
stays within 1:1.05, as with it off — the early refusals fall on each tenant's excess over its
fair share, so the tenant asking for less is not the one refused. Setting: ``kvmeter simulate``'s
defaults (policy vtc, Llama-3.1-70B on one 4 × H200 replica, calibrated profile, the built-in
paid_interactive tier: TTFT SLO 2 s, deadline 6 s); Poisson arrivals of 256-token prompts with
256-token outputs (probed capacity ≈ 18 req/s), A at ``a`` req/s and B at ``3a``. ``a`` = 10 puts A
at about its half of capacity (the edge: A is backlogged only in its bursts); 15 and 20 put it
well above. Service ratio = backlogged service rates (``serving/scheduler/fairness.py``).

Run: .venv/bin/python bench/fairness/scenario_admission.py [--seconds 600] [--a 10 15 20]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
from pathlib import Path


from common import capacity_rps, md_table, save
from kvmeter.cli import main as kvmeter_main
from kvmeter.serving.simulator import SimConfig
from kvmeter.traces import TraceRequest, write_poisson_trace


def simulate(trace: Path, out: Path, *flags: str) -> dict:
    argv = ["simulate", "--trace", str(trace), "--tenants", "column", "--no-progress", "--out", str(out), *flags]
    with contextlib.redirect_stdout(io.StringIO()):
        rc = kvmeter_main(argv)
    if rc != 0:
        raise SystemExit(f"kvmeter {' '.join(argv)} exited {rc}")
    return json.loads(Path(f"{out}.json").read_text())


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--a", type=float, nargs="+", default=[10.0, 15.0, 20.0], help="A's rate (B's is 3×)")
    ap.add_argument("--big", choices=("A", "B"), default=None,
                    help="instead: this tenant sends 4,000-token prompts (the other 256), service demand "
                         "1:3 at 2.5× capacity")
    args = ap.parse_args()
    cap = capacity_rps(lambda n: [TraceRequest(0.0, 256, 256, tenant_id="x")] * n, SimConfig(), n=2000)
    print(f"capacity ≈ {cap:.2f} req/s (FCFS, no limits)")
    rows, figures = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        cases = [(a, {"A": a, "B": 3 * a}, None) for a in args.a]
        if args.big:
            # service per request (1 × prompt + 2 × output): 4,512 big, 768 small; A : B = 1 : 3
            total = cap * 768 * 2.5
            cost = {t: 4512 if t == args.big else 768 for t in ("A", "B")}
            rates = {"A": total / 4 / cost["A"], "B": total * 3 / 4 / cost["B"]}
            cases = [(rates["A"], rates, {args.big: 4000})]
        for i, (a, rates, prompts) in enumerate(cases):
            trace = Path(tmp) / f"two_{i}.csv"
            n = write_poisson_trace(trace, rates, args.seconds, input_tokens=prompts)
            for label, flags in (("on", ()), ("off", ("--no-overload-control",))):
                rep = simulate(trace, Path(tmp) / f"sim_{i}_{label}", *flags)
                ta, tb = rep["tenants"]["A"], rep["tenants"]["B"]
                ratio = tb["backlogged_service_rate"] / ta["backlogged_service_rate"]
                refused = {k: (sum(g["rejected"].values()), sum(g["dropped"].values()))
                           for k, g in (("A", ta), ("B", tb))}
                key = f"A {rates['A']:.3g}/s, B {rates['B']:.3g}/s, overload control {label}"
                figures[key] = {"requests": n, "service_ratio_A_to_B_while_backlogged": 1 / ratio,
                                "A": {"requests": ta["requests"], "completed": ta["completed"],
                                      "rejected": ta["rejected"], "dropped": ta["dropped"],
                                      "service_share": ta["service_share"]},
                                "B": {"requests": tb["requests"], "completed": tb["completed"],
                                      "rejected": tb["rejected"], "dropped": tb["dropped"],
                                      "service_share": tb["service_share"]},
                                "goodput_output_tokens_per_s": rep["overall"]["goodput_output_tokens_per_s"],
                                "throughput_output_tokens_per_s": rep["overall"]["throughput_output_tokens_per_s"],
                                "sim_wall_s": rep["meta"]["wall_s"]}
                rows.append([f"{rates['A']:.3g} : {rates['B']:.3g}" + (f" ({args.big} 4k prompts)" if prompts else ""),
                             label, f"1 : {ratio:.3f}",
                             f"{ta['completed']}/{ta['requests']}", f"{refused['A'][0]} / {refused['A'][1]}",
                             f"{tb['completed']}/{tb['requests']}", f"{refused['B'][0]} / {refused['B'][1]}",
                             f"{ta['service_share']:.3f} : {tb['service_share']:.3f}",
                             rep["overall"]["goodput_output_tokens_per_s"]])
                print(f"  A {a:g}/s overload control {label}: 1 : {ratio:.3f}", flush=True)
    table = md_table(["req/s A : B", "overload control", "service A:B (backlogged)", "A completed",
                      "A refused early / dropped", "B completed", "B refused early / dropped",
                      "service share A : B", "goodput tok/s"], rows)
    print(table)
    save("admission" + (f"_big_{args.big}" if args.big else ""),
         {"capacity_rps": cap, "seconds": args.seconds, "figures": figures, "table": table})
    return figures


if __name__ == "__main__":
    main()
