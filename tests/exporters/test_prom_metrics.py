"""The Prometheus exporter: every round-1 stats type on the bus becomes the declared metrics."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvmeter.attribution import Attribution
from kvmeter.collectors.gpu import (
    CaptureNvml,
    NvmlCollector,
    gpu_samples_from_dcgm,
)
from kvmeter.collectors.remote_vllm import RemoteVllmScraper
from kvmeter.exporters.prometheus import (
    METRICS,
    PrometheusConfig,
    emitted_names,
    install_prometheus,
    metric,
    reserved_names,
)
from kvmeter.exporters.prometheus import buckets as B
from kvmeter.exporters.prometheus.rules.generate_slo import SLO_CLASSES
from kvmeter.stats import (AdmissionDecision, EngineRequestStats, EngineStepStats, GpuCollectorStatus,
                           GpuProcessSample, GpuSample, RequestCompletion, XidEvent)
from kvmeter.tokens import TokenCounts

MIB = 1024 * 1024


@pytest.fixture
def exporter(bus, registry, clock):
    return install_prometheus(bus, registry, config=PrometheusConfig(top_k_tenants=5, model="smollm2"),
                              clock=clock)


def value(registry, name, **labels):
    return registry.get_sample_value(name, labels)


def test_engine_step(bus, registry, exporter):
    e = {"engine": "0", "model": "smollm2"}
    bus.publish(EngineStepStats(wall_ts=1.0, kv_watermark_ratio=0.625, kv_blocks_total=5816,
                                kv_block_size_tokens=16, num_running=12, num_waiting=3, num_preempted=2,
                                prefix_cache_queries_tokens=400, prefix_cache_hits_tokens=320,
                                scheduled_tokens=140, batch_size=12, input_tokens=128, output_tokens=12,
                                ttfts_s=[0.21, 0.35], itls_s=[0.02] * 10))
    bus.publish(EngineStepStats(wall_ts=2.0, kv_watermark_ratio=0.7, kv_blocks_total=5816, num_running=13,
                                num_preempted=1, output_tokens=13, batch_size=13, scheduled_tokens=13))
    assert value(registry, "kvmeter_engine_kv_watermark_ratio", **e) == 0.7
    assert value(registry, "kvmeter_engine_kv_used_blocks", **e) == round(0.7 * 5816)
    assert value(registry, "kvmeter_engine_kv_capacity_blocks", **e) == 5816
    assert value(registry, "kvmeter_engine_kv_block_size_tokens", **e) == 16  # kept from step 1
    assert value(registry, "kvmeter_engine_running_requests", **e) == 13
    assert value(registry, "kvmeter_engine_waiting_requests", **e) == 0
    assert value(registry, "kvmeter_engine_preemptions_total", **e) == 3
    assert value(registry, "kvmeter_engine_prefix_cache_queries_tokens_total", **e) == 400
    assert value(registry, "kvmeter_engine_prefix_cache_hits_tokens_total", **e) == 320
    assert value(registry, "kvmeter_engine_input_tokens_total", **e) == 128
    assert value(registry, "kvmeter_engine_output_tokens_total", **e) == 25
    assert value(registry, "kvmeter_engine_step_batch_size_requests_count", **e) == 2
    assert value(registry, "kvmeter_engine_step_scheduled_tokens_sum", **e) == 153
    assert value(registry, "kvmeter_engine_ttft_seconds_count", **e) == 2
    assert value(registry, "kvmeter_engine_ttft_seconds_bucket", **e, le="0.3") == 1
    assert value(registry, "kvmeter_engine_itl_seconds_sum", **e) == pytest.approx(0.2)


def test_engine_finished_requests_include_aborts(bus, registry, exporter):
    bus.publish(
        EngineRequestStats(
            request_id="r1",
            finish_reason="stop",
            tokens=TokenCounts(input_tokens=900, cached_input_tokens=512, output_tokens=128),
            queued_s=0.4,
            prefill_s=0.3,
            decode_s=2.5,
            e2e_s=3.3,
        )
    )
    bus.publish(
        EngineRequestStats(
            request_id="r2", finish_reason="abort", tokens=TokenCounts(input_tokens=100, output_tokens=7), e2e_s=1.0
        )
    )
    assert value(registry, "kvmeter_engine_request_tokens_total", type="input", finish_reason="stop") == 900
    assert value(registry, "kvmeter_engine_request_tokens_total", type="cached_input", finish_reason="stop") == 512
    assert value(registry, "kvmeter_engine_request_tokens_total", type="output", finish_reason="abort") == 7
    assert value(registry, "kvmeter_engine_request_queue_seconds_sum", finish_reason="stop") == pytest.approx(0.4)
    assert value(registry, "kvmeter_engine_request_decode_seconds_bucket", finish_reason="stop", le="5.0") == 1
    assert value(registry, "kvmeter_engine_request_e2e_seconds_count", finish_reason="abort") == 1


def test_an_abort_accounted_by_the_scheduler_hook_counts_tokens_but_no_phase_times(bus, registry, exporter):
    bus.publish(EngineRequestStats(request_id="r3", finish_reason="abort", tokens=TokenCounts(input_tokens=512),
                                   computed_tokens=512, preempted_tokens=0, phase_times_measured=False))
    assert value(registry, "kvmeter_engine_request_tokens_total", type="input", finish_reason="abort") == 512
    for phase in ("queue", "prefill", "decode", "e2e"):  # 0.0 is not a measurement
        assert value(registry, f"kvmeter_engine_request_{phase}_seconds_count", finish_reason="abort") is None


def completion(tenant="acme", tier="paid_interactive", outcome="ok", prompt=1000, cached=200, out=100,
               ttft=0.4, itls=(0.03,) * 99, e2e=3.4, queue=0.05, slo=True):
    return RequestCompletion(
        attribution=Attribution(tenant, tier=tier, model="smollm2"),
        tokens=TokenCounts(input_tokens=prompt, cached_input_tokens=cached, output_tokens=out),
        outcome=outcome,
        ttft_s=ttft,
        itls_s=list(itls),
        e2e_s=e2e,
        queue_s=queue,
        slo_met=slo,
        wall_ts=1750000000.0,
    )


def test_request_completions(bus, registry, exporter):
    bus.publish(completion())                                             # ok, inside the SLO
    bus.publish(completion(slo=False, ttft=2.5))                          # ok, SLO missed
    bus.publish(completion(outcome="aborted", out=10, itls=(0.03,) * 9))  # client went away
    bus.publish(completion(outcome="error", prompt=50, cached=0, out=0, ttft=None, itls=(), slo=None))
    bus.publish(completion(tier="batch", slo=None))                       # no SLO for the tier
    t = {"tier": "paid_interactive", "tenant": "acme"}
    assert value(registry, "kvmeter_requests_total", **t, outcome="ok") == 2
    assert value(registry, "kvmeter_requests_total", **t, outcome="aborted") == 1
    assert value(registry, "kvmeter_requests_total", **t, outcome="error") == 1
    assert value(registry, "kvmeter_tokens_total", **t, type="input", outcome="ok") == 2000
    assert value(registry, "kvmeter_tokens_total", **t, type="cached_input", outcome="ok") == 400
    assert value(registry, "kvmeter_tokens_total", **t, type="output", outcome="aborted") == 10
    assert value(registry, "kvmeter_tokens_total", **t, type="output", outcome="error") is None  # 0 tokens
    pi = {"tier": "paid_interactive"}
    assert value(registry, "kvmeter_throughput_tokens_total", **pi, type="output") == 210
    assert value(registry, "kvmeter_goodput_tokens_total", **pi, type="output") == 100  # only the SLO-met one
    assert value(registry, "kvmeter_goodput_tokens_total", **pi, type="input") == 1000
    assert value(registry, "kvmeter_goodput_tokens_total", tier="batch", type="output") == 100  # no SLO = good
    assert value(registry, "kvmeter_slo_requests_total", **pi, result="missed") == 1
    assert value(registry, "kvmeter_slo_requests_total", **pi, result="unset") == 1
    assert value(registry, "kvmeter_request_ttft_seconds_count", **pi) == 3  # the error sent no token
    assert value(registry, "kvmeter_request_ttft_seconds_bucket", **pi, le="2.0") == 2
    assert value(registry, "kvmeter_request_itl_seconds_count", **pi) == 99 + 99 + 9
    assert value(registry, "kvmeter_request_e2e_seconds_count", **pi, outcome="error") == 1
    assert value(registry, "kvmeter_request_queue_seconds_sum", **pi) == pytest.approx(0.2)


def test_unknown_outcome_and_tier_are_bounded(bus, registry, exporter):
    bus.publish(completion(outcome="weird", tier=""))
    assert value(registry, "kvmeter_requests_total", tier="unknown", tenant="acme", outcome="error") == 1


def test_admission(bus, registry, exporter):
    bus.publish(completion(tenant="acme"))  # gives acme work, so it holds its own label
    bus.publish(AdmissionDecision(attribution=Attribution('acme', tier='free'), admitted=True))
    bus.publish(
        AdmissionDecision(
            attribution=Attribution("acme", tier="free"),
            admitted=False,
            reason="quota_exceeded",
            level="project",
            dimension="input_tokens_per_minute",
            status_code=429,
        )
    )
    bus.publish(
        AdmissionDecision(
            attribution=Attribution("acme", tier="free"), admitted=False, reason="shed", status_code=503
        )
    )
    assert value(registry, "kvmeter_admission_admitted_requests_total", tier="free", tenant="acme") == 1
    assert value(registry, "kvmeter_admission_rejected_requests_total", tier="free", tenant="acme",
                 reason="quota_exceeded", level="project", dimension="input_tokens_per_minute") == 1
    assert value(registry, "kvmeter_admission_rejected_requests_total", tier="free", tenant="acme", reason="shed",
                 level="", dimension="") == 1


def test_gpu_from_real_captures(bus, registry, exporter, data_dir, clock):
    gpu = data_dir / "gpu" / "nvidia_smi"
    NvmlCollector(CaptureNvml.from_file(gpu / "linux-x86_64__nvidia-h100-mig__590.48.01.txt"),
                  bus=bus, clock=clock).collect()
    g = {"gpu": "0"}
    assert value(registry, "kvmeter_gpu_nvml_available") == 1
    assert value(registry, "kvmeter_gpu_memory_used_bytes", **g) == 11125 * MIB
    assert value(registry, "kvmeter_gpu_memory_reserved_bytes", **g) == 479 * MIB
    assert value(registry, "kvmeter_gpu_utilization_ratio", **g) is None  # [N/A] under MIG: no series, not 0
    assert value(registry, "kvmeter_gpu_power_watts", **g) == pytest.approx(432.21)
    assert value(registry, "kvmeter_gpu_temperature_celsius", **g, sensor="memory") == 58
    assert value(registry, "kvmeter_gpu_clock_hertz", **g, clock="sm") == 1.98e9
    assert value(registry, "kvmeter_gpu_clocks_event_reason_active", **g, reason="hw_thermal_slowdown") == 0
    assert value(registry, "kvmeter_gpu_clocks_event_seconds_total", **g, reason="sw_power_cap") == 0
    assert value(registry, "kvmeter_gpu_pcie_replays_total", **g) == 9
    assert value(registry, "kvmeter_gpu_remapped_rows", **g, type="correctable") is None
    assert value(registry, "kvmeter_gpu_energy_joules_total", **g) is None  # not in the capture
    assert value(registry, "kvmeter_gpu_mig_memory_used_bytes", gpu="0", mig="2") == 11091 * MIB
    assert value(registry, "kvmeter_gpu_mig_sm_count", gpu="0", mig="10") == 16
    assert value(registry, "kvmeter_gpu_mig_info", gpu="0", mig="3", profile="2g.20gb",
                 uuid="MIG-00000001-0000-0000-0000-000000000001") == 1
    assert value(registry, "kvmeter_gpu_process_memory_used_bytes", gpu="0", pid="21198",
                 process="gpu_burn") == 7484 * MIB
    text = generate_latest(registry).decode()
    assert "NaN" not in text


def test_gpu_missing_values_are_dropped_not_zeroed(bus, registry, exporter):
    bus.publish(GpuSample(wall_ts=1, index=0, utilization_gpu_ratio=0.5, power_watts=300.0,
                          processes=[GpuProcessSample(pid=7, name="/usr/bin/python", used_memory_bytes=10)]))
    assert value(registry, "kvmeter_gpu_utilization_ratio", gpu="0") == 0.5
    bus.publish(GpuSample(wall_ts=2, index=0, utilization_gpu_ratio=None, power_watts=None))
    assert value(registry, "kvmeter_gpu_utilization_ratio", gpu="0") is None
    assert value(registry, "kvmeter_gpu_power_watts", gpu="0") is None
    assert value(registry, "kvmeter_gpu_process_memory_used_bytes", gpu="0", pid="7", process="python") is None


def test_gpu_cumulative_counters_mirror_the_device(bus, registry, exporter):
    for joules in (1000.0, 1010.0, 5.0, 7.0):  # 5.0: the device counter restarted (driver reload)
        bus.publish(GpuSample(wall_ts=1, index=1, energy_joules=joules, ecc_corrected_total=3,
                              clocks_event_seconds={"hw_thermal_slowdown": joules / 100}))
    assert value(registry, "kvmeter_gpu_energy_joules_total", gpu="1") == pytest.approx(1000 + 10 + 5 + 2)
    assert value(registry, "kvmeter_gpu_ecc_errors_total", gpu="1", type="corrected") == 3
    assert value(registry, "kvmeter_gpu_clocks_event_seconds_total", gpu="1",
                 reason="hw_thermal_slowdown") == pytest.approx(10.17)


def test_gpu_xid_and_status(bus, registry, exporter):
    bus.publish(XidEvent(wall_ts=1, gpu_index=3, xid=79))
    bus.publish(XidEvent(wall_ts=2, gpu_index=3, xid=79))
    bus.publish(GpuCollectorStatus(state="no_gpu", reason="NVML Shared Library Not Found"))
    assert value(registry, "kvmeter_gpu_xid_errors_total", gpu="3", xid="79") == 2
    assert value(registry, "kvmeter_gpu_nvml_available") == 0


def test_gpu_from_dcgm_capture(bus, registry, exporter, data_dir):
    text = "\n".join(line for line in (data_dir / "gpu/dcgm/dcgm-exporter_README_sample_metrics.txt")
                     .read_text().splitlines() if line.startswith(("# HELP", "# TYPE", "DCGM_")))
    for sample in gpu_samples_from_dcgm(text):
        bus.publish(sample)
    assert value(registry, "kvmeter_gpu_clock_hertz", gpu="0", clock="sm") == 139e6
    assert value(registry, "kvmeter_gpu_temperature_celsius", gpu="0", sensor="memory") is None  # DCGM blank


def test_remote_engine(bus, registry, exporter, data_dir, clock):
    scraper = RemoteVllmScraper("http://vllm-a:8000/metrics", clock=clock, bus=bus)
    real = (data_dir / "vllm_metrics/vllm_v0_metrics_qwen2.5-coder-1.5b_aibrix_docs.prom").read_text()
    scraper.ingest(real)
    clock.advance(10)
    scraper.ingest(real.replace("} 955.0", "} 1955.0"))
    e = {"engine": "http://vllm-a:8000/metrics#0", "model": "Qwen/Qwen2.5-Coder-1.5B-Instruct"}
    assert value(registry, "kvmeter_engine_kv_watermark_ratio", **e) == 0.0
    assert value(registry, "kvmeter_engine_kv_capacity_blocks", **e) == 81767
    assert value(registry, "kvmeter_engine_output_tokens_total", **e) == 1000  # deltas, not the total
    clock.advance(10)
    scraper.ingest(real.replace("} 955.0", "} 3.0"))  # garbage decrease
    assert value(registry, "kvmeter_engine_scrape_anomalies_total", **e, kind="invalid") == 1
    assert value(registry, "kvmeter_engine_output_tokens_total", **e) == 1000
    # the truncated histogram has no count: its window quantiles are NaN, not 0
    q = value(registry, "kvmeter_engine_latency_window_seconds", **e, metric="ttft", quantile="0.5")
    assert q is None or math.isnan(q)


def test_every_emitted_metric_is_registered_and_reserved_ones_are_not(registry, exporter):
    families = {m.name for m in registry.collect()}
    for name in emitted_names():
        assert name.removesuffix("_total") in families, name
    for name in reserved_names():
        assert name.removesuffix("_total") not in families, name


UNIT_WORDS = {"seconds", "tokens", "bytes", "ratio", "requests", "blocks", "watts", "joules", "celsius",
              "hertz", "events", "links", "count", "rows", "info", "available", "pending", "failure",
              "active", "errors", "replays", "retries", "preemptions", "anomalies",
              "level", "degraded", "reports", "reloads", "up", "records", "runs", "calls"}


def test_names_follow_the_conventions():
    for m in METRICS:
        assert m.name.startswith("kvmeter_"), m.name
        assert (m.kind == "counter") == m.name.endswith("_total"), m.name
        assert UNIT_WORDS & set(m.name.split("_")), f"{m.name}: no unit word"
        assert m.kind != "histogram" or m.buckets, m.name
    with pytest.raises(KeyError, match="not declared"):
        metric("kvmeter_nope")


def test_slo_thresholds_are_bucket_boundaries():
    for cls in SLO_CLASSES:
        assert float(cls.ttft_le) in B.TTFT_SECONDS and float(cls.itl_le) in B.ITL_SECONDS


def test_buckets_cover_llm_latencies():
    # below 10 ms too, so a sub-millisecond TTFT (a metering bug) shows in a bucket of its own
    assert B.TTFT_SECONDS[0] <= 0.0001 and {0.0005, 0.001, 0.005} <= set(B.TTFT_SECONDS) and B.TTFT_SECONDS[-1] >= 600
    assert B.ITL_SECONDS[0] <= 0.0001 and B.ITL_SECONDS[-1] >= 5
    for bounds in (B.TTFT_SECONDS, B.ITL_SECONDS, B.E2E_SECONDS, B.QUEUE_SECONDS, B.PHASE_SECONDS):
        assert list(bounds) == sorted(set(bounds))


def test_config_from_env():
    cfg = PrometheusConfig.from_env({"KVMETER_PROM_TOP_K_TENANTS": "50", "KVMETER_PROM_MODEL": "llama"},
                                    tenant_refresh_s=5.0)
    assert (cfg.top_k_tenants, cfg.model, cfg.tenant_refresh_s) == (50, "llama", 5.0)
    assert PrometheusConfig.from_env({"KVMETER_PROM_TOP_K_TENANTS": "7"}, top_k_tenants=3).top_k_tenants == 3
    with pytest.raises(ValueError, match="KVMETER_PROM_TOP_K_TENANTS"):
        PrometheusConfig.from_env({"KVMETER_PROM_TOP_K_TENANTS": "many"})
    with pytest.raises(ValueError):
        PrometheusConfig(top_k_tenants=-1)


def test_installing_twice_in_one_registry_fails_loudly(bus, registry, exporter):
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        install_prometheus(bus, registry)


def test_close_unsubscribes(bus, registry, exporter):
    exporter.close()
    bus.publish(completion())
    assert value(registry, "kvmeter_requests_total", tier="paid_interactive", tenant="acme", outcome="ok") is None


def test_exposition_parses_back(bus, registry, exporter):
    bus.publish(completion())
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert fams["kvmeter_request_ttft_seconds"].type == "histogram"
    assert fams["kvmeter_tokens"].type == "counter"


def test_metrics_asgi_app_serves_the_registry(bus, registry, exporter):
    import asyncio

    import httpx

    from kvmeter.exporters.prometheus import metrics_asgi_app

    bus.publish(completion())

    async def get():
        transport = httpx.ASGITransport(app=metrics_asgi_app(registry))
        async with httpx.AsyncClient(transport=transport, base_url="http://kvmeter") as client:
            return await client.get("/metrics")

    resp = asyncio.run(get())
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    assert 'kvmeter_requests_total{outcome="ok",tenant="acme",tier="paid_interactive"} 1.0' in resp.text


def test_fresh_registry_isolated_from_global():
    assert CollectorRegistry().get_sample_value("kvmeter_requests_total") is None
