"""Several gateway worker processes: prometheus-client multiprocess mode gives whole-server numbers
whichever worker answers the scrape."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmeter.exporters.prometheus import metrics_asgi_app, multiprocess_registry, prepare_multiprocess_dir

HERE = Path(__file__).resolve().parent

WORKER = textwrap.dedent("""
    import sys
    from kvmeter.attribution import Attribution
    from kvmeter.bus import StatsBus
    from kvmeter.exporters.prometheus import install_prometheus
    from kvmeter.stats import (EngineStepStats, GpuCollectorStatus, LedgerStats, RequestCompletion,
                               SchedulerStats, TenantSchedulerStats)
    from kvmeter.tokens import TokenCounts

    n, kv, gpu_state = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    bus = StatsBus()
    install_prometheus(bus)
    for i in range(n):
        bus.publish(RequestCompletion(attribution=Attribution("acme", tier="free", model="m"), outcome="ok",
                                      tokens=TokenCounts(input_tokens=100, output_tokens=10), ttft_s=0.2, e2e_s=1.0))
    bus.publish(EngineStepStats(wall_ts=0.0, kv_watermark_ratio=kv, num_running=n))
    bus.publish(GpuCollectorStatus(state=gpu_state))
    # this worker's scheduler: acme has n queued, n * 100 active KV tokens, oldest wait n seconds
    bus.publish(SchedulerStats(
        wall_ts=1.75e9, policy="vtc", pressure_level=0, queued_total=n, running_total=1, service_rate_per_s=0.0,
        jain_index=1.0, max_service_gap=0.0, service_gap=0.0, tenants=[TenantSchedulerStats(
            tenant_id="acme", tier="free", weight=1.0, queue_depth=n, queued_input_tokens=n * 10,
            queue_wait_oldest_s=float(n), queue_wait_mean_s=0.0, projected_wait_s=0.0, running=1,
            active_kv_tokens=n * 100, kv_budget_tokens=0, service_total=float(n), input_tokens_total=0,
            output_tokens_total=0, vtc_counter=0.0, dispatched_total=0, completed_total=0)]))
    bus.publish(LedgerStats(wall_ts=1.75e9, spool_depth_events=n, spool_oldest_age_seconds=float(n)))
    assert bus.errors_total == 0
""")


def run_worker(mp_dir: Path, *args: str) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mp_dir)}
    subprocess.run([sys.executable, "-c", WORKER, *args], env=env, check=True, timeout=120)


def test_worker_processes_are_merged(tmp_path):
    mp_dir = prepare_multiprocess_dir(tmp_path / "prom")
    run_worker(mp_dir, "3", "0.25", "ok")
    run_worker(mp_dir, "5", "0.75", "no_gpu")
    run_worker(mp_dir, "2", "0.50", "no_gpu")
    registry = multiprocess_registry(mp_dir)
    t = {"tier": "free", "tenant": "acme"}
    assert registry.get_sample_value("kvmeter_requests_total", {**t, "outcome": "ok"}) == 10
    assert registry.get_sample_value("kvmeter_tokens_total", {**t, "type": "input", "outcome": "ok"}) == 1000
    assert registry.get_sample_value("kvmeter_request_ttft_seconds_count", {"tier": "free"}) == 10
    assert registry.get_sample_value("kvmeter_request_ttft_seconds_bucket", {"tier": "free", "le": "0.2"}) == 10
    e = {"engine": "0", "model": ""}
    # gauges follow their declared mode: "mostrecent" = the last worker that wrote
    assert registry.get_sample_value("kvmeter_engine_kv_watermark_ratio", e) == 0.5
    assert registry.get_sample_value("kvmeter_engine_running_requests", e) == 2
    # "max": one worker that can read NVML is enough
    assert registry.get_sample_value("kvmeter_gpu_nvml_available", {}) == 1
    # each worker's scheduler queues its own requests: depth and active KV add up ("livesum"),
    # the oldest wait is the oldest anywhere ("livemax"); service is a counter (summed)
    assert registry.get_sample_value("kvmeter_scheduler_queue_depth_requests", t) == 10
    assert registry.get_sample_value("kvmeter_tenant_active_kv_tokens", t) == 1000
    assert registry.get_sample_value("kvmeter_scheduler_queue_oldest_wait_seconds", t) == 5
    assert registry.get_sample_value("kvmeter_scheduler_service_tokens_total", t) == 10
    assert registry.get_sample_value("kvmeter_ledger_spool_depth_events", {}) == 10


def test_asgi_app_serves_the_merged_files(tmp_path):
    import asyncio

    mp_dir = prepare_multiprocess_dir(tmp_path / "prom")
    run_worker(mp_dir, "4", "0.3", "ok")
    run_worker(mp_dir, "4", "0.3", "ok")

    async def get():
        transport = httpx.ASGITransport(app=metrics_asgi_app(multiprocess_dir=mp_dir))
        async with httpx.AsyncClient(transport=transport, base_url="http://kvmeter") as client:
            return await client.get("/metrics")

    text = asyncio.run(get()).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    key = ("kvmeter_requests_total", (("outcome", "ok"), ("tenant", "acme"), ("tier", "free")))
    assert samples[key] == 8


def test_prepare_empties_stale_files(tmp_path):
    mp_dir = prepare_multiprocess_dir(tmp_path / "prom")
    run_worker(mp_dir, "1", "0.1", "ok")
    assert any(mp_dir.iterdir())
    prepare_multiprocess_dir(mp_dir)
    assert not any(mp_dir.iterdir())
    with pytest.raises(ValueError, match="PROMETHEUS_MULTIPROC_DIR"):
        multiprocess_registry(tmp_path / "missing")


@pytest.mark.slow
def test_uvicorn_workers_scrape_totals(tmp_path, port):
    """A real ``uvicorn --workers 2``: requests land on either worker; every scrape sees all."""
    mp_dir = prepare_multiprocess_dir(tmp_path / "prom")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mp_dir)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "mp_worker_app:app", "--app-dir", str(HERE), "--workers", "2",
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # wait for the server to accept connections (it imports the app twice)
            try:
                if httpx.get(f"{base}/metrics", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "uvicorn did not start"
            assert proc.poll() is None, "uvicorn exited"
            time.sleep(0.2)  # polling an external process at start-up, not timing logic
        pids = set()
        for i in range(40):  # one connection each, so the kernel spreads them over the workers
            with httpx.Client(base_url=base, timeout=10) as client:
                pids.add(client.post("/publish", params={"tokens": i + 1}).json()["pid"])
        expected_tokens = sum(range(1, 41))
        for _ in range(6):
            with httpx.Client(base_url=base, timeout=10) as client:
                text = client.get("/metrics").text
            got = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                   if s.labels.get("type") in (None, "input") and s.name in (
                       "kvmeter_requests_total", "kvmeter_tokens_total")}
            assert got == {"kvmeter_requests_total": 40, "kvmeter_tokens_total": expected_tokens}
        files = {p.name.split("_")[0] for p in mp_dir.iterdir()}
        print(f"requests served by pids {sorted(pids)}; multiprocess files {sorted(files)}")
        assert len(list(mp_dir.glob("counter_*.db"))) >= 1
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
