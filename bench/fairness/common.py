"""Shared helpers of the fairness benchmarks: run one workload under FCFS, RPM-limit and VTC in
the same process, probe capacity, format side-by-side tables, save figures as JSON.

Baselines are configured as the plain deployments they stand for:

* ``fcfs`` — one shared queue in arrival order, no kvmeter limits: no overload control, no KV or
  prefill budget, no adaptive engine limit (a vLLM engine's own queue); engine scheduling ``fcfs``.
* ``rpm``  — the same plus a per-tenant requests-per-minute limit at the gateway (the common
  practice the VTC paper compares against); the limit is stated per scenario.
* ``vtc``  — kvmeter's scheduler: VTC order, KV budgets, engine gating, tier priorities in the
  engine, and — unless a scenario says otherwise — overload control (bounded queues, deadlines,
  shedding by tier).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

REPO = Path(__file__).resolve().parents[2]
RESULTS_DIR = Path(__file__).resolve().parent / "results"

from kvmeter.serving.simulator import SimConfig, Simulation, build_report  # noqa: E402
from kvmeter.traces import TraceRequest  # noqa: E402
from kvmeter.serving.scheduler import SchedulerConfig  # noqa: E402

POLICIES = ("fcfs", "rpm", "vtc")


def baseline_config(rpm_limit: float, **extra) -> SchedulerConfig:
    """FCFS/RPM: :meth:`SchedulerConfig.plain_baseline` — no kvmeter overload control, no KV or
    prefill budgets, no adaptive engine limit (a plain deployment dispatches whatever the engine's
    static caps admit), queues as deep as needed — with ``rpm_limit`` and ``extra`` fields."""
    return SchedulerConfig.plain_baseline(rpm_limit=rpm_limit, **extra)


def run_policies(requests: Sequence[TraceRequest], sim: SimConfig, *, rpm_limit: float,
                 vtc_config: SchedulerConfig | None = None, baseline_extra: dict | None = None,
                 policies: Sequence[str] = POLICIES, label: str = "") -> dict[str, tuple]:
    """Run ``requests`` once per policy; returns ``{policy: (SimResult, report)}``."""
    out = {}
    for policy in policies:
        cfg = vtc_config if policy == "vtc" and vtc_config is not None else baseline_config(
            rpm_limit, **(baseline_extra or {}))
        t0 = time.perf_counter()
        res = Simulation(requests, policy=policy, scheduler_config=cfg, sim=sim).run()
        rep = build_report(res, trace=label)
        print(f"  {label} {policy}: {len(requests)} requests, {res.sim_end_s:.0f} s simulated in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        out[policy] = (res, rep)
    return out


def capacity_rps(make_requests: Callable[[int], list[TraceRequest]], sim: SimConfig, n: int = 2000) -> float:
    """Saturated throughput in requests/s: ``n`` requests all queued at t=0, FCFS, no limits."""
    reqs = [dataclasses.replace(r, arrival_s=0.0) for r in make_requests(n)]
    res = Simulation(reqs, policy="fcfs", scheduler_config=baseline_config(1e9), sim=sim).run()
    return n / res.sim_end_s


def md_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    def fmt(x) -> str:
        if x is None:
            return "–"
        if isinstance(x, float):
            return f"{x:.4g}" if abs(x) < 1e5 else f"{x:.3e}"
        return str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> str:
    try:
        model = next(line.split(":", 1)[1].strip() for line in
                     subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
                     if line.startswith("Model name"))
    except (StopIteration, OSError):
        model = platform.processor() or "unknown CPU"
    return f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}"


def save(name: str, payload: dict) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    payload = {"scenario": name, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(),
               "command": " ".join([Path(sys.executable).name] + sys.argv), **payload}
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def window_goodput(res, tier: str, t0: float, t1: float) -> float:
    """Goodput (output tokens/s of SLO-met requests) of ``tier`` for requests *arriving* in [t0, t1)."""
    pol = res.scheduler_config.tier(tier)
    good = 0
    for r in res.records:
        if r.tier != tier or not (t0 <= r.arrival_s < t1) or r.outcome != "ok":
            continue
        ttft = r.first_token_s - r.arrival_s
        tpot = (r.finish_s - r.first_token_s) / (r.generated - 1) if r.generated > 1 else 0.0
        if pol.meets_slo(ttft, tpot):
            good += r.generated
    return good / (t1 - t0)


def service_in_window(res, t0: float, t1: float) -> dict[str, float]:
    """Weighted service each tenant received between the samples nearest ``t0`` and ``t1``."""
    samples = res.samples
    a = min(samples, key=lambda s: abs(s.t - t0))
    b = min(samples, key=lambda s: abs(s.t - t1))
    return {t: b.service_by_tenant.get(t, 0.0) - a.service_by_tenant.get(t, 0.0) for t in b.service_by_tenant}
