"""Noisy-neighbour scenarios at GPU scale, through the simulator: Llama-3.1-70B on H200s (one
replica, TP 4 — the simulator's default 70B deployment), normal tenants plus one noisy tenant per
shape; the same detectors and the same attribution as the real-engine bench
(``bench/noisy/scenarios.py``), run unchanged on the simulator's records.

The simulation publishes the serve path's stats on a bus (:mod:`kvmeter.serving.simulator.publish`:
per-step :class:`~kvmeter.stats.EngineStepShares`, step stats, scheduler snapshots, request
completions with the gateway's re-prefill tracker). This script wires the consumers onto that bus
— the simulator imports none of them:

* kvmeter's Prometheus exporter (``install_prometheus`` on a private registry, on the simulation's
  clock); its ``/metrics`` text is rendered (``generate_latest``) every ``--sample-s`` simulated
  seconds and kept;
* a chDB ledger in a temporary folder: every step through ``Ledger.record_step_shares``
  (``engine_steps``), and after the run one usage event per completed request (``usage_events``).

Then the real-engine bench's own evaluation (imported, not copied): ``evaluate`` — at each sample
the :func:`~kvmeter.exporters.prometheus.rules.noisy_eval.rank` of the window ending there, with
the thresholds ``noisy.yml`` ships (GPU-sized, no override) — and ``attribute`` — the ledger's
interference read over the normal tenants' missed TTFTs, under the default tiers' objectives.

Tenants: acme (enterprise, TTFT 1 s), globex and initech (paid interactive, TTFT 2 s) send Poisson
chats (``--normal-rps`` each, prompts 600–2,000 tokens opening with the tenant's 512-token system
prompt — one shared hash block, served from the prefix cache — outputs 50–250) the whole run; umbrella
(paid interactive) is the noisy one. Phases: ``clean`` (``--clean-s``, normal tenants only: any
detection is a false positive), then each shape for ``--shape-s`` followed by ``--cooldown-s`` of
normal load:

========== ===================================================================================
prefill    24,000-token prompts, 1 output token, 0.3 requests/s (≈ 7,200 prefill tokens/s)
decode     100-token prompts, 2,000-token outputs, 1 request/s
kv         long sessions: 4,000-token prompts, 3,000-token outputs, 1.5 requests/s
burst      600 short requests at once every 20 s
thrash     a cycle of 160 distinct 8,192-token prompts (16 hash blocks each; 1.3M tokens, more
           than the replica's 1.2M-token KV cache) visited in order at 1.2 requests/s: each
           revisit, 133 s later, finds its prefix evicted and prefills it again
agent      one agent run making 2 model calls/s (600-token prompts, 20 output tokens)
========== ===================================================================================

**Not modelled: slow** (streaming clients that stop reading). The simulator has no clients and no
streams: a token exists when its step ends, nothing is sent, so no send can block and no stream can
be cut (``kvmeter_stream_stall_cut_requests_total`` needs the gateway's stall watchdog on a real
socket). The real-engine bench measures that shape. The agent shape is open-loop here (a trace has
fixed arrivals; a real agent calls after the previous answer).

Usage (a few minutes on 2 cores; measure with a low load average)::

    .venv/bin/python bench/noisy/sim_scenarios.py [--policy fcfs|vtc]

Writes ``bench/noisy/results/sim-<policy>.json`` and prints the table (``bench/noisy/scenarios.py``'s
format).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from scenarios import NOISY, NORMAL, Phase, Run, attribute, evaluate, table  # noqa: E402

from common import machine  # noqa: E402  (bench/fairness, on the path scenarios.py set)
from kvmeter.traces import TraceRequest  # noqa: E402

SIM_SHAPES = ("prefill", "decode", "kv", "burst", "thrash", "agent")
#: not modelled by the simulator (module docstring)
UNMODELLED = {"slow": "no clients or streams in the simulator: no send can block, no stream be cut"}
TIERS = {"acme": "enterprise", "globex": "paid_interactive", "initech": "paid_interactive"}
MODEL = "llama-3.1-70b"


def _poisson(rng: np.random.Generator, rate: float, t0: float, t1: float) -> list[float]:
    out, t = [], t0 + rng.exponential(1.0 / rate)
    while t < t1:
        out.append(float(t))
        t += rng.exponential(1.0 / rate)
    return out


def _noisy(shape: str, t0: float, t1: float, rng: np.random.Generator, cycle_base: int) -> list[TraceRequest]:
    """The noisy tenant's requests of one shape in ``[t0, t1)``."""
    def req(t: float, i: int, o: int, **kw) -> TraceRequest:
        return TraceRequest(t, i, o, tenant_id=NOISY, tier="paid_interactive", **kw)

    if shape == "prefill":
        return [req(t, 24_000, 1) for t in _poisson(rng, 0.3, t0, t1)]
    if shape == "decode":
        return [req(t, 100, 2_000) for t in _poisson(rng, 1.0, t0, t1)]
    if shape == "kv":
        return [req(t, 4_000, 3_000) for t in _poisson(rng, 1.5, t0, t1)]
    if shape == "burst":
        return [req(float(t) + 0.001 * k, 200, 16) for t in np.arange(t0, t1, 20.0) for k in range(600)]
    if shape == "thrash":
        n, blocks = 160, 16
        return [req(t0 + k / 1.2, blocks * 512, 1,
                    hash_ids=tuple(cycle_base + (k % n) * 1000 + b for b in range(blocks)))
                for k in range(int((t1 - t0) * 1.2))]
    if shape == "agent":
        return [req(t0 + k / 2.0, 600, 20, agent_run_id=f"loop-{int(t0)}") for k in range(int((t1 - t0) * 2.0))]
    raise ValueError(f"unknown shape {shape!r}")


def workload(args) -> tuple[list[TraceRequest], list[Phase]]:
    rng = np.random.default_rng(args.seed)
    phases = [Phase("clean", 0.0, args.clean_s)]
    t, out = args.clean_s, []
    for k, shape in enumerate(args.shapes):
        phases.append(Phase(shape, t, t + args.shape_s))
        out += _noisy(shape, t, t + args.shape_s, rng, cycle_base=10_000_000 * (k + 1))
        t += args.shape_s + args.cooldown_s
    for j, tenant in enumerate(NORMAL):
        for i, a in enumerate(_poisson(rng, args.normal_rps, 0.0, t)):
            n = int(rng.integers(600, 2000))
            # the tenant's 512-token system prompt (one hash block, shared by its requests), then
            # the conversation's own blocks
            hashes = (j + 1,) + tuple(1_000_000 * (j + 1) + 100 * i + b for b in range(1, -(-n // 512)))
            out.append(TraceRequest(a, n, int(rng.integers(50, 250)), hash_ids=hashes, tenant_id=tenant,
                                    tier=TIERS[tenant]))
    return out, phases


def _usage_events(result, wall0: float) -> list:
    """One usage event per completed request, the simulator's times on the run's wall clock."""
    from kvmeter.events import UsageEvent, event_id_for
    from kvmeter.tokens import TokenCounts
    from kvmeter.attribution import Attribution

    out = []
    for r in result.records:
        if r.outcome != "ok":
            continue
        ttft = r.first_token_s - r.arrival_s
        itl = (r.finish_s - r.first_token_s) / (r.generated - 1) if r.generated > 1 else None
        out.append(UsageEvent(
            event_id=event_id_for(r.tenant_id, r.request_id), request_id=r.request_id,
            attribution=Attribution(r.tenant_id, tier=r.tier, model=MODEL), outcome="ok", finish_reason="length",
            arrival_ts=float(wall0 + r.arrival_s), finish_ts=float(wall0 + r.finish_s),
            tokens=TokenCounts(input_tokens=r.input_tokens, cached_input_tokens=r.cached_tokens,
                               output_tokens=r.generated),
            reserved=TokenCounts(input_tokens=r.input_tokens, output_tokens=r.output_tokens),
            ttft_s=float(ttft), itl_mean_s=None if itl is None else float(itl), e2e_s=float(r.finish_s - r.arrival_s),
            queue_s=float(r.dispatch_s - r.arrival_s)))
    return out


def simulate(args, run_dir: Path) -> tuple[Run, object, dict]:
    """Run the simulation with the exporter and the ledger on its bus; returns the bench's
    :class:`Run` (snapshots, phases, wall clock at virtual 0), the result and counts."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvmeter.bus import StatsBus
    from kvmeter.exporters.prometheus import PrometheusConfig, install_prometheus
    from kvmeter.ledger.config import LedgerConfig
    from kvmeter.ledger.ledger import Ledger
    from kvmeter.serving.scheduler import SchedulerConfig
    from kvmeter.serving.simulator import SimConfig, Simulation
    from kvmeter.stats import EngineStepShares, SchedulerStats

    reqs, phases = workload(args)
    wall0 = float(int(time.time()))
    scfg = SchedulerConfig.plain_baseline() if args.policy == "fcfs" else SchedulerConfig()
    sim_cfg = SimConfig(model=MODEL, gpu="h200", tp=args.tp)
    bus = StatsBus()
    sim = Simulation(reqs, policy=args.policy, scheduler_config=scfg, sim=sim_cfg, progress=True,
                     sample_interval_s=1.0, bus=bus, start_wall=wall0)
    registry = CollectorRegistry()
    install_prometheus(bus, registry, config=PrometheusConfig(top_k_tenants=20, model=MODEL), clock=sim.clock)
    ledger = Ledger.open(LedgerConfig(dsn=f"chdb://{(run_dir / 'ledger').absolute()}",
                                      spool_dir=(run_dir / "spool").absolute()))
    counts = {"steps": 0, "step_rows": 0}

    def on_step(s: EngineStepShares) -> None:
        counts["steps"] += 1
        counts["step_rows"] += len(s.tenants)
        ledger.record_step_shares(s, model=MODEL, replica="sim-h200")

    bus.subscribe(EngineStepShares, on_step)
    run = Run("", MODEL, None, 0.0, t0=0.0, wall_t0=wall0, phases=phases)
    state = {"next": 0.0}

    def on_sample(_: SchedulerStats) -> None:  # after the exporter's own subscriber: its gauges are set
        now = sim.clock.monotonic()
        if now + 1e-9 >= state["next"]:
            run.snapshots.append((now, generate_latest(registry).decode()))
            state["next"] = now + args.sample_s

    bus.subscribe(SchedulerStats, on_sample)
    try:
        result = sim.run()
        events = _usage_events(result, wall0)

        async def write() -> None:
            for i in range(0, len(events), 500):
                await asyncio.gather(*(ledger.record(e) for e in events[i:i + 500]))

        asyncio.run(write())
        assert ledger.flush(60.0), "the ledger did not drain"
    finally:
        ledger.close()
    counts["requests"] = len(reqs)
    counts["completed"] = len(events)
    counts["by_outcome"] = {o: sum(1 for r in result.records if r.outcome == o) for o in ("ok", "rejected", "dropped")}
    return run, result, counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SIM_SHAPES), choices=SIM_SHAPES)
    ap.add_argument("--clean-s", type=float, default=120.0)
    ap.add_argument("--shape-s", type=float, default=180.0)
    ap.add_argument("--cooldown-s", type=float, default=60.0)
    ap.add_argument("--window-s", type=float, default=30.0, help="the evaluator's window (s)")
    ap.add_argument("--sample-s", type=float, default=5.0, help="simulated seconds between /metrics renders")
    ap.add_argument("--normal-rps", type=float, default=1.0, help="requests/s of each normal tenant")
    ap.add_argument("--policy", choices=["fcfs", "vtc"], default="fcfs")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default=None, help="default: bench/noisy/results/sim-<policy>.json")
    args = ap.parse_args(argv)
    args.thresholds = None
    from kvmeter.exporters.prometheus.rules.noisy import THRESHOLDS
    from kvmeter.serving.tenancy.tiers import DEFAULT_TIERS

    load0 = os.getloadavg()
    wall = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvmeter-sim-noisy-") as tmp:
        run_dir = Path(tmp)
        run, result, counts = simulate(args, run_dir)
        sim_wall = time.perf_counter() - wall
        print(f"simulated {result.sim_end_s:.0f} s in {result.wall_s:.1f} s ({counts['steps']} engine steps, "
              f"{counts['step_rows']} step rows, {len(run.snapshots)} /metrics snapshots); evaluating", flush=True)
        ev = evaluate(run, args, thresholds=THRESHOLDS)
        attribute(ev, run, run_dir, slos=[(t.name, t.ttft_slo_s, t.itl_slo_s) for t in DEFAULT_TIERS.values()])
    load1 = os.getloadavg()
    for name, why in UNMODELLED.items():
        ev["phases"][name] = {"detector": "slow_clients", "modelled": False, "why": why}
    out = Path(args.out or HERE / "results" / f"sim-{args.policy}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "scenario": "noisy_neighbours_simulated", "id": str(uuid.uuid4()),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"), "machine": machine(),
        "command": " ".join([Path(sys.executable).name] + sys.argv), "args": vars(args),
        "deployment": {"model": MODEL, "gpu": "h200", "tp": args.tp, "replicas": 1, "policy": args.policy},
        "load_average_before": load0, "load_average_after": load1, "counts": counts,
        "simulated_s": result.sim_end_s, "simulation_wall_s": result.wall_s, "total_wall_s": time.perf_counter() - wall,
        "evaluation": {"phases": {k: {kk: vv for kk, vv in v.items() if kk != "samples"}
                                  for k, v in ev["phases"].items()}}}, indent=2, default=str))
    shown = {"phases": {k: v for k, v in ev["phases"].items() if v.get("modelled", True)}}
    print(table(shown))
    print(f"not modelled: {', '.join(f'{k} ({v})' for k, v in UNMODELLED.items())}")
    print(f"simulation + exporter + ledger {sim_wall:.1f} s; load average {load0[0]:.2f} → {load1[0]:.2f}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
