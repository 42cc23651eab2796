"""A synthetic but realistic day for the dashboards, written through the ledger's own paths.

What it builds (defaults: 1,000,000 requests over 24 h, 200 tenants, a sample every 10 s):

* **Requests**: prompt/output lengths drawn from the real Azure LLM inference trace (conversation,
  2023; ``data/traces``); arrivals follow a diurnal curve; tenants' traffic shares are
  Zipf-skewed (ServeGen: the top 5 clients carry ~58 %). Tiers: the five demo tenants (acme
  enterprise, globex and umbrella paid_interactive, initech batch, hobbyist free) plus ``t###``
  tenants (10 % enterprise, 30 % paid_interactive, 10 % batch, 50 % free).
* **The 2 a.m. case**: from 01:30 to 03:00 ``umbrella`` sends 20 requests a minute of 60–120k-token
  prompts with 500–2,000-token outputs — request rate barely moves, tokens and KV explode, everyone queues.
* **Latency** follows load: utilisation u = demanded ÷ capacity tokens per 10 s tick; queue wait
  ~ Exp(mean 0.05 s × u ÷ (1 − u)); prefill = prompt ÷ 20k tokens/s; ITL = 25 ms × (1 + 2u).
* **Outcomes**: 1 % aborted (frontend-counted), 0.2 % error; 2 % of attempts rejected (rate
  limits, concurrency, KV budget, queue full, context length).

Write paths (the real ones): usage events with ``Ledger.record`` (group commit), attempts with
``Ledger.record_attempt``, the engine's account through ``EngineRequestStats`` on the bus the ledger
subscribes to, and signals through the real :class:`kvmeter.exporters.signals.SignalSampler` fed
with engine, scheduler, request and GPU stats each tick, written with ``Ledger.write_signals``.

    .venv/bin/python bench/dashboards/synth.py --dir var/bench/dashboards [--events 1000000] [--hours 24]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from kvmeter.attribution import Attribution
from kvmeter.bus import StatsBus
from kvmeter.clock import ManualClock
from kvmeter.events import UsageEvent, event_id_for
from kvmeter.exporters.signals import SignalSampler, SignalSamplerConfig
from kvmeter.ledger import AttemptRecord, Ledger, LedgerConfig
from kvmeter.stats import (EngineRequestStats, EngineStepStats, GpuSample, RequestCompletion, SchedulerStats,
                           TenantSchedulerStats, TierSchedulerStats)
from kvmeter.tokens import TokenCounts
from kvmeter.traces import load_trace

__all__ = ["build", "DAY_START", "DEMO_TENANTS"]

#: The synthetic day starts here (UTC).
DAY_START = datetime(2026, 11, 27, tzinfo=timezone.utc).timestamp()
MODEL = "Llama-3.1-70B-Instruct"
DEMO_TENANTS = {"acme": "enterprise", "globex": "paid_interactive", "umbrella": "paid_interactive",
                "initech": "batch", "hobbyist": "free"}
SLO_TTFT = {"enterprise": 1.0, "paid_interactive": 2.0, "batch": 600.0, "free": 10.0}
ENGINES, GPUS = 4, 8
KV_CAPACITY_TOKENS = 4 * 600_000          # 4 replicas × ~600k KV tokens
CAPACITY_TOKENS_PER_S = 4 * 45_000        # prefill + decode work the fleet clears per second
TICK_S = 10.0
REJECT_REASONS = (("rate_limited", 429), ("concurrency_limited", 429), ("kv_budget_exceeded", 429),
                  ("queue_full", 429), ("context_length_exceeded", 400))


@dataclass
class Day:
    """The generated requests as columns (numpy arrays, one entry per request)."""

    tenant: np.ndarray
    arrival: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    queue: np.ndarray
    prefill: np.ndarray
    decode: np.ndarray
    itl: np.ndarray
    outcome: np.ndarray  # 0 ok, 1 aborted, 2 error
    cached: np.ndarray


def tenants(n: int, rng: np.random.Generator) -> tuple[list[str], list[str], np.ndarray]:
    """Names, tiers and Zipf traffic shares (s = 1.1) of ``n`` tenants, demo tenants first."""
    names = list(DEMO_TENANTS) + [f"t{i:03d}" for i in range(n - len(DEMO_TENANTS))]
    drawn = rng.choice(["enterprise", "paid_interactive", "batch", "free"], size=n - len(DEMO_TENANTS),
                       p=[0.1, 0.3, 0.1, 0.5])
    tiers = list(DEMO_TENANTS.values()) + [str(t) for t in drawn]
    share = 1.0 / np.arange(1, n + 1) ** 1.1
    return names, tiers, share / share.sum()


def generate(events: int, hours: float, n_tenants: int, seed: int = 7) -> tuple[Day, list[str], list[str]]:
    """Draw the day (see the module docstring)."""
    rng = np.random.default_rng(seed)
    names, tiers, share = tenants(n_tenants, rng)
    span = hours * 3600
    trace = load_trace("azure-conv")
    pairs = np.array([(r.input_tokens, r.output_tokens) for r in trace], dtype=np.int64)
    noisy_start, noisy_end = 1.5 * 3600, min(3.0 * 3600, span)
    n_noisy = int(max(0.0, noisy_end - noisy_start) / 60 * 20) if span > noisy_start else 0
    n_base = events - n_noisy
    # diurnal arrivals: density ∝ 1 + 0.6 sin(2π (h − 9) / 24), by inverse-CDF on a fine grid
    grid = np.linspace(0, span, 20_001)
    dens = 1 + 0.6 * np.sin(2 * np.pi * (grid / 3600 - 9) / 24)
    cdf = np.cumsum(dens)
    cdf = (cdf - cdf[0]) / (cdf[-1] - cdf[0])
    arrival = np.interp(rng.random(n_base), cdf, grid)
    tenant = rng.choice(n_tenants, size=n_base, p=share)
    pick = pairs[rng.integers(0, len(pairs), size=n_base)]
    prompt, output = pick[:, 0], pick[:, 1]
    if n_noisy:
        arrival = np.concatenate([arrival, np.sort(rng.uniform(noisy_start, noisy_end, n_noisy))])
        tenant = np.concatenate([tenant, np.full(n_noisy, names.index("umbrella"))])
        prompt = np.concatenate([prompt, rng.integers(60_000, 120_000, n_noisy)])
        output = np.concatenate([output, rng.integers(500, 2_000, n_noisy)])
    order = np.argsort(arrival, kind="stable")
    arrival, tenant, prompt, output = arrival[order], tenant[order], prompt[order], output[order]
    # load per tick → utilisation → latency
    ticks = int(math.ceil(span / TICK_S))
    tick = np.minimum((arrival // TICK_S).astype(np.int64), ticks - 1)
    demand = np.bincount(tick, weights=prompt + output, minlength=ticks) / TICK_S
    u = np.clip(demand / CAPACITY_TOKENS_PER_S, 0, 0.97)[tick]
    queue = rng.exponential(0.05 * u / (1 - u))
    prefill = prompt / 20_000.0
    itl = 0.025 * (1 + 2 * u) * rng.uniform(0.8, 1.2, size=len(u))
    decode = output * itl
    outcome = rng.choice(3, size=len(u), p=[0.988, 0.01, 0.002])
    cached = (prompt * rng.uniform(0, 0.6, size=len(u))).astype(np.int64)
    day = Day(tenant, DAY_START + arrival, prompt, output, queue, prefill, decode, itl, outcome, cached)
    return day, names, tiers


def _event(day: Day, i: int, names: list[str], tiers: list[str]) -> UsageEvent:
    t = names[day.tenant[i]]
    tier = tiers[day.tenant[i]]
    prompt, out = int(day.prompt[i]), int(day.output[i])
    outcome = ("ok", "aborted", "error")[day.outcome[i]]
    if outcome != "ok":
        out = out // 3
    queue, prefill = float(day.queue[i]), float(day.prefill[i])
    decode = out * float(day.itl[i])
    ttft = queue + prefill + 0.01
    e2e = ttft + decode
    return UsageEvent(
        event_id=event_id_for(t, f"req-{i}"),
        request_id=f"r{i}",
        attribution=Attribution(
            t,
            workspace_id="default",
            project_id="default",
            api_key_id=f"{t}-key",
            tier=tier,
            model=MODEL,
            endpoint="chat.completions",
        ),
        tokens=TokenCounts(
            input_tokens=prompt, cached_input_tokens=min(prompt, int(day.cached[i])), output_tokens=out
        ),
        reserved=TokenCounts(input_tokens=prompt, output_tokens=max(out, int(day.output[i] * 2))),
        outcome=outcome,
        finish_reason={"ok": "stop", "aborted": "abort", "error": "error"}[outcome],
        arrival_ts=float(day.arrival[i]),
        finish_ts=float(day.arrival[i]) + e2e,
        status_code=200,
        stream=True,
        queue_s=queue,
        ttft_s=ttft,
        prefill_s=prefill,
        decode_s=decode,
        e2e_s=e2e,
        itl_mean_s=float(day.itl[i]) if out >= 2 else None,
        kv_token_seconds=prompt * (prefill + decode) + out * decode / 2,
        token_source="engine_hooks" if outcome == "ok" else "frontend",
        attempt=1,
    )


async def write_requests(ledger: Ledger, bus: StatsBus, day: Day, names: list[str], tiers: list[str],
                         rng: np.random.Generator, chunk: int = 20_000) -> int:
    """Record every request: attempt(s), the engine's account (bus), then the usage event."""
    n = len(day.arrival)
    rejected = 0
    for start in range(0, n, chunk):
        events = [_event(day, i, names, tiers) for i in range(start, min(n, start + chunk))]
        attempts = []
        for e in events:
            attempts.append(AttemptRecord(attribution=e.attribution, request_id=e.request_id, status="admitted",
                                          ts=e.arrival_ts, event_id=e.event_id, reserved=e.reserved))
            if rng.random() < 0.02:
                reason, code = REJECT_REASONS[int(rng.integers(0, len(REJECT_REASONS)))]
                rejected += 1
                attempts.append(AttemptRecord(attribution=e.attribution, request_id=e.request_id + "-x",
                                              status="rejected", ts=e.arrival_ts - 0.5, reason=reason,
                                              status_code=code))
        await asyncio.gather(*(ledger.record_attempt(a) for a in attempts))
        for e in events:
            if e.outcome != "aborted":  # vLLM's hooks never report aborted requests
                bus.publish(EngineRequestStats(
                    request_id=e.request_id, finish_reason=e.finish_reason, tokens=e.tokens,
                    queued_s=e.queue_s or 0.0, prefill_s=e.prefill_s or 0.0, decode_s=e.decode_s or 0.0,
                    inference_s=(e.prefill_s or 0.0) + (e.decode_s or 0.0), e2e_s=e.e2e_s or 0.0,
                    mean_tpot_s=e.itl_mean_s or 0.0, wall_ts=e.finish_ts, attribution=e.attribution))
        await asyncio.gather(*(ledger.record(e) for e in events))
        print(f"  requests {min(n, start + chunk):,}/{n:,}", file=sys.stderr, flush=True)
    return rejected


def write_signals(ledger: Ledger, day: Day, names: list[str], tiers: list[str], hours: float,
                  rng: np.random.Generator) -> int:
    """Feed the real SignalSampler tick by tick and write its rows through the ledger."""
    span = hours * 3600
    ticks = int(math.ceil(span / TICK_S))
    start = ((day.arrival - DAY_START) // TICK_S).astype(np.int64)
    end_s = day.arrival - DAY_START + day.queue + day.prefill + day.decode
    end = np.minimum((end_s // TICK_S).astype(np.int64), ticks)
    disp = np.minimum(((day.arrival - DAY_START + day.queue) // TICK_S).astype(np.int64), ticks)
    hold = (day.prompt + day.output / 2).astype(np.float64)
    nt = len(names)

    def span_sum(weights: np.ndarray, a: np.ndarray, b: np.ndarray, by_tenant: bool) -> np.ndarray:
        shape = (nt, ticks + 1) if by_tenant else (ticks + 1,)
        diff = np.zeros(shape)
        if by_tenant:
            np.add.at(diff, (day.tenant, a), weights)
            np.add.at(diff, (day.tenant, b), -weights)
            return np.cumsum(diff, axis=1)[:, :ticks]
        np.add.at(diff, a, weights)
        np.add.at(diff, b, -weights)
        return np.cumsum(diff)[:ticks]

    kv_tenant = span_sum(hold, disp, end, True)
    running_tenant = span_sum(np.ones_like(hold), disp, end, True)
    queued_tenant = span_sum(np.ones_like(hold), start, disp, True)
    kv = kv_tenant.sum(axis=0)
    running, queued = running_tenant.sum(axis=0), queued_tenant.sum(axis=0)
    finish_tick = np.minimum(end, ticks - 1)
    order = np.argsort(finish_tick, kind="stable")
    bounds = np.searchsorted(finish_tick[order], np.arange(ticks + 1))
    tier_names = sorted(set(tiers))

    bus = StatsBus()
    clock = ManualClock(start_wall=DAY_START, start_monotonic=0.0)
    sampler = SignalSampler(bus, clock=clock, model=MODEL, config=SignalSamplerConfig(interval_s=TICK_S))
    rows_total = 0
    pending = []
    for k in range(ticks):
        clock.advance(TICK_S)
        now = clock.wall()
        watermark = min(0.99, kv[k] / KV_CAPACITY_TOKENS)
        for e in range(ENGINES):
            share = rng.uniform(0.85, 1.15) / ENGINES
            bus.publish(EngineStepStats(
                wall_ts=now, engine_idx=e, kv_watermark_ratio=float(min(0.995, watermark * share * ENGINES)),
                kv_blocks_total=KV_CAPACITY_TOKENS // ENGINES // 16, kv_block_size_tokens=16,
                num_running=int(running[k] * share), num_waiting=int(max(0, queued[k] * share - 8)),
                num_preempted=int(rng.poisson(3)) if watermark > 0.93 else 0,
                output_tokens=int(rng.normal(1, 0.1) * 4000 * min(1.0, running[k] / 200) * TICK_S / ENGINES)))
        busy = np.flatnonzero((kv_tenant[:, k] > 0) | (queued_tenant[:, k] > 0))
        service = kv_tenant[busy, k]
        jain = (float(service.sum() ** 2 / (len(service) * (service ** 2).sum()))
                if len(service) > 1 and service.any() else 1.0)
        bus.publish(SchedulerStats(
            wall_ts=now, policy="vtc", pressure_level=2 if watermark > 0.95 else (1 if watermark > 0.85 else 0),
            queued_total=int(queued[k]), running_total=int(running[k]), service_rate_per_s=CAPACITY_TOKENS_PER_S,
            jain_index=min(1.0, 0.35 + 0.65 * jain), max_service_gap=float(service.max(initial=0)),
            service_gap=float(service.max(initial=0) - service.min(initial=0)),
            tiers=[TierSchedulerStats(t, 0, 0, False, 0, 0, 0, 0, 1.0) for t in tier_names],
            tenants=[TenantSchedulerStats(
                tenant_id=names[i], tier=tiers[i], weight=1.0, queue_depth=int(queued_tenant[i, k]),
                queued_input_tokens=0, queue_wait_oldest_s=0.0, queue_wait_mean_s=0.0, projected_wait_s=0.0,
                running=int(running_tenant[i, k]), active_kv_tokens=int(kv_tenant[i, k]), kv_budget_tokens=0,
                service_total=0.0, input_tokens_total=0, output_tokens_total=0, vtc_counter=0.0,
                dispatched_total=0, completed_total=0) for i in busy]))
        for j in order[bounds[k]:bounds[k + 1]]:
            tier = tiers[day.tenant[j]]
            ttft = float(day.queue[j] + day.prefill[j])
            bus.publish(
                RequestCompletion(
                    attribution=Attribution(names[day.tenant[j]], tier=tier, model=MODEL),
                    tokens=TokenCounts(input_tokens=int(day.prompt[j]), output_tokens=int(day.output[j])),
                    outcome=("ok", "aborted", "error")[day.outcome[j]],
                    ttft_s=ttft,
                    slo_met=ttft <= SLO_TTFT[tier],
                    wall_ts=now,
                )
            )
        load = min(1.0, kv[k] / KV_CAPACITY_TOKENS)
        for g in range(GPUS):
            bus.publish(GpuSample(
                wall_ts=now, index=g, name="NVIDIA H200", memory_total_bytes=150_754_820_096,
                memory_used_bytes=int(150_754_820_096 * 0.92), utilization_gpu_ratio=1.0 if running[k] else 0.0,
                sm_active_ratio=float(min(1, 0.15 + 0.6 * load * rng.uniform(0.9, 1.1))),
                tensor_active_ratio=float(min(1, 0.1 + 0.5 * load)),
                dram_bandwidth_ratio=float(min(1, 0.2 + 0.7 * load)),
                power_watts=float(180 + 480 * load), temperature_gpu_celsius=float(32 + 38 * load),
                temperature_memory_celsius=float(36 + 40 * load)))
        rows = sampler.sample()
        rows_total += len(rows)
        pending.extend(rows)
        if len(pending) >= 90_000:
            ledger.write_signals(pending)
            pending = []
            assert ledger.flush(120), "signals did not drain"
        if k % 500 == 0:
            print(f"  signal ticks {k:,}/{ticks:,} ({rows_total:,} rows)", file=sys.stderr, flush=True)
    if pending:
        ledger.write_signals(pending)
        assert ledger.flush(120)
    sampler.close()
    return rows_total


def build(directory: Path, events: int = 1_000_000, hours: float = 24.0, n_tenants: int = 200,
          seed: int = 7) -> dict:
    """Generate the day into a fresh ledger under ``directory`` (``chdb/`` and ``spool/``).

    Returns:
        Counts and the window: ``events``, ``attempts_rejected``, ``signal_rows``, ``start``,
        ``end`` (epoch seconds), ``seconds`` (generation time).
    """
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed + 1)
    day, names, tiers = generate(events, hours, n_tenants, seed)
    config = LedgerConfig(dsn=f"chdb://{directory / 'chdb'}", spool_dir=directory / "spool", fsync=False,
                          flush_interval_s=2.0, rollup_interval_s=3600, signal_buffer=200_000, close_timeout_s=120)
    bus = StatsBus()
    ledger = Ledger.open(config, bus=bus)
    try:
        rejected = asyncio.run(write_requests(ledger, bus, day, names, tiers, rng))
        assert ledger.flush(600), "requests did not drain"
        signal_rows = write_signals(ledger, day, names, tiers, hours, rng)
        ledger.refresh_rollups(full=True)
    finally:
        ledger.close()
    return {"events": len(day.arrival), "attempts_rejected": rejected, "signal_rows": signal_rows,
            "start": DAY_START, "end": DAY_START + hours * 3600, "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, type=Path)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--tenants", type=int, default=200)
    args = ap.parse_args()
    if (args.dir / "chdb").exists():
        sys.exit(f"{args.dir / 'chdb'} exists; remove it or choose another --dir")
    print(build(args.dir, args.events, args.hours, args.tenants))


if __name__ == "__main__":
    main()
