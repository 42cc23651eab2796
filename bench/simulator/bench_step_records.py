"""The simulator's speed with and without its per-step records (issue 14: the simulator emits the
serve path's stats on a bus, :mod:`kvmeter.serving.simulator.publish`).

The same trace (``azure-conv``, the first ``--limit`` requests, VTC, Llama-3.1-70B on 4 × H200)
simulated three ways, interleaved ``--repeat`` times so a load change hits all alike:

* ``no bus`` — the baseline: nothing is built (the default);
* ``bus, counting`` — a bus whose only subscriber counts the EngineStepShares (the cost of
  building and publishing the records);
* ``bus + exporter`` — kvmeter's Prometheus exporter subscribed (what ``bench/noisy/sim_scenarios.py``
  does, less the ledger).

Run: .venv/bin/python bench/simulator/bench_step_records.py [--limit 5000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fairness"))
from common import machine, md_table  # noqa: E402

from kvmeter.traces import load_trace  # noqa: E402


def one(reqs, mode: str) -> tuple[float, int]:
    from prometheus_client import CollectorRegistry

    from kvmeter.bus import StatsBus
    from kvmeter.exporters.prometheus import PrometheusConfig, install_prometheus
    from kvmeter.serving.simulator import SimConfig, Simulation
    from kvmeter.stats import EngineStepShares

    bus = None if mode == "no bus" else StatsBus()
    n = [0]
    sim = Simulation(reqs, policy="vtc", sim=SimConfig(model="llama-3.1-70b", gpu="h200", tp=4), bus=bus)
    if bus is not None:
        bus.subscribe(EngineStepShares, lambda s: n.__setitem__(0, n[0] + 1))
        if mode == "bus + exporter":
            install_prometheus(bus, CollectorRegistry(), config=PrometheusConfig(model="llama-3.1-70b"),
                               clock=sim.clock)
    t = time.perf_counter()
    res = sim.run()
    wall = time.perf_counter() - t
    return wall, n[0] or sum(res.seg_k[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=5000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    reqs = load_trace("azure-conv", limit=args.limit)
    modes = ("no bus", "bus, counting", "bus + exporter")
    walls: dict[str, list[float]] = {m: [] for m in modes}
    steps = 0
    load0 = os.getloadavg()
    for i in range(args.repeat):
        for m in modes:
            w, steps = one(reqs, m)
            walls[m].append(w)
            print(f"[{i + 1}/{args.repeat}] {m}: {w:.2f} s ({steps} engine steps)", flush=True)
    base = statistics.median(walls["no bus"])
    rows = [[m, f"{statistics.median(walls[m]):.2f}", f"{steps / statistics.median(walls[m]):,.0f}",
             f"{statistics.median(walls[m]) / base:.2f}×"] for m in modes]
    print(md_table(["mode", "wall s (median)", "engine steps / s", "vs no bus"], rows))
    print(f"{len(reqs)} requests, {steps} engine steps; {machine()}; load average {load0[0]:.2f} → "
          f"{os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
