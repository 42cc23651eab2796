"""Benchmark: /metrics render time with 1,000 tenants and every signal populated.

    .venv/bin/python bench/exporters/bench_render.py [--tenants 1000] [--k 20] [--runs 30]

Populates one registry through the real bus and exporter with:
  * 1,000 tenants over 4 tiers sending requests (ok / aborted / error, varying TTFT and ITL) and
    admission decisions (admitted and 3 rejection reasons);
  * 8 local engines (steps and finished requests), 4 scraped remote engines;
  * 8 GPUs (the real H200 capture, replicated) and one MIG GPU (the real H100 MIG capture);
  * the round-2 tenant-labelled families reserved in names.py (queue depth, active KV, service,
    retries), filled through the same top-K labeler, so "all signals" includes what round 2 adds.
Then times ``generate_latest`` (what /metrics serves) with top-K bounding and unbounded (K =
number of tenants), in single-process mode and — with --multiprocess — in prometheus-client's
multiprocess mode (the several-gateway-workers set-up) reading the merged files.
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

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("KVMETER_SHARED_DATA", REPO.parent / "shared" / "data"))
TIERS = ("enterprise", "paid_interactive", "batch", "free")


def populate(registry, k: int, tenants: int, seed: int = 1):
    from kvmeter.bus import StatsBus
    from kvmeter.clock import ManualClock
    from kvmeter.collectors.gpu import CaptureNvml, NvmlCollector
    from kvmeter.collectors.remote_vllm import RemoteVllmScraper
    from kvmeter.exporters.prometheus import PrometheusConfig, install_prometheus, make_metric, signal
    from kvmeter.stats import AdmissionDecision, EngineRequestStats, EngineStepStats, RequestCompletion

    rng = random.Random(seed)
    clock = ManualClock()
    bus = StatsBus()
    exporter = install_prometheus(bus, registry, clock=clock,
                                  config=PrometheusConfig(top_k_tenants=k, model="llama-70b"))
    reserved = {name: make_metric(signal(name), registry) for name in (
        "kvmeter_scheduler_queue_depth_requests", "kvmeter_scheduler_queue_depth_tokens",
        "kvmeter_tenant_active_kv_tokens", "kvmeter_scheduler_service_tokens_total",
        "kvmeter_gateway_retries_total")}
    publish_times = []
    for round_ in range(3):
        for i in range(tenants):
            tenant, tier = f"tenant-{i:04d}", TIERS[i % 4]
            for outcome in ("ok", "ok", "aborted" if i % 7 == 0 else "ok", "error" if i % 11 == 0 else "ok"):
                c = RequestCompletion(
                    tenant_id=tenant, tier=tier, model="llama-70b", outcome=outcome,
                    prompt_tokens=rng.randint(50, 20000), cached_prompt_tokens=rng.randint(0, 50),
                    completion_tokens=rng.randint(1, 2000), ttft_s=rng.lognormvariate(-1, 1.2),
                    itls_s=[rng.lognormvariate(-3.5, 0.5) for _ in range(20)], e2e_s=rng.uniform(0.5, 90),
                    queue_s=rng.expovariate(5), slo_met=rng.random() < 0.9)
                t0 = time.perf_counter()
                bus.publish(c)
                publish_times.append(time.perf_counter() - t0)
            bus.publish(AdmissionDecision(tenant_id=tenant, tier=tier, admitted=True))
            reason = ("rate_limited", "quota_exceeded", "queue_full")[i % 3]
            bus.publish(AdmissionDecision(tenant_id=tenant, tier=tier, admitted=False, reason=reason,
                                          level="org", dimension="requests_per_minute", status_code=429))
            labels = exporter.tenants
            labels.set_active(tenant, rng.randint(0, 50_000))
            for name, metric in reserved.items():
                child = labels.child(metric, 1, (tier, tenant))
                child.inc(rng.randint(1, 100)) if name.endswith("_total") else child.set(rng.randint(0, 500))
        clock.advance(20)  # let the labeler refresh between rounds
    for engine in range(8):
        for _ in range(50):
            bus.publish(EngineStepStats(wall_ts=1.0, engine_idx=engine, kv_watermark_ratio=rng.random(),
                                        kv_blocks_total=80_000, kv_block_size_tokens=16, num_running=64,
                                        num_waiting=rng.randint(0, 30), num_preempted=rng.randint(0, 2),
                                        prefix_cache_queries_tokens=4000, prefix_cache_hits_tokens=1500,
                                        scheduled_tokens=rng.randint(64, 8192), batch_size=64,
                                        prompt_tokens=2000, generation_tokens=64,
                                        ttfts_s=[rng.random()], itls_s=[rng.random() / 10] * 8))
        for reason in ("stop", "length", "abort"):
            bus.publish(EngineRequestStats(request_id="r", finish_reason=reason, prompt_tokens=900,
                                           cached_prompt_tokens=100, generation_tokens=80, queued_s=0.2,
                                           prefill_s=0.3, decode_s=4.0, e2e_s=4.5))
    gpu_dir = SHARED / "gpu" / "nvidia_smi"
    h200 = NvmlCollector(CaptureNvml.from_file(gpu_dir / "linux-x86_64__nvidia-h200__590.48.01.txt"),
                         clock=clock).collect()[0]
    for index in range(8):
        bus.publish(dataclasses.replace(h200, index=index, energy_joules=1e6 + index))
    mig = NvmlCollector(CaptureNvml.from_file(gpu_dir / "linux-x86_64__nvidia-h100-mig__590.48.01.txt"),
                        clock=clock).collect()[0]
    bus.publish(dataclasses.replace(mig, index=8))
    v0 = (SHARED / "vllm_metrics" / "vllm_v0_metrics_qwen2.5-coder-1.5b_aibrix_docs.prom").read_text()
    for r in range(4):
        scraper = RemoteVllmScraper(f"http://vllm-{r}:8000/metrics", clock=clock, bus=bus)
        scraper.ingest(v0)
        scraper.ingest(v0.replace("} 955.0", "} 1955.0"))
    assert bus.errors_total == 0
    return publish_times


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
        publish = populate(registry, k, args.tenants)
        times, size, samples = time_render(registry, args.runs)
        label = "bounded" if k < args.tenants else "unbounded"
        print(f"| single process | {label} K={k} | {samples} | {size / 1024:.0f} KiB | {fmt(times)} |"
              f" publish {statistics.median(publish) * 1e6:.0f} µs/completion |")


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
