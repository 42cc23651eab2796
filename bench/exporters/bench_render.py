"""Benchmark: /metrics render time with 1,000 tenants and every metric populated.

    .venv/bin/python bench/exporters/bench_render.py [--tenants 1000] [--k 20] [--runs 30]

Populates one registry through the real bus and exporter with:
  * 1,000 tenants over 4 tiers sending requests (ok / aborted / error, varying TTFT and ITL) and
    admission decisions (admitted and 3 rejection reasons);
  * 8 local engines (steps and finished requests), 4 scraped remote engines;
  * 8 GPUs (the real H200 capture, replicated) and one MIG GPU (the real H100 MIG capture);
  * the scheduler, quota and ledger sources through their producers' real stats types: a
    ``SchedulerStats`` snapshot listing all 1,000 tenants (queue depth, queued tokens, oldest
    wait, active KV, service) once per round, a ``ReservationDrift`` pair per completion, client
    retries and idempotent replays (``IdempotencyAttempt``), dropped-by-reason, a degraded quota
    store, tool-call reports, config reloads and ``LedgerStats``.
Then times ``generate_latest`` (what /metrics serves) with top-K bounding and unbounded (K =
number of tenants), in single-process mode and — with --multiprocess — in prometheus-client's
multiprocess mode (the several-gateway-workers set-up) reading the merged files. Also reports the
cost of publishing one 1,000-tenant ``SchedulerStats`` (the scheduler does it once a second).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from kvmeter.attribution import Attribution
from kvmeter.tokens import TokenCounts
from kvmeter.traces import data_dir

REPO = Path(__file__).resolve().parents[2]
DATA = data_dir()
TIERS = ("enterprise", "paid_interactive", "batch", "free")


def scheduler_snapshot(rng, tenants: int, round_: int):
    """A ``SchedulerStats`` as FairScheduler publishes it, listing every tenant."""
    from kvmeter.stats import SchedulerStats, TenantSchedulerStats

    rows = []
    for i in range(tenants):
        depth = rng.randint(0, 6)
        running = rng.randint(0, 4)
        rows.append(TenantSchedulerStats(
            tenant_id=f"tenant-{i:04d}", tier=TIERS[i % 4], weight=1.0, queue_depth=depth,
            queued_input_tokens=depth * rng.randint(50, 4000), queue_wait_oldest_s=rng.random() * 30 if depth else 0.0,
            queue_wait_mean_s=rng.random(), projected_wait_s=rng.random() * 10, running=running,
            active_kv_tokens=running * rng.randint(100, 12_000), kv_budget_tokens=200_000,
            service_total=(round_ + 1) * rng.randint(1_000, 100_000), input_tokens_total=0,
            output_tokens_total=0, vtc_counter=0.0, dispatched_total=0, completed_total=0))
    return SchedulerStats(wall_ts=1.75e9 + round_, policy="vtc", pressure_level=1, queued_total=0, running_total=0,
                          service_rate_per_s=50_000.0, jain_index=0.8, max_service_gap=9_000.0, service_gap=4_000.0,
                          dropped_total={"deadline": 10 * round_, "shed": 5 * round_, "cancelled": round_},
                          tenants=rows)


def populate(registry, k: int, tenants: int, seed: int = 1):
    from kvmeter.bus import StatsBus
    from kvmeter.clock import ManualClock
    from kvmeter.collectors.gpu import CaptureNvml, NvmlCollector
    from kvmeter.collectors.remote_vllm import RemoteVllmScraper
    from kvmeter.exporters.prometheus import PrometheusConfig, install_prometheus
    from kvmeter.stats import LedgerStats
    from kvmeter.stats import IdempotencyAttempt, QuotaStoreState, ReservationDrift, ToolCallReported
    from kvmeter.stats import ConfigReloaded
    from kvmeter.stats import AdmissionDecision, EngineRequestStats, EngineStepStats, RequestCompletion

    rng = random.Random(seed)
    clock = ManualClock()
    bus = StatsBus()
    install_prometheus(bus, registry, clock=clock, config=PrometheusConfig(top_k_tenants=k, model="llama-70b"))
    publish_times = []
    snapshot_times = []
    for round_ in range(3):
        for i in range(tenants):
            tenant, tier = f"tenant-{i:04d}", TIERS[i % 4]
            for outcome in ("ok", "ok", "aborted" if i % 7 == 0 else "ok", "error" if i % 11 == 0 else "ok"):
                c = RequestCompletion(
                    attribution=Attribution(tenant, tier=tier, model="llama-70b"),
                    tokens=TokenCounts(
                        input_tokens=rng.randint(50, 20000),
                        cached_input_tokens=rng.randint(0, 50),
                        output_tokens=rng.randint(1, 2000),
                    ),
                    outcome=outcome,
                    ttft_s=rng.lognormvariate(-1, 1.2),
                    itls_s=[rng.lognormvariate(-3.5, 0.5) for _ in range(20)],
                    e2e_s=rng.uniform(0.5, 90),
                    queue_s=rng.expovariate(5),
                    slo_met=rng.random() < 0.9,
                )
                t0 = time.perf_counter()
                bus.publish(c)
                publish_times.append(time.perf_counter() - t0)
                for dim, reserved, actual in (("input_tokens", c.input_tokens, c.input_tokens),
                                              ("output_tokens", 2048, c.output_tokens)):
                    bus.publish(
                        ReservationDrift(
                            attribution=Attribution(tenant, tier=tier, api_key_id="k"),
                            dimension=dim,
                            reserved=reserved,
                            actual=actual,
                        )
                    )
            bus.publish(AdmissionDecision(attribution=Attribution(tenant, tier=tier), admitted=True))
            reason = ("rate_limited", "quota_exceeded", "queue_full")[i % 3]
            bus.publish(
                AdmissionDecision(
                    attribution=Attribution(tenant, tier=tier),
                    admitted=False,
                    reason=reason,
                    level="org",
                    dimension="requests_per_minute",
                    status_code=429,
                )
            )
            if i % 5 == 0:  # an agent retrying a step: one replay, one conflict
                bus.publish(IdempotencyAttempt(tenant_id=tenant, outcome="replayed", attempt=1, replayed=True))
                bus.publish(IdempotencyAttempt(tenant_id=tenant, outcome="conflict", attempt=1, replayed=False))
        snap = scheduler_snapshot(rng, tenants, round_)
        t0 = time.perf_counter()
        bus.publish(snap)
        snapshot_times.append(time.perf_counter() - t0)
        bus.publish(QuotaStoreState(store="redis", degraded=round_ == 1, pending_settles=3 * round_))
        bus.publish(
            ToolCallReported(
                attribution=Attribution(
                    "tenant-0001", api_key_id="k", agent_run_id="run-1", endpoint="agent_runs.tool_calls"
                ),
                tool_calls=round_,
                max_tool_calls=1,
                exceeded=round_ > 1,
            )
        )
        bus.publish(ConfigReloaded(ok=round_ != 1, version=round_ + 1))
        bus.publish(LedgerStats(wall_ts=1.75e9 + round_, spool_depth_events=1200, spool_oldest_age_seconds=4.5,
                                events_ingested_total={"new": 4000 * (round_ + 1), "duplicate": 7, "invalid": 1,
                                                       "late": 2}, insert_retries_total=round_, clickhouse_up=True))
        clock.advance(20)  # let the labeler refresh between rounds
    for engine in range(8):
        for _ in range(50):
            bus.publish(EngineStepStats(wall_ts=1.0, engine_idx=engine, kv_watermark_ratio=rng.random(),
                                        kv_blocks_total=80_000, kv_block_size_tokens=16, num_running=64,
                                        num_waiting=rng.randint(0, 30), num_preempted=rng.randint(0, 2),
                                        prefix_cache_queries_tokens=4000, prefix_cache_hits_tokens=1500,
                                        scheduled_tokens=rng.randint(64, 8192), batch_size=64,
                                        input_tokens=2000, output_tokens=64,
                                        ttfts_s=[rng.random()], itls_s=[rng.random() / 10] * 8))
        for reason in ("stop", "length", "abort"):
            bus.publish(
                EngineRequestStats(
                    request_id="r",
                    finish_reason=reason,
                    tokens=TokenCounts(input_tokens=900, cached_input_tokens=100, output_tokens=80),
                    queued_s=0.2,
                    prefill_s=0.3,
                    decode_s=4.0,
                    e2e_s=4.5,
                )
            )
    gpu_dir = DATA / "gpu" / "nvidia_smi"
    h200 = NvmlCollector(CaptureNvml.from_file(gpu_dir / "linux-x86_64__nvidia-h200__590.48.01.txt"),
                         clock=clock).collect()[0]
    for index in range(8):
        bus.publish(dataclasses.replace(h200, index=index, energy_joules=1e6 + index))
    mig = NvmlCollector(CaptureNvml.from_file(gpu_dir / "linux-x86_64__nvidia-h100-mig__590.48.01.txt"),
                        clock=clock).collect()[0]
    bus.publish(dataclasses.replace(mig, index=8))
    v0 = (DATA / "vllm_metrics" / "vllm_v0_metrics_qwen2.5-coder-1.5b_aibrix_docs.prom").read_text()
    for r in range(4):
        scraper = RemoteVllmScraper(f"http://vllm-{r}:8000/metrics", clock=clock, bus=bus)
        scraper.ingest(v0)
        scraper.ingest(v0.replace("} 955.0", "} 1955.0"))
    for _ in range(10):  # steady state: the once-a-second snapshot, labels settled
        snap = scheduler_snapshot(rng, tenants, 3)
        t0 = time.perf_counter()
        bus.publish(snap)
        snapshot_times.append(time.perf_counter() - t0)
        clock.advance(1)
    assert bus.errors_total == 0
    return publish_times, snapshot_times


def time_render(collect_registry, runs: int) -> tuple[list[float], int, int]:
    from prometheus_client import generate_latest

    text = generate_latest(collect_registry)  # warm-up
    samples = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        generate_latest(collect_registry)
        times.append(time.perf_counter() - t0)
    return times, len(text), samples


def fmt(times: list[float]) -> str:
    q = statistics.quantiles(times, n=20) if len(times) >= 2 else times
    return f"median {statistics.median(times) * 1e3:.1f} ms, p95 {q[-1] * 1e3:.1f} ms"


def single(args) -> None:
    from prometheus_client import CollectorRegistry

    for k in (args.k, args.tenants):
        registry = CollectorRegistry()
        publish, snapshots = populate(registry, k, args.tenants)
        times, size, samples = time_render(registry, args.runs)
        label = "bounded" if k < args.tenants else "unbounded"
        print(f"| single process | {label} K={k} | {samples} | {size / 1024:.0f} KiB | {fmt(times)} |"
              f" publish {statistics.median(publish) * 1e6:.0f} µs/completion,"
              f" {statistics.median(snapshots) * 1e3:.1f} ms/SchedulerStats |")


def multiprocess_child(args) -> None:
    from kvmeter.exporters.prometheus import multiprocess_registry

    populate(None, args.k if args.child == "bounded" else args.tenants, args.tenants)
    times, size, samples = time_render(multiprocess_registry(os.environ["PROMETHEUS_MULTIPROC_DIR"]), args.runs)
    k = args.k if args.child == "bounded" else args.tenants
    print(f"| multiprocess (files) | {args.child} K={k} | {samples} | {size / 1024:.0f} KiB | {fmt(times)} | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--multiprocess", action="store_true", help="also measure multiprocess mode")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        multiprocess_child(args)
        return
    print("| mode | tenant labels | samples | exposition | render (generate_latest) | |")
    print("|---|---|---|---|---|---|")
    single(args)
    if args.multiprocess:
        for which in ("bounded", "unbounded"):
            with tempfile.TemporaryDirectory() as mp_dir:
                env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": mp_dir}
                subprocess.run([sys.executable, __file__, "--tenants", str(args.tenants), "--k", str(args.k),
                                "--runs", str(max(5, args.runs // 3)), "--child", which], env=env, check=True)


if __name__ == "__main__":
    main()
