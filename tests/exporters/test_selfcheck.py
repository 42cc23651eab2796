"""Self-checks on a real run: ``kvmeter serve``'s runtime (instant engine, embedded chDB ledger,
injected clock) serves requests whose numbers cannot be true — the instant engine answers in 0 s
on the manual clock, so with the model's parameter count configured every TTFT is below the
prefill's physical floor — and its ``/metrics`` page is what
``kvmeter check`` judges and what the promtool test of ``rules/selfcheck.yml`` reads."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvmeter.bus import StatsBus
from kvmeter.clock import ManualClock
from kvmeter.exporters.prometheus import METRICS, rule_files
from kvmeter.serving.selfcheck.bounds import PhysicalBounds
from kvmeter.serving.selfcheck.checks import (CHECKS, RECONCILIATION_DRIFT_MAX_RATIO, RECONCILIATION_STALE_S,
                                              SPOOL_AGE_MAX_S, parse_exposition, run_checks)
from kvmeter.serving.selfcheck.monitor import SelfCheckMonitor
from kvmeter.attribution import Attribution
from kvmeter.stats import EngineRequestStats, RequestCompletion, ReservationDrift, SelfCheckViolation
from kvmeter.tokens import TokenCounts

FREE = Attribution("t", tier="free", model="m")


def completion(input_tokens: int, output_tokens: int, **kw) -> RequestCompletion:
    return RequestCompletion(attribution=FREE, outcome="ok",
                             tokens=TokenCounts(input_tokens=input_tokens, output_tokens=output_tokens), **kw)


PROMTOOL = shutil.which("promtool")
SELFCHECK_RULES = next(p for p in rule_files() if p.name == "selfcheck.yml")
T0 = 1_790_000_000.0
ACME_KEY = "sk-demo-acme-0001"
PARAMS = 134_515_008  # SmolLM2-135M, as counted from its safetensors headers


async def _real_run(tmp_path: Path, **selfcheck) -> str:
    from kvmeter.serving.config import load_serve_config
    from kvmeter.serving.runtime import ServeRuntime

    overrides = {("engine", "kind"): "instant", ("ledger_dsn",): f"chdb://{tmp_path}/chdb",
                 ("spool_dir",): str(tmp_path / "spool")}
    overrides.update({("selfcheck", k): v for k, v in selfcheck.items()})
    config = load_serve_config(None, overrides, env={})
    clock = ManualClock(start_wall=T0)
    runtime = ServeRuntime(config, registry=CollectorRegistry(), clock=clock)
    app = runtime.app()
    await runtime.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://serve") as client:
            for i, stream in enumerate((False, True, True)):
                body = {"model": runtime.engine.model_name, "max_tokens": 6, "stream": stream,
                        "messages": [{"role": "user", "content": f"question {i} " + "word " * 200}]}
                r = await client.post("/v1/chat/completions", headers={"authorization": f"Bearer {ACME_KEY}"},
                                      json=body)
                assert r.status_code == 200, r.text
            assert await __import__("asyncio").to_thread(runtime.recorder.ledger.flush, 30.0)
            r = await client.get("/metrics")
            assert r.status_code == 200
            return r.text
    finally:
        await runtime.stop()


def _series(exposition: str, samples: int) -> list[dict[str, str]]:
    """The self-check series of the page, each starting at 0 (every counter is created at 0 when
    serve starts) and holding its scraped value for ``samples`` minutes."""
    read = set(re.findall(r"\bkvmeter_[a-z0-9_]+", SELFCHECK_RULES.read_text()))
    out = []
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name in read:
                labels = ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(sample.labels.items()))
                out.append({"series": f"{sample.name}{{{labels}}}", "values": f"0 {sample.value!r}x{samples}"})
    return out


def _description(alert: str) -> str:
    return next(r["annotations"]["description"] for g in yaml.safe_load(SELFCHECK_RULES.read_text())["groups"]
                for r in g["rules"] if r.get("alert") == alert)


def _promtool(tmp_path: Path, series, checks) -> None:
    test = {"rule_files": [str(SELFCHECK_RULES)], "evaluation_interval": "1m",
            "tests": [{"name": "a real run's series", "interval": "1m", "input_series": series,
                       "alert_rule_test": checks}]}
    path = tmp_path / "selfcheck.test.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    result = subprocess.run([PROMTOOL, "test", "rules", path.name], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not on PATH (Debian: apt-get install -y prometheus)")
@pytest.mark.prometheus
async def test_impossible_ttft_and_decode_speed_fail_the_check_and_fire_the_alerts(tmp_path, model_dir):
    exposition = await _real_run(tmp_path, model_params=PARAMS)
    samples = parse_exposition(exposition)
    assert samples.total("kvmeter_selfcheck_ttft_below_floor_requests_total") == 3  # every request: 0 s
    # the instant engine sends a stream's tokens in one chunk: no inter-token gaps to judge
    assert samples.total("kvmeter_selfcheck_output_above_roofline_requests_total") == 0
    assert samples.total("kvmeter_selfcheck_streamed_ok_requests_total") == 2
    assert samples.total("kvmeter_request_ttft_seconds_count") == 3
    # a sub-millisecond TTFT has a bucket of its own
    assert samples.by_label("kvmeter_request_ttft_seconds_bucket", "le")["0.0001"] == 3
    status = {r.name: r.status for r in run_checks(samples, T0)}
    assert status == {"ttft_floor": "FAIL", "ttft_samples": "PASS", "output_roofline": "PASS",
                      "cached_input": "PASS", "reservation": "PASS", "reconciliation": "PASS", "spool_age": "PASS"}
    _promtool(tmp_path, _series(exposition, 30), [
        {"eval_time": "5m", "alertname": "KvmeterTtftBelowPhysicalFloor",
         "exp_alerts": [{"exp_labels": {"severity": "critical"}, "exp_annotations": {
             "summary": "3 requests on  reported a TTFT below the physical floor",
             "description": _description("KvmeterTtftBelowPhysicalFloor")}}]},
        {"eval_time": "5m", "alertname": "KvmeterOutputAboveRoofline", "exp_alerts": []},
        {"eval_time": "5m", "alertname": "KvmeterTtftSamplesMissing", "exp_alerts": []},
        {"eval_time": "5m", "alertname": "KvmeterCachedOverInput", "exp_alerts": []},
        {"eval_time": "25m", "alertname": "KvmeterTtftBelowPhysicalFloor", "exp_alerts": []},
    ])


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not on PATH (Debian: apt-get install -y prometheus)")
@pytest.mark.prometheus
async def test_a_run_without_a_physical_bound_passes_every_check(tmp_path, model_dir):
    exposition = await _real_run(tmp_path)  # the instant engine computes nothing: no parameter count
    samples = parse_exposition(exposition)
    assert all(r.status in ("PASS", "SKIP") for r in run_checks(samples, T0)), run_checks(samples, T0)
    _promtool(tmp_path, _series(exposition, 30), [
        {"eval_time": "5m", "alertname": alert, "exp_alerts": []}
        for alert in ("KvmeterTtftBelowPhysicalFloor", "KvmeterOutputAboveRoofline", "KvmeterTtftSamplesMissing",
                      "KvmeterCachedOverInput", "KvmeterReservationExceeded")])


def test_physical_bounds_follow_the_flops_and_the_configured_floor():
    b = PhysicalBounds(PARAMS, peak_flops_per_s=1e14, ttft_floor_s=0.001)
    assert b.ttft_floor(1500, 500) == pytest.approx(2 * PARAMS * 1000 / 1e14)  # 2.7 ms > the configured 1 ms
    assert b.ttft_floor(10, 10) == 0.001  # all cached: the configured floor
    assert b.output_roofline() == pytest.approx(1e14 / (2 * PARAMS))
    assert PhysicalBounds(None, ttft_floor_s=0.5).ttft_floor(100_000) == 0.5
    assert PhysicalBounds(None).output_roofline() is None
    with pytest.raises(ValueError):
        PhysicalBounds(PARAMS, peak_flops_per_s=0)


def test_monitor_flags_a_stream_decoded_faster_than_the_roofline():
    bus = StatsBus()
    seen: list[SelfCheckViolation] = []
    bus.subscribe(SelfCheckViolation, seen.append)
    SelfCheckMonitor(bus, PhysicalBounds(PARAMS, peak_flops_per_s=1e13))  # roofline ≈ 37,171 tokens/s
    slow = completion(10, 5, ttft_s=1.0, itls_s=[0.01] * 4, stream=True)
    fast = completion(10, 5, ttft_s=1.0, itls_s=[1e-6] * 4, stream=True)
    bus.publish(slow)
    bus.publish(fast)
    assert [(v.check, v.value) for v in seen] == [("output_above_roofline", pytest.approx(1e6))]


def test_monitor_flags_cached_over_input_and_exceeded_reservations():
    bus = StatsBus()
    seen: list[SelfCheckViolation] = []
    bus.subscribe(SelfCheckViolation, seen.append)
    SelfCheckMonitor(bus, PhysicalBounds(None), input_ratio=0.1)
    tokens = TokenCounts(input_tokens=100, cached_input_tokens=100, output_tokens=5)
    bus.publish(EngineRequestStats("r1", "stop", tokens, attribution=FREE, reported_cached_input_tokens=120))
    bus.publish(EngineRequestStats("r2", "stop", tokens, attribution=FREE))  # equal: fine
    bus.publish(ReservationDrift(FREE, "output_tokens", reserved=10, actual=11))
    bus.publish(ReservationDrift(FREE, "output_tokens", reserved=10, actual=10))
    bus.publish(ReservationDrift(FREE, "input_tokens", reserved=100, actual=110))  # within 10 %
    bus.publish(ReservationDrift(FREE, "input_tokens", reserved=100, actual=111))
    assert [(v.check, v.view, v.value, v.bound) for v in seen] == [
        ("cached_over_input", "engine", 120, 100),
        ("reservation_exceeded", "output", 11, 10), ("reservation_exceeded", "input", 111, pytest.approx(110))]
    assert bus.errors_total == 0


def test_each_check_reads_declared_metrics_and_names_a_shipped_alert_with_its_threshold():
    declared = {m.name for m in METRICS}
    alerts = {r["alert"]: r["expr"] for p in rule_files() for g in yaml.safe_load(p.read_text())["groups"]
              for r in g["rules"] if "alert" in r}
    for check in CHECKS:
        assert check.alert in alerts, check.name
        for name in check.metrics:
            assert name.removesuffix("_count") in declared, name
            assert name.removesuffix("_count") in alerts[check.alert] or check.name == "reconciliation", check.name
    assert f"> {RECONCILIATION_DRIFT_MAX_RATIO}" in alerts["KvmeterReconciliationDrift"]
    assert f"> {RECONCILIATION_STALE_S:.0f}" in alerts["KvmeterReconciliationStale"]
    assert f"> {SPOOL_AGE_MAX_S:.0f}" in alerts["KvmeterLedgerSpoolLag"]
