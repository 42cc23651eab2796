"""Noisy-neighbour scenarios at GPU scale, through the simulator: Llama-3.1-70B on H200s (one
replica, TP 4 — the simulator's default 70B deployment — or TP 2 with ``--tp 2``), normal tenants
plus one noisy tenant per shape; the same detectors and the same attribution as the real-engine bench
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
kv         ``kv_sessions`` long sessions (4,000-token prompts, 3,000-token outputs) at
           ``kv_rps`` requests/s — both from the replica (:func:`size_shapes`)
burst      600 short requests at once every 20 s
thrash     a cycle of ``thrash_cycle`` distinct 8,192-token prompts (16 hash blocks each; in all
           just above the replica's KV cache) visited in order at ``thrash_rps`` requests/s: each
           revisit finds its prefix evicted and prefills it again (:func:`size_shapes`)
agent      one agent run making 2 model calls/s (600-token prompts, 20 output tokens)
========== ===================================================================================

**kv and thrash are sized from the simulated replica** (:func:`size_shapes`, on the capacity and
prefill rate :func:`replica_rates` reads from the deployment's cost model; nothing hard-coded for
one cache). Both are bounded by the same physics — KV exists only once it is prefilled (or
decoded) — so their earliest possible detection is the time to prefill a share of the cache at the
replica's prefill rate; the sizing sends as fast as the prefill capacity the normal tenants leave
allows, so nothing but that physics delays them. The per-deployment tables and floors are in
``bench/noisy/RESULTS.md``.

**Not modelled: slow** (streaming clients that stop reading). The simulator has no clients and no
streams: a token exists when its step ends, nothing is sent, so no send can block and no stream can
be cut (``kvmeter_stream_stall_cut_requests_total`` needs the gateway's stall watchdog on a real
socket). The real-engine bench measures that shape. The agent shape is open-loop here (a trace has
fixed arrivals; a real agent calls after the previous answer).

Usage (a few minutes on 2 cores; measure with a low load average)::

    .venv/bin/python bench/noisy/sim_scenarios.py [--policy fcfs|vtc] [--tp 4|2]

Writes ``bench/noisy/results/sim-70b-tp<tp>-h200-<policy>.json`` (with the sizing) and prints the
table (``bench/noisy/scenarios.py``'s format).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from scenarios import NOISY, NORMAL, Phase, Run, attribute, evaluate, table  # noqa: E402

from common import machine  # noqa: E402  (bench/fairness, on the path scenarios.py set)
from kvmeter.traces import TraceRequest  # noqa: E402

SIM_SHAPES = ("prefill", "decode", "kv", "burst", "thrash", "agent")
#: the shapes' fixed request sizes (tokens): kv sessions, thrash prompts (16 hash blocks of 512)
KV_PROMPT, KV_OUTPUT = 4_000, 3_000
THRASH_PROMPT = 16 * 512
#: not modelled by the simulator (module docstring)
UNMODELLED = {"slow": "no clients or streams in the simulator: no send can block, no stream be cut"}
TIERS = {"acme": "enterprise", "globex": "paid_interactive", "initech": "paid_interactive"}
MODEL = "llama-3.1-70b"


@dataclass(frozen=True, slots=True)
class ShapeSizing:
    """The kv and thrash shapes sized for one replica (:func:`size_shapes`).

    Attributes:
        capacity_tokens, prefill_tokens_per_s, background_tokens_per_s: the inputs.
        spare_tokens_per_s: prefill capacity left after the normal tenants (tokens/s, > 0).
        kv_sessions: long sessions whose prompts alone push the KV watermark past the detector's
            condition (with margin); kv_rps: their arrival rate (requests/s).
        thrash_cycle: distinct prompts in the thrash cycle; thrash_rps: its visit rate
            (requests/s); thrash_period_s: seconds between two visits of one prompt.
        kv_floor_s: seconds to prefill the detector's watermark share of the cache at the
            replica's full prefill rate — no KV shape can be detected sooner.
        thrash_floor_s: seconds to prefill the whole cache at that rate — no prompt can be evicted
            and revisited sooner.
    """

    capacity_tokens: int
    prefill_tokens_per_s: float
    background_tokens_per_s: float
    spare_tokens_per_s: float
    kv_sessions: int
    kv_rps: float
    thrash_cycle: int
    thrash_rps: float
    thrash_period_s: float
    kv_floor_s: float
    thrash_floor_s: float


def size_shapes(capacity_tokens: int, prefill_tokens_per_s: float, background_tokens_per_s: float, *,
                kv_watermark_above: float, kv_margin: float = 0.1, kv_prompt_tokens: int = KV_PROMPT,
                thrash_prompt_tokens: int = THRASH_PROMPT, cycle_over_capacity: float = 1.1) -> ShapeSizing:
    """Size the kv and thrash shapes from a replica's KV capacity and prefill rate.

    The rule (``spare = prefill_tokens_per_s − background_tokens_per_s``, the prefill capacity the
    normal tenants leave, tokens/s):

    * kv: ``kv_sessions = ⌈(kv_watermark_above + kv_margin) · capacity ÷ kv_prompt_tokens⌉`` — the
      sessions' prompts alone, before any output, fill the cache past the detector's watermark
      (``KvmeterTenantKvShareHigh``: watermark above ``kv_watermark_above``), so the noisy tenant
      holds most of the active KV; ``kv_rps = spare ÷ kv_prompt_tokens`` — prefill-bound, as fast as
      the engine can take them.
    * thrash: ``thrash_cycle = ⌈cycle_over_capacity · capacity ÷ thrash_prompt_tokens⌉`` distinct
      prompts (in all just above the cache: visited in order, LRU evicts each before its revisit);
      ``thrash_rps = spare ÷ thrash_prompt_tokens`` — each prompt comes back as soon as the spare
      prefill capacity allows, every ``thrash_period_s = thrash_cycle ÷ thrash_rps`` seconds.
    * floors (physics, not the shape): ``kv_floor_s = kv_watermark_above · capacity ÷
      prefill_tokens_per_s``, ``thrash_floor_s = capacity ÷ prefill_tokens_per_s`` — at the whole
      prefill rate, with no normal tenant.

    Args:
        capacity_tokens: the replica's KV cache (tokens, ≥ 1).
        prefill_tokens_per_s: its prefill rate (tokens/s, > 0; :func:`replica_rates`).
        background_tokens_per_s: the normal tenants' scheduled tokens (prefill + decode) per second
            (≥ 0, below ``prefill_tokens_per_s``).
        kv_watermark_above: the KV detector's watermark threshold (0–1).
        kv_margin: how far past it the sessions' prompts reach (≥ 0).
        kv_prompt_tokens, thrash_prompt_tokens: the shapes' prompt sizes (≥ 1).
        cycle_over_capacity: thrash cycle tokens ÷ capacity (> 1).
    Raises:
        ValueError: on values out of range, or no spare prefill capacity.
    """
    if capacity_tokens < 1 or kv_prompt_tokens < 1 or thrash_prompt_tokens < 1:
        raise ValueError("capacity_tokens and prompt sizes must be ≥ 1")
    if not prefill_tokens_per_s > 0 or background_tokens_per_s < 0:
        raise ValueError("prefill_tokens_per_s must be > 0 and background_tokens_per_s ≥ 0")
    if not 0 <= kv_watermark_above < 1 or kv_margin < 0 or not cycle_over_capacity > 1:
        raise ValueError("kv_watermark_above in [0, 1), kv_margin ≥ 0, cycle_over_capacity > 1")
    spare = prefill_tokens_per_s - background_tokens_per_s
    if not spare > 0:
        raise ValueError(f"no spare prefill capacity: {prefill_tokens_per_s:.0f} tokens/s, "
                         f"{background_tokens_per_s:.0f} taken by the normal tenants")
    cycle = math.ceil(cycle_over_capacity * capacity_tokens / thrash_prompt_tokens)
    thrash_rps = spare / thrash_prompt_tokens
    return ShapeSizing(
        capacity_tokens=capacity_tokens, prefill_tokens_per_s=prefill_tokens_per_s,
        background_tokens_per_s=background_tokens_per_s, spare_tokens_per_s=spare,
        kv_sessions=math.ceil((kv_watermark_above + kv_margin) * capacity_tokens / kv_prompt_tokens),
        kv_rps=spare / kv_prompt_tokens, thrash_cycle=cycle, thrash_rps=thrash_rps,
        thrash_period_s=cycle / thrash_rps, kv_floor_s=kv_watermark_above * capacity_tokens / prefill_tokens_per_s,
        thrash_floor_s=capacity_tokens / prefill_tokens_per_s)


def replica_rates(sim_cfg, prompt_tokens: int = THRASH_PROMPT) -> tuple[int, float]:
    """(KV capacity in tokens, prefill tokens/s) of ``sim_cfg``'s replica, from its cost model:
    ``kv_capacity_tokens``, and ``prompt_tokens`` over the summed step times of that prompt's
    chunks at the replica's step budget (``max_num_batched_tokens``, chunked prefill from an
    empty cache: :meth:`~kvmeter.serving.simulator.RooflineCostModel.step_time`)."""
    from kvmeter.serving.simulator import build_cost_model

    cost = build_cost_model(sim_cfg)
    budget = int(sim_cfg.max_num_batched_tokens or cost.accelerator.max_num_batched_tokens)
    seconds, start = 0.0, 0
    while start < prompt_tokens:
        n = min(budget, prompt_tokens - start)
        seconds += cost.step_time(0, 0.0, [(start, n)])
        start += n
    return cost.kv_capacity_tokens, prompt_tokens / seconds


def background_tokens_per_s(normal_rps: float) -> float:
    """The normal tenants' scheduled tokens per second (:func:`workload`'s load): each of
    :data:`NORMAL` at ``normal_rps``, prompts uniform on [600, 2000) less the cached 512-token
    system prompt, outputs uniform on [50, 250)."""
    return normal_rps * len(NORMAL) * ((600 + 1999) / 2 - 512 + (50 + 249) / 2)


def _poisson(rng: np.random.Generator, rate: float, t0: float, t1: float) -> list[float]:
    out, t = [], t0 + rng.exponential(1.0 / rate)
    while t < t1:
        out.append(float(t))
        t += rng.exponential(1.0 / rate)
    return out


def _noisy(shape: str, t0: float, t1: float, rng: np.random.Generator, cycle_base: int,
           sizing: ShapeSizing) -> list[TraceRequest]:
    """The noisy tenant's requests of one shape in ``[t0, t1)`` (kv and thrash sized by ``sizing``)."""
    def req(t: float, i: int, o: int, **kw) -> TraceRequest:
        return TraceRequest(t, i, o, tenant_id=NOISY, tier="paid_interactive", **kw)

    if shape == "prefill":
        return [req(t, 24_000, 1) for t in _poisson(rng, 0.3, t0, t1)]
    if shape == "decode":
        return [req(t, 100, 2_000) for t in _poisson(rng, 1.0, t0, t1)]
    if shape == "kv":
        return [req(t, KV_PROMPT, KV_OUTPUT) for t in _poisson(rng, sizing.kv_rps, t0, t1)[:sizing.kv_sessions]]
    if shape == "burst":
        return [req(float(t) + 0.001 * k, 200, 16) for t in np.arange(t0, t1, 20.0) for k in range(600)]
    if shape == "thrash":
        n, blocks, rps = sizing.thrash_cycle, THRASH_PROMPT // 512, sizing.thrash_rps
        return [req(t0 + k / rps, THRASH_PROMPT, 1,
                    hash_ids=tuple(cycle_base + (k % n) * 1000 + b for b in range(blocks)))
                for k in range(int((t1 - t0) * rps))]
    if shape == "agent":
        return [req(t0 + k / 2.0, 600, 20, agent_run_id=f"loop-{int(t0)}") for k in range(int((t1 - t0) * 2.0))]
    raise ValueError(f"unknown shape {shape!r}")


def workload(args, sizing: ShapeSizing) -> tuple[list[TraceRequest], list[Phase]]:
    rng = np.random.default_rng(args.seed)
    phases = [Phase("clean", 0.0, args.clean_s)]
    t, out = args.clean_s, []
    for k, shape in enumerate(args.shapes):
        phases.append(Phase(shape, t, t + args.shape_s))
        out += _noisy(shape, t, t + args.shape_s, rng, cycle_base=10_000_000 * (k + 1), sizing=sizing)
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


def deployment(args):
    """The simulated deployment of ``args``: one replica of :data:`MODEL` on ``args.tp`` H200s."""
    from kvmeter.serving.simulator import SimConfig

    return SimConfig(model=MODEL, gpu="h200", tp=args.tp)


def sizing_for(args) -> ShapeSizing:
    """:func:`size_shapes` for ``args``' deployment (:func:`deployment`) and normal load, at the
    shipped KV watermark threshold."""
    from kvmeter.exporters.prometheus.rules.noisy import THRESHOLDS

    capacity, rate = replica_rates(deployment(args))
    return size_shapes(capacity, rate, background_tokens_per_s(args.normal_rps),
                       kv_watermark_above=THRESHOLDS.kv_watermark_above)


def simulate(args, run_dir: Path) -> tuple[Run, object, dict]:
    """Run the simulation with the exporter and the ledger on its bus; returns the bench's
    :class:`Run` (snapshots, phases, wall clock at virtual 0), the result and counts."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvmeter.bus import StatsBus
    from kvmeter.exporters.prometheus import PrometheusConfig, install_prometheus
    from kvmeter.ledger.config import LedgerConfig
    from kvmeter.ledger.ledger import Ledger
    from kvmeter.serving.scheduler import SchedulerConfig
    from kvmeter.serving.simulator import Simulation
    from kvmeter.stats import EngineStepShares, SchedulerStats

    reqs, phases = workload(args, args.sizing)
    wall0 = float(int(time.time()))
    scfg = SchedulerConfig.plain_baseline() if args.policy == "fcfs" else SchedulerConfig()
    sim_cfg = deployment(args)
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
    ap.add_argument("--tp", type=int, default=4,
                    help="tensor-parallel GPUs of the one H200 replica (4: 1.2M-token cache; 2: 384k)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default=None, help="default: bench/noisy/results/sim-70b-tp<tp>-h200-<policy>.json")
    args = ap.parse_args(argv)
    args.thresholds = None
    sizing = args.sizing = sizing_for(args)
    print(f"70B on {args.tp} x H200 (TP {args.tp}): KV {sizing.capacity_tokens:,} tokens, prefill "
          f"{sizing.prefill_tokens_per_s:,.0f} tokens/s ({sizing.spare_tokens_per_s:,.0f} spare); kv "
          f"{sizing.kv_sessions} sessions at {sizing.kv_rps:.2f}/s (floor {sizing.kv_floor_s:.0f} s); thrash "
          f"{sizing.thrash_cycle} prompts at {sizing.thrash_rps:.2f}/s, period {sizing.thrash_period_s:.0f} s "
          f"(floor {sizing.thrash_floor_s:.0f} s)", flush=True)
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
    out = Path(args.out or HERE / "results" / f"sim-70b-tp{args.tp}-h200-{args.policy}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "scenario": "noisy_neighbours_simulated", "id": str(uuid.uuid4()),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"), "machine": machine(),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "args": {k: v for k, v in vars(args).items() if k != "sizing"}, "sizing": asdict(sizing),
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
