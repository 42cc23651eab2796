"""Benchmark: collector cost per scrape.

    .venv/bin/python bench/exporters/bench_collectors.py [--runs 200]

* NVML collector: one ``collect()`` through the capture-backed pynvml stand-in, per capture. This
  is kvmeter's own cost per poll (the calls, conversions, MIG and process walks), not NVML's
  driver latency, which only a GPU machine can measure (``collectors/gpu/check_live.py``).
* Capture parsing: ``load_capture`` of each real capture (stand-in start-up cost).
* Remote vLLM scraper: ``parse_vllm_metrics`` on the two real expositions, and parse + diff
  (``ingest``) of a large V1-style page written by prometheus-client (8 engines, every histogram
  vLLM V1 exposes, with its default buckets).
* DCGM: ``gpu_samples_from_dcgm`` on the real 4-GPU V100 excerpt.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvmeter.clock import ManualClock
from kvmeter.collectors.gpu import CaptureNvml, NvmlCollector, gpu_samples_from_dcgm, load_capture
from kvmeter.collectors.remote_vllm import RemoteVllmScraper, parse_vllm_metrics
from kvmeter.traces import data_dir

REPO = Path(__file__).resolve().parents[2]
DATA = data_dir()
CAPTURES = ("linux-x86_64__nvidia-h100-80gb-hbm3__590.48.01.txt", "linux-x86_64__nvidia-h200__590.48.01.txt",
            "linux-x86_64__nvidia-h100-mig__590.48.01.txt", "telegraf_a100-sxm4-v12.xml")


def bench(fn, runs: int) -> str:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return f"median {statistics.median(times) * 1e3:.3f} ms, p95 {statistics.quantiles(times, n=20)[-1] * 1e3:.3f} ms"


def _vllm_buckets():
    """vLLM's default bucket module, loaded by path: importing the vllm package itself would
    pull in torch for nothing."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    path = Path(spec.submodule_search_locations[0]) / "v1" / "metrics" / "buckets.py"
    module_spec = importlib.util.spec_from_file_location("vllm_buckets", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def big_v1_page(engines: int = 8, seed_value: float = 1.0) -> str:
    """A V1 page as vLLM's PrometheusStatLogger writes it (names, labels, default buckets)."""
    buckets = _vllm_buckets()
    TIME_TO_FIRST_TOKEN_BUCKETS = buckets.TIME_TO_FIRST_TOKEN_BUCKETS
    INTER_TOKEN_LATENCY_BUCKETS = buckets.INTER_TOKEN_LATENCY_BUCKETS
    REQUEST_LATENCY_BUCKETS = buckets.REQUEST_LATENCY_BUCKETS
    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    gauges = [Gauge(n, n, labels, registry=reg) for n in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")]
    counters = [Counter(n, n, labels, registry=reg) for n in (
        "vllm:input_tokens", "vllm:output_tokens", "vllm:num_preemptions",
        "vllm:prefix_cache_queries", "vllm:prefix_cache_hits")]
    hists = [Histogram("vllm:time_to_first_token_seconds", "ttft", labels, buckets=TIME_TO_FIRST_TOKEN_BUCKETS,
                       registry=reg),
             Histogram("vllm:inter_token_latency_seconds", "itl", labels, buckets=INTER_TOKEN_LATENCY_BUCKETS,
                       registry=reg)]
    hists += [Histogram(n, n, labels, buckets=REQUEST_LATENCY_BUCKETS, registry=reg) for n in (
        "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds")]
    for e in range(engines):
        lv = ("meta-llama/Llama-3.1-70B-Instruct", str(e))
        for g in gauges:
            g.labels(*lv).set(0.5)
        for c in counters:
            c.labels(*lv).inc(1000 * seed_value)
        for h in hists:
            for x in (0.01, 0.1, 0.5, 2.0, 8.0):
                h.labels(*lv).observe(x * seed_value)
    return generate_latest(reg).decode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    gpu = DATA / "gpu" / "nvidia_smi"
    print("| collector | input | cost |")
    print("|---|---|---|")
    for name in CAPTURES:
        collector = NvmlCollector(CaptureNvml.from_file(gpu / name), clock=ManualClock())
        collector.start()
        print(f"| NVML collect() via stand-in | {name} | {bench(collector.collect, args.runs)} |")
    for name in CAPTURES:
        print(f"| capture parse (load_capture) | {name} | {bench(lambda name=name: load_capture(gpu / name), 20)} |")
    for name in sorted((DATA / "vllm_metrics").glob("*.prom")):
        text = name.read_text()
        cost = bench(lambda text=text: parse_vllm_metrics(text), args.runs)
        print(f"| remote parse_vllm_metrics | {name.name} ({len(text)} B) | {cost} |")
    page1, page2 = big_v1_page(seed_value=1.0), big_v1_page(seed_value=2.0)
    print(f"| remote parse_vllm_metrics | V1-style, 8 engines ({len(page1) // 1024} KiB) | "
          f"{bench(lambda: parse_vllm_metrics(page1), 50)} |")
    scraper = RemoteVllmScraper("http://bench/metrics", clock=ManualClock())
    scraper.ingest(page1)
    print(f"| remote ingest (parse + diff) | V1-style, 8 engines | {bench(lambda: scraper.ingest(page2), 50)} |")
    dcgm = (DATA / "gpu" / "dcgm" / "dcgm_v100_4gpu_issue250.prom").read_text()
    cost = bench(lambda: gpu_samples_from_dcgm(dcgm), args.runs)
    print(f"| DCGM gpu_samples_from_dcgm | dcgm_v100_4gpu_issue250.prom | {cost} |")


if __name__ == "__main__":
    main()
