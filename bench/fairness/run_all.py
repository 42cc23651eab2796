"""Run every fairness scenario and the scheduler-cost micro-benchmark; tables go to stdout and
JSON to bench/fairness/results/. Run: .venv/bin/python bench/fairness/run_all.py"""

from __future__ import annotations

import sys
import time

import bench_scheduler_cost
import scenario_burst
import scenario_noisy_neighbour
import scenario_servegen
import scenario_two_tenants
import scenario_weights

if __name__ == "__main__":
    for mod in (scenario_two_tenants, scenario_weights, scenario_servegen, scenario_burst,
                scenario_noisy_neighbour, bench_scheduler_cost):
        sys.argv = [f"bench/fairness/{mod.__name__}.py"]
        t0 = time.perf_counter()
        print(f"\n## {mod.__name__}", flush=True)
        mod.main()
        print(f"({time.perf_counter() - t0:.1f} s)", flush=True)
